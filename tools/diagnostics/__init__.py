"""Diagnosis tools (see README.md here); nothing outside tools/diagnostics and its tests imports them, except the trainer behind --memory-trace and --profile-steps."""

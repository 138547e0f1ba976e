"""Helpers for the static-pass tests: program builders run in FLAGS_enable_pir_api=0 subprocesses."""

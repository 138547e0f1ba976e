"""The framework-neutral engine. Nothing in this package imports paddle or torch."""

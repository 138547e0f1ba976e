"""Paddle memory: the stream-ordered allocator switch (:mod:`.allocator`, which imports no paddle
at import time)."""

"""The CUDA driver's graph-memory counters (``cuDeviceGetGraphMemAttribute``), through ctypes.

Under the stream-ordered allocator (cudaMallocAsync), memory that graphs allocate is the
driver's graph memory: the frameworks' own counters leave it out. No framework import.
"""

from __future__ import annotations

import ctypes

__all__ = ["GraphMemory"]


class GraphMemory:
    """The driver's graph-memory counters (cuDeviceGetGraphMemAttribute); ``None`` if unavailable."""

    USED_CURRENT, USED_HIGH, RESERVED_CURRENT, RESERVED_HIGH = 0, 1, 2, 3

    def __init__(self, ordinal: int):
        self.lib = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            dev = ctypes.c_int()
            lib.cuInit(ctypes.c_uint(0))  # already done by the CUDA runtime; harmless again
            if lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)) == 0:
                self.lib, self.dev = lib, dev
        except (OSError, AttributeError):
            pass

    def get(self, attr: int):
        if self.lib is None:
            return None
        value = ctypes.c_uint64()
        rc = self.lib.cuDeviceGetGraphMemAttribute(self.dev, ctypes.c_int(attr), ctypes.byref(value))
        return value.value if rc == 0 else None

    def reset_high(self) -> None:
        if self.lib is not None:
            for attr in (self.USED_HIGH, self.RESERVED_HIGH):
                zero = ctypes.c_uint64(0)
                self.lib.cuDeviceSetGraphMemAttribute(self.dev, ctypes.c_int(attr), ctypes.byref(zero))

    def trim(self) -> None:
        if self.lib is not None:
            self.lib.cuDeviceGraphMemTrim(self.dev)

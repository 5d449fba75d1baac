"""The plugin's memory: host memory that the (emulated) NPU reads and writes in place, like
ggml's rpcmem buffers shared between the CPU and the DSP."""

from __future__ import annotations

import numpy as np

ALIGNMENT = 128  # an HVX vector


class HtpBuffer:
    """A buffer's bytes (128-byte aligned) and whether it is a repack (weights) buffer."""

    __slots__ = ("mem", "repack")

    def __init__(self, size: int, repack: bool) -> None:
        raw = np.zeros(size + ALIGNMENT, np.uint8)
        shift = (-raw.ctypes.data) % ALIGNMENT
        self.mem = raw[shift : shift + size]
        self.repack = repack

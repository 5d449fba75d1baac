"""A tiny progress bar on stderr (no dependency): redrawn in place on a terminal; on a pipe
or a log only the final line is printed, so captured output stays short."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Bar:
    """``with Bar("load", total, unit="MiB", scale=2**-20) as bar: bar.update(n)``.

    ``total`` in the caller's units (bytes, tokens); ``scale`` converts them for display.
    Redraws at most every 0.1 s; ``close()`` prints the final state with the rate.
    """

    def __init__(self, desc: str, total: float, unit: str = "", scale: float = 1.0,
                 file: TextIO | None = None, enabled: bool = True) -> None:  # fmt: skip
        self.desc = desc
        self.total = max(float(total), 0.0)
        self.unit = unit
        self.scale = scale
        self.file = file if file is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.file, "isatty") and self.file.isatty()
        self.n = 0.0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._closed = False

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.tty and (now - self._last >= 0.1 or self.n >= self.total):
            self._last = now
            self._draw("\r\033[K", "")

    def _draw(self, prefix: str, end: str) -> None:
        el = time.perf_counter() - self.t0
        frac = min(1.0, self.n / self.total) if self.total else 1.0
        width = 24
        fill = int(frac * width)
        bar = "#" * fill + "." * (width - fill)
        rate = self.n * self.scale / el if el > 0 else 0.0
        done, tot = self.n * self.scale, self.total * self.scale
        fmt = ".0f" if self.scale == 1.0 else ".1f"
        self.file.write(f"{prefix}{self.desc:<10} [{bar}] {done:{fmt}}/{tot:{fmt}} {self.unit} "
                        f"{el:5.1f}s {rate:8.1f} {self.unit}/s{end}")  # fmt: skip
        self.file.flush()

    def close(self) -> None:
        if self._closed or not self.enabled:
            return
        self._closed = True
        self._draw("\r\033[K" if self.tty else "", "\n")

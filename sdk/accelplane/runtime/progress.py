"""Progress of long work on stderr, for the SDK and every plugin (no dependency):

- :class:`Bar`, over a known total (a model's bytes loaded or written): redrawn in place on a
  terminal; on a pipe or a log only the final line is printed, so captured output stays short;
- :func:`phase`, for a step of unknown length (compiling kernels, building programs): nothing
  when it ends within a second; past that, one line, "what ..." then "done in 14.1 s" on it.
  Only on a terminal: a pipe or a log gets none;
- :func:`status`, a transient line on a terminal (which run of a benchmark is going), replaced
  by the next one, by a phase or a bar, or cleared.

``ACCELPLANE_QUIET=1`` silences all three.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from accelplane import env

_lock = threading.Lock()  # phase lines from several threads are written whole
AFTER_S = 1.0  # a phase says what it is doing once it has taken this long


def _stderr(file: TextIO | None) -> TextIO:
    return file if file is not None else sys.stderr


def _tty(file: TextIO) -> bool:
    return hasattr(file, "isatty") and file.isatty()


def _shows(file: TextIO) -> bool:
    return _tty(file) and not env.QUIET.get()


_CLEAR = "\r\033[K"  # back to the start of the line, erase it (a status line a phase replaces)


def status(msg: str, file: TextIO | None = None) -> None:
    """Show ``msg`` as the terminal's current line (nothing on a pipe); ``status("")`` clears it."""
    f = _stderr(file)
    if _shows(f):
        with _lock:
            f.write(_CLEAR + msg)
            f.flush()


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
        self.file = _stderr(file)
        self.enabled = enabled and not env.QUIET.get()
        self.tty = self.enabled and _tty(self.file)
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


class phase:  # noqa: N801 - used as a function: ``with phase("sycl: compiling 23 kernels"):``
    """Say what a long step is doing, on stderr, once it has taken ``after_s`` seconds (default
    AFTER_S, 1):
    ``what ...`` then, when the step ends, `` done in 14.1 s`` (`` failed after ...`` when it
    raises) on the same line. A step that ends sooner prints nothing. Quiet unless ``file``
    (default stderr) is a terminal, and with ACCELPLANE_QUIET=1. A timer thread writes the first
    half while the step runs (a compiler call holds this thread); ``shown`` says whether it
    did."""

    def __init__(self, what: str, after_s: float | None = None, file: TextIO | None = None) -> None:
        self.what = what
        self.after_s = AFTER_S if after_s is None else after_s
        self.file = _stderr(file)
        self.shown = False
        self._ended = False
        self._timer: threading.Timer | None = None

    def __enter__(self) -> phase:
        self.t0 = time.perf_counter()
        if not _shows(self.file):
            return self
        if self.after_s <= 0:
            self._show()
        else:
            self._timer = threading.Timer(self.after_s, self._show)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _show(self) -> None:
        with _lock:
            if not self._ended:
                self.shown = True
                self.file.write(f"{_CLEAR}{self.what} ...")  # over a status line, if one is up
                self.file.flush()

    def __exit__(self, exc_type, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with _lock:
            self._ended = True
            if self.shown:
                el = time.perf_counter() - self.t0
                self.file.write(f" {'done in' if exc_type is None else 'failed after'} {el:.1f} s\n")
                self.file.flush()

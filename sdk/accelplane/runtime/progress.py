"""Progress of long work, for the SDK and every plugin (no dependency).

The convention: progress is for a person watching a terminal. It goes to stderr (stdout keeps
the results), only when stderr is a terminal, and never while :func:`set_quiet` is on (the
command line's ``-q``/``--quiet``). A pipe, a log or a test's captured output gets none of it.

- :class:`Bar`, over a known total (a model's bytes written or loaded, tokens generated):
  redrawn in place at most every 0.1 s, ending on a line with the total time and rate;
- :class:`phase`, a step of unknown length (a kernel build, a shader compile, a benchmark's
  run): ``what ...`` once it has taken ``after_s`` seconds (default 1: a short step says
  nothing), then `` done in 1.4 s`` on that line when it ends, with the step's own note;
- :func:`step`, one line (a step that is over);
- :func:`status`, a transient line that the next line replaces (which case a benchmark of
  hundreds of cases is at).

They share the terminal's current line: a phase that starts while a bar or another phase has
the line moves to the next one, and an outer phase ending after an inner one says ``what ...
done in ...`` again on a line of its own, so every line reads whole.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

_lock = threading.RLock()  # lines from several threads (a compile on a worker) are written whole
_quiet = False
_line: object | None = None  # what holds the terminal's current line unfinished: a Bar, a phase
AFTER_S = 1.0  # a phase says what it is doing once it has taken this long
_CLEAR = "\r\033[K"  # back to the start of the line, erase it


def set_quiet(on: bool = True) -> bool:
    """Silence (or, with False, allow) all progress of this process; returns the previous
    setting (to restore it)."""
    global _quiet
    with _lock:
        prev, _quiet = _quiet, bool(on)
    return prev


def is_quiet() -> bool:
    return _quiet


def _stderr(file: TextIO | None) -> TextIO:
    return file if file is not None else sys.stderr


def shows(file: TextIO | None = None) -> bool:
    """Whether progress written to ``file`` (default stderr) is shown: a terminal, not quiet."""
    f = _stderr(file)
    if _quiet:
        return False
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _take(owner: object, f: TextIO) -> str:
    """The prefix that gives ``owner`` the current line: a line break when another holds the
    line unfinished (it keeps what it wrote), else a clear of the line (a status line is
    always replaced). Call under _lock."""
    global _line
    prefix = "\n" if _line is not None and _line is not owner and _line is not status else _CLEAR
    _line = owner
    return prefix


def _release(owner: object) -> None:
    global _line
    if _line is owner:
        _line = None


def end_line(file: TextIO | None = None) -> None:
    """End a line that a bar, a phase or a status left unfinished (before an error message)."""
    f = _stderr(file)
    with _lock:
        if _line is not None and shows(f):
            f.write("\n")
            f.flush()
        _release(_line)


def status(msg: str, file: TextIO | None = None) -> None:
    """``msg`` as the terminal's current line, replaced by the next one; ``status("")``
    clears it."""
    f = _stderr(file)
    if shows(f):
        with _lock:
            f.write(_take(status, f) + msg)
            if not msg:
                _release(status)
            f.flush()


def step(msg: str, file: TextIO | None = None) -> None:
    """``msg`` as a line of its own."""
    f = _stderr(file)
    if shows(f):
        with _lock:
            f.write(_take(step, f) + msg + "\n")
            _release(step)
            f.flush()


class Bar:
    """``with Bar("load", total, unit="MiB", scale=2**-20) as bar: bar.update(n)``.

    ``total`` in the caller's units (bytes, tokens); ``scale`` converts them for display.
    ``enabled=False`` silences this bar whatever the terminal.
    """

    def __init__(self, desc: str, total: float, unit: str = "", scale: float = 1.0,
                 file: TextIO | None = None, enabled: bool = True) -> None:  # fmt: skip
        self.desc = desc
        self.total = max(float(total), 0.0)
        self.unit = unit
        self.scale = scale
        self.file = _stderr(file)
        self.enabled = enabled and shows(self.file)
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
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last >= 0.1 or self.n >= self.total:
            self._last = now
            self._draw("")

    def _draw(self, end: str) -> None:
        el = time.perf_counter() - self.t0
        frac = min(1.0, self.n / self.total) if self.total else 1.0
        width = 24
        fill = int(frac * width)
        bar = "#" * fill + "." * (width - fill)
        rate = self.n * self.scale / el if el > 0 else 0.0
        done, tot = self.n * self.scale, self.total * self.scale
        fmt = ".0f" if self.scale == 1.0 else ".1f"
        with _lock:
            self.file.write(f"{_take(self, self.file)}{self.desc:<10} [{bar}] {done:{fmt}}/{tot:{fmt}} "
                            f"{self.unit} {el:5.1f}s {rate:8.1f} {self.unit}/s{end}")  # fmt: skip
            if end:
                _release(self)
            self.file.flush()

    def close(self) -> None:
        if self._closed or not self.enabled:
            return
        self._closed = True
        self._draw("\n")


class phase:  # noqa: N801 - used as a function: ``with phase("sycl: compiling 23 kernels"):``
    """Say what a long step is doing: ``what ...`` on stderr once the step has taken
    ``after_s`` seconds (default AFTER_S; 0: at once), then, when it ends, `` done in 14.1 s``
    (`` failed after ...`` when it raises) and ``: <note>`` when :meth:`note` gave one. A step
    that ends sooner prints nothing. Shown only where :func:`shows` says. A timer thread
    writes the first half while the step runs (a compiler call holds this thread); ``shown``
    says whether it did; ``enabled=False`` silences this one whatever the terminal."""

    def __init__(self, what: str, after_s: float | None = None, file: TextIO | None = None,
                 enabled: bool = True) -> None:  # fmt: skip
        self.what = what
        self.after_s = AFTER_S if after_s is None else after_s
        self.file = _stderr(file)
        self.enabled = enabled
        self.shown = False
        self._note = ""
        self._ended = False
        self._timer: threading.Timer | None = None

    def note(self, text: str) -> None:
        """What the step found, said after its time (``: 412.3 tokens/s``)."""
        self._note = text

    def __enter__(self) -> phase:
        self.t0 = time.perf_counter()
        if not (self.enabled and shows(self.file)):
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
                self.file.write(f"{_take(self, self.file)}{self.what} ...")
                self.file.flush()

    def __exit__(self, exc_type, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with _lock:
            self._ended = True
            if self.shown:
                el = time.perf_counter() - self.t0
                # the line is still ours: finish it; else another took it: say it all again
                head = " " if _line is self else f"{_take(self, self.file)}{self.what} ... "
                tail = f"done in {el:.1f} s" if exc_type is None else f"failed after {el:.1f} s"
                self.file.write(f"{head}{tail}{': ' + self._note if self._note else ''}\n")
                _release(self)
                self.file.flush()

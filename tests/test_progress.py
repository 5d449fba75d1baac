"""accelplane.runtime.progress: a phase says what a long step does on a terminal (one line, "what
... done in N s"), nothing for a short step, on a pipe or with ACCELPLANE_QUIET=1; status lines
are transient; the bar keeps its final line on a pipe. And the plugins' compiles go through it."""

from __future__ import annotations

import io
import re
import time

import pytest
from accelplane.runtime import progress
from accelplane.runtime.progress import Bar, phase, status


class Term(io.StringIO):
    """A terminal (or, with tty=False, a pipe) that keeps what was written."""

    def __init__(self, tty: bool = True) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_a_long_step_is_one_line(monkeypatch):
    monkeypatch.delenv("ACCELPLANE_QUIET", raising=False)
    out = Term()
    with phase("sycl: SYCL0: compiling 23 kernels", after_s=0.05, file=out) as ph:
        time.sleep(0.3)
    assert ph.shown
    want = r"\r\033\[Ksycl: SYCL0: compiling 23 kernels \.\.\. done in 0\.[3-9] s\n"
    assert re.fullmatch(want, out.getvalue()), repr(out.getvalue())


def test_a_failing_step_says_so(monkeypatch):
    monkeypatch.delenv("ACCELPLANE_QUIET", raising=False)
    out = Term()
    with pytest.raises(RuntimeError), phase("vulkan: compiling 3 shaders with glslc", after_s=0.02, file=out):
        time.sleep(0.1)
        raise RuntimeError("glslc failed")
    assert out.getvalue().endswith(" ... failed after 0.1 s\n"), repr(out.getvalue())


@pytest.mark.parametrize("tty, quiet, sleep", [(True, None, 0.0), (False, None, 0.2), (True, "1", 0.2)],
                         ids=["short", "pipe", "quiet"])  # fmt: skip
def test_silent_when_short_on_a_pipe_or_quiet(monkeypatch, tty, quiet, sleep):
    if quiet is None:
        monkeypatch.delenv("ACCELPLANE_QUIET", raising=False)
    else:
        monkeypatch.setenv("ACCELPLANE_QUIET", quiet)
    out = Term(tty)
    with phase("cuda: CUDA0: compiling kernels/gemm.cu (40 kernels)", after_s=0.05, file=out) as ph:
        time.sleep(sleep)
    time.sleep(0.1)  # a timer that was not cancelled would write by now
    assert out.getvalue() == "" and not ph.shown


def test_status_and_bar(monkeypatch):
    monkeypatch.delenv("ACCELPLANE_QUIET", raising=False)
    term, pipe = Term(), Term(tty=False)
    for f in (term, pipe):
        status("CPU split=none pp512: run 1/3", file=f)
    assert term.getvalue() == "\r\033[KCPU split=none pp512: run 1/3" and pipe.getvalue() == ""
    with Bar("load", 4 << 20, "MiB", 2**-20, file=pipe) as bar:
        bar.update(4 << 20)
    assert re.fullmatch(r"load +\[#{24}\] 4\.0/4\.0 MiB .*MiB/s\n", pipe.getvalue()), pipe.getvalue()
    monkeypatch.setenv("ACCELPLANE_QUIET", "1")
    quiet = Term()
    status("x", file=quiet)
    with Bar("load", 10, file=quiet) as bar:
        bar.update(10)
    assert quiet.getvalue() == ""


@pytest.fixture
def terminal(monkeypatch):
    """stderr as a terminal (where progress writes: pytest swaps sys.stderr itself), and every
    phase shown at once."""
    monkeypatch.delenv("ACCELPLANE_QUIET", raising=False)
    term = Term()
    monkeypatch.setattr(progress, "_stderr", lambda f: term if f is None else f)
    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    return term


def _scale_on(dev):
    import numpy as np
    from accelplane.core.graph import Context
    from accelplane.runtime.alloc import alloc_tensors

    ctx = Context()
    x = ctx.new_tensor("f32", (64,), "x")
    g = ctx.graph(ctx.scale(x, 3.0))
    buf = alloc_tensors([x, *g.nodes], dev.buffer_type)
    x.set(np.ones(64, np.float32))
    b = dev.new_backend()
    b.compute(g)
    assert g.nodes[-1].get().tolist() == [3.0] * 64
    b.free()
    buf.free()


def _fresh(plugin_module: str, name: str):
    import importlib

    from accelplane.runtime.registry import Registry

    try:
        module = importlib.import_module(plugin_module)
    except ImportError as e:
        pytest.skip(f"{name} is not installed: {e}")
    reg = Registry()
    if reg.register(module, name) is None:
        pytest.skip(f"no {name} device: {reg.failures[-1].reason}")
    return reg.devices_of(name)[0]


def _wait_for(term: Term, pattern: str) -> str:
    for _ in range(50):  # the timer thread writes the first half
        if re.search(pattern, term.getvalue()):
            break
        time.sleep(0.01)
    return term.getvalue()


def test_sycl_kernel_builds_say_so(terminal):
    dev = _fresh("accelplane_sycl.plugin", "sycl")  # a device of its own: nothing built yet
    _scale_on(dev)
    got = _wait_for(terminal, r"done in")
    assert re.search(r"sycl: SYCL0: compiling 1 kernel \.\.\. done in \d+\.\d s\n", got), repr(got)


def test_vulkan_pipeline_compiles_say_so(terminal):
    dev = _fresh("accelplane_vulkan.plugin", "vulkan")  # a logical device of its own: no pipeline yet
    _scale_on(dev)
    got = _wait_for(terminal, r"done in")
    assert re.search(r"vulkan: Vulkan0: compiling 1 pipeline \.\.\. done in \d+\.\d s\n", got), repr(got)


def test_vulkan_glslc_compiles_say_so(terminal, tmp_path, monkeypatch):
    from accelplane_vulkan import shaders

    if shaders.glslc() is None:
        pytest.skip("glslc is not installed")
    sdir = tmp_path / "shaders"
    sdir.mkdir()
    for p in [shaders.SHADER_DIR / "unary.comp", *shaders.SHADER_DIR.glob("*.glsl")]:
        (sdir / p.name).write_bytes(p.read_bytes())
    monkeypatch.setenv("ACCELPLANE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(shaders, "PREBUILT_DIR", tmp_path / "none")
    assert set(shaders.compile_all(sdir)) == {"unary"}
    got = _wait_for(terminal, r"done in")
    want = r"\r\033\[Kvulkan: compiling 1 shader with glslc \.\.\. done in \d+\.\d s\n"
    assert re.fullmatch(want, got), repr(got)
    shaders.compile_all(sdir)  # cached now: nothing to say
    assert terminal.getvalue() == got

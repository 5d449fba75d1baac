"""accelplane.runtime.progress: progress goes to stderr on a terminal only, never with
set_quiet (the command line's -q): a phase says what a long step does in one line ("what ...
done in N s"), nothing for a short step; a step is a line, a status line is transient, a bar
ends on its summary line; lines that interleave (a compile inside a benchmark run, inside a
bar) still read whole. The plugins' kernel builds go through it, and `bench model` and
`make-model` show it on a terminal (a pseudo-terminal here), not on a pipe, not with -q."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time

import pytest
from accelplane.runtime import progress
from accelplane.runtime.progress import Bar, end_line, phase, set_quiet, status, step

CLEAR = "\r\033[K"


def screen(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: each line as its last redraw left it."""
    return [ln.rsplit(CLEAR, 1)[-1] for ln in text.split("\n")]


class Term(io.StringIO):
    """A terminal (or, with tty=False, a pipe) that keeps what was written."""

    def __init__(self, tty: bool = True) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture(autouse=True)
def _fresh_state():
    """Progress on (as in a fresh process), and no line left open by another test."""
    prev = set_quiet(False)
    progress._line = None
    yield
    set_quiet(prev)
    progress._line = None


def test_a_long_step_is_one_line():
    out = Term()
    with phase("sycl: SYCL0: compiling 23 kernels", after_s=0.05, file=out) as ph:
        time.sleep(0.3)
    assert ph.shown
    want = re.escape(CLEAR) + r"sycl: SYCL0: compiling 23 kernels \.\.\. done in 0\.[3-9] s\n"
    assert re.fullmatch(want, out.getvalue()), repr(out.getvalue())


def test_a_failing_step_says_so():
    out = Term()
    with pytest.raises(RuntimeError), phase("vulkan: compiling 3 shaders with glslc", after_s=0.02, file=out):
        time.sleep(0.1)
        raise RuntimeError("glslc failed")
    assert out.getvalue().endswith(" ... failed after 0.1 s\n"), repr(out.getvalue())


def test_a_note_follows_the_time():
    out = Term()
    with phase("CPU split=none pp8: timed run 1/2", after_s=0, file=out) as ph:
        ph.note("412.3 tokens/s")
    assert re.fullmatch(re.escape(CLEAR) + r"CPU split=none pp8: timed run 1/2 \.\.\. done in 0\.0 s: "
                        r"412\.3 tokens/s\n", out.getvalue()), repr(out.getvalue())  # fmt: skip


@pytest.mark.parametrize("tty, quiet, enabled, sleep", [(True, False, True, 0.0), (False, False, True, 0.2),
                                                        (True, True, True, 0.2), (True, False, False, 0.2)],
                         ids=["short", "pipe", "quiet", "disabled"])  # fmt: skip
def test_silent_when_short_on_a_pipe_or_quiet(tty, quiet, enabled, sleep):
    set_quiet(quiet)
    out = Term(tty)
    with phase("cuda: CUDA0: compiling kernels/gemm.cu (40 kernels)", after_s=0.05, file=out,
               enabled=enabled) as ph:  # fmt: skip
        time.sleep(sleep)
    time.sleep(0.1)  # a timer that was not cancelled would write by now
    assert out.getvalue() == "" and not ph.shown


def test_set_quiet_returns_the_previous_setting():
    assert set_quiet(True) is False
    assert progress.is_quiet() and not progress.shows(Term())
    assert set_quiet(False) is True
    assert progress.shows(Term()) and not progress.shows(Term(tty=False))


def test_status_step_and_bar():
    term, pipe = Term(), Term(tty=False)
    for f in (term, pipe):
        status("CPU: MUL_MAT(type_a=f32)", file=f)
        status("CPU: ADD(type=f32)", file=f)
        step("CPU: copy bandwidth ... done in 0.2 s: 12.0 GB/s", file=f)
        with Bar("load", 4 << 20, "MiB", 2**-20, file=f) as bar:
            bar.update(4 << 20)
    got = term.getvalue()
    head = f"{CLEAR}CPU: MUL_MAT(type_a=f32){CLEAR}CPU: ADD(type=f32){CLEAR}CPU: copy bandwidth"
    assert got.startswith(head), repr(got)
    # the status line is replaced, the step is a line, the bar ends on its line with the rate
    assert re.fullmatch(r".*GB/s\n" + re.escape(CLEAR) + r"load +\[#{24}\] 4\.0/4\.0 MiB .*MiB/s\n", got,
                        re.S), repr(got)  # fmt: skip
    assert pipe.getvalue() == ""
    set_quiet(True)
    quiet = Term()
    status("x", file=quiet)
    step("x", file=quiet)
    with Bar("load", 10, file=quiet) as bar:
        bar.update(10)
    with Bar("load", 10, file=term, enabled=False) as bar:
        bar.update(10)
    assert quiet.getvalue() == "" and term.getvalue() == got


def test_interleaved_lines_read_whole():
    """A compile (an inner phase) inside a benchmark run (an outer one) inside nothing, then a
    phase over a bar: each takes a line of its own and the outer one says itself again."""
    out = Term()
    with phase("CPU split=none pp8: warm-up", after_s=0, file=out) as outer:
        with phase("vulkan: Vulkan0: compiling 3 pipelines", after_s=0, file=out):
            pass
        outer.note("99.0 tokens/s")
    with Bar("load", 2, file=out) as bar:
        bar.update(1)
        with phase("sycl: SYCL0: compiling 1 kernel", after_s=0, file=out):
            pass
        bar.update(1)
    lines = screen(out.getvalue())
    assert lines[:3] == ["CPU split=none pp8: warm-up ...",
                         "vulkan: Vulkan0: compiling 3 pipelines ... done in 0.0 s",
                         "CPU split=none pp8: warm-up ... done in 0.0 s: 99.0 tokens/s"], lines  # fmt: skip
    assert re.fullmatch(r"load +\[#{12}\.{12}\] 1/2 .*", lines[3]), lines
    assert lines[4] == "sycl: SYCL0: compiling 1 kernel ... done in 0.0 s", lines
    assert re.fullmatch(r"load +\[#{24}\] 2/2 .*/s", lines[5]) and lines[6:] == [""], lines


def test_end_line_finishes_an_open_line():
    out = Term()
    with Bar("load", 10, file=out) as bar:
        bar.update(5)
        end_line(file=out)  # an error is about to be printed
        assert out.getvalue().endswith("/s\n")
        bar._closed = True  # (the error unwinds; the bar's summary would follow)
    end_line(file=out)  # nothing open: nothing written
    assert out.getvalue().count("\n") == 1


@pytest.fixture
def terminal(monkeypatch):
    """stderr as a terminal (where progress writes: pytest swaps sys.stderr itself), and every
    phase shown at once."""
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
    want = re.escape(CLEAR) + r"vulkan: compiling 1 shader with glslc \.\.\. done in \d+\.\d s\n"
    assert re.fullmatch(want, got), repr(got)
    shaders.compile_all(sdir)  # cached now: nothing to say
    assert terminal.getvalue() == got


# --- the command line, on a pseudo-terminal ---------------------------------------------------------------
def _cli_stderr(args: list[str], tty: bool, cwd) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``accelplane ARGS`` with only the CPU plugin, stderr a
    pseudo-terminal when ``tty`` (else a pipe)."""
    import pty

    env = dict(os.environ, ACCELPLANE_PLUGINS="cpu", ACCELPLANE_CACHE_DIR=str(cwd / "cache"))
    argv = [sys.executable, "-m", "accelplane.cli", *args]
    if not tty:
        r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
        return r.returncode, r.stdout, r.stderr
    master, slave = pty.openpty()
    p = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal (EIO)
            break
        if not data:
            break
        chunks.append(data)
    out = p.stdout.read()
    p.wait(timeout=300)
    os.close(master)
    return p.returncode, out, b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from accelplane.models.runner import PRESETS, make_with_bar

    path = tmp_path_factory.mktemp("progress") / "tiny.gguf"
    make_with_bar(path, **PRESETS["tiny"], wtype="f32")
    return path


def test_bench_model_says_each_step_on_a_terminal(tiny_model, tmp_path):
    args = ["bench", "model", "--model", str(tiny_model), "-d", "CPU", "--pp", "8", "--tg", "2",
            "--reps", "2"]  # fmt: skip
    rc, out, err = _cli_stderr(args, True, tmp_path)
    assert rc == 0, out + err
    lines = [ln for ln in screen(err) if ln]
    steps = [ln for ln in lines if not ln.startswith("load ")]
    want = [r"CPU: copy bandwidth \.\.\. done in \d+\.\d s: \d+\.\d GB/s"]
    want += [rf"CPU split=none {t}: {w} \.\.\. done in \d+\.\d s: \d+\.\d tokens/s"
             for t in ("pp8", "tg2")
             for w in ("warm-up 1/2", "warm-up 2/2", "timed run 1/2", "timed run 2/2")]  # fmt: skip
    assert len(steps) == len(want), lines
    assert all(re.fullmatch(w, s) for w, s in zip(want, steps, strict=True)), lines
    assert any(re.fullmatch(r"load +\[#{24}\] .* MiB/s", ln) for ln in lines), lines
    assert "pp8" in out and "tg2" in out  # the results stay on stdout
    rc_q, out_q, err_q = _cli_stderr([*args, "-q"], True, tmp_path)
    rc_p, out_p, err_p = _cli_stderr(args, False, tmp_path)
    assert rc_q == rc_p == 0 and err_q == "" and err_p == "", (err_q, err_p)
    assert "pp8" in out_q and "pp8" in out_p


def test_make_model_shows_its_bar_on_a_terminal_only(tmp_path):
    args = ["make-model", str(tmp_path / "m.gguf"), "--preset", "tiny", "--jobs", "1"]
    rc, out, err = _cli_stderr(args, True, tmp_path)
    assert rc == 0 and "wrote" in out, out + err
    assert [ln for ln in screen(err) if ln] == [screen(err)[0]], repr(err)  # one line, redrawn
    assert re.fullmatch(r"make +\[#{24}\] [\d.]+/[\d.]+ MiB .* MiB/s", screen(err)[0]), repr(err)
    rc, out, err = _cli_stderr([*args, "--quiet"], True, tmp_path)
    assert rc == 0 and err == "", repr(err)
    rc, out, err = _cli_stderr(args, False, tmp_path)
    assert rc == 0 and err == "", repr(err)

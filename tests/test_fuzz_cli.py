"""Fuzzing the command line: random argument lists drawn from the commands' own grammar
(options with legal and illegal values, missing values, stray words, bad paths, bad
ACCELPLANE_* settings), run in-process on the CPU plugin and a tiny model.

Each must end with status 0 (work done), 1 (the work failed: a check, a computation) or 2
with exactly one line ``accelplane: error: ...`` on stderr; never an exception out of main,
a traceback or a hang. ACCELPLANE_FUZZ=long runs the long count (tests/fuzzing.py).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
from accelplane.cli import main
from accelplane.models import make_model
from fuzzing import TALLY, examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_host import deadline

# n_vocab 300: room for make-model's byte vocabulary, so `run --prompt` tokenizes
TINY = dict(n_layers=1, d_model=64, n_head=4, n_head_kv=2, d_ff=128, n_vocab=300, n_ctx=256, wtype="q8_0")
JUNK = ["", "-", "--", "x", "-1", "0", "1e309", "nan", "ÿ", "--json", "-d", "\x00", "a\x00b", "a" * 300, "/",
        "(", "*"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-fuzz")
    make_model(d / "tiny.gguf", **TINY)
    make_model(d / "bert.gguf", arch="bert", n_layers=1, d_model=64, n_head=4, d_ff=128, n_vocab=128,
               n_ctx=64, wtype="q8_0")  # fmt: skip
    (d / "not-a-model.gguf").write_bytes(b"GGUF" + b"\0" * 40)
    cwd = os.getcwd()
    os.chdir(d)  # relative output paths the fuzz draws land here, not in the checkout
    yield {"dir": d, "model": str(d / "tiny.gguf"), "bert": str(d / "bert.gguf"),
           "bad": str(d / "not-a-model.gguf"), "out": str(d / "out.json"),
           "missing": str(d / "no" / "such.json")}  # fmt: skip
    os.chdir(cwd)


def _value(draw, kind: str, p: dict) -> str:
    good = {
        "count": st.sampled_from(["0", "1", "2", "3"]),
        "pos": st.sampled_from(["1", "2", "4"]),
        "float": st.sampled_from(["0.001", "0.5", "1e-3", "2"]),
        "path": st.sampled_from([p["out"]]),
        "model": st.sampled_from([p["model"]]),
        "device": st.sampled_from(["CPU", "cpu"]),
        "regex": st.sampled_from(["MUL_MAT.*m=4096,n=1,", "add", "^$"]),
        "split": st.sampled_from(["none", "layer", "tensor"]),
        "wtype": st.sampled_from(["f32", "q8_0", "Q4_0", "q4_k"]),
        "sizes": st.sampled_from(["4K", "1M,64K"]),
        "preset": st.sampled_from(["bert-tiny"]),
        "bert": st.sampled_from([p["bert"], p["model"]]),
        "ids": st.sampled_from(["101 5 102", "101,6,7,102", "1", "127", "128", "1 2,,3", " "]),
        "pooling": st.sampled_from(["none", "mean", "cls", "last"]),
        "norm": st.sampled_from(["-1", "0", "1", "2", "3"]),
        "arch": st.sampled_from(["llama", "qwen2", "qwen3", "gemma3", "bert"]),
        "scaling": st.sampled_from(["none", "linear", "llama3"]),
        "text": st.sampled_from(["Hello", "Grüße aus 東京 🦙", "", "<s>x</s>", "  \t\n"]),
    }[kind]
    bad = st.sampled_from(JUNK + [p["missing"], str(p["dir"]), p["bad"], "NOPE", "-5", "1.5", "[", "9" * 30])
    return draw(good if draw(st.integers(0, 3)) else bad)


# (command words, {option: value kind or None for a flag}, options that keep it fast)
GRAMMAR = [
    (["devices"], {"--json": None, "--env": None}, []),
    (["run"], {"--model": "model", "-d": "device", "--split": "split", "--tokens": "count",
               "--prompt-tokens": "pos", "--seed": "count", "--nmse-tol": "float", "--no-check": None,
               "--prompt": "text", "--temp": "float", "--top-k": "count", "--top-p": "float",
               "--special": None},
     ["--model", "-d", "--tokens", "--prompt-tokens"]),
    (["bench", "model"], {"--model": "model", "-d": "device", "--pp": "count", "--tg": "count",
                          "--reps": "pos", "--split": "split", "--json": "path", "--profile": "count"},
     ["--model", "-d", "--pp", "--tg", "--reps"]),
    (["bench", "ops"], {"-d": "device", "-p": "regex", "--time": "float", "--repeat": "pos",
                        "--json": "path", "--set": "split"}, ["-d", "-p", "--time"]),
    (["bench", "tp"], {"--sizes": "sizes", "-d": "device", "--peer-json": "path"}, []),
    (["bench", "graph"], {"--preset": "preset", "-d": "device", "--reps": "pos", "--batch": "pos",
                          "--seq": "pos", "--json": "path"},
     ["--preset", "-d", "--reps", "--batch", "--seq"]),
    (["make-model"], {"--preset": "split", "--layers": "pos", "--d-model": "pos", "--wtype": "wtype",
                      "--jobs": "pos", "--vocab": "pos", "--arch": "arch", "--head-dim": "pos",
                      "--sliding-window": "count", "--rope-scaling": "scaling", "--tied": None,
                      "--pooling": "pooling", "--kv-heads": "pos"}, []),
    (["embed"], {"--model": "bert", "--ids": "ids", "--pooling": "pooling", "--normalize": "norm",
                 "--out": "path", "-d": "device"}, ["--model", "--ids"]),
    (["ops"], {"--markdown": "path", "--json": None}, []),
]  # fmt: skip
SLOW_IF_VALID = {("bench", "tp"), ("make-model",), ("ops",)}  # only their error paths run


def _argv(draw, p: dict) -> list[str]:
    words, opts, fast = draw(st.sampled_from(GRAMMAR))
    argv = list(words)
    if tuple(words) in SLOW_IF_VALID:
        argv.append(draw(st.sampled_from(["NOPE", p["missing"], "--bogus", "-5"])))  # always an error
    if words == ["make-model"]:
        argv.insert(1, draw(st.sampled_from([p["missing"], str(p["dir"]), ""])))
    chosen = draw(st.lists(st.sampled_from(sorted(opts)), max_size=5, unique=True))
    for o in dict.fromkeys([*fast, *chosen]):
        argv.append(o)  # the options that keep a valid command fast are always there
        if opts[o] is not None and draw(st.integers(0, 15)):  # now and then the value is missing
            argv.append(_value(draw, opts[o], p))
    if words[0] == "run" and "--tokens" not in argv:
        argv += ["--tokens", "2"]
    if draw(st.integers(0, 7)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(JUNK)))
    return argv


SETTINGS = [("ACCELPLANE_CHECK_RESULTS", "banana"), ("ACCELPLANE_NTHREADS", "-3"), ("ACCELPLANE_FUSION", "0"),
            ("ACCELPLANE_SCHED_DEBUG", "7"), ("ACCELPLANE_MODEL_POLICY", "strict")]  # fmt: skip


@contextmanager
def setting(var: str | None, value: str):
    old = os.environ.get(var) if var else None
    if var:
        os.environ[var] = value
    try:
        yield
    finally:
        if var and old is None:
            del os.environ[var]
        elif var:
            os.environ[var] = old


@given(st.data())
@settings(max_examples=examples(300, 3000), deadline=None, suppress_health_check=list(HealthCheck))
def test_every_command_line_ends_in_a_status_and_at_most_one_error_line(paths, capsys, data):
    argv = _argv(data.draw, paths)
    var, value = data.draw(st.sampled_from(SETTINGS)) if data.draw(st.integers(0, 9)) == 0 else (None, "")
    with deadline(120), setting(var, value):
        rc = main(argv)
    out, err = capsys.readouterr()
    assert rc in (0, 1, 2), (argv, rc, err)
    assert "Traceback" not in err and "Traceback" not in out, (argv, err)
    if rc == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert lines and lines[-1].startswith("accelplane: error: "), (argv, err)
        errors = [ln for ln in lines if "error" in ln.lower()]
        assert len(errors) == 1, (argv, err)
    TALLY.add("cli", {0: "done", 1: "failed (status 1)", 2: "user error (one line, status 2)"}[rc])

"""The command line at its edges: every user error is one line ``accelplane: error: ...`` with
exit status 2, found before the work starts; failures of the work exit 1; Ctrl-C exits 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from accelplane.cli import main
from accelplane.models import make_model, read_gguf, save_gguf

TINY = dict(n_layers=1, d_model=64, n_head=4, n_head_kv=2, d_ff=128, n_vocab=256, n_ctx=256, wtype="f32")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    make_model(p, **TINY)
    return p


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str, *parts: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("accelplane: error: "), err
    for p in parts:
        assert p in lines[0], (p, lines[0])


@pytest.mark.parametrize(("argv", "parts"), [
    (["bench", "ops", "-p", "(f16"], ["-p/--pattern", "not a regular expression"]),
    (["bench", "ops", "--time", "0"], ["--time", "expected a finite number > 0, got 0"]),
    (["bench", "ops", "--repeat", "-1"], ["--repeat", "expected an integer from 1"]),
    (["bench", "tp", "--sizes", "4Q"], ["--sizes"]),
    (["bench", "model", "--pp", "0", "--tg", "0"], ["--pp 0 and --tg 0"]),
    (["bench", "model", "--pp", "-5"], ["--pp", "expected an integer >= 0, got -5"]),
    (["bench", "model", "--llama-bench", "/nonexistent/llama-bench"],
     ["--llama-bench /nonexistent/llama-bench: not an executable file"]),
    (["bench", "ops", "--llama-bench", "/bin/sh"], ["--llama-bench is a peer of bench model only"]),
    (["run", "--nmse-tol", "-1"], ["--nmse-tol", "expected a finite number > 0"]),
    (["run", "--nmse-tol", "nan"], ["--nmse-tol"]),
    (["run", "--tokens", "x"], ["--tokens", "expected an integer, got 'x'"]),
    (["run", "--prompt-tokens", "0"], ["--prompt-tokens", ">= 1"]),
    (["run", "--model", "/nonexistent/m.gguf"], ["--model /nonexistent/m.gguf: no such file"]),
    (["run", "--model", "m" * 300], [f"--model {'m' * 300}: File name too long"]),  # (the fuzz found it)
    (["run", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["run", "--experts", "cpu", "--n-cpu-moe", "1"], ["--experts and --n-cpu-moe", "give one"]),
    (["bench", "model", "--experts", "gpu"], ["--experts", "invalid choice"]),
    (["make-model", "/nonexistent/dir/m.gguf"], ["directory /nonexistent/dir does not exist"]),
    (["make-model", "x.gguf", "--layers", "0"], ["--layers", "from 1 to"]),
    (["make-model", "x.gguf", "--wtype", "iq2_xxs"], ["--wtype", "invalid choice"]),
    (["make-model", "x.gguf", "--arch", "gpt2"], ["--arch", "invalid choice"]),
    (["make-model", "x.gguf", "--sliding-window", "8"], ["--sliding-window does not apply to --arch llama"]),
    (["make-model", "x.gguf", "--arch", "bert", "--tied"], ["--tied does not apply to --arch bert"]),
    (["make-model", "x.gguf", "--arch", "qwen2", "--rope-scaling", "llama3"], ["llama3 rope", "qwen2"]),
    (["make-model", "x.gguf", "--arch", "qwen3", "--rope-factor", "0"], ["--rope-factor", "> 0"]),
    (["ops", "--markdown", "/nonexistent/ops.md"], ["/nonexistent does not exist"]),
    (["bench", "ops", "--json", "/nonexistent/x.json"], ["--json /nonexistent/x.json"]),
    (["bench", "ops", "--json", "j" * 300], ["cannot be written (File name too long)"]),  # (fuzz)
    (["nosuchcommand"], ["invalid choice"]),
])  # fmt: skip
def test_user_errors_are_one_line_with_status_2(capsys, argv, parts):
    t0 = time.perf_counter()
    rc, _, err = run(capsys, *argv)
    assert rc == 2, err
    one_line(err, *parts)
    assert time.perf_counter() - t0 < 10, "found before any work"


def test_an_output_path_that_is_a_directory(capsys, tmp_path):
    rc, _, err = run(capsys, "make-model", str(tmp_path), "--preset", "tiny")
    assert rc == 2
    one_line(err, "is a directory")
    rc, _, err = run(capsys, "bench", "ops", "--json", str(tmp_path))
    assert rc == 2
    one_line(err, "--json", "is a directory")


def test_a_file_system_error_during_the_work_is_one_line_with_status_1(capsys, monkeypatch):
    import accelplane.cli as cli

    def full(args, extra):
        raise OSError(28, "No space left on device", "/data/out.json")

    monkeypatch.setattr(cli, "_dispatch", full)
    rc, _, err = run(capsys, "devices")
    assert rc == 1
    one_line(err, "/data/out.json: No space left on device")


@pytest.mark.parametrize(("var", "value"), [("ACCELPLANE_CHECK_RESULTS", "banana"),
                                            ("ACCELPLANE_NTHREADS", "abc"), ("ACCELPLANE_CPU_ISA", "bogus"),
                                            ("ACCELPLANE_MODEL_POLICY", "eager")])  # fmt: skip
def test_a_bad_setting_stops_any_command(capsys, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    for argv in (["devices"], ["run", "--no-check"]):
        rc, _, err = run(capsys, *argv)
        assert rc == 2, err
        one_line(err, f"{var}={value!r}: expected")


def test_devices_env_lists_what_is_set(capsys, monkeypatch):
    monkeypatch.setenv("ACCELPLANE_FUSION", "0")
    monkeypatch.setenv("ACCELPLANE_NO_SUCH_KNOB", "1")
    rc, out, _ = run(capsys, "devices", "--env")
    assert rc == 0
    assert "ACCELPLANE_FUSION=0 [accelplane]: plugins may fuse nodes" in out
    assert "ACCELPLANE_NO_SUCH_KNOB=1" in out and "no installed component reads this variable" in out
    assert "ACCELPLANE_VK_DEVICES [vulkan]" in out or "vulkan" not in out  # plugins' variables too
    assert "ACCELPLANE_CHECK_RESULTS [accelplane] (1|0, default 0)" in out


def test_tokens_past_the_context_are_refused_naming_it(capsys, tiny):
    rc, _, err = run(capsys, "run", "--model", str(tiny), "-d", "CPU", "--tokens", "100000")
    assert rc == 2
    assert "exceed the model's context of 256 tokens (n_ctx; a KV cache of 100096 positions" in err
    assert err.strip().splitlines()[-1].startswith("accelplane: error: ")


@pytest.mark.parametrize("cmd", [["run"], ["bench", "model"]])
def test_an_unknown_device_is_one_line(capsys, tiny, cmd):
    rc, out, err = run(capsys, *cmd, "--model", str(tiny), "-d", "NOPE")
    assert rc == 2
    assert err.strip().splitlines()[-1].startswith("accelplane: error: no device named 'NOPE'")
    if cmd == ["bench", "model"]:
        assert out == "", out  # the device is checked before the model is described


@pytest.fixture(scope="module")
def nan_model(tiny, tmp_path_factory) -> Path:
    f = read_gguf(tiny)
    t = f.tensors["blk.0.ffn_down.weight"]
    data = t.data.copy().view(np.float32)
    data[5] = np.nan
    f.tensors[t.name] = replace(t, data=data.view(np.uint8))
    p = tmp_path_factory.mktemp("nan") / "nan.gguf"
    save_gguf(p, f)
    f.close()
    return p


def test_nan_logits_fail_the_run_even_without_the_check(capsys, nan_model):
    rc, out, err = run(capsys, "run", "--model", str(nan_model), "-d", "CPU", "--no-check", "--tokens", "2")
    assert rc == 1, out + err
    assert err.strip().splitlines()[-1].startswith("accelplane: error: the logits of the prefill hold NaN")
    assert "ACCELPLANE_CHECK_RESULTS=1" in err


def test_check_results_names_where_the_nan_comes_from(capsys, monkeypatch, nan_model):
    monkeypatch.setenv("ACCELPLANE_CHECK_RESULTS", "1")
    rc, out, err = run(capsys, "run", "--model", str(nan_model), "-d", "CPU", "--no-check", "--tokens", "2")
    assert rc == 1, out + err
    last = err.strip().splitlines()[-1]
    assert last.startswith("accelplane: error: check-results: ") and "holds NaN" in last, last
    assert "ffn_down" in last, last


def test_ctrl_c_exits_130_with_one_line(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "accelplane.cli", "make-model", str(tmp_path / "big.gguf"),
                          "--preset", "1b", "--jobs", "1"], env=env, stderr=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "accelplane: interrupted"
    assert "Traceback" not in err
    assert not (tmp_path / "big.gguf").exists(), "no partial model is left behind"


def test_ops_markdown_has_a_row_per_block_type(capsys, tmp_path):
    """`ops --markdown` ends with a row for every block type of the catalog; a type's row counts
    the conformance cases that name the type (counted here apart), and the CPU plugin takes
    them all."""
    from accelplane.cli import support_matrix
    from accelplane.conformance.cases import all_cases
    from accelplane.core.ops import QUANT

    out = tmp_path / "ops.md"
    rc, _, err = run(capsys, "ops", "--markdown", str(out))
    assert rc == 0, err
    table = out.read_text().split("## Block types")[1]
    names = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")}
    assert names - {"type", "---"} == {t.name for t in QUANT}
    cols, _, by_type = support_matrix()
    cpu = next(c for c in cols if c.startswith("cpu/"))
    cases = all_cases()
    for t in QUANT:
        n = sum(1 for c in cases if any(type(v) is type(t) and v == t for v in c.params.values()))
        assert n >= 4 and by_type[t.name][cpu] == (n, n), (t.name, n, by_type[t.name][cpu])

"""``bench model --llama-bench``: the SDK's side of running llama.cpp's llama-bench beside ours.

llama-bench itself is not built here, so a small script stands in for it: it records the
arguments it was given and prints llama-bench's JSON records with samples chosen by the test,
which makes the arguments, the alternation (peer before and after ours), the ratios and every
failure checkable. Real runs against llama.cpp are in docs/performance.md.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from accelplane.bench.llama_peer import PeerRun, attach, peer_args, record_test, run_llama_bench
from accelplane.errors import PeerError
from accelplane.interface import DeviceType
from accelplane.models import make_model, read_gguf
from accelplane.testing.plugins import cpu_and_async_registry

TINY = dict(n_layers=2, d_model=64, n_head=4, n_head_kv=2, d_ff=96, n_vocab=96, n_ctx=64, wtype="f32",
            seed=11)  # fmt: skip

FAKE = """#!{python}
# a stand-in for llama-bench: appends its argv to LOG, then follows MODE
import json, sys
args = sys.argv[1:]
log, mode = {log!r}, open({mode!r}).read().strip()
with open(log, "a") as f:
    f.write(json.dumps(args) + "\\n")
if mode == "fail":
    sys.stderr.write("main: error: invalid device CUDA7\\n")
    sys.exit(1)
if mode == "garbage":
    print("not json")
    sys.exit(0)
def val(flag):
    return args[args.index(flag) + 1]
p, n, r = int(val("-p")), int(val("-n")), int(val("-r"))
calls = sum(1 for _ in open(log))
out = []
for pp, tg in ((p, 0), (0, n)):
    if (pp or tg) and not (mode == "no-tg" and tg):
        rate = (1000.0 if pp else 100.0) * calls  # 2nd call twice the 1st: the mean of both shows
        out.append(dict(build_commit="abc1234", n_prompt=pp, n_gen=tg, n_depth=0,
                        samples_ts=[rate] * r, avg_ts=rate))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reg():
    os.environ.setdefault("ACCELPLANE_TEST_DELAY_US", "20")
    return cpu_and_async_registry(n_async=2)


@pytest.fixture
def fake(tmp_path):
    """(executable, argv log, mode file): the stand-in llama-bench."""
    log, mode = tmp_path / "calls.log", tmp_path / "mode"
    mode.write_text("ok")
    exe = tmp_path / "llama-bench"
    exe.write_text(FAKE.format(python=sys.executable, log=str(log), mode=str(mode)))
    exe.chmod(0o755)
    return exe, log, mode


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("peer") / "tiny.gguf"
    make_model(p, **TINY)
    return p


def calls(log: Path) -> list[list[str]]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def test_tests_are_named_as_bench_model_names_them():
    assert record_test({"n_prompt": 512, "n_gen": 0}) == "pp512"
    assert record_test({"n_prompt": 0, "n_gen": 128}) == "tg128"
    assert record_test({"n_prompt": 512, "n_gen": 128}) is None  # -pg: not a bench model test
    assert record_test({"n_prompt": 512, "n_gen": 0, "n_depth": 4096}) is None


def test_each_config_maps_to_llama_benchs_placement(reg):
    cpu = next(d for d in reg.devices if d.type == DeviceType.CPU)
    a0, a1 = [d for d in reg.devices if d.type != DeviceType.CPU][:2]
    tail = ["-fa", "1", "-p", "512", "-n", "128", "-r", "3", "-t", "4", "-ncmoe", "0", "-o", "json"]
    assert peer_args([cpu], "none", 0, 512, 128, 3, 4) == ["-ngl", "0", "-dev", "none", *tail]
    assert peer_args([a0], "none", 0, 512, 128, 3, 4) == ["-ngl", "99", "-dev", a0.name, *tail]
    assert peer_args([a0, a1], "layer", 0, 512, 128, 3, 4) == [
        "-ngl", "99", "-dev", f"{a0.name}/{a1.name}", "-sm", "layer", *tail]  # fmt: skip
    assert peer_args([a0, a1], "tensor", 0, 512, 128, 3, 4) is None  # no like in llama.cpp
    assert peer_args([a0, cpu], "layer", 0, 512, 128, 3, 4) is None
    assert peer_args([a0], "none", 48, 0, 128, 2, 16)[-4:-2] == ["-ncmoe", "48"]


def test_the_peer_runs_before_and_after_ours_and_rows_get_the_ratio(reg, tiny, fake):
    from accelplane.bench.model import bench_model, format_bench, threads

    exe, log, _ = fake
    cpu = next(d for d in reg.devices if d.type == DeviceType.CPU)
    a0, a1 = [d for d in reg.devices if d.type != DeviceType.CPU][:2]
    with read_gguf(tiny) as f:
        rows = bench_model(f, [([cpu], "none"), ([a0, a1], "tensor")], cpu, pp=8, tg=4, reps=2,
                           llama_bench=str(exe))  # fmt: skip
    argv = calls(log)
    assert len(argv) == 2, "once before ours and once after, for the CPU config only (tensor: no like)"
    assert argv[0] == argv[1] == ["-m", str(tiny), *peer_args([cpu], "none", 0, 8, 4, 2, threads())]
    by = {(r["devices"], r["test"]): r for r in rows}
    pp, tg = by[(cpu.name, "pp8")], by[(cpu.name, "tg4")]
    # the stand-in's second call reports twice its first: the peer's figure is the mean of both
    assert pp["peer_runs_tokens_per_s"] == [1000.0, 2000.0] and pp["peer_tokens_per_s"] == 1500.0
    assert tg["peer_runs_tokens_per_s"] == [100.0, 200.0] and tg["peer_tokens_per_s"] == 150.0
    assert pp["vs_peer"] == pytest.approx(pp["tokens_per_s"] / 1500.0)
    assert tg["vs_peer"] == pytest.approx(tg["tokens_per_s"] / 150.0)
    assert pp["peer"] == "llama.cpp abc1234"
    assert not any("vs_peer" in r for r in rows if r["split"] == "tensor")
    table = format_bench(rows)
    assert "vs llama.cpp" in table and f"{tg['vs_peer']:.2f}x" in table and "150.00" in table


@pytest.mark.parametrize(("mode", "message"), [
    ("fail", "llama-bench failed (exit status 1): main: error: invalid device CUDA7"),
    ("garbage", "llama-bench printed no JSON"),
    ("no-tg", "llama-bench reported no tg4"),
])  # fmt: skip
def test_a_peer_that_fails_or_reports_nothing_is_a_peer_error(reg, tiny, fake, mode, message):
    from accelplane.bench.model import bench_model

    exe, _, mode_file = fake
    mode_file.write_text(mode)
    cpu = next(d for d in reg.devices if d.type == DeviceType.CPU)
    with read_gguf(tiny) as f, pytest.raises(PeerError, match=re.escape(message)):
        bench_model(f, [([cpu], "none")], cpu, pp=8, tg=4, reps=1, llama_bench=str(exe))


def test_a_model_without_a_file_has_no_peer(reg, tiny, fake):
    from accelplane.bench.model import bench_model
    from accelplane.models.gguf import GGUFFile

    exe, log, _ = fake
    cpu = next(d for d in reg.devices if d.type == DeviceType.CPU)
    with read_gguf(tiny) as f, pytest.raises(PeerError, match="reads a model file"):
        bench_model(GGUFFile(None, f.metadata, f.tensors, f.alignment), [([cpu], "none")], cpu, pp=8, tg=4,
                    reps=1, llama_bench=str(exe))  # fmt: skip
    assert not calls(log)


def test_a_peer_that_cannot_start_is_a_peer_error(tmp_path, tiny):
    bad = tmp_path / "llama-bench"
    bad.write_text("not a program")
    bad.chmod(0o755)
    with pytest.raises(PeerError, match="cannot run"):
        run_llama_bench(str(bad), str(tiny), ["-p", "8"])


def test_attach_refuses_a_run_without_the_test():
    rows = [{"test": "pp512", "devices": "CUDA0", "tokens_per_s": 10.0}]
    with pytest.raises(PeerError, match="no pp512 for CUDA0"):
        attach(rows, [PeerRun({"pp512": [5.0]}, "x"), PeerRun({"tg128": [1.0]}, "x")])


def test_the_cli_prints_the_ratio_and_fails_in_one_line_when_the_peer_fails(tiny, fake, tmp_path, capsys):
    from accelplane import cli

    exe, _, mode = fake
    js = tmp_path / "b.json"
    argv = ["bench", "model", "--model", str(tiny), "-d", "CPU", "--pp", "8", "--tg", "4", "--reps", "1",
            "--llama-bench", str(exe)]  # fmt: skip
    assert cli.main([*argv, "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "vs llama.cpp" in out
    rows = json.loads(js.read_text())["results"]
    assert {r["test"] for r in rows} == {"pp8", "tg4"} and all(r["vs_peer"] > 0 for r in rows)
    mode.write_text("fail")
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "invalid device CUDA7" in err[0], err

"""Listing the devices of every installed plugin opens no runtime: no SYCL context or queue,
no OpenCL program built, no Vulkan logical device (the ``vulkan`` package is not even
imported) and no shader compiled, no emulated NPU loaded, no CuPy; the first real use of each
device opens it (the positive control: the same counters move). Run in a fresh interpreter
with every installed plugin, as ``import accelplane; accelplane.devices()`` would be."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import json, sys
    import numpy as np

    counts = {"SyclContext": 0, "SyclQueue": 0, "program.build": 0, "shaders.compile_all": 0,
              "shaders.run_glslc": 0}

    def counting(owner, attr, key):
        real = getattr(owner, attr)

        def wrapper(*a, **k):
            counts[key] += 1
            return real(*a, **k)

        setattr(owner, attr, wrapper)

    # counters around what opening a runtime does, installed before anything is listed (each
    # module imported here is a light one: the runtimes' own are not)
    try:
        from accelplane_sycl import program, runtime as sycl_runtime
        import dpctl  # (for its counters: listing itself does not import it)

        counting(dpctl, "SyclContext", "SyclContext")
        counting(dpctl, "SyclQueue", "SyclQueue")
        counting(program, "build", "program.build")
    except ImportError:
        pass
    try:
        from accelplane_vulkan import shaders

        counting(shaders, "compile_all", "shaders.compile_all")
        counting(shaders, "run_glslc", "shaders.run_glslc")
    except ImportError:
        pass
    RUNTIME_MODULES = ("vulkan", "accelplane_vulkan.runtime", "accelplane_hexagon._htp", "cupy")

    import accelplane
    from accelplane.core.graph import Context
    from accelplane.runtime.alloc import alloc_tensors

    reg = accelplane.get_registry()
    devices = reg.devices
    reg.info()  # what `accelplane devices --no-open` prints
    listed = {
        "devices": [(d.plugin.name, d.name, d.is_open) for d in devices],
        "modules": [m for m in RUNTIME_MODULES if m in sys.modules],
        "counts": dict(counts),
    }
    # `accelplane devices` opens every device and compiles nothing
    import contextlib, io
    from accelplane.cli import main

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        rc = main(["devices"])
    opened = {"rc": rc, "is_open": [d.is_open for d in devices], "counts": dict(counts),
              "out": shown.getvalue()}
    used = {}
    for d in devices:  # the first real use of each device
        if d.type.value == "CPU":
            continue
        ctx = Context()
        x = ctx.new_tensor("f32", (64,), "x")
        y = ctx.scale(x, 2.0)
        g = ctx.graph(y)
        buf = alloc_tensors([x, y], d.buffer_type)
        b = d.new_backend()
        x.set(np.arange(64, dtype=np.float32))
        b.compute(g)
        ok = y.get().tolist() == (np.arange(64) * 2.0).tolist()
        b.free()
        buf.free()
        used[d.name] = ok
    print(json.dumps({"listed": listed, "opened": opened, "used": used,
                      "is_open": [d.is_open for d in devices],
                      "modules": [m for m in RUNTIME_MODULES if m in sys.modules], "counts": counts,
                      "failures": [(f.name, f.reason) for f in reg.failures]}))
    """
)


@pytest.fixture(scope="module")
def probe() -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"probe crashed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _plugin(probe: dict, name: str) -> list:
    devs = [d for d in probe["listed"]["devices"] if d[0] == name]
    if not devs:
        why = [r for n, r in probe["failures"] if n == name]
        pytest.skip(f"no {name} device: {why[0] if why else 'the plugin is not installed'}")
    return devs


def test_listing_opens_no_device(probe):
    listed = probe["listed"]
    vendor = [d for d in listed["devices"] if d[0] != "cpu"]
    if not vendor:
        pytest.skip(f"no device of a vendor plugin here: {probe['failures']}")
    assert [d for d in vendor if d[2]] == [], "listing opened a device"
    assert listed["modules"] == [], "listing imported a device runtime"
    assert listed["counts"] == dict.fromkeys(listed["counts"], 0), "listing opened or compiled something"


def test_accelplane_devices_opens_every_device_and_compiles_nothing(probe):
    opened = probe["opened"]
    assert opened["rc"] == 0, opened["out"]
    listed = probe["listed"]["devices"]
    failed = [line for line in opened["out"].splitlines() if "did not open" in line]
    assert all(opened["is_open"]) or failed, opened["out"]
    counts = opened["counts"]
    compiled = ("program.build", "shaders.compile_all", "shaders.run_glslc")
    assert [counts[k] for k in compiled] == [0, 0, 0], counts
    if any(d[0] == "sycl" for d in listed):  # the positive control: opening made its context and queue
        assert counts["SyclQueue"] >= 1, counts  # (its context may be the platform's default one)
    for _, name, _ in listed:
        assert re.search(rf"^  {name} ", opened["out"], re.M), (name, opened["out"])


def test_sycl_opens_a_context_and_builds_on_first_use(probe):
    _plugin(probe, "sycl")
    assert probe["listed"]["counts"]["SyclContext"] == probe["listed"]["counts"]["SyclQueue"] == 0
    assert probe["counts"]["SyclQueue"] >= 1  # (its context may be the platform's default one)
    assert probe["counts"]["program.build"] >= 1, "the scale kernel was built at its first use"


def test_vulkan_opens_a_device_and_loads_shaders_on_first_use(probe):
    _plugin(probe, "vulkan")
    assert "vulkan" in probe["modules"] and "accelplane_vulkan.runtime" in probe["modules"]
    assert probe["counts"]["shaders.compile_all"] >= 1


def test_hexagon_loads_the_emulator_on_first_use(probe):
    _plugin(probe, "hexagon")
    assert "accelplane_hexagon._htp" in probe["modules"]


def test_first_use_computes(probe):
    if not probe["used"]:
        pytest.skip("no device of a vendor plugin here")
    assert probe["used"] == dict.fromkeys(probe["used"], True)
    assert all(probe["is_open"][i] for i, d in enumerate(probe["listed"]["devices"]) if d[1] in probe["used"])


# --- a plugin without a device, and the startup benchmark --------------------------------------------------
NO_DEVICE_ENV = {"ACCELPLANE_EXTRA_PLUGINS": "asynctest=accelplane.testing.asyncdev",
                 "ACCELPLANE_ASYNCDEV_NDEV": "0", "ACCELPLANE_DISABLE_PLUGINS": "vulkan,sycl,hexagon,cuda"}
NO_DEVICE_LINE = "plugin asynctest: no device (DeviceError: plugin reports no devices)"


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accelplane.cli", *args], capture_output=True, text=True,
                          env={**{k: v for k, v in os.environ.items() if k != "ACCELPLANE_PLUGINS"}, **env},
                          timeout=600)  # fmt: skip


def test_a_plugin_without_devices_is_one_informational_line():
    """get_devices returning [] is "no device", never "broken": one line, exit status 0."""
    for args in (["devices"], ["devices", "--no-open"]):
        r = _cli(*args, **NO_DEVICE_ENV)
        assert r.returncode == 0, r.stdout + r.stderr
        mentions = [line for line in r.stdout.splitlines() if "asynctest" in line]
        assert mentions == [NO_DEVICE_LINE], r.stdout
        assert "broken" not in r.stdout and r.stderr == "", r.stdout + r.stderr


def test_startup_bench_runs_and_its_json_has_the_fields(tmp_path):
    out = tmp_path / "startup.json"
    r = _cli("bench", "startup", "--runs", "1", "--json", str(out), **NO_DEVICE_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["runs"] == 1 and "cpu" in res["machine"]
    rows = {row["what"]: row for row in res["results"]}
    assert list(rows) == ["import numpy (the floor)", "import accelplane", "devices(): all plugins",
                          "devices(): asynctest alone",
                          "devices(): cpu alone", "accelplane devices (opens each)"], list(rows)  # fmt: skip
    keys = {"what", "plugin", "import_ms", "list_ms", "total_ms", "cpu_ms", "process_ms", "devices", "note"}
    assert all(set(row) == keys for row in rows.values()), rows
    every = rows["devices(): all plugins"]
    assert every["devices"] == ["CPU"], every
    assert every["note"] == "asynctest: no device (DeviceError: plugin reports no devices)", every
    for row in rows.values():  # the parts add up, and a process takes longer than what runs in it
        assert row["process_ms"] > 0
        if row["list_ms"] is not None:
            assert row["total_ms"] == pytest.approx(row["import_ms"] + row["list_ms"], rel=1e-6)
            assert row["process_ms"] > row["total_ms"] and row["cpu_ms"] > 0
    assert rows["devices(): cpu alone"]["devices"] == ["CPU"]
    assert rows["devices(): asynctest alone"]["devices"] == []
    per = {p["plugin"]: p for p in res["plugins"]}
    assert set(per) == {"cpu", "asynctest"}, per
    assert per["cpu"]["outcome"] == "listed" and per["cpu"]["devices"] == ["CPU"]
    assert per["asynctest"]["outcome"] == "no device: DeviceError: plugin reports no devices"
    for p in per.values():
        parts = [p["import_ms"], p["validate_ms"], p["get_devices_ms"]]
        assert all(v is not None and v >= 0 for v in parts) and p["total_ms"] == pytest.approx(sum(parts)), p
        assert sum(parts) < every["list_ms"]  # each plugin's share is inside the listing it is part of
    assert "devices(): all plugins" in r.stdout and "get_devices" in r.stdout and f"wrote {out}" in r.stdout

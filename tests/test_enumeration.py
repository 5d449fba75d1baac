"""Listing the devices of every installed plugin opens no runtime: no SYCL context or queue,
no OpenCL program built, no Vulkan logical device (the ``vulkan`` package is not even
imported) and no shader compiled, no emulated NPU loaded, no CuPy; the first real use of each
device opens it (the positive control: the same counters move). Run in a fresh interpreter
with every installed plugin, as ``import accelplane; accelplane.devices()`` would be."""

from __future__ import annotations

import json
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
        import dpctl  # the plugin's probe imports it anyway

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
    print(json.dumps({"listed": listed, "used": used, "is_open": [d.is_open for d in devices],
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


def test_sycl_opens_a_context_and_builds_on_first_use(probe):
    _plugin(probe, "sycl")
    assert probe["listed"]["counts"]["SyclContext"] == probe["listed"]["counts"]["SyclQueue"] == 0
    assert probe["counts"]["SyclContext"] >= 1 and probe["counts"]["SyclQueue"] >= 1
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

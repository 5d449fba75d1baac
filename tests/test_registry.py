"""Plugin discovery and failure isolation, through real entry points.

A fake installed distribution (``*.dist-info`` with METADATA and entry_points.txt) and its
plugin modules are written to a temporary directory that is put on PYTHONPATH of a fresh
interpreter, so the process-wide registry and sys.modules start clean in every run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from importlib import metadata
from pathlib import Path

import accelplane
import numpy as np
import pluggy
import pytest
from accelplane.cpu import plugin as cpu_plugin
from accelplane.errors import AccelplaneError, DeviceError, PluginLoadError
from accelplane.interface import API_VERSION, HOOK_NAMES, DeviceSpec, DeviceType, hookimpl
from accelplane.runtime.alloc import GraphAllocator, alloc_ctx_tensors
from accelplane.runtime.backend import Device
from accelplane.runtime.registry import Registry
from accelplane.testing.plugins import host_plugin

HEAVY = ("cffi", "accelplane.cpu._kernels", "accelplane.cpu.plan", "gguf", "ml_dtypes")

# --- the fixture plugins -------------------------------------------------------------------------
_REEXPORT = "from accelplane.cpu.plugin import *  # noqa: F401,F403  (every cpu hookimpl)\n"
_IMPORTS = "from accelplane.interface import DeviceSpec, DeviceType, hookimpl\n"


def plugin_src(body: str) -> str:
    """A plugin module: every cpu hookimpl re-exported, then ``body`` (overrides)."""
    return _REEXPORT + _IMPORTS + textwrap.dedent(body)


GOOD = plugin_src(
    """
    from pathlib import Path

    @hookimpl
    def get_devices():
        Path(__file__).with_name("hostdev_get_devices_called").write_text("yes")
        return [DeviceSpec("HOSTDEV", "test host-memory device", DeviceType.ACCEL)]
    """
)

# name -> (module source, expected failure stage, substrings the reason must contain)
BROKEN: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "bad_import": (
        "raise ImportError('libfakevendor.so.1: cannot open shared object file')\n",
        "import",
        ("ImportError", "libfakevendor.so.1"),
    ),
    "bad_major": (
        plugin_src(
            """
            from pathlib import Path

            @hookimpl
            def api_version():
                return (2, 0)

            @hookimpl
            def get_devices():
                Path(__file__).with_name("bad_major_get_devices_called").write_text("oops")
                return [DeviceSpec("MAJOR2", "must never be listed", DeviceType.GPU)]
            """
        ),
        "api_version",
        ("bad_major", "2.0", "{}.{}".format(*API_VERSION)),
    ),
    "bad_argname": (
        plugin_src(
            """
            @hookimpl
            def get_devices():
                return [DeviceSpec("ARGNAME", "must never be listed", DeviceType.GPU)]

            @hookimpl
            def supports_op(device, tensor):
                return True
            """
        ),
        "validate",
        ("supports_op", "tensor"),
    ),
    "bad_devices": (
        plugin_src(
            """
            @hookimpl
            def get_devices():
                raise RuntimeError("driver exploded: fakeGetDeviceCount returned 999")
            """
        ),
        "devices",
        ("RuntimeError", "driver exploded"),
    ),
    "no_devices": (
        plugin_src(
            """
            @hookimpl
            def get_devices():
                return []
            """
        ),
        "devices",
        ("no devices",),
    ),
    "missing_required": (
        plugin_src(
            """
            del graph_compute  # noqa: F821

            @hookimpl
            def get_devices():
                return [DeviceSpec("NOCOMPUTE", "must never be listed", DeviceType.GPU)]
            """
        ),
        "validate",
        ("required", "graph_compute"),
    ),
    "unknown_hook": (
        plugin_src(
            """
            @hookimpl
            def get_devices():
                return [DeviceSpec("TYPO", "must never be listed", DeviceType.GPU)]

            @hookimpl
            def graph_computee(backend, graph):
                pass
            """
        ),
        "validate",
        ("unknown hook", "graph_computee"),
    ),
    "partial_events": (
        plugin_src(
            """
            @hookimpl
            def get_devices():
                return [DeviceSpec("HALFEVENTS", "must never be listed", DeviceType.GPU)]

            @hookimpl
            def event_new(device):
                return object()
            """
        ),
        "validate",
        ("event_record", "event_synchronize"),
    ),
}

# a plugin that loads but whose device_memory raises: `devices` must still be listable
FLAKY_MEMORY = plugin_src(
    """
    @hookimpl
    def get_devices():
        return [DeviceSpec("FLAKYMEM", "device_memory raises", DeviceType.ACCEL)]

    @hookimpl
    def device_memory(device):
        raise RuntimeError("sysfs went away")
    """
)


def _dist(site: Path, name: str, version: str, entries: dict[str, str]) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{ep} = {mod}\n" for ep, mod in entries.items())
    (info / "entry_points.txt").write_text(f"[accelplane.plugins]\n{lines}")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory holding two fake installed distributions and their plugin modules."""
    site = tmp_path_factory.mktemp("site")
    entries = {}
    for name, (src, _, _) in BROKEN.items():
        (site / f"fakeplug_{name}.py").write_text(src)
        entries[name] = f"fakeplug_{name}"
    (site / "fakeplug_flaky_memory.py").write_text(FLAKY_MEMORY)
    entries["flaky_memory"] = "fakeplug_flaky_memory"
    _dist(site, "accelplane-brokenplugins", "0.1", entries)
    (site / "fakeplug_hostdev.py").write_text(GOOD)
    _dist(site, "accelplane-hostdev", "0.3", {"hostdev": "fakeplug_hostdev"})
    return site


PROBE = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import accelplane
    from accelplane.errors import AccelplaneError, PluginLoadError
    try:
        reg = accelplane.get_registry()
    except AccelplaneError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e),
                          "is_plugin_load_error": isinstance(e, PluginLoadError)}))
        raise SystemExit(0)
    elapsed = time.perf_counter() - t0
    info = reg.info()
    info["elapsed_s"] = elapsed
    info["heavy"] = sorted(m for m in %r if m in sys.modules)
    info["pm_plugins"] = sorted(reg.pm.get_name(p) for p in reg.pm.get_plugins())
    info["api_version_impls"] = len(reg.pm.hook.api_version.get_hookimpls())
    info["devices"] = [d.name for d in reg.devices]
    info["cpu_plugin_imported"] = "accelplane.cpu.plugin" in sys.modules
    info["metadata_imported"] = "importlib.metadata" in sys.modules
    reg.pm.check_pending()  # what failed left nothing behind in the plugin manager
    print(json.dumps(info))
    """
) % (HEAVY,)


def probe(site: Path | None = None, **env: str) -> dict:
    """Run discovery in a fresh interpreter; returns info() plus extras, or the error."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPLANE_")}
    # vendor plugins installed in this environment (vulkan, sycl, …) stay out of the picture:
    # these tests reason about the CPU plugin and the fixture plugins only
    vendors = [ep.name for ep in metadata.entry_points(group="accelplane.plugins") if ep.name != "cpu"]
    disabled = [x for x in [env.pop("ACCELPLANE_DISABLE_PLUGINS", "")] + vendors if x]
    if disabled:
        e["ACCELPLANE_DISABLE_PLUGINS"] = ",".join(disabled)
    if site is not None:
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), e.get("PYTHONPATH")]))
    e.update(env)
    cwd = site if site is not None else tempfile.gettempdir()
    r = subprocess.run(
        [sys.executable, "-c", PROBE], env=e, cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, f"probe crashed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def full(site) -> dict:
    for marker in site.glob("*_called"):
        marker.unlink()
    return probe(site)


def _failure(info: dict, name: str) -> dict:
    got = [f for f in info["failures"] if f["name"] == name]
    assert len(got) == 1, f"{name} not reported once in failures: {info['failures']}"
    return got[0]


# --- discovery with every broken plugin installed -----------------------------------------------
def test_host_keeps_working(full):
    assert "error" not in full, full
    names = [p["name"] for p in full["plugins"]]
    assert sorted(names) == ["cpu", "flaky_memory", "hostdev"]
    assert full["devices"][-1] == "CPU", "CPU devices come last"
    assert set(full["devices"]) == {"CPU", "HOSTDEV", "FLAKYMEM"}
    # the plugin manager holds exactly the loaded plugins, no leftover hookimpls
    assert full["pm_plugins"] == sorted(names)
    assert full["api_version_impls"] == len(names)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_plugin_is_isolated(full, name):
    f = _failure(full, name)
    _, stage, needles = BROKEN[name]
    assert f["stage"] == stage, f
    for n in needles:
        assert n in f["reason"], f"{n!r} not in reason {f['reason']!r}"
    assert name not in [p["name"] for p in full["plugins"]]


def test_wrong_major_never_runs_device_code(site, full):
    assert not (site / "bad_major_get_devices_called").exists(), (
        "get_devices of a plugin with API major 2 was called"
    )
    # positive control: the marker mechanism works (the good plugin's marker was written)
    assert (site / "hostdev_get_devices_called").exists()


def test_good_plugin_listed_with_its_version(full):
    (p,) = [p for p in full["plugins"] if p["name"] == "hostdev"]
    assert p["version"] == "0.3"
    assert p["api_version"] == list(cpu_plugin.api_version())  # the cpu hooks it re-exports
    (d,) = p["devices"]
    assert d["name"] == "HOSTDEV" and d["type"] == "ACCEL"
    assert d["description"] == "test host-memory device"


def test_failing_device_memory_does_not_break_info(full):
    (p,) = [p for p in full["plugins"] if p["name"] == "flaky_memory"]
    assert p["devices"][0]["memory_free"] == 0 and p["devices"][0]["memory_total"] == 0


def test_discovery_imports_nothing_heavy(full):
    print(f"\nimport accelplane + discovery of {len(full['plugins'])} plugins "
          f"(+{len(full['failures'])} broken): {full['elapsed_s'] * 1e3:.1f} ms")  # fmt: skip
    assert full["heavy"] == []


def test_default_install_imports_nothing_heavy():
    info = probe()
    print(f"\nimport accelplane + discovery (default install): {info['elapsed_s'] * 1e3:.1f} ms")
    assert "error" not in info, info
    assert "cpu" in [p["name"] for p in info["plugins"]]
    assert info["heavy"] == []


def test_entry_points_are_read_as_importlib_metadata_reads_them(site, monkeypatch, tmp_path):
    """The registry reads entry_points.txt itself (importing importlib.metadata costs more than
    the rest of discovery): the same entry points and versions, the first distribution of a name
    on sys.path winning; a zip archive on sys.path goes through importlib.metadata."""
    import zipfile

    from accelplane.runtime import registry

    def ours():
        return sorted((e.name, e.value, e.version) for e in registry.entry_points())

    def theirs():
        return sorted((e.name, e.value, e.dist.version) for e in metadata.entry_points(group=registry.GROUP))

    shadow = tmp_path / "shadow"  # a later copy of the hostdev distribution: not read
    shadow.mkdir()
    _dist(shadow, "accelplane-hostdev", "9.9", {"hostdev": "elsewhere"})
    monkeypatch.setattr(sys, "path", [str(site), str(shadow), *sys.path])
    got = ours()
    assert got == theirs()
    assert ("hostdev", "fakeplug_hostdev", "0.3") in got and "elsewhere" not in str(got)
    assert ("bad_import", "fakeplug_bad_import", "0.1") in got
    archive = tmp_path / "plugins.zip"
    with zipfile.ZipFile(archive, "w") as z:
        info = "zipped_plugin-1.2.dist-info"
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: zipped-plugin\nVersion: 1.2\n")
        z.writestr(f"{info}/entry_points.txt", "[accelplane.plugins]\nzipped = zmod\n")
    monkeypatch.setattr(sys, "path", [str(archive), *sys.path])
    got = ours()
    assert ("zipped", "zmod", "1.2") in got and got == theirs()


def test_discovery_reads_entry_points_without_importlib_metadata(full):
    assert full["metadata_imported"] is False


# --- allow and block lists -----------------------------------------------------------------------
def test_disable_hides_cpu(site):
    info = probe(site, ACCELPLANE_DISABLE_PLUGINS="cpu")
    assert "CPU" not in info["devices"]
    assert "cpu" not in [p["name"] for p in info["plugins"]]
    assert "cpu" not in [f["name"] for f in info["failures"]], "disabled is not a failure"
    assert "HOSTDEV" in info["devices"]


def test_disabled_plugin_is_never_imported():
    info = probe(ACCELPLANE_DISABLE_PLUGINS=" cpu , something_else ")
    assert info["plugins"] == [] and info["devices"] == []
    assert not info["cpu_plugin_imported"]


def test_allow_list_loads_only_those(site):
    info = probe(site, ACCELPLANE_PLUGINS="cpu")
    assert [p["name"] for p in info["plugins"]] == ["cpu"]
    assert info["devices"] == ["CPU"]
    assert info["failures"] == [], "broken plugins outside the allow list are not even loaded"
    info = probe(site, ACCELPLANE_PLUGINS="hostdev,cpu")
    assert sorted(p["name"] for p in info["plugins"]) == ["cpu", "hostdev"]


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_allow_listed_broken_plugin_is_loud(site, name):
    info = probe(site, ACCELPLANE_PLUGINS=f"cpu,{name}")
    assert info.get("is_plugin_load_error"), info
    assert name in info["message"]
    assert BROKEN[name][1] in info["message"], "the message names the failing stage"


def test_allow_listed_missing_plugin_raises(site):
    info = probe(site, ACCELPLANE_PLUGINS="cpu,nosuchplugin")
    assert info.get("is_plugin_load_error"), info
    assert "nosuchplugin" in info["message"]


def test_allow_and_block_both_name_a_plugin(site):
    # blocked wins; the block list is not "missing"
    info = probe(site, ACCELPLANE_PLUGINS="cpu,hostdev", ACCELPLANE_DISABLE_PLUGINS="hostdev")
    assert "error" not in info, info
    assert info["devices"] == ["CPU"]


# --- in-process registration (fresh Registry objects) ------------------------------------------
def _compute_add(dev: Device) -> None:
    ctx = accelplane.Context()
    a = ctx.new_tensor("f32", (3, 5))
    b = ctx.new_tensor("f32", (3, 5))
    out = ctx.add(a, b)
    g = ctx.graph(out)
    buf = alloc_ctx_tensors(ctx, dev.buffer_type)
    GraphAllocator(dev.buffer_type).alloc_graph(g)
    x = np.arange(15, dtype=np.float32).reshape(3, 5)
    a.set(x)
    b.set(2 * x)
    dev.new_backend().compute(g)
    np.testing.assert_array_equal(out.get(), 3 * x)
    buf.free()


def test_hot_path_does_not_go_through_pluggy(monkeypatch):
    reg = Registry()
    assert reg.register(cpu_plugin, "cpu") is not None
    dev = reg.device("cpu")

    ours = {id(getattr(reg.pm.hook, h)) for h in HOOK_NAMES}
    call = pluggy.HookCaller.__call__

    def no_pluggy(self, *a, **kw):  # pytest runs on pluggy too: trap only this registry's
        if id(self) in ours:
            raise AssertionError(f"pm.hook.{self.name} called on the hot path")
        return call(self, *a, **kw)

    monkeypatch.setattr(pluggy.HookCaller, "__call__", no_pluggy)
    with pytest.raises(AssertionError):  # the trap works
        reg.pm.hook.graph_compute(backend=None, graph=None)
    _compute_add(dev)  # buffer type, alloc, set/get, init_backend, graph_compute: all direct


def test_dispatch_table_is_the_plugins_functions():
    reg = Registry()
    p = reg.register(cpu_plugin, "cpu")
    for h, f in p.fn.items():
        assert f is getattr(cpu_plugin, h), h
    be = reg.device("cpu").new_backend()
    assert be._graph_compute is cpu_plugin.graph_compute


def test_hookimpl_with_subset_or_reordered_args():
    """pluggy passes arguments by name, so an impl may take a subset of the spec's arguments
    in any order; the direct dispatch must honour that too."""
    seen = {}

    def supports_op(op, device):  # reordered
        seen["op"], seen["device"] = op, device
        return True

    def init_backend(device):  # subset
        seen["init_device"] = device
        return "ctx"

    reg = Registry()
    assert reg.register(host_plugin("ODD", supports_op=supports_op,
                                    init_backend=init_backend), "odd")  # fmt: skip
    dev = reg.device("ODD")
    ctx = accelplane.Context()
    t = ctx.sqr(ctx.new_tensor("f32", (4,)))
    assert dev.supports_op(t)
    assert seen["op"] is t and seen["device"] is dev
    assert dev.new_backend().ctx == "ctx" and seen["init_device"] is dev


def test_duplicate_names_rejected():
    reg = Registry()
    assert reg.register(host_plugin("DUP"), "one")
    assert reg.register(host_plugin("dup"), "two") is None  # device names clash (any case)
    assert reg.register(host_plugin("OTHER"), "one") is None  # plugin name taken
    assert [f.stage for f in reg.failures] == ["devices", "validate"]
    assert "DUP" in reg.failures[0].reason.upper() and "'one'" in reg.failures[1].reason
    assert not reg.failures[0].no_device, "a device-name clash is a plugin bug, not an absent device"
    assert [d.name for d in reg.devices] == ["DUP"]
    assert len(reg.pm.get_plugins()) == 1


def test_two_devices_of_one_plugin_with_one_name_rejected():
    def get_devices():
        return [DeviceSpec("TWIN", "a", DeviceType.GPU), DeviceSpec("TWIN", "b", DeviceType.GPU)]

    reg = Registry()
    m = host_plugin("X")
    m.get_devices = hookimpl(get_devices)
    assert reg.register(m, "twins") is None
    assert "TWIN" in reg.failures[0].reason
    assert reg.devices == []


def _no_runtime():
    raise DeviceError("no FAKE device: the runtime is not installed")


def _bug():
    raise AttributeError("'NoneType' object has no attribute 'enumerate'")


@pytest.mark.parametrize("get_devices, no_device", [(lambda: [], True), (_no_runtime, True), (_bug, False)],
                         ids=["empty", "DeviceError", "bug"])  # fmt: skip
def test_devices_failure_records_whether_the_device_is_absent(get_devices, no_device):
    """[] or DeviceError from get_devices is "no device" (hardware or runtime absent); any other
    exception is a broken plugin. An allow-listed plugin's PluginLoadError carries the record."""
    reg = Registry()
    assert reg.register(host_plugin("X", get_devices=get_devices), "x") is None
    assert [(f.name, f.stage, f.no_device) for f in reg.failures] == [("x", "devices", no_device)]
    with pytest.raises(PluginLoadError, match="failed at devices") as e:
        Registry().register(host_plugin("X", get_devices=get_devices), "x", _allow=["x"])
    f = e.value.failure
    assert (f.name, f.stage, f.no_device) == ("x", "devices", no_device)


def test_default_order_puts_emulated_devices_after_the_cpu():
    """Accelerators first (GPU, integrated GPU, other accelerator, as ggml_backend_init_best),
    then the CPU, then devices emulated on the host's cores; `run` takes the real accelerators
    and falls back to the CPU, never to an emulated device."""
    from accelplane.interface import DeviceCaps
    from accelplane.models.runner import pick_devices

    def registry(*specs):
        reg = Registry()
        for i, spec in enumerate(specs):
            plugin = host_plugin(spec[0], get_devices=lambda spec=spec: [DeviceSpec(*spec)])
            assert reg.register(plugin, f"p{i}")
        return reg

    emu = DeviceCaps(emulated=True)
    reg = registry(("EMUGPU", "", DeviceType.GPU, emu), ("HOST", "", DeviceType.CPU),
                   ("NPU", "", DeviceType.ACCEL), ("IG", "", DeviceType.IGPU), ("G", "", DeviceType.GPU),
                   ("EMUNPU", "", DeviceType.ACCEL, emu))  # fmt: skip
    order = [(d.name, why) for d, why in reg.ranked()]
    assert order == [("G", "a GPU"), ("IG", "an integrated GPU"), ("NPU", "an accelerator"),
                     ("HOST", "the host's CPU"), ("EMUGPU", "a GPU, emulated on the host's CPU cores"),
                     ("EMUNPU", "an accelerator, emulated on the host's CPU cores")]  # fmt: skip
    assert reg.best_device().name == "G"
    assert [d.name for d in pick_devices(reg, None)] == ["G", "IG", "NPU"]
    assert [r["device"] for r in reg.info()["default_order"]] == [f"{d.plugin.name}/{n}" for (n, _), (d, _) in
                                                                   zip(order, reg.ranked(), strict=True)]
    only_emulated = registry(("HOST", "", DeviceType.CPU), ("EMUGPU", "", DeviceType.GPU, emu))
    assert only_emulated.best_device().name == "HOST"
    assert [d.name for d in pick_devices(only_emulated, None)] == ["HOST"]
    assert [d.name for d in pick_devices(only_emulated, ["EMUGPU"])] == ["EMUGPU"], "a named device is taken"
    with pytest.raises(DeviceError, match="no devices"):
        Registry().best_device()


def test_unregister_and_lookup_errors():
    reg = Registry()
    reg.register(host_plugin("GONE"), "gone")
    reg.unregister("gone")
    assert reg.devices == [] and reg.pm.get_plugins() == set()
    with pytest.raises(AccelplaneError, match="GONE"):
        reg.device("GONE")
    reg.register(host_plugin("X", get_devices=lambda: []), "empty")
    with pytest.raises(AccelplaneError, match="no devices"):
        reg.devices_of("empty")  # names why it is not loaded


# --- the interface version a plugin declares -------------------------------------------------------
@pytest.mark.parametrize(("declared", "why"), [
    ((API_VERSION[0] + 1, 0), "major versions must match"),
    ((API_VERSION[0] - 1, API_VERSION[1]), "major versions must match"),
    ((API_VERSION[0], API_VERSION[1] + 1), "newer than this accelplane's"),
    ("1.1", "must return (major, minor), two integers"),
    ((1, 1, 0), "must return (major, minor), two integers"),
    ((1.0, 1), "must return (major, minor), two integers"),
    (None, "must return (major, minor), two integers"),
])  # fmt: skip
def test_a_plugin_of_another_interface_version_is_rejected(declared, why):
    seen = []
    spec = DeviceSpec("V", "", DeviceType.CPU)
    plugin = host_plugin("VERSIONED", get_devices=lambda: seen.append(1) or [spec])
    plugin.api_version = hookimpl(lambda: declared)
    r = Registry()
    assert r.register(plugin, "versioned") is None
    (f,) = r.failures
    assert f.stage == "api_version" and why in f.reason, f.reason
    assert "APIVersionError" in f.reason and f"{API_VERSION[0]}.{API_VERSION[1]}" in f.reason
    assert not seen, "no other hook of a rejected plugin runs"


def test_an_older_minor_is_accepted_without_the_newer_hooks():
    plugin = host_plugin("OLDER")
    plugin.api_version = hookimpl(lambda: (API_VERSION[0], 0))
    r = Registry()
    p = r.register(plugin, "older")
    assert p is not None and p.api_version == (API_VERSION[0], 0)
    assert "record_begin" not in p.fn  # a 1.1 hook is not called for a 1.0 plugin


def test_every_plugin_declares_its_version_as_a_literal():
    """A plugin's api_version() returns the version it was written for, frozen in its own
    source, so the check above can fire; returning the running SDK's API_VERSION cannot."""
    import ast

    root = Path(__file__).resolve().parents[1]
    plugins = [root / "sdk/accelplane/cpu/plugin.py", root / "sdk/accelplane/testing/asyncdev.py",
               *root.glob("plugins/*/accelplane_*/plugin.py")]  # fmt: skip
    for p in plugins:
        fn = next(n for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.FunctionDef)
                  and n.name == "api_version")  # fmt: skip
        (ret,) = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
        elts = ret.value.elts if isinstance(ret.value, ast.Tuple) else [ret.value]
        assert all(isinstance(e, ast.Constant) for e in elts), p

"""Plugin discovery and registration: entry points → validated plugins → devices.

Each entry point of the ``accelplane.plugins`` group is loaded in its own try block; a
plugin that fails (import error, wrong API major, hookimpl that does not match its spec,
missing required hook, error or nothing from get_devices) is recorded in
``Registry.failures`` with the stage and reason, and the host carries on.

Discovery only imports and validates: a discovered plugin's devices open (its get_devices,
which may start a runtime such as CuPy, dpctl or a Vulkan instance) on the first use of
``devices``, ``plugins`` or ``failures``, so ``import accelplane`` plus discovery stays cheap.
Plugins named in ACCELPLANE_PLUGINS open at discovery, so their failures are loud there.

Environment:
  ACCELPLANE_PLUGINS          comma list: load only these; a listed plugin that fails or is
                              missing raises PluginLoadError (loud, like JAX_PLATFORMS)
  ACCELPLANE_DISABLE_PLUGINS  comma list: never load these
  ACCELPLANE_EXTRA_PLUGINS    comma list of name=module: load these modules as plugins too,
                              without an installed distribution (plugin development, and the
                              SDK's own test devices such as accelplane.testing.asyncdev)
"""

from __future__ import annotations

import importlib
import threading
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from accelplane import env
from accelplane.errors import APIVersionError, ConfigError, DeviceError, PluginLoadError
from accelplane.interface import (
    API_VERSION,
    HOOK_MIN_MINOR,
    HOOK_NAMES,
    PROJECT,
    REQUIRED_HOOKS,
    DeviceType,
    Specs,
)
from accelplane.runtime.backend import Device

GROUP = "accelplane.plugins"
# hooks that come as a group: the first one of each group implies the others
HOOK_GROUPS = {
    "event_new": frozenset({"event_new", "event_record", "event_synchronize"}),
    "comm_init": frozenset({"comm_init", "comm_allreduce_tensor"}),
    "record_begin": frozenset({"record_begin", "record_end", "record_replay"}),
}


@dataclass
class Plugin:
    """A registered plugin: its dispatch table (hook name → function) and devices."""

    name: str
    module: Any
    api_version: tuple[int, int]
    version: str
    fn: dict[str, Any]
    devices: list[Device] = field(default_factory=list)


@dataclass
class Failure:
    name: str
    stage: str  # import | api_version | validate | devices | allowlist
    reason: str
    detail: str = ""
    # the devices stage found no device: get_devices returned [] or raised DeviceError (absent
    # hardware or runtime), as opposed to a plugin bug; the conformance suite's
    # --allow-no-device reports only these as skipped
    no_device: bool = False


def check_api_version(name: str, declared: Any) -> tuple[int, int]:
    """A plugin's declared ``(major, minor)``, or APIVersionError naming both versions: the
    major must be this SDK's, and the minor at most this SDK's (a plugin written for a newer
    minor relies on hooks or semantics this SDK does not have)."""
    ours = f"{API_VERSION[0]}.{API_VERSION[1]}"
    ints = isinstance(declared, tuple | list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in declared
    )
    if not ints or len(declared) != 2:
        raise APIVersionError(
            f"plugin {name!r}: api_version() must return (major, minor), two integers, as a literal "
            f"such as (1, 1); it returned {declared!r} (this accelplane implements {ours})"
        )
    major, minor = declared
    if major != API_VERSION[0]:
        raise APIVersionError(
            f"plugin {name!r} implements backend API {major}.{minor}, this accelplane implements "
            f"{ours} (major versions must match)"
        )
    if minor > API_VERSION[1]:
        raise APIVersionError(
            f"plugin {name!r} implements backend API {major}.{minor}, newer than this accelplane's "
            f"{ours}: upgrade accelplane"
        )
    return major, minor


def _dist_version(ep: metadata.EntryPoint) -> str:
    try:
        return ep.dist.version if ep.dist is not None else "?"
    except Exception:  # pragma: no cover - broken metadata
        return "?"


class Registry:
    """The process-wide set of plugins and devices (ggml_backend_registry)."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(Specs)
        self._plugins: dict[str, Plugin] = {}
        self._failures: list[Failure] = []
        self._devices: list[Device] = []
        # validated plugins whose devices are not open yet: discovery stays cheap, and the
        # runtimes (cupy, dpctl, a Vulkan instance) start on the first use of devices
        self._pending: list[tuple[Plugin, list[str] | None]] = []
        self._lock = threading.RLock()
        # a plugin setting with a bad value is the user's to fix, not a broken plugin: every
        # use of the registry raises it (a run must not fall back to other devices in silence)
        self._config_error: ConfigError | None = None

    @property
    def plugins(self) -> dict[str, Plugin]:
        """Plugins with open devices (opening any discovered ones first)."""
        self._open_pending()
        return self._plugins

    @property
    def failures(self) -> list[Failure]:
        """Plugins that failed, with the stage and reason (opening discovered plugins first)."""
        self._open_pending()
        return self._failures

    @property
    def devices(self) -> list[Device]:
        """All devices, CPU devices last (opening any discovered plugins first)."""
        self._open_pending()
        return self._devices

    def _open_pending(self) -> None:
        if self._pending:
            with self._lock:
                while self._pending:
                    plugin, allow = self._pending.pop(0)
                    self._open(plugin, allow)
        if self._config_error is not None:
            raise self._config_error

    # --- discovery ------------------------------------------------------------------------------
    def discover(self) -> None:
        """Load every entry point of the group (subject to the allow/block lists)."""
        allow = list(env.PLUGINS.get() or ()) or None
        block = set(env.DISABLE_PLUGINS.get() or ())
        eps = sorted(metadata.entry_points(group=GROUP), key=lambda e: (e.name == "cpu", e.name))
        found = set()
        for ep in eps:
            if ep.name in found:  # the same distribution seen twice on sys.path
                continue
            found.add(ep.name)
            if ep.name in block or (allow is not None and ep.name not in allow):
                continue
            try:
                module = ep.load()
            except Exception as e:
                self._fail(ep.name, "import", f"{type(e).__name__}: {e}", allow)
                continue
            # an allow-listed plugin opens now, so its failure is loud at discovery
            self.register(module, ep.name, version=_dist_version(ep), _allow=allow, _defer=allow is None)
        for spec in env.EXTRA_PLUGINS.get() or ():
            name, sep, modname = spec.partition("=")
            name, modname = name.strip(), modname.strip()
            if not sep or not name or not modname:
                raise ConfigError(f"ACCELPLANE_EXTRA_PLUGINS entry {spec!r} is not of the form name=module")
            if name in found or name in block or (allow is not None and name not in allow):
                continue
            found.add(name)
            try:
                module = importlib.import_module(modname)
            except Exception as e:
                self._fail(name, "import", f"{type(e).__name__}: {e}", allow)
                continue
            self.register(module, name, version="(extra)", _allow=allow, _defer=allow is None)
        if allow is not None:
            missing = [n for n in allow if n not in found]
            if missing:
                raise PluginLoadError(
                    f"ACCELPLANE_PLUGINS names {', '.join(missing)}, which no installed "
                    f"distribution provides (installed: {', '.join(sorted(found)) or 'none'})"
                )

    def _fail(
        self, name: str, stage: str, reason: str, allow: list[str] | None = None, no_device: bool = False
    ) -> None:
        failure = Failure(name, stage, reason, traceback.format_exc(limit=3), no_device)
        self._failures.append(failure)
        if allow is not None and name in allow:
            err = PluginLoadError(f"plugin {name!r} failed at {stage}: {reason}")
            err.failure = failure
            raise err

    # --- registration -----------------------------------------------------------------------------
    def register(
        self, module: ModuleType | Any, name: str, version: str = "?", _allow=None, _defer: bool = False
    ) -> Plugin | None:
        """Validate and register one plugin object and open its devices; returns None (and
        records why) on failure. Discovery passes ``_defer``: devices open on first use."""
        with self._lock:
            if name in self._plugins or any(p.name == name for p, _ in self._pending):
                self._fail(
                    name, "validate", f"a plugin named {name!r} is already registered", _allow
                )
                return None
            # 1. API version, read before pluggy or any device code touches the plugin
            try:
                av = getattr(module, "api_version", None)
                if av is None:
                    raise APIVersionError(f"plugin {name!r} has no api_version() hook")
                got = check_api_version(name, av())
            except Exception as e:
                self._fail(name, "api_version", f"{type(e).__name__}: {e}", _allow)
                return None
            # 2. pluggy validation (argument names, unknown hooks), then required hooks
            try:
                self.pm.register(module, name=name)
                try:
                    self.pm.check_pending()
                except pluggy.PluginValidationError as e:
                    raise PluginLoadError(str(e)) from e
                fn = self._dispatch_table(module, got)
                missing = sorted(REQUIRED_HOOKS - fn.keys())
                if missing:
                    raise PluginLoadError(f"required hooks not implemented: {', '.join(missing)}")
                for lead, group in HOOK_GROUPS.items():
                    missing = sorted(group - fn.keys()) if lead in fn else []
                    if missing:
                        raise PluginLoadError(f"{lead} is implemented but not {', '.join(missing)}")
            except Exception as e:
                if self.pm.is_registered(module):
                    self.pm.unregister(module)
                self._fail(name, "validate", f"{type(e).__name__}: {e}", _allow)
                return None
            plugin = Plugin(name, module, got, version, fn)
            if _defer:
                self._pending.append((plugin, _allow))
                return plugin
            return self._open(plugin, _allow)

    def _open(self, plugin: Plugin, _allow) -> Plugin | None:
        """Stage 3: the plugin's devices (its first call allowed to open the runtime)."""
        name, module, fn = plugin.name, plugin.module, plugin.fn
        with self._lock:
            try:
                specs = list(fn["get_devices"]())
                if not specs:
                    raise DeviceError("plugin reports no devices")
                for s in specs:
                    if not isinstance(s.type, DeviceType):
                        raise PluginLoadError(f"device {s.name!r}: type must be a DeviceType")
                plugin.devices = [Device(plugin, s, i) for i, s in enumerate(specs)]
            except Exception as e:
                self.pm.unregister(module)
                if isinstance(e, ConfigError):
                    self._config_error = self._config_error or e
                self._fail(name, "devices", f"{type(e).__name__}: {e}", _allow,
                           no_device=isinstance(e, DeviceError))  # fmt: skip
                return None
            # device names are looked up case-insensitively: unique across all plugins
            taken = {d.name.lower() for d in self._devices}
            clash = []
            for d in plugin.devices:
                if d.name.lower() in taken:
                    clash.append(d.name)
                taken.add(d.name.lower())
            if clash:
                self.pm.unregister(module)
                self._fail(
                    name, "devices", f"device names already taken: {', '.join(clash)}", _allow
                )
                return None
            self._plugins[name] = plugin
            # CPU devices last, like ggml (the scheduler's last backend is the CPU)
            self._devices = sorted(
                self._devices + plugin.devices, key=lambda d: d.type == DeviceType.CPU
            )
            return plugin

    def _dispatch_table(self, module: Any, version: tuple[int, int]) -> dict[str, Any]:
        """hook name → this plugin's function, resolved once (the hot path skips pm.hook).

        Handles call these positionally with the spec's arguments. pluggy lets an impl take
        a subset of them, in any order (it passes them by name); such an impl gets an adapter
        that picks its arguments, so it sees what pluggy would give it."""
        fn: dict[str, Any] = {}
        for hname in HOOK_NAMES:
            if HOOK_MIN_MINOR.get(hname, 0) > version[1]:
                continue
            hook = getattr(self.pm.hook, hname)
            for impl in hook.get_hookimpls():
                if impl.plugin is module:
                    fn[hname] = _bind(impl, hook.spec.argnames)
        return fn

    def unregister(self, name: str) -> None:
        with self._lock:
            p = self.plugins.pop(name)
            self.pm.unregister(p.module)
            self._devices = [d for d in self._devices if d.plugin is not p]

    # --- lookups ----------------------------------------------------------------------------------
    def device(self, name: str) -> Device:
        """Device by name (case-insensitive), e.g. 'CPU', 'Vulkan0'."""
        for d in self.devices:
            if d.name.lower() == name.lower():
                return d
        raise DeviceError(
            f"no device named {name!r}; devices: "
            f"{', '.join(d.name for d in self.devices) or 'none'}"
        )

    def devices_of(self, plugin: str) -> list[Device]:
        if plugin not in self.plugins:
            why = [f.reason for f in self.failures if f.name == plugin]
            raise DeviceError(
                f"plugin {plugin!r} is not loaded"
                + (f": {why[0]}" if why else f"; loaded: {', '.join(self.plugins) or 'none'}")
            )
        return self.plugins[plugin].devices

    def ranked(self) -> list[tuple[Device, str]]:
        """Every device, best first for default placement, each with why it stands there:
        accelerators (GPU, then integrated GPU, then other accelerators, as ggml_backend_init_best
        ranks them), then CPU devices, then devices whose work runs on the host's CPU cores anyway
        (``DeviceCaps.emulated``: an OpenCL CPU runtime, a software Vulkan driver, an emulated
        NPU), which are correct but never faster than the CPU plugin."""
        order = {DeviceType.GPU: 0, DeviceType.IGPU: 1, DeviceType.ACCEL: 2, DeviceType.CPU: 3}
        why = {DeviceType.GPU: "a GPU", DeviceType.IGPU: "an integrated GPU",
               DeviceType.ACCEL: "an accelerator", DeviceType.CPU: "the host's CPU"}  # fmt: skip

        def emulated(d: Device) -> bool:
            return d.caps.emulated and d.type != DeviceType.CPU

        def reason(d: Device) -> str:
            r = why.get(d.type, d.type.value)
            return f"{r}, emulated on the host's CPU cores" if emulated(d) else r

        ranked = sorted(self.devices, key=lambda d: (emulated(d), order.get(d.type, 2)))
        return [(d, reason(d)) for d in ranked]

    def accelerators(self) -> list[Device]:
        """The devices default placement puts ahead of the CPU: :meth:`ranked`'s non-CPU devices
        that are not emulated on the host's cores ([] on a machine without one)."""
        return [d for d, _ in self.ranked() if d.type != DeviceType.CPU and not d.caps.emulated]

    def best_device(self) -> Device:
        """The first device of :meth:`ranked`."""
        ranked = self.ranked()
        if not ranked:
            raise DeviceError("no devices registered")
        return ranked[0][0]

    def info(self) -> dict:
        """Everything `accelplane devices --json` prints."""
        from accelplane._version import __version__

        return {
            "accelplane": __version__,
            "api_version": list(API_VERSION),
            "plugins": [
                {
                    "name": p.name,
                    "version": p.version,
                    "api_version": list(p.api_version),
                    "devices": [
                        {
                            "name": d.name,
                            "description": d.description,
                            "type": d.type.value,
                            "memory_free": _memory(d)[0],
                            "memory_total": _memory(d)[1],
                            "caps": {
                                "async": d.caps.async_,
                                "host_buffer": d.caps.host_buffer,
                                "events": d.caps.events,
                                "emulated": d.caps.emulated,
                            },
                        }
                        for d in p.devices
                    ],
                }
                for p in self.plugins.values()
            ],
            "default_order": [
                {"device": f"{d.plugin.name}/{d.name}", "why": why} for d, why in self.ranked()
            ],
            "failures": [
                {"name": f.name, "stage": f.stage, "reason": f.reason, "no_device": f.no_device}
                for f in self.failures
            ],
        }


def _bind(impl: Any, spec_args: tuple[str, ...]) -> Any:
    """The impl's function, or an adapter when it takes a subset/reordering of spec_args."""
    f = impl.function
    if tuple(impl.argnames) == tuple(spec_args):
        return f
    idx = tuple(spec_args.index(a) for a in impl.argnames)

    def adapter(*args: Any) -> Any:
        return f(*[args[i] for i in idx])

    adapter.__wrapped__ = f  # type: ignore[attr-defined]
    return adapter


def _memory(d: Device) -> tuple[int, int]:
    """device.memory() for listings: a plugin whose device_memory raises shows (0, 0)."""
    try:
        return d.memory()
    except Exception:
        return (0, 0)


def installed_names() -> list[str]:
    """Names of every plugin this environment offers (the entry points of the group and the
    ACCELPLANE_EXTRA_PLUGINS entries), whether loaded, broken, or left out by the allow and
    block lists."""
    names = {ep.name for ep in metadata.entry_points(group=GROUP)}
    names |= {s.partition("=")[0].strip() for s in env.EXTRA_PLUGINS.get() or ()}
    return sorted(names - {""})


_registry: Registry | None = None
_reg_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, discovering plugins on first use."""
    global _registry
    if _registry is None:
        with _reg_lock:
            if _registry is None:
                r = Registry()
                r.discover()
                _registry = r
    return _registry


def reset_registry() -> None:
    """Forget the registry (tests; the next get_registry() discovers again)."""
    global _registry
    with _reg_lock:
        _registry = None

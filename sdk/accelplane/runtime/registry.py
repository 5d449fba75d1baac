"""Plugin discovery and registration: entry points → validated plugins → devices.

Each entry point of the ``accelplane.plugins`` group is loaded in its own try block; a
plugin that fails (import error, wrong API major, hookimpl that does not match its spec,
missing required hook, error or nothing from get_devices) is recorded in
``Registry.failures`` with the stage and reason, and the host carries on.

Discovery only imports and validates: a discovered plugin's devices are probed (its
get_devices, which may load a runtime's library, e.g. dpctl, or create a Vulkan instance) on
the first use of ``devices``, ``plugins`` or ``failures``, so ``import accelplane`` plus
discovery stays cheap. Plugins named in ACCELPLANE_PLUGINS are probed at discovery, so their
failures are loud there. Probing opens no device: each device's runtime (contexts, queues,
logical devices) opens on its first use (runtime/backend.py, Device.open), and a failure
there is that device's DeviceOpenError; ``info(open=True)`` (``accelplane devices``) opens
every device to report them.

Environment:
  ACCELPLANE_PLUGINS          comma list: load only these; a listed plugin that fails or is
                              missing raises PluginLoadError (loud, like JAX_PLATFORMS)
  ACCELPLANE_DISABLE_PLUGINS  comma list: never load these
  ACCELPLANE_EXTRA_PLUGINS    comma list of name=module: load these modules as plugins too,
                              without an installed distribution (plugin development, and the
                              SDK's own test devices such as accelplane.testing.asyncdev)
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.machinery import PathFinder
from types import ModuleType
from typing import Any

import pluggy

from accelplane import env
from accelplane.errors import APIVersionError, ConfigError, DeviceError, DeviceOpenError, PluginLoadError
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
    "timeline_begin": frozenset({"timeline_begin", "timeline_end"}),
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
    hooks: Any = None  # what pluggy holds for it (_hook_object)


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


@dataclass(frozen=True)
class EntryPoint:
    """An entry point of GROUP: its name, ``module`` or ``module:attr`` value, and where it
    comes from (``dist_info``: the distribution's metadata directory, ``*.dist-info`` or
    ``*.egg-info``, or its version as importlib.metadata gave it)."""

    name: str
    value: str
    dist_info: str | None = None
    dist_version: str | None = None

    def load(self) -> Any:
        module, _, attr = self.value.partition(":")
        obj = importlib.import_module(module.strip())
        for a in filter(None, attr.strip().split(".")):
            obj = getattr(obj, a)
        return obj

    @property
    def version(self) -> str:
        """The distribution's version (its METADATA's Version field), or '?'."""
        if self.dist_info is None:
            return self.dist_version or "?"
        meta = "PKG-INFO" if self.dist_info.lower().endswith(".egg-info") else "METADATA"
        try:
            with open(os.path.join(self.dist_info, meta), encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        break
                    key, _, value = line.partition(":")
                    if key.strip().lower() == "version":
                        return value.strip()
        except OSError:
            pass
        return "?"


def entry_points(group: str = GROUP) -> list[EntryPoint]:
    """The entry points of ``group`` of every distribution on sys.path, the first distribution
    of a (normalized) name winning, as importlib.metadata.entry_points(group=...) gives them.

    Read directly from each ``*.dist-info`` (or ``*.egg-info``) directory's entry_points.txt:
    importing importlib.metadata (which imports the email package) costs more than the rest of
    discovery. A zip archive or an ``*.egg`` on sys.path, or a finder on sys.meta_path with
    distributions of its own, sends the whole lookup through importlib.metadata."""
    if any(hasattr(f, "find_distributions") and f is not PathFinder for f in sys.meta_path):
        return _metadata_entry_points(group)
    out: list[EntryPoint] = []
    seen: set[str] = set()
    header = f"[{group}]"
    for entry in sys.path:
        root = entry or "."
        try:
            children = os.listdir(root)
        except NotADirectoryError:
            return _metadata_entry_points(group)  # a zip archive on sys.path
        except OSError:  # missing, or not a path (an import hook's token)
            continue
        for child in children:
            low = child.lower()
            if low.endswith(".egg"):
                return _metadata_entry_points(group)
            if not low.endswith((".dist-info", ".egg-info")):
                continue
            dist = re.sub(r"[-_.]+", "_", child.rpartition(".")[0].partition("-")[0]).lower()
            if dist in seen:
                continue
            seen.add(dist)
            info = os.path.join(root, child)
            try:
                with open(os.path.join(info, "entry_points.txt"), encoding="utf-8") as f:
                    text = f.read()
            except OSError:
                continue
            section = None
            for line in text.splitlines():
                line = line.strip()
                if line.startswith("["):
                    section = line
                elif section == header and "=" in line and not line.startswith(("#", ";")):
                    name, _, value = line.partition("=")
                    out.append(EntryPoint(name.strip(), value.strip(), info))
    return out


def _metadata_entry_points(group: str) -> list[EntryPoint]:
    from importlib import metadata

    out = []
    for ep in metadata.entry_points(group=group):
        try:
            version = ep.dist.version if ep.dist is not None else None
        except Exception:  # pragma: no cover - broken metadata
            version = None
        out.append(EntryPoint(ep.name, ep.value, dist_version=version))
    return out


def _hook_object(plugin: Any) -> Any:
    """What pluggy registers for ``plugin``: for a module, a namespace of only its hookimpls
    (pluggy inspects every attribute of what it registers, and a plugin module's attributes
    are mostly its imports: that took longer than reading every entry point), else the
    object itself. pluggy takes the same functions either way: routines with the marker."""
    if not isinstance(plugin, ModuleType):
        return plugin
    marker = f"{PROJECT}_impl"
    impls = {k: v for k, v in vars(plugin).items() if inspect.isroutine(v) and getattr(v, marker, None)}
    return _Hooks(plugin.__name__, impls)


class _Hooks:
    """A plugin module's hookimpls as attributes (hashed by identity, as pluggy needs)."""

    def __init__(self, module: str, impls: dict[str, Any]) -> None:
        self.__dict__.update(impls)
        self._module = module

    def __repr__(self) -> str:
        return f"<hooks of {self._module}>"


class Registry:
    """The process-wide set of plugins and devices (ggml_backend_registry)."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(Specs)
        self._plugins: dict[str, Plugin] = {}
        self._failures: list[Failure] = []
        self._devices: list[Device] = []
        # validated plugins whose devices are not probed yet: discovery stays cheap, and the
        # runtimes' libraries (dpctl, a Vulkan instance) load on the first use of devices
        self._pending: list[tuple[Plugin, list[str] | None]] = []
        self._lock = threading.RLock()
        # a plugin setting with a bad value is the user's to fix, not a broken plugin: every
        # use of the registry raises it (a run must not fall back to other devices in silence)
        self._config_error: ConfigError | None = None
        # where discovery and listing spent their time, per plugin: seconds of its module's
        # import, of validation (API version, pluggy, dispatch table) and of get_devices
        # (`accelplane bench startup` reports them)
        self.timings: dict[str, dict[str, float]] = {}

    @property
    def plugins(self) -> dict[str, Plugin]:
        """Plugins with devices (probing any discovered ones first)."""
        self._probe_pending()
        return self._plugins

    @property
    def failures(self) -> list[Failure]:
        """Plugins that failed, with the stage and reason (probing discovered plugins first)."""
        self._probe_pending()
        return self._failures

    @property
    def devices(self) -> list[Device]:
        """All devices, CPU devices last (probing any discovered plugins first; no device's
        runtime opens here)."""
        self._probe_pending()
        return self._devices

    def _probe_pending(self) -> None:
        if self._pending:
            with self._lock:
                while self._pending:
                    plugin, allow = self._pending.pop(0)
                    self._probe(plugin, allow)
        if self._config_error is not None:
            raise self._config_error

    # --- discovery ------------------------------------------------------------------------------
    def discover(self) -> None:
        """Load every entry point of the group (subject to the allow/block lists)."""
        allow = list(env.PLUGINS.get() or ()) or None
        block = set(env.DISABLE_PLUGINS.get() or ())
        eps = sorted(entry_points(), key=lambda e: (e.name == "cpu", e.name))
        found = set()
        for ep in eps:
            if ep.name in found:  # the same distribution seen twice on sys.path
                continue
            found.add(ep.name)
            if ep.name in block or (allow is not None and ep.name not in allow):
                continue
            t0 = time.perf_counter()
            try:
                module = ep.load()
            except Exception as e:
                self._fail(ep.name, "import", f"{type(e).__name__}: {e}", allow)
                continue
            finally:
                self._timed(ep.name, "import_s", t0)
            # an allow-listed plugin is probed now, so its failure is loud at discovery
            self.register(module, ep.name, version=ep.version, _allow=allow, _defer=allow is None)
        for spec in env.EXTRA_PLUGINS.get() or ():
            name, sep, modname = spec.partition("=")
            name, modname = name.strip(), modname.strip()
            if not sep or not name or not modname:
                raise ConfigError(f"ACCELPLANE_EXTRA_PLUGINS entry {spec!r} is not of the form name=module")
            if name in found or name in block or (allow is not None and name not in allow):
                continue
            found.add(name)
            t0 = time.perf_counter()
            try:
                module = importlib.import_module(modname)
            except Exception as e:
                self._fail(name, "import", f"{type(e).__name__}: {e}", allow)
                continue
            finally:
                self._timed(name, "import_s", t0)
            self.register(module, name, version="(extra)", _allow=allow, _defer=allow is None)
        if allow is not None:
            missing = [n for n in allow if n not in found]
            if missing:
                raise PluginLoadError(
                    f"ACCELPLANE_PLUGINS names {', '.join(missing)}, which no installed "
                    f"distribution provides (installed: {', '.join(sorted(found)) or 'none'})"
                )

    def _timed(self, name: str, key: str, t0: float) -> None:
        self.timings.setdefault(name, {})[key] = time.perf_counter() - t0

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
        """Validate and register one plugin object and probe its devices; returns None (and
        records why) on failure. Discovery passes ``_defer``: devices are probed on first use."""
        with self._lock:
            if name in self._plugins or any(p.name == name for p, _ in self._pending):
                self._fail(
                    name, "validate", f"a plugin named {name!r} is already registered", _allow
                )
                return None
            known = [*self._plugins.values(), *(p for p, _ in self._pending)]
            twin = [p.name for p in known if p.module is module]
            if twin:  # (pluggy sees a namespace per registration, so it would not refuse it)
                self._fail(name, "validate", f"{module!r} is registered already, as plugin {twin[0]!r}",
                           _allow)  # fmt: skip
                return None
            t0 = time.perf_counter()
            try:
                valid = self._validate(module, name, _allow)
            finally:
                self._timed(name, "validate_s", t0)
            if valid is None:
                return None
            got, hooks, fn = valid
            plugin = Plugin(name, module, got, version, fn, hooks=hooks)
            if _defer:
                self._pending.append((plugin, _allow))
                return plugin
            return self._probe(plugin, _allow)

    def _validate(self, module: Any, name: str, _allow) -> tuple[tuple[int, int], Any, dict] | None:
        """Stages 1 and 2: (API version, what pluggy holds, dispatch table), or None (recorded)."""
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
        hooks = _hook_object(module)
        try:
            self.pm.register(hooks, name=name)
            try:
                self.pm.check_pending()
            except pluggy.PluginValidationError as e:
                raise PluginLoadError(str(e)) from e
            fn = self._dispatch_table(hooks, got)
            missing = sorted(REQUIRED_HOOKS - fn.keys())
            if missing:
                raise PluginLoadError(f"required hooks not implemented: {', '.join(missing)}")
            for lead, group in HOOK_GROUPS.items():
                missing = sorted(group - fn.keys()) if lead in fn else []
                if missing:
                    raise PluginLoadError(f"{lead} is implemented but not {', '.join(missing)}")
        except Exception as e:
            if self.pm.is_registered(hooks):
                self.pm.unregister(hooks)
            self._fail(name, "validate", f"{type(e).__name__}: {e}", _allow)
            return None
        return got, hooks, fn

    def _probe(self, plugin: Plugin, _allow) -> Plugin | None:
        """Stage 3: the plugin's devices (its first call allowed to load the runtime)."""
        name, hooks, fn = plugin.name, plugin.hooks, plugin.fn
        with self._lock:
            t0 = time.perf_counter()
            try:
                specs = list(fn["get_devices"]())
                if not specs:
                    raise DeviceError("plugin reports no devices")
                for s in specs:
                    if not isinstance(s.type, DeviceType):
                        raise PluginLoadError(f"device {s.name!r}: type must be a DeviceType")
                plugin.devices = [Device(plugin, s, i) for i, s in enumerate(specs)]
            except Exception as e:
                self.pm.unregister(hooks)
                if isinstance(e, ConfigError):
                    self._config_error = self._config_error or e
                self._fail(name, "devices", f"{type(e).__name__}: {e}", _allow,
                           no_device=isinstance(e, DeviceError))  # fmt: skip
                return None
            finally:
                self._timed(name, "devices_s", t0)
            # device names are looked up case-insensitively: unique across all plugins
            taken = {d.name.lower() for d in self._devices}
            clash = []
            for d in plugin.devices:
                if d.name.lower() in taken:
                    clash.append(d.name)
                taken.add(d.name.lower())
            if clash:
                self.pm.unregister(hooks)
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

    def _dispatch_table(self, hooks: Any, version: tuple[int, int]) -> dict[str, Any]:
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
                if impl.plugin is hooks:
                    fn[hname] = _bind(impl, hook.spec.argnames)
        return fn

    def unregister(self, name: str) -> None:
        with self._lock:
            p = self.plugins.pop(name)
            self.pm.unregister(p.hooks)
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
        that are not emulated on the host's cores and whose runtime opens (each is opened now,
        see :meth:`usable`; [] on a machine without one)."""
        return self.usable(d for d, _ in self.ranked() if d.type != DeviceType.CPU and not d.caps.emulated)

    def best_device(self) -> Device:
        """The first device of :meth:`ranked` whose runtime opens (see :meth:`usable`)."""
        ranked = self.ranked()
        if not ranked:
            raise DeviceError("no devices registered")
        ok = self.usable(d for d, _ in ranked)
        if not ok:
            raise DeviceError("no device opened: " + "; ".join(str(d.open_error) for d, _ in ranked))
        return ok[0]

    @staticmethod
    def usable(devices: Iterable[Device]) -> list[Device]:
        """Those of ``devices`` whose runtime opens, opening each now (default placement: a
        device whose runtime fails is passed over, its DeviceOpenError kept in
        ``device.open_error`` for listings). A ConfigError is raised: the setting is the user's
        to fix, not a reason to place work elsewhere."""
        out = []
        for d in devices:
            try:
                d.open()
            except DeviceOpenError:
                continue
            out.append(d)
        return out

    def info(self, open: bool = False) -> dict:
        """Everything `accelplane devices --json` prints. ``open``: open every device's runtime
        first (a device that fails shows its ``open_error``); else only what the probes said,
        with memory figures where the plugin has them without opening (null otherwise)."""
        from accelplane._version import __version__

        if open:
            for d in self.devices:
                with contextlib.suppress(DeviceOpenError):  # kept in d.open_error, listed below
                    d.open()
        return {
            "accelplane": __version__,
            "api_version": list(API_VERSION),
            "plugins": [
                {
                    "name": p.name,
                    "version": p.version,
                    "api_version": list(p.api_version),
                    "devices": [_device_info(d) for d in p.devices],
                }
                for p in self.plugins.values()
            ],
            "default_order": [
                {"device": f"{d.plugin.name}/{d.name}", "why": why}
                for d, why in self.ranked() if d.open_error is None  # default placement passes over those
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


def _device_info(d: Device) -> dict:
    """One device of info(): memory only where the plugin has it without opening the device
    (None otherwise); a plugin whose device_memory raises shows (0, 0)."""
    try:
        mem = d.memory(open=False)
    except Exception:
        mem = (0, 0)
    return {
        "name": d.name,
        "description": d.description,
        "type": d.type.value,
        "memory_free": None if mem is None else mem[0],
        "memory_total": None if mem is None else mem[1],
        "caps": {
            "async": d.caps.async_,
            "host_buffer": d.caps.host_buffer,
            "events": d.caps.events,
            "emulated": d.caps.emulated,
        },
        "open": d.is_open,
        "open_error": None if d.open_error is None else str(d.open_error),
    }


def installed_names() -> list[str]:
    """Names of every plugin this environment offers (the entry points of the group and the
    ACCELPLANE_EXTRA_PLUGINS entries), whether loaded, broken, or left out by the allow and
    block lists."""
    names = {ep.name for ep in entry_points()}
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

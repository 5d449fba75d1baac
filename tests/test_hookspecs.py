"""The backend interface itself (datasette-style): every hookspec documents its contract and
fallback, is documented for plugin authors with its exact signature, and the constants that
describe the interface agree with it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pluggy
import pytest
from accelplane.cpu import plugin as cpu_plugin
from accelplane.interface import (
    API_VERSION,
    HOOK_MIN_MINOR,
    HOOK_NAMES,
    PROJECT,
    REQUIRED_HOOKS,
    Specs,
    hookspecs,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-a-plugin.md"


def _spec_names() -> set[str]:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(Specs)
    return {n for n in vars(pm.hook) if not n.startswith("_")}


SPEC_NAMES = sorted(_spec_names())


def spec_args(name: str) -> tuple[str, ...]:
    """The arguments a hookimpl receives (the spec's, without ``self``)."""
    return tuple(p for p in inspect.signature(getattr(Specs, name)).parameters if p != "self")


def test_hook_names_are_the_hookspecs():
    assert set(HOOK_NAMES) == set(SPEC_NAMES)
    assert len(HOOK_NAMES) == len(set(HOOK_NAMES))


def test_api_version():
    assert isinstance(API_VERSION, tuple) and len(API_VERSION) == 2
    assert all(isinstance(x, int) and x >= 0 for x in API_VERSION)
    assert API_VERSION[0] >= 1


def test_required_hooks():
    assert REQUIRED_HOOKS.issubset(SPEC_NAMES)
    assert {"api_version", "get_devices", "graph_compute"} <= REQUIRED_HOOKS
    # a required hook can never be gated on a minor version
    assert not REQUIRED_HOOKS & HOOK_MIN_MINOR.keys()


def test_minor_gated_hooks():
    assert set(HOOK_MIN_MINOR) <= set(SPEC_NAMES)
    assert all(0 < m <= API_VERSION[1] for m in HOOK_MIN_MINOR.values())


# names the whole ecosystem reads (DESIGN.md): fixed, with these arguments where given
ECOSYSTEM = {
    "supports_op": ("device", "op"),
    "supports_buft": ("device", "buft"),
    "offload_op": ("device", "op"),
    "set_tensor_async": None,
    "get_tensor_async": None,
    "cpy_tensor_async": ("backend_src", "backend_dst", "src", "dst"),
    "synchronize": ("backend",),
    "graph_compute": ("backend", "graph"),
    "event_new": None,
    "event_record": ("backend", "event"),
    "event_wait": ("backend", "event"),
    "event_synchronize": None,
    "comm_init": ("backends",),
    "comm_allreduce_tensor": ("comm", "tensors"),
    "comm_free": ("comm",),
}


@pytest.mark.parametrize("name", sorted(ECOSYSTEM))
def test_ecosystem_names(name):
    assert name in SPEC_NAMES
    if ECOSYSTEM[name] is not None:
        assert spec_args(name) == ECOSYSTEM[name]


HANDLE_ARGS = {"device", "buft", "buffer", "backend", "backend_src", "comm", "backends"}
REGISTRATION = {"api_version", "get_devices", "conformance_expected_failures"}


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_first_argument_is_a_handle(name):
    args = spec_args(name)
    if name in REGISTRATION:
        assert args == ()
    else:
        assert args and args[0] in HANDLE_ARGS, f"{name}{args}"


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_docstring_states_required_or_fallback(name):
    doc = inspect.getdoc(getattr(Specs, name))
    assert doc and len(doc) > 20, f"{name} has no docstring"
    if name in REQUIRED_HOOKS:
        assert doc.startswith("*Required.*"), f"required hook {name}: docstring must say so first"
    else:
        assert re.search(r"fallback|required when", doc, re.IGNORECASE), (
            f"optional hook {name}: the docstring must name its fallback (or say when it is "
            f"required): {doc!r}"
        )
        assert not doc.startswith("*Required.*"), f"{name} is not in REQUIRED_HOOKS"


def test_module_docstring_points_at_the_guides():
    assert "writing-a-plugin.md" in hookspecs.__doc__
    assert "ordering.md" in hookspecs.__doc__


def test_cpu_plugin_impls_match_the_spec_exactly():
    """The built-in plugin is the model: it implements every required hook, and each of its
    hookimpls takes every spec argument, in order (pluggy would allow a subset)."""
    impls = [n for n in SPEC_NAMES if hasattr(cpu_plugin, n)]
    assert REQUIRED_HOOKS.issubset(impls)
    for name in impls:
        got = tuple(inspect.signature(getattr(cpu_plugin, name)).parameters)
        assert got == spec_args(name), name


# --- docs/writing-a-plugin.md ---------------------------------------------------------------------
def _split_params(text: str) -> list[str]:
    """Split a parameter list on top-level commas (annotations may hold brackets)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [p for p in (x.strip() for x in out) if p]


def _param_name(p: str) -> str:
    return re.split(r"[:=]", p, maxsplit=1)[0].strip().lstrip("*")


def documented_signatures(text: str, name: str) -> list[tuple[str, ...]]:
    """Every ``name(arg, ...)`` in the text, as tuples of argument names (annotations and
    defaults dropped, ``self`` ignored)."""
    sigs = []
    for m in re.finditer(rf"(?<![\w.]){re.escape(name)}\(", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        params = [_param_name(p) for p in _split_params(text[m.end() : i - 1])]
        sigs.append(tuple(p for p in params if p != "self"))
    return sigs


@pytest.fixture(scope="module")
def guide() -> str:
    if not DOC.exists():
        pytest.skip(f"{DOC.relative_to(DOC.parents[1])} does not exist yet (the lead writes it)")
    return DOC.read_text()


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_hook_documented_with_exact_signature(guide, name):
    sigs = documented_signatures(guide, name)
    want = spec_args(name)
    assert sigs, f"docs/writing-a-plugin.md never mentions {name}(...)"
    assert want in sigs, (
        f"docs/writing-a-plugin.md shows {name} as {sorted(set(sigs))}, "
        f"but the hookspec is {name}({', '.join(want)})"
    )


def test_signature_parser():
    text = "x = foo(a, b)\n`def buffer_set_tensor(buffer, tensor, data, offset: int, size: int)`"
    text += "\nobj.buffer_free(buffer)  comm_init(backends: list[Backend]) api_version()"
    assert documented_signatures(text, "buffer_set_tensor") == [
        ("buffer", "tensor", "data", "offset", "size")
    ]
    assert documented_signatures(text, "buffer_free") == []  # a method call, not the hook
    assert documented_signatures(text, "comm_init") == [("backends",)]
    assert documented_signatures(text, "api_version") == [()]
    assert documented_signatures("f(d: dict[str, int], e=(1, 2))", "f") == [("d", "e")]

"""accelplane: compute backends as plugins, in the mould of ggml's backend system.

Import is cheap: plugins are discovered on first use of :func:`get_registry` (or anything that
needs devices); listing the devices runs each plugin's cheap probe, and a device's runtime
(contexts, queues, the vendor's Python package) opens on its first use. ``accelplane bench
startup`` measures both in fresh processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelplane._version import __version__
from accelplane.core.graph import Context, Graph
from accelplane.core.ops import GluOp, Op, SortOrder, UnaryOp
from accelplane.core.tensor import Tensor, TensorFlag
from accelplane.core.types import GGMLType
from accelplane.errors import AccelplaneError
from accelplane.runtime import data as _data  # noqa: F401 - Tensor.set/get move data through it
from accelplane.runtime.backend import BufferUsage

if TYPE_CHECKING:
    from accelplane.runtime.alloc import GraphAllocator, alloc_ctx_tensors, alloc_tensors
    from accelplane.runtime.dlpack import from_dlpack
    from accelplane.sched import Scheduler

# imported on first use: `import accelplane; accelplane.devices()` needs none of them
_LAZY = {"GraphAllocator": "accelplane.runtime.alloc", "alloc_ctx_tensors": "accelplane.runtime.alloc",
         "alloc_tensors": "accelplane.runtime.alloc", "from_dlpack": "accelplane.runtime.dlpack",
         "Scheduler": "accelplane.sched"}  # fmt: skip

__all__ = [
    "AccelplaneError", "BufferUsage", "Context", "Graph", "GGMLType", "GluOp", "GraphAllocator", "Op",
    "Scheduler", "SortOrder", "Tensor", "TensorFlag", "UnaryOp", "alloc_ctx_tensors", "alloc_tensors",
    "from_dlpack", "get_registry", "devices", "device", "__version__",
]  # fmt: skip


def get_registry():
    """The process-wide plugin registry (discovers plugins on first call)."""
    from accelplane.runtime.registry import get_registry as _get

    return _get()


def devices():
    """All devices of all loaded plugins (CPU devices last), as their probes list them: no
    device's runtime is opened and no kernel compiled here."""
    return get_registry().devices


def device(name: str):
    """A device by name, e.g. ``accelplane.device("CPU")``."""
    return get_registry().device(name)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'accelplane' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

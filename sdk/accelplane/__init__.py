"""accelplane: compute backends as plugins, in the mould of ggml's backend system.

Import is cheap: plugins are discovered on first use of :func:`get_registry` (or anything that
needs devices), and each plugin imports its runtime only when its devices are opened.
"""

from __future__ import annotations

from accelplane._version import __version__
from accelplane.core.graph import Context, Graph
from accelplane.core.ops import GluOp, Op, SortOrder, UnaryOp
from accelplane.core.tensor import Tensor, TensorFlag
from accelplane.core.types import GGMLType
from accelplane.errors import AccelplaneError
from accelplane.runtime import data as _data  # noqa: F401 - Tensor.set/get move data through it
from accelplane.runtime.alloc import GraphAllocator, alloc_ctx_tensors, alloc_tensors
from accelplane.runtime.backend import BufferUsage
from accelplane.runtime.dlpack import from_dlpack
from accelplane.sched import Scheduler

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
    """All devices of all loaded plugins (CPU devices last)."""
    return get_registry().devices


def device(name: str):
    """A device by name, e.g. ``accelplane.device("CPU")``."""
    return get_registry().device(name)

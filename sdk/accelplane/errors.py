"""Typed errors of accelplane.

Every error the SDK or a plugin raises on bad input derives from :class:`AccelplaneError`,
so a host can catch one class. Messages name the tensor, op, device or plugin at fault.
"""

from __future__ import annotations


class AccelplaneError(Exception):
    """Base class of every accelplane error."""


class ShapeError(AccelplaneError, ValueError):
    """Tensor shapes do not fit the op or the call (build time or set/get)."""


class TypeMismatchError(AccelplaneError, TypeError):
    """A tensor type is not allowed for the op, or types of operands disagree."""


class UnsupportedOpError(AccelplaneError):
    """No backend (or not the pinned one) can run this node."""


class OutOfRangeError(AccelplaneError, IndexError):
    """An offset/size outside a tensor or buffer, or an index outside its range."""


class DataError(AccelplaneError, ValueError):
    """Values a tensor's type cannot hold: NaN or infinity for a block-quantized type (it
    would corrupt its whole block), integers outside an integer type's range, or fractions
    for an integer type."""


class PluginLoadError(AccelplaneError):
    """A plugin failed to import, validate, register or report its devices. ``failure`` is
    the registry's record of it (name, stage, reason) when one plugin's load failed."""

    failure = None  # accelplane.runtime.registry.Failure, when the error is one plugin's failure


class APIVersionError(PluginLoadError):
    """A plugin implements a different major version of the backend interface."""


class DeviceError(AccelplaneError):
    """A device, buffer, backend or event was misused: freed, of another device, absent."""


class DeviceOpenError(DeviceError):
    """A device's runtime (its contexts, queues, library) failed to open on the device's first
    use: listing devices only probes them. The message names the plugin, the device and the
    cause, which is chained as ``__cause__``; every later use of the device raises it again."""


class BufferFreedError(DeviceError):
    """A buffer (or a tensor in it) was used after the buffer was freed."""


class AllocationError(DeviceError, MemoryError):
    """A buffer could not be allocated."""


class DLPackError(AccelplaneError, BufferError):
    """A tensor or array cannot cross DLPack as asked (docs/interop.md): a type DLPack has no
    code for (the block-quantized types) or accelplane has no type for, a copy needed where
    ``copy=False`` forbids one, a device or stream the producer cannot serve, a malformed
    capsule. A BufferError, as the array API asks of ``__dlpack__``."""


class ComputeError(AccelplaneError):
    """A backend failed while computing a graph."""


class KernelCompileError(ComputeError):
    """A plugin's kernel (shader, OpenCL C, CUDA C) did not compile; the message is the
    compiler's. Raised when the kernels are built, never half-way through a computation."""


class CheckResultsError(ComputeError):
    """Check-results mode found a node whose result is over its error threshold."""


class CommError(ComputeError):
    """A collective (all-reduce) across devices or processes failed."""


class CommTimeoutError(CommError):
    """A collective did not complete within its deadline: across processes
    (``ACCELPLANE_MPI_TIMEOUT``) or across the GPUs of a plugin's communicator (the CUDA
    peer-memory all-reduce, ~10 s): a peer died, hung, or did not enter the same collective."""


class PeerError(AccelplaneError):
    """A benchmark's peer (llama.cpp's llama-bench) could not run, failed, or reported no
    result for a test it was asked to run."""


class ConfigError(AccelplaneError, ValueError):
    """An ACCELPLANE_* environment variable (or another setting) has a value outside the ones
    it accepts; the message names the variable, the value and what it accepts."""


class GGUFError(AccelplaneError):
    """A GGUF file is malformed, truncated or uses something accelplane does not support."""


class TokenizerError(AccelplaneError, ValueError):
    """A model's vocabulary cannot make a tokenizer (no ``tokenizer.ggml.*`` keys, a tokenizer
    model or pre-tokenizer accelplane does not know, malformed arrays), or text cannot be
    encoded with it (not valid Unicode, a byte no token covers); the message names the file
    and the key."""

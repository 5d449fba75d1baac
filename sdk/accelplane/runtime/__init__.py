"""The runtime: plugin discovery (:mod:`.registry`), the handles over plugin objects and ggml's
fallbacks for every optional hook (:mod:`.backend`), tensor data in and out (:mod:`.data`), the
allocators (:mod:`.alloc`), plan caches (:mod:`.plancache`) and the helpers plugins' comm hooks
share (:mod:`.collective`)."""

from accelplane.runtime import data as _data  # noqa: F401 - Tensor's data methods delegate to it

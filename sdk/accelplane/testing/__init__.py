"""Test doubles for the SDK's own logic (scheduler, ordering, conformance self-tests).

Nothing here is a backend: the asynchronous test device runs the CPU plugin's kernels on
worker threads so that ordering bugs (a missing synchronize, an event that does not wait, a
copy that returns early) show up as wrong results.
"""

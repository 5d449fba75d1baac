"""Deliberately faulty plugins: each reuses a reference plugin's hookimpls (the CPU plugin or
the asynchronous test device) and overrides exactly one behaviour, so that
tests/test_suite_catches_bugs.py can check that the conformance suite fails exactly where
it should. Load one with ``ACCELPLANE_EXTRA_PLUGINS=faulty_tail=faulty.tail`` (with tests/ on
PYTHONPATH).

Every module also renames its devices (the registry wants device names unique across
plugins, and the CPU and asynctest plugins may be loaded beside it).
"""

from __future__ import annotations

from dataclasses import replace


def renamed(specs, prefix: str) -> list:
    """The reference plugin's DeviceSpecs under new names: PREFIX, or PREFIX0, PREFIX1, …"""
    specs = list(specs)
    if len(specs) == 1:
        return [replace(specs[0], name=prefix, description=f"{specs[0].description} [faulty]")]
    return [replace(s, name=f"{prefix}{i}", description=f"{s.description} [faulty]")
            for i, s in enumerate(specs)]  # fmt: skip

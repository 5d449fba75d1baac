"""The SDK's test suite: its markers, the ``plugin_device`` fixture, and the fuzz tests' tally
in the terminal summary."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def plugin_device():
    """``plugin_device(kind)``: the first device of the installed plugin ``kind`` (vulkan, sycl,
    cuda, ...); the test is skipped, saying why, where it has none."""
    import accelplane

    def get(kind: str):
        reg = accelplane.get_registry()
        for d in reg.devices:
            if d.plugin.name == kind:
                return d
        why = [f.reason for f in reg.failures if f.name == kind]
        pytest.skip(f"no {kind} device: {why[0] if why else 'the plugin is not installed'}")

    return get


def pytest_addoption(parser) -> None:
    parser.addoption("--llama-vocabs", default=None, metavar="DIR",
                     help="llama.cpp's models/ directory: check the tokenizer on its whole ggml-vocab-*.gguf "
                          "vocabularies too (tests/test_tokenizer.py)")  # fmt: skip


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "tox: runs tox (fresh environments from the package index); "
                            "skipped where tox is not installed, an error in CI (CI set)")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    try:
        from fuzzing import TALLY
    except ImportError:  # pragma: no cover - tests/ not on the path
        return
    lines = TALLY.lines()
    if lines:
        terminalreporter.section("fuzz cases (each: the oracle's result or a typed error)")
        for ln in lines:
            terminalreporter.write_line(ln)

"""The SDK's test suite: its markers, and the fuzz tests' tally in the terminal summary."""

from __future__ import annotations


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

"""The documents' own rules: docs/performance.md and the result files behind it, and no words from the
project's history (numbered sessions and rounds, issue numbers, what was tried and dropped) in the
documents or the code.

The result files are checked on disk (so an unstaged new file fails too); the line share is counted over
the files git tracks. Tests that need git skip outside a git work tree.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import re
import shutil
import subprocess
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
PERF = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "docs" / "results"
MAX_PERF_LINES = 250
MAX_RESULTS_SHARE = 0.05  # of the repository's tracked text lines

# Words from the history of the work, not from what the code does now. Case-insensitive.
_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
             "last|previous|later|earlier|next|this|that|same")  # fmt: skip
DIARY_PATTERNS = [
    rf"\b(?:{_ORDINALS})\s+sessions?\b",  # "the ninth session", "this session's build"
    r"\bissues?\s+#?\d+\b",  # "issue 9"
    r"\([^()\n]{0,40}\bissue\)",  # "(CUDA issue)"
    r"\bissue's\b",  # "the reference"
    r"\btried and (?:not kept|dropped|abandoned|rejected|reverted)\b",
    r"\bnot kept in the repo",
    r"\bexploratory scripts?\b",
    r"\bscratch scripts?\b|\bscratch cop(?:y|ies) of (?:the |this |that )?(?:same )?code\b",
    r"\brounds? \d+\b",  # "round 3"
    r"(?<![\w.\\])s\d{1,2}/",  # result folders named after rounds: docs/results/h200/s9/
    r"\b[\w-]+-lab\d*\.txt\b",  # outputs of one-off kernel studies: mmv-lab7.txt
]
# in prose only: pytest's session scope and similar are legitimate in code
DOC_ONLY_PATTERNS = [r"\bsessions?\b", r"\b(?:previous|earlier|later|older) builds?\b"]


def _git(*args: str) -> bytes:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"not a git work tree: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


@cache
def _tracked() -> tuple[str, ...]:
    return tuple(p for p in _git("ls-files", "-z").decode().split("\0") if p)


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary (NUL bytes) or missing file."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return None if b"\0" in data else data.decode("utf-8", errors="replace")


def _lines(text: str) -> int:
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def _result_files() -> list[str]:
    """Every file under docs/results/ on disk, as a path from the repository root."""
    return sorted(p.relative_to(ROOT).as_posix() for p in RESULTS.rglob("*") if p.is_file())


def _perf() -> str:
    return PERF.read_text(encoding="utf-8")


def _hits(files: list[str], patterns: list[str]) -> list[str]:
    regexes = [re.compile(p, re.IGNORECASE) for p in patterns]
    found = []
    for rel in files:
        text = _text(ROOT / rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for rx in regexes:
                m = rx.search(line)
                if m:
                    found.append(f"{rel}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}")
                    break
    return found


def _doc_files() -> list[str]:
    """Prose: the Markdown under docs/ (not the result files), README.md and each plugin's README."""
    return [p for p in _tracked()
            if (p.startswith("docs/") and p.endswith(".md") and not p.startswith("docs/results/"))
            or p == "README.md" or re.fullmatch(r"plugins/[^/]+/README\.md", p)]  # fmt: skip


def _code_files() -> list[str]:
    """The SDK, the scripts, the tools and each plugin's package (not the tests)."""
    package = re.compile(r"plugins/[^/]+/accelplane_[^/]+/")
    return [p for p in _tracked() if p.startswith(("sdk/", "scripts/", "tools/")) or package.match(p)]


# --- docs/performance.md and docs/results/ -------------------------------------------------------------
def test_performance_doc_is_short() -> None:
    n = _lines(_perf())
    assert n <= MAX_PERF_LINES, f"docs/performance.md has {n} lines (at most {MAX_PERF_LINES})"


def test_every_result_file_is_named_in_performance_doc() -> None:
    text = _perf()
    files = _result_files()
    assert files, "docs/results/ holds no files"
    unnamed = [f for f in files if f not in text]
    assert not unnamed, (
        "files under docs/results/ that docs/performance.md does not name (delete them "
        "or name them beside the figure they back):\n  " + "\n  ".join(unnamed)
    )


def test_every_path_named_in_performance_doc_exists() -> None:
    text = _perf()
    named = {m.rstrip(".,;:") for m in re.findall(r"docs/results/[\w./+-]*", text)}
    named |= {"docs/" + m for m in re.findall(r"\]\((img/[^)\s]+)\)", text)}  # the plots
    assert named, "docs/performance.md names no result file"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, "docs/performance.md names paths that do not exist:\n  " + "\n  ".join(missing)


def test_results_are_a_small_share_of_the_repository() -> None:
    total = results = 0
    for rel in _tracked():
        text = _text(ROOT / rel)
        if text is None:
            continue
        n = _lines(text)
        total += n
        if rel.startswith("docs/results/"):
            results += n
    assert total > 0
    share = results / total
    assert share <= MAX_RESULTS_SHARE, (
        f"docs/results/ is {results} of {total} tracked lines ({share:.1%}, at most "
        f"{MAX_RESULTS_SHARE:.0%}): keep only the files behind docs/performance.md, reduced with "
        "scripts/compact-results"
    )


def test_no_two_result_files_are_identical() -> None:
    by_hash: dict[str, list[str]] = defaultdict(list)
    for rel in _result_files():
        by_hash[hashlib.sha256((ROOT / rel).read_bytes()).hexdigest()].append(rel)
    dups = [files for files in by_hash.values() if len(files) > 1]
    assert not dups, "byte-identical files under docs/results/ (keep one): " + "; ".join(map(", ".join, dups))


def _compact_results():
    """scripts/compact-results as a module (it has no .py suffix)."""
    path = ROOT / "scripts" / "compact-results"
    loader = importlib.machinery.SourceFileLoader("compact_results", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_result_json_files_are_compacted() -> None:
    dumps = _compact_results().dumps
    loose = [rel for rel in _result_files() if rel.endswith(".json")
             and (ROOT / rel).read_text() != dumps(json.loads((ROOT / rel).read_text())) + "\n"]  # fmt: skip
    assert not loose, "run scripts/compact-results on: " + " ".join(loose)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=30)  # fmt: skip


@given(_json)
def test_compact_results_keeps_the_data(value: object) -> None:
    text = _compact_results().dumps(value)
    assert json.loads(text) == value  # the json module is the oracle
    assert _compact_results().dumps(json.loads(text)) == text  # a second pass changes nothing


def test_compact_results_reduces_a_conformance_report() -> None:
    mod = _compact_results()
    cases = [{"id": f"t{i}", "status": s} for i, s in enumerate(["passed", "skipped", "passed", "failed"])]
    report = {"plugin": "x", "totals": {"passed": 2, "skipped": 1, "failed": 1}, "cases": cases}
    once = mod.reduce_conformance(report)
    assert once["cases_passed"] == 2 and [c["id"] for c in once["cases"]] == ["t1", "t3"]
    assert once["totals"] == report["totals"]
    assert mod.reduce_conformance(once) == once
    assert mod.reduce_conformance({"results": cases}) == {"results": cases}  # not a report: unchanged


# --- no history words --------------------------------------------------------------------------------
def test_no_diary_words_in_docs() -> None:
    files = _doc_files()
    assert "README.md" in files and "docs/performance.md" in files
    hits = _hits(files, DIARY_PATTERNS + DOC_ONLY_PATTERNS)
    assert not hits, "describe what the code does now, not how it got there:\n  " + "\n  ".join(hits)


def test_no_diary_words_in_code() -> None:
    files = _code_files()
    assert any(f.startswith("sdk/") for f in files)
    hits = _hits(files, DIARY_PATTERNS)
    assert not hits, "describe what the code does now, not how it got there:\n  " + "\n  ".join(hits)


@pytest.mark.parametrize(("line", "caught"), [
    ("Measured in the ninth session, on one H200.", True),
    ("this session's build", True),
    ("## Tensor parallelism (tensor-parallel issue)", True),
    ("as issue 9 asks", True),
    ("ggml CUDA µs (issue)", True),
    ("the issue's ggml reference", True),
    ("One more thing tried and not kept: a prefetch", True),
    ("by an exploratory script not kept in the repository", True),
    ("run as a scratch copy of the same code", True),
    ("after round 3 of tuning", True),
    ("`docs/results/h200/s11/ops-matvec.json`", True),
    ("(`mmv-lab7.txt`)", True),
    ("the kernel issues its loads before the wait", False),
    ("the issue list for one tuple of tensors", False),
    ("issues a synchronize", False),
    ("the butterfly's first round exchanges halves", False),
    ("scratch memory the steps use", False),
    ("the scratch copies some dispatches make", False),
    ("`docs/results/h200/model-8b-q4_0.json`", False),
])  # fmt: skip
def test_diary_patterns(line: str, caught: bool) -> None:
    """The patterns catch the history words and leave ordinary uses of the same words alone."""
    assert any(re.search(p, line, re.IGNORECASE) for p in DIARY_PATTERNS) is caught


def test_session_is_a_diary_word_in_docs_only() -> None:
    assert not any(re.search(p, 'scope="session"', re.IGNORECASE) for p in DIARY_PATTERNS)
    assert any(re.search(p, "measured in this session", re.IGNORECASE) for p in DOC_ONLY_PATTERNS)


def test_readme_examples_run(tmp_path):
    """README's "Using it" code, as written: the scheduler route, then the single-backend route on
    the same graph; both print the same first values."""
    import sys

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 2, "README shows the scheduler route and the single-backend route"
    first = blocks[0].replace("sched.free()\n", "")
    code = first + blocks[1] + "print(np.asarray(y)[0, :4])\nsched.free()\n"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "MUL_MAT" in lines[1] and "UNARY" in lines[1], "placement names each node and its backend"
    assert lines[0] == lines[2], "both routes compute the same values"

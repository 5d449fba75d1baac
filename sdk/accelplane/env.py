"""Every ``ACCELPLANE_*`` environment variable, declared once and parsed strictly.

A variable is declared where it is used, with its kind, default and meaning::

    FUSION = env.flag("ACCELPLANE_FUSION", True, "plugins may fuse nodes into one kernel")
    if FUSION.get(): ...

A plugin gathers its knobs in one frozen dataclass whose fields are declarations, read once::

    @dataclass(frozen=True)
    class Tuning:
        graphs: bool = env.field(env.flag("ACCELPLANE_CUDA_GRAPHS", True, "replay CUDA graphs"))

    TUNING = env.read(Tuning)

Contract: an unset or empty variable gives the default; any other value must parse, else
:class:`~accelplane.errors.ConfigError` names the variable, the value and what it accepts. No
value is ever taken for the default in silence. ``accelplane devices --env`` lists the variables
that are set (:func:`report`), with their meaning.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from accelplane.errors import ConfigError

T = TypeVar("T")

PREFIX = "ACCELPLANE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Var(Generic[T]):
    """One declared variable. ``parse`` turns a non-empty string into the value or raises
    ValueError with what is accepted; ``accepts`` says it for listings."""

    name: str
    default: T
    help: str
    accepts: str
    parse: Callable[[str], T]
    owner: str = "accelplane"

    def raw(self) -> str | None:
        """The variable's string when set and not empty, else None."""
        v = os.environ.get(self.name)
        return v if v is not None and v.strip() != "" else None

    def get(self) -> T:
        """The parsed value (the default when unset or empty); ConfigError when it does not parse."""
        v = self.raw()
        if v is None:
            return self.default
        try:
            return self.parse(v.strip())
        except ValueError as e:
            why = str(e) or f"expected {self.accepts}"
            raise ConfigError(f"{self.name}={v!r}: {why} ({self.help})") from None

    def is_set(self) -> bool:
        return self.raw() is not None

    def default_text(self) -> str:
        """The default as one would write it in the environment ('' when there is none)."""
        d = self.default
        if d is None or d == "":
            return ""
        if isinstance(d, bool):
            return "1" if d else "0"
        if isinstance(d, tuple):
            return ",".join(map(str, d))
        return str(d)


_VARS: dict[str, Var] = {}


def declare(var: Var[T]) -> Var[T]:
    """Register ``var`` (idempotent for the same declaration; a second, different declaration
    of one name is a programming error)."""
    if not var.name.startswith(PREFIX):
        raise ValueError(f"{var.name}: accelplane variables start with {PREFIX}")
    old = _VARS.get(var.name)
    if old is not None and (old.default, old.accepts, old.owner) != (var.default, var.accepts, var.owner):
        raise ValueError(f"{var.name} is declared twice, differently")
    _VARS.setdefault(var.name, var)
    return _VARS[var.name]


def _owner(name: str, owner: str | None) -> str:
    return owner or "accelplane"


def flag(name: str, default: bool, help: str, owner: str | None = None) -> Var[bool]:
    """An on/off switch: 1/true/yes/on or 0/false/no/off (any case)."""

    def parse(s: str) -> bool:
        s = s.lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
        raise ValueError("expected 1 or 0 (also true/false, yes/no, on/off)")

    return declare(Var(name, default, help, "1|0", parse, _owner(name, owner)))


def integer(name: str, default: int | None, help: str, *, min: int | None = None,
            max: int | None = None, owner: str | None = None) -> Var:  # fmt: skip
    """A decimal integer in [min, max] (either bound optional)."""
    accepts = _range("an integer", min, max)

    def parse(s: str) -> int:
        try:
            v = int(s, 10)
        except ValueError:
            raise ValueError(f"expected {accepts}") from None
        _check_range(v, min, max, accepts)
        return v

    return declare(Var(name, default, help, accepts, parse, _owner(name, owner)))


def number(name: str, default: float | None, help: str, *, min: float | None = None,
           max: float | None = None, owner: str | None = None) -> Var:  # fmt: skip
    """A finite decimal number in [min, max]."""
    accepts = _range("a number", min, max)

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise ValueError(f"expected {accepts}") from None
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"expected {accepts}")
        _check_range(v, min, max, accepts)
        return v

    return declare(Var(name, default, help, accepts, parse, _owner(name, owner)))


def choice(name: str, default: str, allowed: Sequence[str], help: str,
           owner: str | None = None) -> Var[str]:  # fmt: skip
    """One of ``allowed`` (exact, case-insensitive; the result is the allowed spelling)."""
    allowed = tuple(allowed)
    accepts = "|".join(allowed)

    def parse(s: str) -> str:
        for a in allowed:
            if s.lower() == a.lower():
                return a
        raise ValueError(f"expected one of {', '.join(allowed)}")

    return declare(Var(name, default, help, accepts, parse, _owner(name, owner)))


def names(name: str, help: str, owner: str | None = None) -> Var[tuple[str, ...] | None]:
    """A comma-separated list of names (blanks dropped); None when unset."""

    def parse(s: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in s.split(",") if x.strip())
        if not items:
            raise ValueError("expected a comma-separated list of names")
        return items

    return declare(Var(name, None, help, "NAME[,NAME...]", parse, _owner(name, owner)))


def indices(name: str, help: str, owner: str | None = None) -> Var[tuple[int, ...] | None]:
    """A comma list of indices >= 0 (``0`` or ``0,0``; repeats allowed); None when unset."""

    def parse(s: str) -> tuple[int, ...]:
        try:
            out = tuple(int(x, 10) for x in s.split(","))
        except ValueError:
            raise ValueError("expected a comma list of device indices, e.g. 0 or 0,0") from None
        if any(i < 0 for i in out):
            raise ValueError("device indices are >= 0")
        return out

    return declare(Var(name, None, help, "I[,I...]", parse, _owner(name, owner)))


def text(name: str, default: str | None, help: str, accepts: str = "any text",
         owner: str | None = None) -> Var:  # fmt: skip
    """Free text (a path, a command); no parsing beyond stripping blanks."""
    return declare(Var(name, default, help, accepts, lambda s: s, _owner(name, owner)))


def custom(name: str, default: T, help: str, accepts: str, parse: Callable[[str], T],
           owner: str | None = None) -> Var[T]:  # fmt: skip
    """A variable with its own ``parse`` (raise ValueError with what is accepted)."""
    return declare(Var(name, default, help, accepts, parse, _owner(name, owner)))


def _range(what: str, lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"{what} from {lo} to {hi}"
    if lo is not None:
        return f"{what} >= {lo}"
    if hi is not None:
        return f"{what} <= {hi}"
    return what


def _check_range(v, lo, hi, accepts: str) -> None:
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"expected {accepts}")


# --- settings dataclasses ---------------------------------------------------------------------
def field(var: Var) -> Any:
    """A dataclass field whose value :func:`read` takes from ``var``."""
    return dataclasses.field(default=var.default, metadata={"env": var})


S = TypeVar("S")


def read(cls: type[S]) -> S:
    """An instance of the dataclass ``cls`` with every :func:`field` read from the environment
    now (ConfigError on the first bad value)."""
    kw = {f.name: f.metadata["env"].get() for f in dataclasses.fields(cls) if "env" in f.metadata}
    return cls(**kw)


# --- listings --------------------------------------------------------------------------------
def declared() -> dict[str, Var]:
    """Every declared variable by name (those of plugins once their modules are imported)."""
    return dict(sorted(_VARS.items()))


def check() -> None:
    """Parse every declared variable that is set: ConfigError for the first that does not."""
    for v in declared().values():
        v.get()


def report() -> list[dict[str, str]]:
    """The ACCELPLANE_* variables set in the environment: name, value, owner, meaning, and
    ``problem`` (a parse error, or that nothing installed reads it)."""
    rows = []
    for name in sorted(k for k in os.environ if k.startswith(PREFIX)):
        value = os.environ[name]
        var = _VARS.get(name)
        row = {"name": name, "value": value, "owner": var.owner if var else "",
               "meaning": var.help if var else "", "accepts": var.accepts if var else "",
               "problem": ""}  # fmt: skip
        if var is None:
            row["problem"] = "no installed component reads this variable"
        else:
            try:
                var.get()
            except ConfigError as e:
                row["problem"] = str(e)
        rows.append(row)
    return rows


# --- variables read in several places (the SDK and plugins) --------------------------------------
TEST_DELAY_US = number(
    "ACCELPLANE_TEST_DELAY_US", None,
    "test devices and plugin queues wait a random time up to this many microseconds before "
    "each operation, so that ordering bugs show (the asynchronous test device: 100 when unset)",
    min=0,
)  # fmt: skip


# --- plugin discovery (accelplane.runtime.registry) ------------------------------------------------------
PLUGINS = names(
    "ACCELPLANE_PLUGINS", "load only these plugins; one that fails or is missing is an error"
)
DISABLE_PLUGINS = names("ACCELPLANE_DISABLE_PLUGINS", "never load these plugins")
EXTRA_PLUGINS = names(
    "ACCELPLANE_EXTRA_PLUGINS",
    "name=module entries: load these modules as plugins without an installed distribution",
)


# --- the scheduler (accelplane.sched) ------------------------------------------------------------
PREFETCH_EXPERTS = integer(
    "ACCELPLANE_SCHED_PREFETCH_EXPERTS", 3,
    "the scheduler prefetches the next N host-expert tensors of a prefill on a second stream (0: off)", min=0,
)  # fmt: skip
SCHED_DEBUG = choice(
    "ACCELPLANE_SCHED_DEBUG", "0", ("0", "1", "2"),
    "print the scheduler's splits (1), and each node's backend with the reason (2)",
)  # fmt: skip
CHECK_RESULTS = flag(
    "ACCELPLANE_CHECK_RESULTS", False,
    "compare every node with the float64 oracle as it runs; stop at the first over its threshold",
)  # fmt: skip


# --- fusion rules (accelplane.core.fusion) ------------------------------------------------------------
FUSION = flag(
    "ACCELPLANE_FUSION", True, "plugins may fuse nodes into one kernel (0: none does, for bisecting)"
)


# --- caches (accelplane.runtime.plancache) ---------------------------------------------------------------
CACHE_DIR = text(
    "ACCELPLANE_CACHE_DIR", None,
    "where compiled kernels and synthetic models are cached (default $XDG_CACHE_HOME/accelplane)",
    accepts="a directory",
)


# --- all-reduce (accelplane.parallel.comm) ----------------------------------------------------------------
COMM_COMPRESS_MIN = integer(
    "ACCELPLANE_COMM_COMPRESS_MIN", 1 << 17,  # ggml's CUDA NCCL path compresses from 32768 F32
    "all-reduces of at least this many bytes travel compressed (BF16) where allowed", min=0,
)  # fmt: skip


# --- processes (accelplane.parallel.mpi) ------------------------------------------------------------------
MPI_TIMEOUT = number(
    "ACCELPLANE_MPI_TIMEOUT", 120.0,
    "seconds one collective across MPI ranks may take before CommTimeoutError", min=0.001,
)  # fmt: skip


# --- tensor split (accelplane.parallel.meta) --------------------------------------------------------------
META_DEBUG = flag(
    "ACCELPLANE_META_DEBUG", False, "the meta device prints each op's split states and plan"
)
META_RECORD = flag(
    "ACCELPLANE_META_RECORD", True,
    "tensor split replays each backend's recording of a step (0: submits subgraphs and "
    "all-reduces one by one)",
)  # fmt: skip


# --- the decoder model (accelplane.models) -------------------------------------------------------
MODEL_EMBD = choice(
    "ACCELPLANE_MODEL_EMBD", "auto", ("auto", "cpu", "device"),
    "where the decoder model keeps its token embeddings (auto: the first layer's device when it is "
    "not a CPU and runs their GET_ROWS)",
)  # fmt: skip
MODEL_POLICY = choice(
    "ACCELPLANE_MODEL_POLICY", "relaxed", ("relaxed", "strict"),
    "the decoder model's scheduler policy (docs/ordering.md)",
)  # fmt: skip
MODEL_MERGE = flag(
    "ACCELPLANE_MODEL_MERGE", True, "the decoder model merges Q/K/V and gate/up into one matrix each"
)
MODEL_REPACK = flag(
    "ACCELPLANE_MODEL_REPACK", True,
    "the decoder model keeps its CPU matrices in the CPU's repack buffer type, whose layout multiplies "
    "faster (llama-bench --repack; 0: host memory as in the file)",
)  # fmt: skip
MODEL_MOE_DEVICE_SHARE = number(
    "ACCELPLANE_MODEL_MOE_DEVICE_SHARE", 0.0,
    "in a decode with experts in host memory, the share of each token's experts its layer's device "
    "computes, reading them in place while the CPU computes the rest (0, the default: the CPU computes all)",
    min=0.0, max=1.0,
)  # fmt: skip


# --- the CPU plugin (accelplane.cpu) -------------------------------------------------------------
NTHREADS = integer(
    "ACCELPLANE_NTHREADS", None, "CPU plugin threads (default: one per CPU this process may run on)",
    min=1, max=1024,
)
CPU_SPIN = integer(
    "ACCELPLANE_CPU_SPIN", None,
    "how long idle CPU plugin threads spin before they sleep, in libgomp spin iterations (~100 a "
    "microsecond; sets GOMP_SPINCOUNT; default 10000 on up to 4 usable CPUs, 1000000 on more)",
    min=0,
)  # fmt: skip
CPU_ISA = choice(
    "ACCELPLANE_CPU_ISA", "auto", ("auto", "avx512", "avx2-vnni", "avx2", "portable"),
    "the CPU plugin's kernel code path (auto: the best the CPU has; a missing one falls back; "
    "portable: no AVX2, e.g. to compare)",
)  # fmt: skip


# --- the asynchronous test device (accelplane.testing.asyncdev) ----------------------------------
ASYNCDEV_NDEV = integer(
    "ACCELPLANE_ASYNCDEV_NDEV", 2, "devices of the asynchronous test device", min=0, max=64
)
ASYNCDEV_SEED = integer(
    "ACCELPLANE_ASYNCDEV_SEED", None, "seed of the asynchronous test device's random delays"
)
ASYNCDEV_MAX_SIZE = integer(
    "ACCELPLANE_ASYNCDEV_MAX_SIZE", 32 << 20,
    "the asynchronous test device's max buffer size in bytes (small, so multi-buffers get exercised)",
    min=4096,
)  # fmt: skip


# --- the test suites (tests/, plugins/*/tests) ---------------------------------------------------
FUZZ = choice(
    "ACCELPLANE_FUZZ", "ci", ("ci", "long"),
    "how many cases the property-based and fuzz tests run: a CI-sized count, or the long run",
)

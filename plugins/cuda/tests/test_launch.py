"""Host-side checks of programmatic dependent launch (no GPU needed)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from accelplane.errors import ConfigError
from accelplane_cuda import launch, tuning


def _kernels(kind: str = "__global__", names: str = r"k_\w+") -> dict[str, str]:
    """name → body of every ``kind`` function of kernels/*.cu whose name matches ``names``."""
    src = "\n".join(p.read_text() for p in sorted((Path(launch.__file__).parent / "kernels").glob("*.cu")))
    out = {}
    for m in re.finditer(kind + r"[^{;]*?\b(" + names + r")\s*\(", src):
        start = src.index("{", m.end())
        depth, i = 0, start
        while True:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            if depth == 0:
                break
            i += 1
        out[m.group(1)] = src[start : i + 1]
    return out


def test_every_kernel_waits_for_its_predecessor():
    """The contract that makes programmatic launches safe (kernels/common.cuh: pdl_enter): every
    kernel calls pdl_enter first, or pdl_enter_params (its parameters, written at plan time,
    copied to shared memory before the wait), except the mat-vecs (k_mmv_row, k_mmv_row1,
    k_mmv_ring), which may only load weights before it, and only when the plan allows it (P[15]),
    and the vector norm, which may load its MUL's weights before it likewise (P[32]), as may the
    MoE router (k_moe_router) its weights (P[12]); k_mmv_row1_id, whose expert comes from an
    earlier kernel, waits first."""
    bodies = _kernels()
    assert len(bodies) >= 30
    for name, body in bodies.items():
        stmts = [s.strip() for s in body[1:].split(";") if s.strip()]
        if name == "k_mmv_row":
            before = body[: body.index("pdl_enter();")]
            assert "if (early) load(lid)" in before and "dst" not in before.split("const bool early")[1]
            assert "if (!early) load(lid)" in body
        elif name == "k_mmv_row1":  # its body (below) waits before or after its one load site
            assert "mmv_row1<WT, U, LPR, MINB, RT, QKV>(P, dst, w, xq, P[15] != 0);" in body, body
        elif name == "k_mmv_row1_id":  # reads the ids first: waits, then loads at once
            assert stmts[0] == "pdl_enter()" and body.rstrip("} \n").endswith(", true);"), body
        elif name == "k_mmv_ring":  # weight copies into its own slots, the wait before or after them
            before = body[: body.index("if (!early) pdl_enter();")]
            assert "dst" not in before and "__ldg" not in before and "issue(st)" not in before
            wait = ("if (!early) pdl_enter();\n    #pragma unroll\n"
                    "    for (int st = 0; st < S - 1; ++st) issue(st);\n    if (early) pdl_enter();")
            assert wait in body
            issue = body[body.index("auto issue"): body.index("const bool early")]
            assert "cp_async16(slots" in issue and "dst" not in issue and "xq" not in issue
        elif name == "k_norm_vec":  # its parameters, the weights where the plan allows (P[32]), the wait
            before = body[: body.index("pdl_enter();")]
            assert not any(w in before for w in ("src", "dst", "sum", "xq", " b ")), before
            assert before.rstrip().endswith("if (early) load_g();") and "if (!early) load_g();" in body
            assert "const bool early = Ps[32] != 0;" in before and "Ps[i] = P[i]" in before
        elif name == "k_moe_router":  # the router's weights where the plan allows (P[12]), then the wait
            before = body[: body.index("pdl_enter();")]
            assert before.rstrip().endswith("const bool early = P[12] != 0;\n    if (early) load();"), before
            assert "if (!early) load();" in body
            load = before[before.index("auto load") :]
            assert "__ldg(wr + " in load and not any(w in load for w in ("logits", "xv", "probs", "counter"))
        elif stmts[0].startswith("__shared__ i64 Ps["):  # the plan-time parameters, then the wait
            wait = stmts[1]
            assert re.fullmatch(r"pdl_enter_params<[^>]+>\(P, Ps(, [^;]+)?\)", wait), (name, wait)
        else:
            assert stmts[0] == "pdl_enter()", (name, stmts[0])


def test_register_matvec_body_waits_around_its_one_load_site():
    """mmv_row1, the body of k_mmv_row1 and k_mmv_row1_id: nothing before the wait but the
    weights' loads (and those only when ``early``)."""
    body = _kernels("__device__ __forceinline__ void", "mmv_row1")["mmv_row1"]
    before = body[: body.index("if (!early) pdl_enter();")]
    assert "dst" not in before and "__ldg" not in before and "load(lid)" not in before
    assert "if (!early) pdl_enter();  // as k_mmv_row (one load site: fewer registers)\n    load(lid);\n" \
           "    if (early) pdl_enter();" in body


def test_launch_takes_numpy_scalars_only():
    class Fn:
        class kernel:  # noqa: N801 - CuPy's attribute name
            ptr = 0

    with pytest.raises(TypeError, match="NumPy scalar"):
        launch.Launch("k_x", Fn, (1,), (32,), 0, 0, (np.uint64(1), 7), True)


def test_pdl_switch(monkeypatch):
    """Programmatic launches on sm_90+ unless ACCELPLANE_CUDA_PDL=0 (as a plan reads it)."""
    monkeypatch.setenv("ACCELPLANE_CUDA_PDL", "1")
    assert launch.pdl_wanted(90, tuning.read().pdl) and not launch.pdl_wanted(80, tuning.read().pdl)
    monkeypatch.setenv("ACCELPLANE_CUDA_PDL", "0")
    assert not launch.pdl_wanted(90, tuning.read().pdl)
    monkeypatch.setenv("ACCELPLANE_CUDA_PDL", "yes")
    assert launch.pdl_wanted(90, tuning.read().pdl)
    monkeypatch.setenv("ACCELPLANE_CUDA_PDL", "2")
    with pytest.raises(ConfigError, match="ACCELPLANE_CUDA_PDL"):
        tuning.read()

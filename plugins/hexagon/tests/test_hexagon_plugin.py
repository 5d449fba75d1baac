"""Registration and device facts (emulated, HTP0..N, memory 0/0, buffer types), a cheap
import, and supports_op's exact claims and refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from accelplane.core.graph import Context
from accelplane.core.ops import GluOp, UnaryOp
from accelplane.core.types import GGMLType
from accelplane.interface import DeviceType

T = GGMLType


def _py(code: str, **env: str) -> str:
    e = {**os.environ, "ACCELPLANE_PLUGINS": "hexagon", **env}
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          env=e, timeout=120).stdout  # fmt: skip


def test_device_says_emulated(htp):
    assert htp.name == "HTP0" and htp.plugin.name == "hexagon"
    assert "emulated" in htp.description and "not NPU performance" in htp.description
    assert htp.memory() == (0, 0)
    assert htp.type is DeviceType.ACCEL
    assert not htp.caps.async_ and not htp.caps.events  # graph_compute is synchronous


def test_buffer_types(htp, repack):
    normal = htp.buffer_type
    assert normal.name == "HTP0" and normal.is_host and normal.alignment == 128
    assert repack.name == "HTP0-REPACK" and not repack.is_host and repack.alignment == 128
    assert htp.supports_buft(normal) and htp.supports_buft(repack)


def test_ndev_and_cheap_import():
    out = _py(
        "import sys, json, accelplane\n"
        "import accelplane_hexagon.plugin\n"
        "lazy = 'accelplane_hexagon._htp' not in sys.modules\n"
        "devs = accelplane.get_registry().devices_of('hexagon')\n"
        "print(json.dumps([lazy, [d.name for d in devs]]))",
        ACCELPLANE_HEXAGON_NDEV="3",
    )
    lazy, names = json.loads(out)
    assert lazy, "importing the plugin module must not load the NPU kernels"
    assert names == ["HTP0", "HTP1", "HTP2"]


@pytest.mark.parametrize("bad", ["x", "17", "-1"])
def test_bad_ndev_is_a_config_error(bad):
    out = _py("import accelplane\nfrom accelplane.errors import ConfigError\n"
              "try:\n    accelplane.get_registry().devices\nexcept ConfigError as e:\n    print(e)",
              ACCELPLANE_HEXAGON_NDEV=bad, ACCELPLANE_PLUGINS="")  # fmt: skip
    assert out.startswith(f"ACCELPLANE_HEXAGON_NDEV={bad!r}: expected an integer from 0 to 16"), out


# --- supports_op ------------------------------------------------------------------------------------
def _mm(ta, k, m, n=2, tb=T.F32):
    ctx = Context()
    return ctx.mul_mat(ctx.new_tensor_ne(ta, k, m), ctx.new_tensor_ne(tb, k, n))


@pytest.mark.parametrize("build,expected", [
    (lambda: _mm(T.Q4_0, 64, 32), True),
    (lambda: _mm(T.Q8_0, 4096, 32768), True),
    (lambda: _mm(T.Q8_0, 64, 32769), False),  # the LM-head gate
    (lambda: _mm(T.F16, 64, 40, tb=T.F16), True),
    (lambda: _mm(T.F32, 48, 8), False),  # K % 32
    (lambda: _mm(T.Q8_0, 131072 + 32, 32), False),  # longer rows than the fp16 error was measured for
    (lambda: _mm(T.Q4_K, 256, 8), False),
    (lambda: _mm(T.BF16, 64, 8), False),
], ids=["q4_0", "q8_0-32768-rows", "lm-head", "f16", "k48", "k-too-long", "q4_k", "bf16"])  # fmt: skip
def test_supports_mul_mat(htp, build, expected):
    assert htp.supports_op(build()) is expected


def _unary(u, ty=T.F32):
    ctx = Context()
    return ctx.unary(ctx.new_tensor_ne(ty, 8), u)


def _binary(ta, tb):
    ctx = Context()
    return ctx.add(ctx.new_tensor_ne(ta, 8, 2), ctx.new_tensor_ne(tb, 8))


def _other(name):
    ctx = Context()
    a = ctx.new_tensor_ne(T.F32, 8, 2)
    return {"l2": lambda: ctx.l2_norm(a), "sqr": lambda: ctx.sqr(a), "concat": lambda: ctx.concat(a, a, 0),
            "sum_rows": lambda: ctx.sum_rows(a), "argsort": lambda: ctx.argsort(a),
            "clamp": lambda: ctx.clamp(a, 0, 1)}[name]()  # fmt: skip


def test_supports_exactly_the_listed_ops(htp):
    for u in UnaryOp:
        want = u.name in ("SILU", "GELU", "SIGMOID", "NEG", "EXP", "TANH", "SOFTPLUS")
        assert htp.supports_op(_unary(u)) is want, u.name
        assert htp.supports_op(_unary(u, T.BF16)) is False
    for g in GluOp:
        ctx = Context()
        assert htp.supports_op(ctx.glu(ctx.new_tensor_ne(T.F16, 8), None, g)) is True
    assert htp.supports_op(_binary(T.F32, T.F32)) and htp.supports_op(_binary(T.F16, T.F16))
    assert not htp.supports_op(_binary(T.F32, T.F16)) and not htp.supports_op(_binary(T.BF16, T.BF16))
    for name in ("l2", "sqr", "concat", "sum_rows", "argsort", "clamp"):
        assert htp.supports_op(_other(name)) is False, name


def test_repacked_weights_feed_matmuls_only(htp, repack, placed):
    ctx = Context()
    w = ctx.new_tensor_ne(T.Q8_0, 64, 40, name="w")
    idx = ctx.new_tensor_ne(T.I32, 2, name="idx")
    x = ctx.new_tensor_ne(T.F32, 64, 3, name="x")
    rows = ctx.get_rows(w, idx)
    mm = ctx.mul_mat(w, x)
    view = ctx.view(w, (64, 8), w.nb, 0)
    mm_view = ctx.mul_mat(view, x)
    assert htp.supports_op(rows)  # not placed yet: a plain Q8_0 tensor
    placed.put(repack, w)
    w.buffer.init_view(view)
    assert htp.supports_op(mm)
    assert not htp.supports_op(rows), "tiles are for the matmul kernels"
    assert not htp.supports_op(mm_view), "the tiles cover whole tensors"

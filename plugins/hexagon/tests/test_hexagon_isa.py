"""The ISA tier: the tile kernel written with HVX intrinsics, compiled for Hexagon v67 with
clang-19 and run under qemu-hexagon on fixed inputs, equals the host-C emulation bit for bit
(int32 row sums, fp16- and fp32-accumulated results). Skipped, saying so, where the tools are
not installed (plugins/hexagon/system-deps installs them)."""

from __future__ import annotations

import pytest

from accelplane_hexagon.isa import hvx

_missing = hvx.missing()
pytestmark = pytest.mark.skipif(
    bool(_missing),
    reason=f"skipped: {', '.join(_missing)} not installed (plugins/hexagon/system-deps installs "
    "clang-19, lld-19 and qemu-user)",
)


@pytest.mark.parametrize("q4", [False, True], ids=["q8_0", "q4_0"])
def test_hvx_kernel_equals_emulation(q4, tmp_path):
    case = hvx.fixed_case(q4)
    isa = hvx.run_isa(case, tmp_path)
    host = hvx.run_host(case)
    assert hvx.mismatches(isa, host) == []
    assert isa.isum.any() and (isa.out16 != isa.out32).any()  # the inputs exercise both modes

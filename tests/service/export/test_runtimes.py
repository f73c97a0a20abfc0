"""The second runtime's verdict on an INT8 file depends on the CPU that runs it
(service/export/runtimes.py): without VNNI, OpenVINO's 8-bit dot products saturate, and a
difference there says nothing of the file (docs/int8.md, "Checks and the report's `int8` section")."""

from __future__ import annotations

import pytest

from bnrecal.service.export.runtimes import cpu_saturates_int8

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n"


@pytest.mark.parametrize("cpuinfo, saturates", [
    (AVX2_ONLY, True),                                                # an AMD EPYC of this project's machines
    ("flags\t\t: avx2 avx512f avx512bw\n", True),                     # AVX-512 without VNNI (Skylake-SP)
    ("flags\t\t: avx2 avx512f avx512_vnni\n", False),                 # Cascade Lake and later, Zen 4
    ("flags\t\t: avx2 avx_vnni\n", False),                            # Alder Lake's AVX-VNNI
    ("flags\t\t: avx2 avx512f amx_int8 amx_tile\n", False),           # Sapphire Rapids' AMX
    ("processor\t: 0\nmodel name\t: unknown\n", False),               # no flags said: the check stays strict
])
def test_a_cpu_saturates_int8_without_any_vnni_flag(cpuinfo, saturates):
    assert cpu_saturates_int8(cpuinfo) is saturates

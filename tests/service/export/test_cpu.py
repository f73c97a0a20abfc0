"""The CPU an INT8 file is checked on (service/export/cpu.py): without VNNI the runtimes'
8-bit kernels add u8 x s8 pairs in 16 bits and can saturate, so a runtime's departure from
the file's own arithmetic there is named saturation; with VNNI it fails the file (docs/int8.md,
"Every x86 CPU")."""

from __future__ import annotations

import pytest

from bnrecal.service.export.cpu import cpu_features

AVX2_ONLY = ("processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma\n\n"
             "processor\t: 1\nflags\t\t: fpu avx2\n")


@pytest.mark.parametrize("cpuinfo, vnni", [
    (AVX2_ONLY, False),                                               # an AMD EPYC of this project's machines
    ("flags\t\t: avx2 avx512f avx512bw\n", False),                    # AVX-512 without VNNI (Skylake-SP)
    ("flags\t\t: avx2 avx512f avx512_vnni\n", True),                  # Cascade Lake and later, Zen 4
    ("flags\t\t: avx2 avx_vnni\n", True),                             # Alder Lake's AVX-VNNI
    ("flags\t\t: avx2 avx512f amx_int8 amx_tile\n", True),            # Sapphire Rapids' AMX
    ("processor\t: 0\nmodel name\t: unknown\n", True),                # no flags said: the check stays strict
])
def test_vnni_is_any_of_its_flags(cpuinfo, vnni):
    features = cpu_features(cpuinfo, environ={})
    assert features.vnni is vnni
    assert features.has_vnni("onnxruntime") is vnni and features.has_vnni("openvino") is vnni


def test_the_report_names_the_model_and_the_int8_flags():
    features = cpu_features(AVX2_ONLY, environ={})
    assert features.model == "AMD EPYC 7B12"
    assert features.flags == ["sse4_2", "avx2"]
    assert features.describe() == "AMD EPYC 7B12 (sse4_2, avx2, no VNNI)"
    assert "openvino_isa_cap" not in features.to_dict()


@pytest.mark.parametrize("cap, openvino_vnni", [
    ("AVX2", False), ("avx512_core", False), ("AVX512_CORE_VNNI", True), ("AVX2_VNNI", True),
    ("AVX512_CORE_AMX", True), ("ALL", True), ("", True),
])
def test_onednn_isa_cap_takes_vnni_from_openvino_only(cap, openvino_vnni):
    """OpenVINO's CPU plugin dispatches through oneDNN, which honours ONEDNN_MAX_CPU_ISA (and
    its old name DNNL_MAX_CPU_ISA): a deployment capped below VNNI runs OpenVINO's INT8
    kernels as a CPU without it; onnxruntime's kernels do not read it."""
    vnni_cpu = "flags\t\t: avx2 avx512f avx512_vnni\n"
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        features = cpu_features(vnni_cpu, environ={name: cap})
        assert features.has_vnni("openvino") is openvino_vnni
        assert features.has_vnni("onnxruntime") is True
        assert ("capped at" in features.describe()) is (cap not in ("ALL", ""))

"""The CPU an INT8 file is checked on, as its runtimes' 8-bit kernels see it (docs/int8.md,
"Every x86 CPU"): whether they have VNNI, whose dot products accumulate in 32 bits, or add
u8 x s8 pairs in 16 bits and can saturate. The report names it (``int8.cpu``), and the checks
put a runtime's departure from the file's own arithmetic down to saturation only where that
runtime's kernels lack VNNI.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from bnrecal.service.report_part import ReportPart

VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
"""The CPU flags (Linux's names) of the 8-bit dot-product instructions that accumulate in 32
bits. Without one of them the runtimes' INT8 kernels multiply u8 x s8 with ``VPMADDUBSW``,
which adds each pair of products in 16 bits and saturates past 32,767 (onnxruntime's
documented U8S8 "saturation issue", OpenVINO's alike): full 8-bit weights can, 7-bit weights
cannot (255 x 64 x 2 = 32,640)."""

ISA_FLAGS = ("sse4_2", "avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
"""The flags the report names: what the INT8 kernels can dispatch to."""

ISA_CAPS_WITHOUT_VNNI = frozenset({"SSE41", "AVX", "AVX2", "AVX512_CORE", "AVX512_MIC", "AVX512_MIC_4OPS"})
"""oneDNN's ``ONEDNN_MAX_CPU_ISA`` caps (OpenVINO's CPU plugin honours them) that leave out
every VNNI instruction: a deployment so capped runs OpenVINO's INT8 kernels as a CPU without VNNI."""


class CpuFeatures(ReportPart):
    """The CPU the INT8 checks ran on (``int8.cpu``): its model, the ISA flags its INT8 kernels
    can use, whether it has VNNI, and oneDNN's ISA cap where one is set for OpenVINO."""

    OMIT_WHEN_NONE = frozenset({"openvino_isa_cap"})

    model: str
    flags: list[str]
    vnni: bool
    openvino_isa_cap: str | None = None

    def has_vnni(self, runtime: str) -> bool:
        """Whether ``runtime``'s INT8 kernels use VNNI here (OpenVINO's may be capped below it)."""
        if runtime == "openvino" and self.openvino_isa_cap is not None:
            return self.vnni and self.openvino_isa_cap not in ISA_CAPS_WITHOUT_VNNI
        return self.vnni

    def describe(self) -> str:
        """``Intel Xeon ... (avx2, avx512f, avx512_vnni)``, and a cap: the console's words."""
        said = f"{self.model} ({', '.join(self.flags) or 'no SSE4.2 or AVX flags'}"
        if not self.vnni:
            said += ", no VNNI"
        if self.openvino_isa_cap is not None:
            said += f"; OpenVINO capped at {self.openvino_isa_cap}"
        return said + ")"


def cpu_features(cpuinfo: str | None = None, environ: Mapping[str, str] | None = None) -> CpuFeatures:
    """This machine's CPU as its INT8 kernels see it. ``cpuinfo`` is ``/proc/cpuinfo``'s text
    (read when not given); where it names no flags (or cannot be read) the CPU is taken to have
    VNNI, so that a large difference fails the file instead of being put down to saturation.
    ``environ`` (default ``os.environ``) may cap OpenVINO's ISA (``ONEDNN_MAX_CPU_ISA``)."""
    import os

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    model = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "model name" and not model:
            model = value.strip()
    environ = os.environ if environ is None else environ
    cap = environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA")
    return CpuFeatures(
        model=model or "unknown CPU",
        flags=[flag for flag in ISA_FLAGS if flag in flags],
        vnni=not flags or bool(flags.intersection(VNNI_FLAGS)),
        openvino_isa_cap=cap.strip().upper() if cap and cap.strip().upper() not in ("ALL", "DEFAULT") else None,
    )

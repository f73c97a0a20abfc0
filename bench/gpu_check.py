"""The GPU check's measurements, run by ``bench/gpu_check.sh`` on one CUDA GPU.

1. The calibration pass on CUDA against ``torch.optim.swa_utils.update_bn`` and a plain
   eval forward: torchvision resnet50 with random weights and stale BN statistics,
   3x224x224, ``--samples`` samples (1024) in batches of 128, held in host memory and
   read through a ``DataLoader`` as a user's script reads them. Each contender runs in
   this process after one warm-up batch; bnrecal is ``bnrecal.recalibrate(model, loader,
   device="cuda")`` (one NCCL rank on an embedded Ray): its calibration pass is the
   report's ``seconds`` (on the rank), its whole call beside it. The statistics of both
   are held against a float64 reference computed here on the GPU (every value each BN
   layer sees, in training-mode BN, summed in float64), independent of the engine.
2. Device-side JPEG decode (nvJPEG through ``workers.data.reading.device_decode``) against the
   CPU path (PIL), on ``--photos`` crops of scikit-learn's two sample photos saved without
   chroma subsampling (decoded on the GPU) and with it (4:2:0, routed to the CPU path):
   time, how far the crops are apart in levels of 255, and for 4:2:0 what nvJPEG would
   have done to them and to resnet50's BN statistics (beside the sampling noise).

``--device cpu`` runs the same measurements on the CPU: a dry run of this script on a
machine without a GPU (the shell script never asks for it).

Prints one table (markdown), with the GPU tests' summary first when ``--tests`` names
pytest's junit file, and writes the same figures as JSON to ``--json``.

    python bench/gpu_check.py [--samples 1024] [--photos 512] [--tests gpu-tests.xml] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.shards writes the photos
DEVICE = torch.device("cuda")


def stale_resnet50() -> nn.Module:
    """resnet50 with random weights and BN statistics far from its data's (the stale model)."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.2, 0.2)
    return model


def float64_reference(model: nn.Module, loader: DataLoader) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each BN layer's mean and unbiased variance over every value it sees, the model run
    in float64 on the GPU with its BN layers in training mode (batch statistics), streamed
    as per-channel float64 sums."""
    reference = copy.deepcopy(model).double().to(DEVICE).eval()
    sums: dict[str, list[torch.Tensor | int]] = {}
    for name, module in reference.named_modules():
        if isinstance(module, _BatchNorm):
            module.training = True
            sums[name] = [0, 0.0, 0.0]

            def keep(mod: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                x = args[0].transpose(0, 1).reshape(args[0].shape[1], -1)
                acc = sums[name]
                acc[0] += x.shape[1]
                acc[1] = acc[1] + x.sum(1)
                acc[2] = acc[2] + (x * x).sum(1)

            module.register_forward_pre_hook(keep)
    with torch.no_grad():
        for (batch,) in loader:
            reference(batch.to(DEVICE).double())
    out = {}
    for name, (n, s, q) in sums.items():
        mean = s / n
        out[name] = (mean.cpu(), ((q - n * mean * mean) / (n - 1)).cpu())
    return out


def errors(model: nn.Module, exact: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """The largest relative error of ``running_var`` and the largest error of
    ``running_mean`` in units of the true standard deviation, over every layer."""
    var_err = mean_err = 0.0
    for name, (mean, var) in exact.items():
        layer = model.get_submodule(name)
        var_err = max(var_err, ((layer.running_var.double().cpu() - var).abs() / var).max().item())
        mean_err = max(mean_err, ((layer.running_mean.double().cpu() - mean).abs() / var.sqrt()).max().item())
    return var_err, mean_err


def timed(run: Callable[[], object]) -> tuple[float, object]:
    """Seconds to run ``run`` with the GPU's queue drained before and after."""
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    result = run()
    sync()
    return time.perf_counter() - started, result


def calibration(samples: int, batch: int, profile: Path | None = None) -> list[tuple[str, str, str]]:
    """Rows for the calibration pass against update_bn and a plain eval forward."""
    from torch.optim.swa_utils import update_bn

    import bnrecal
    from bnrecal.workers.engine.statistics_pass import full_float32

    stale = stale_resnet50()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 3, 224, 224, generator=generator) * 0.8 + 0.3
    loader = DataLoader(TensorDataset(x), batch_size=batch)
    warm = x[:batch].to(DEVICE)

    def forward() -> None:
        with torch.no_grad():
            for (b,) in loader:
                plain(b.to(DEVICE, non_blocking=True))

    plain = copy.deepcopy(stale).to(DEVICE)
    with torch.no_grad():
        plain(warm)
    forward_s, _ = timed(forward)
    with full_float32(DEVICE):
        with torch.no_grad():
            plain(warm)
        exact_forward_s, _ = timed(forward)

    swa = copy.deepcopy(stale).to(DEVICE)
    update_bn([(warm,)], copy.deepcopy(swa), device=DEVICE)  # warm-up on a throwaway copy
    update_bn_s, _ = timed(lambda: update_bn(loader, swa, device=DEVICE))

    ours = copy.deepcopy(stale).to(DEVICE)
    call_s, report = timed(lambda: bnrecal.recalibrate(ours, loader, device=DEVICE.type, progress=False))
    pass_s = float(report.seconds or 0.0)
    if profile is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
        with profiler(activities=activities) as prof:
            bnrecal.recalibrate(copy.deepcopy(stale).to(DEVICE), loader, device=DEVICE.type, progress=False)
        key = "self_cuda_time_total" if DEVICE.type == "cuda" else "self_cpu_time_total"
        profile.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n"
                           + prof.key_averages().table(sort_by=key, row_limit=25))

    exact = float64_reference(stale, loader)
    rows = [
        (f"eval forward ({DEVICE.type}, floor)", f"{forward_s:.2f} s", "1.00x"),
        ("eval forward, full float32 (the pass's floor)", f"{exact_forward_s:.2f} s",
         f"{exact_forward_s / forward_s:.2f}x; TF32 off, as the pass runs"),
        (f"update_bn ({DEVICE.type})", f"{update_bn_s:.2f} s", f"{update_bn_s / forward_s:.2f}x the forward"),
        (f"bnrecal calibration pass (1 {report.backend} rank)", f"{pass_s:.2f} s",
         f"{pass_s / exact_forward_s:.2f}x the float32 forward, {pass_s / update_bn_s:.2f}x update_bn"),
        ("bnrecal.recalibrate whole call", f"{call_s:.2f} s", "Ray start-up and the rank's included"),
    ]
    for label, model in (("update_bn", swa), ("bnrecal", ours)):
        var_err, mean_err = errors(model, exact)
        rows.append((f"{label} vs float64: var rel. err, mean err (std)", f"{var_err:.2e}, {mean_err:.2e}", ""))
    rows.append(("report", f"backend {report.backend}, device {report.device}",
                 f"{report.samples} samples, {report.steps} steps, {len(report.layers)} BN layers"))
    return rows


def differences(a: torch.Tensor, b: torch.Tensor) -> str:
    """How far two uint8 images (or batches) are apart, in levels of 255."""
    diff = (a.int() - b.int()).abs().float()
    return (f"max {diff.max().item():.0f}, mean {diff.mean().item():.3f}, "
            f"{(diff > 1).float().mean().item() * 100:.2f}% over 1")


def statistics_gap(model: nn.Module, a: torch.Tensor, b: torch.Tensor) -> str:
    """How far resnet50's exact BN statistics over samples ``a`` are from those over ``b``:
    per layer the channels' average relative difference of the variance and average
    difference of the mean in units of the standard deviation; the worst layer's."""
    exact_a = float64_reference(model, DataLoader(TensorDataset(a), batch_size=128))
    exact_b = float64_reference(model, DataLoader(TensorDataset(b), batch_size=128))
    var = max(((exact_a[k][1] - v).abs() / v).mean().item() for k, (_, v) in exact_b.items())
    mean = max(((exact_a[k][0] - m).abs() / v.sqrt()).mean().item() for k, (m, v) in exact_b.items())
    return f"var {var:.2e}, mean {mean:.2e} std"


def nvjpeg_crops(items: list[tuple[str, bytes, int]], transform: object) -> torch.Tensor:
    """Every photo decoded by nvJPEG and cropped on the device, whatever its subsampling
    (what the ranks would do without routing subsampled JPEGs to the CPU path)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from bnrecal.workers.data.reading.device_decode import _crop

    raw = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _, data, _ in items]
    return torch.stack([_crop(image, transform).cpu() for image in decode_jpeg(raw, mode=ImageReadMode.RGB, device=DEVICE)])


def device_decode(count: int) -> list[tuple[str, str, str]]:
    """Rows for JPEG decode on the GPU against the CPU path: photos without chroma subsampling
    (decoded on the device), photos with it (4:2:0, routed to the CPU path), and what nvJPEG
    on those would do to the crops and to resnet50's BN statistics."""
    from bnrecal.workers.data import ReadOptions, describe_dataset
    from bnrecal.workers.data.reading.device_decode import DeviceDecoded
    from tests.shards import folder_order, photos, write_folder

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in ("4:4:4", "4:2:0"):
            items = photos(count, size=320, subsampling=name)
            root = Path(folder) / name.replace(":", "")
            write_folder(root, items)
            spec = describe_dataset(root, ReadOptions(transform={"resize": 256, "crop": 224}))
            cpu, gpu = spec.open(), DeviceDecoded(spec.open(), DEVICE)
            gpu.load_kept(0, 8)  # nvJPEG's handle and the kernels' first launch
            cpu_s, on_cpu = timed(lambda: cpu.load_kept(0, count))
            gpu_s, on_gpu = timed(lambda: gpu.load_kept(0, count))
            route = "nvJPEG" if name == "4:4:4" else "routed to the CPU path"
            rows += [
                (f"JPEG {name}, {count} photos, decode + resize + crop: CPU path", f"{cpu_s:.2f} s", "one process"),
                (f"... on a {DEVICE.type} rank ({route})", f"{gpu_s:.2f} s",
                 f"{cpu_s / gpu_s:.1f}x; crops vs CPU path: {differences(on_gpu, on_cpu)}"),  # type: ignore[arg-type]
            ]
        forced = nvjpeg_crops(folder_order(items), spec.transform)  # the folder's order, as the crops above
    as_cpu = cpu.from_kept(on_cpu)  # type: ignore[arg-type]
    model = stale_resnet50()
    half = count // 2
    return rows + [
        ("if 4:2:0 went through nvJPEG: crops vs CPU path", differences(forced, on_cpu), "chroma upsampling"),  # type: ignore[arg-type]
        ("... resnet50 BN statistics, nvJPEG vs CPU crops", statistics_gap(model, cpu.from_kept(forced), as_cpu),
         "worst layer's channel average"),
        ("... for scale: CPU crops, one half vs the other", statistics_gap(model, as_cpu[:half], as_cpu[half : 2 * half]),
         "sampling noise of half the photos"),
    ]


def test_rows(path: Path) -> list[tuple[str, str, str]]:
    """The GPU tests' summary from pytest's junit file: counts, and each failure's name."""
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failures = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    rows = [("gpu-marked tests", f"{total - failures - skipped} passed",
             f"{failures} failed, {skipped} skipped, {float(suite.get('time', 0)):.0f} s")]
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            rows.append(("  FAILED", case.get("name", "?"), case.get("classname", "")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--photos", type=int, default=512)
    parser.add_argument("--tests", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--profile", type=Path, help="write torch.profiler's tables of one more bnrecal call here")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check")
        return
    rows: list[tuple[str, str, str]] = []
    if args.tests is not None and args.tests.exists():
        rows += test_rows(args.tests)
    for part in (lambda: calibration(args.samples, args.batch, args.profile), lambda: device_decode(args.photos)):
        try:
            rows += part()
        except Exception as exc:  # a failed part is a row of the table, the others still run
            rows.append(("FAILED", type(exc).__name__, str(exc).splitlines()[0][:160] if str(exc) else ""))
            import traceback

            traceback.print_exc()
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (dry run)"
    print(f"\n## GPU check: {name}, torch {torch.__version__}, cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}\n")
    print("| check | result | detail |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

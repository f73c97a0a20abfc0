"""The whole job against the statistics alone and against the sum of its passes, as a user
runs them: fresh processes of ``bnrecal calibrate --workers 2`` on real photos, once for the
statistics only and once with ``--eval-data`` (the same photos), ``--onnx`` and
``--onnx-int8``.

The photos are crops of the two sample images that ship with scikit-learn, recoloured per
crop and encoded as JPEG (``tests/shards.py``), in class folders, read with the ImageNet
transform at 224 by a torchvision resnet18 (10 classes, random weights, stale statistics).
Rounds run the two commands in turn, so each whole job is paired with the statistics-only
job of its round: the ratio printed is the median over rounds of whole / statistics (the
target at 256-400 photos: 2.0x at most).

For larger sets, where start-up no longer counts, the whole job is held to the sum of what
it must do beyond the statistics, each measured here in a fresh process of its own on the
same photos, decoded before the clock starts (the job decodes each photo once): one plain
PyTorch eval forward per FP32 model evaluated (the recalibrated and the stale one), one
onnxruntime pass of the INT8 file per INT8 model evaluated (the file and the stale one), and
onnxruntime's quantizer once per INT8 model written (``quant_pre_process``, then
``quantize_static`` given one batch, so its own range pass costs next to nothing). The
target: the whole job within 1.15x of the statistics-only job plus that sum. The whole job's
``timeline`` (docs/report.md) from the last round shows where its time went.

``--bnrecal`` runs another checkout's command (its venv's ``bnrecal``), so the same bench
measures an older commit beside this one. ``--int8`` gives the whole job's INT8 options
(``'{"method": "entropy"}'``: onnxruntime's entropy search, the INT8 phase's heaviest work);
the last lines sum the timeline by where it ran, the job's host against its ranks:

    .venv/bin/python bench/whole_job.py [--photos 256] [--rounds 2] [--bnrecal PATH] [--int8 JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fresh_process import user_environment  # bench/fresh_process.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
TRANSFORM = '{"resize": 256, "crop": 224}'
BATCH = 32
MODELS = 2  # the recalibrated model and the stale one: each evaluated in FP32 and INT8, each quantized


def prepare(folder: Path, photos: int) -> tuple[Path, Path]:
    """The photos in class folders and a resnet18 checkpoint whose BN statistics are stale."""
    import torch
    import torchvision

    sys.path.insert(0, str(ROOT))
    from tests.shards import photos as make_photos
    from tests.shards import write_folder

    images = write_folder(folder / "photos", make_photos(photos, size=256, classes=10))
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    checkpoint = folder / "stale.pt"
    torch.save(model.state_dict(), checkpoint)
    return images, checkpoint


def run(command: list[str]) -> float:
    """Wall seconds of one fresh process, which must succeed."""
    environment = user_environment()
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds


def baseline(part: str, folder: Path) -> float:
    """One baseline in a fresh process of this script: the seconds it printed."""
    done = subprocess.run([sys.executable, __file__, "--baseline", part, "--folder", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"baseline {part} failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def measure_baseline(part: str, folder: Path) -> float:
    """Run one baseline here (the child's side of ``baseline``): decode the photos first,
    then time only the work: a PyTorch eval forward, an onnxruntime INT8 pass, or the quantizer."""
    import numpy as np
    import torch

    from bnrecal.workers.data import ReadOptions, describe_dataset

    torch.set_num_threads(os.cpu_count() or 1)
    dataset = describe_dataset(folder / "photos", ReadOptions(transform=json.loads(TRANSFORM)))
    with dataset.open() as data:
        samples = data.load(0, dataset.num_samples)
    batches = [samples[i : i + BATCH] for i in range(0, len(samples), BATCH)]
    if part == "eval-forward":
        import torchvision

        model = torchvision.models.resnet18(weights=None, num_classes=10)
        model.load_state_dict(torch.load(folder / "stale.pt"))
        model.eval()
        started = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                model(batch)
        return time.perf_counter() - started
    import onnxruntime as ort

    if part == "int8-pass":
        options = ort.SessionOptions()
        options.intra_op_num_threads = os.cpu_count() or 1
        session = ort.InferenceSession(str(folder / "m-int8.onnx"), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        started = time.perf_counter()
        for batch in batches:
            session.run(None, {name: batch.numpy()})
        return time.perf_counter() - started
    assert part == "quantizer"
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quant_pre_process, quantize_static

    class OneBatch(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([{"input": samples[:8].numpy().astype(np.float32)}])

        def get_next(self) -> dict | None:
            return next(self.feeds, None)

    started = time.perf_counter()
    quant_pre_process(str(folder / "m.onnx"), str(folder / "m-pre.onnx"))
    quantize_static(str(folder / "m-pre.onnx"), str(folder / "m-static.onnx"), OneBatch(), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bnrecal", default=str(Path(sys.executable).with_name("bnrecal")),
                        help="the bnrecal command to time (another checkout's venv to compare)")
    parser.add_argument("--int8", help="the whole job's --int8 options (JSON)")
    parser.add_argument("--baseline", choices=["eval-forward", "int8-pass", "quantizer"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:
        print(f"{measure_baseline(args.baseline, args.folder):.4f}")
        return
    print(f"{args.bnrecal}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="bnrecal-whole-job-") as temp:
        folder = Path(temp)
        images, checkpoint = prepare(folder, args.photos)
        base = [args.bnrecal, "calibrate", "--arch", "torchvision:resnet18", "--model-kwargs", '{"num_classes": 10}',
                "--checkpoint", str(checkpoint), "--data", str(images), "--workers", "2", "--batch-size", str(BATCH),
                "--transform", TRANSFORM, "--out", str(folder / "out.pt")]
        whole = [*base, "--eval-data", str(images), "--onnx", str(folder / "m.onnx"),
                 "--onnx-int8", str(folder / "m-int8.onnx"), "--report", str(folder / "report.json"),
                 *(["--int8", args.int8] if args.int8 else [])]
        times: dict[str, list[float]] = {"statistics": [], "whole job": []}
        for round_ in range(args.rounds):
            for name, command in (("statistics", base), ("whole job", whole)):
                times[name].append(run(command))
                print(f"  round {round_ + 1}: {name:10s} {times[name][-1]:6.1f} s", flush=True)
        parts = {part: baseline(part, folder) for part in ("eval-forward", "int8-pass", "quantizer")}
        report = json.loads((folder / "report.json").read_text())
    stats, whole_time = statistics.median(times["statistics"]), statistics.median(times["whole job"])
    ratios = [w / s for w, s in zip(times["whole job"], times["statistics"])]
    print(f"statistics only: median {stats:.1f} s")
    print(f"whole job:       median {whole_time:.1f} s")
    print(f"whole / statistics: {statistics.median(ratios):.2f}x (per round: {', '.join(f'{r:.2f}' for r in ratios)})")
    floor = stats + MODELS * sum(parts.values())
    print(f"each alone, fresh processes: PyTorch eval forward {parts['eval-forward']:.2f} s, onnxruntime INT8 pass "
          f"{parts['int8-pass']:.2f} s, quantizer {parts['quantizer']:.2f} s (each x{MODELS})")
    print(f"whole / (statistics + {MODELS} eval forwards + {MODELS} INT8 passes + {MODELS} quantizers = {floor:.1f} s): "
          f"{whole_time / floor:.2f}x")
    print(f"that sum alone is {floor / stats:.2f}x the statistics: no whole job that runs those passes beats it")
    for entry in report.get("timeline", []):
        print(f"  {entry['phase']:45s} {entry['seconds']:7.2f} s  {entry['samples']:6d} samples  "
              f"{entry['passes']} passes  {entry['where']}")
    where: dict[str, float] = {}
    for entry in report.get("timeline", []):
        where[entry["where"]] = where.get(entry["where"], 0.0) + entry["seconds"]
    print("  by where it ran: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in sorted(where.items())))
    decoding = report.get("decoding")
    if decoding is not None:  # an older checkout's report has none
        print(f"samples decoded by the ranks: {decoding['decoded']} for {report['samples']} distinct samples "
              f"(calibration and evaluation alike; {decoding['reused']} reads from what they kept)")
    print(f"after: load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

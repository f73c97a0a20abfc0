"""INT8: onnxruntime latency of the QDQ file against the folded FP32, and range collection
on K Ray ranks against onnxruntime's own single-process ``quantize_static``.

Each mode is one fresh process, so a whole-process timer (``/usr/bin/time -v``, or a pair
of them run in turn) measures it the way a user meets it:

    .venv/bin/python bench/int8.py prepare DIR            # the digits demo's model, FP32 export, data
    .venv/bin/python bench/int8.py ranks DIR --workers 2  # bnrecal: pre-process, ranges on 2 ranks, QDQ, top-1
    .venv/bin/python bench/int8.py ort DIR                # quantize_static on the same model and data, top-1
    .venv/bin/python bench/int8.py latency DIR            # FP32 vs INT8 in onnxruntime, batch 1 and 8
    .venv/bin/python bench/int8.py compare DIR            # bnrecal's targets vs quantize_static vs NNCF
    .venv/bin/python bench/int8.py weights DIR            # 7-bit vs 8-bit weights (and U8U8), with and without VNNI

``prepare`` recalibrates the demo's stale resnet18 (``service.demo``) with torch's ``update_bn``, exports it
folded (``DIR/fp32.onnx``) and also exports a torchvision resnet18 at 3x224x224 (random
weights, BN statistics from a train-mode pass; ``DIR/fp32-224.onnx``) for latency at a size
where compute, not overhead, dominates. ``ranks`` and ``ort`` append one JSON line (mode,
seconds, top-1 on the demo's held-out scans) to ``DIR/results.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BATCH = 64


def prepare(folder: Path) -> None:
    """Demo inputs, the recalibrated demo model's folded export, and a 224x224 resnet18's."""
    import torch
    import torchvision

    from bnrecal.service.demo import write_demo_inputs
    from bnrecal.service.export import export_folded_onnx

    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = folder / "resnet18-stale.pt"
    if not all((folder / name).exists() for name in ("resnet18-stale.pt", "calib.npy", "eval.npz")):
        checkpoint = write_demo_inputs(folder).checkpoint  # else the demo's inputs, copied in, are used
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    calib = torch.from_numpy(np.load(folder / "calib.npy"))
    torch.optim.swa_utils.update_bn([(calib[i : i + BATCH],) for i in range(0, len(calib), BATCH)], model)
    export_folded_onnx(model.eval(), calib[:8], folder / "fp32.onnx")
    torch.manual_seed(0)
    large = torchvision.models.resnet18()
    large.train()
    with torch.no_grad():
        large(torch.randn(16, 3, 224, 224))
    export_folded_onnx(large.eval(), torch.randn(8, 3, 224, 224), folder / "fp32-224.onnx")


def _evaluation(folder: Path):
    from bnrecal.service.export.int8.checks import LabelledBatches

    held = np.load(folder / "eval.npz")
    x, y = held["x"].astype(np.float32), held["y"].astype(np.int64)
    return LabelledBatches([x[i : i + BATCH] for i in range(0, len(x), BATCH)],
                           [y[i : i + BATCH] for i in range(0, len(y), BATCH)])


def accuracy(model: bytes, held) -> dict[str, float]:
    """Top-1 of an ONNX model on the labelled batches, in onnxruntime (the bench's own count)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    right = total = 0
    for x, y in zip(held.batches, held.labels):
        scores = session.run(None, {name: x})[0]
        right += int((scores.argmax(axis=1) == y).sum())
        total += len(y)
    return {"top1": right / total}


def _record(folder: Path, entry: dict) -> None:
    with (folder / "results.jsonl").open("a") as out:
        out.write(json.dumps(entry) + "\n")
    print(json.dumps(entry))


def _reader(calib: np.ndarray, batch: int):
    """onnxruntime's calibration data reader over ``calib`` in batches of ``batch``."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"input": calib[i : i + batch]} for i in range(0, len(calib), batch)])

        def get_next(self) -> dict | None:
            return next(self.batches, None)

    return Reader()


def ranks(folder: Path, workers: int) -> None:
    """bnrecal's path: pre-process, ranges on ``workers`` Ray ranks (embedded Ray), QDQ, top-1."""
    started = time.perf_counter()
    from bnrecal.workers.data import describe_dataset

    from bnrecal.service.export.int8.options import Int8Options
    from bnrecal.service.run.cluster import ensure_ray
    from bnrecal.service.run.executors import on_ranks
    from bnrecal.service.run.outputs.int8 import quantize_export
    from bnrecal.service.settings import Settings

    ensure_ray(None, min_cpus=workers)
    dataset = describe_dataset(folder / "calib.npy")
    gather = on_ranks(dataset, BATCH, workers, "cpu", Settings())
    verify = np.load(folder / "calib.npy", mmap_mode="r")[:8]
    import torch

    quantized = quantize_export((folder / "fp32.onnx").read_bytes(), Int8Options(), gather, torch.from_numpy(
        np.array(verify)))
    (folder / f"int8-k{workers}.onnx").write_bytes(quantized.model)
    top1 = accuracy(quantized.model, _evaluation(folder))["top1"]
    _record(folder, {"mode": f"ranks-k{workers}", "seconds": time.perf_counter() - started, "top1": top1,
                     "range_seconds": quantized.section.range_seconds})


def ort(folder: Path) -> None:
    """onnxruntime's own: ``quant_pre_process`` then ``quantize_static`` (QDQ, MinMax, per
    channel int8 weights, uint8 activations) over the same batches, top-1."""
    started = time.perf_counter()
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_static,
    )

    calib = np.load(folder / "calib.npy").astype(np.float32)

    pre, out = folder / "ort-pre.onnx", folder / "int8-ort.onnx"
    with contextlib.redirect_stdout(io.StringIO()):
        quant_pre_process(str(folder / "fp32.onnx"), str(pre))
        quantize_static(str(pre), str(out), _reader(calib, BATCH), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax)
    top1 = accuracy(out.read_bytes(), _evaluation(folder))["top1"]
    _record(folder, {"mode": "ort-quantize-static", "seconds": time.perf_counter() - started, "top1": top1,
                     "same_bytes_as_ranks": [
                         (folder / f"int8-k{k}.onnx").read_bytes() == out.read_bytes()
                         for k in (1, 2) if (folder / f"int8-k{k}.onnx").exists()]})


def latency(folder: Path, repeats: int, threads: int) -> None:
    """FP32 and INT8 alternately in onnxruntime (full optimizations), median ms per run."""
    import onnxruntime

    from bnrecal.service.export.int8.options import Int8Options
    from bnrecal.service.run.outputs.int8 import quantize_export
    from bnrecal.service.run.outputs.onnx_passes import InProcessPasses
    from bnrecal.workers.data import describe_dataset

    rows = []
    for name, shape in (("fp32.onnx", (3, 16, 16)), ("fp32-224.onnx", (3, 224, 224))):
        fp32 = (folder / name).read_bytes()
        rng = np.random.default_rng(0)
        calib = rng.standard_normal((64, *shape)).astype(np.float32)
        if name == "fp32.onnx":
            calib = np.load(folder / "calib.npy")[:256].astype(np.float32)
        np.save(folder / "latency-calib.npy", calib)
        import torch

        int8 = quantize_export(fp32, Int8Options(), InProcessPasses(describe_dataset(folder / "latency-calib.npy"), 32),
                               torch.from_numpy(calib[:8])).model
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        sessions = {kind: onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])
                    for kind, data in (("fp32", fp32), ("int8", int8))}
        for batch in (1, 8):
            feed = calib[:batch] if len(calib) >= batch else np.repeat(calib[:1], batch, axis=0)
            times: dict[str, list[float]] = {"fp32": [], "int8": []}
            for _ in range(3):
                for session in sessions.values():
                    session.run(None, {"input": feed})
            for _ in range(repeats):
                for kind, session in sessions.items():
                    begun = time.perf_counter()
                    session.run(None, {"input": feed})
                    times[kind].append(1000 * (time.perf_counter() - begun))
            fp32_ms, int8_ms = statistics.median(times["fp32"]), statistics.median(times["int8"])
            rows.append(f"| resnet18 {'x'.join(map(str, shape))} | {batch} | {fp32_ms:.2f} | {int8_ms:.2f} | "
                        f"{fp32_ms / int8_ms:.2f}x | {len(fp32) / 2**20:.1f} / {len(int8) / 2**20:.1f} |")
    print(f"onnxruntime {onnxruntime.__version__}, {threads} intra-op thread(s), median of {repeats}\n")
    print("| model | batch | FP32 ms | INT8 ms | speed-up | MiB FP32 / INT8 |\n|---|---|---|---|---|---|")
    print("\n".join(rows))


def _quantizers(folder: Path) -> dict[str, bytes]:
    """The same folded FP32 file quantized by bnrecal (each target; entropy), onnxruntime's
    ``quantize_static`` (MinMax; Entropy at its defaults) and NNCF 3.x's ONNX backend, all
    from the same calibration samples."""
    import torch

    from bnrecal.workers.data import describe_dataset

    from bnrecal.service.export.int8.options import int8_options
    from bnrecal.service.run.outputs.int8 import quantize_export
    from bnrecal.service.run.outputs.onnx_passes import InProcessPasses

    fp32 = (folder / "fp32.onnx").read_bytes()
    calib = np.load(folder / "calib.npy").astype(np.float32)
    dataset, verify = describe_dataset(folder / "calib.npy"), torch.from_numpy(calib[:8])
    files: dict[str, bytes] = {"FP32 (folded)": fp32}
    for label, options in (("bnrecal minmax, target onnxruntime", {}),
                           ("bnrecal entropy (2048/128 bins), target onnxruntime", {"method": "entropy"}),
                           ("bnrecal minmax, target openvino", {"target": "openvino"}),
                           ("bnrecal minmax, target tensorrt", {"target": "tensorrt"})):
        files[label] = quantize_export(fp32, int8_options(options), InProcessPasses(dataset, BATCH), verify).model
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType
    from onnxruntime.quantization import quant_pre_process, quantize_static

    pre = folder / "ort-pre.onnx"
    with contextlib.redirect_stdout(io.StringIO()):
        quant_pre_process(str(folder / "fp32.onnx"), str(pre))
        for label, method in (("quantize_static MinMax", CalibrationMethod.MinMax),
                              ("quantize_static Entropy (its defaults)", CalibrationMethod.Entropy)):
            out = folder / "int8-compare.onnx"
            # one batch: onnxruntime's entropy collector fails on a short last batch
            quantize_static(str(pre), str(out), _reader(calib, len(calib)), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, calibrate_method=method)
            files[label] = out.read_bytes()
    try:
        import nncf
        import onnx
    except ImportError:
        print("nncf is not installed: its row is left out", file=sys.stderr)
        return files
    samples = [calib[i : i + 1] for i in range(len(calib))]
    quantized = nncf.quantize(onnx.load(str(folder / "fp32.onnx")), nncf.Dataset(samples, lambda x: {"input": x}),
                              subset_size=len(samples))
    files[f"NNCF {nncf.__version__} ONNX backend (defaults)"] = quantized.SerializeToString()
    return files


def _openvino_runner(model: bytes):
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(io.BytesIO(model)), "CPU", {"INFERENCE_NUM_THREADS": 1})
    request = compiled.create_infer_request()
    return lambda x: np.array(request.infer({0: x})[compiled.outputs[0]])


def _onnxruntime_runner(model: bytes):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"input": x})[0]


def compare(folder: Path, repeats: int) -> None:
    """Top-1 on the held-out scans and median batch-1 latency of each quantizer's file, in
    onnxruntime and in OpenVINO (CPU, one thread each, dynamic batch), one table."""
    held = np.load(folder / "eval.npz")
    x, y = held["x"].astype(np.float32), held["y"].astype(np.int64)
    rows = []
    for label, model in _quantizers(folder).items():
        cells = []
        for make in (_onnxruntime_runner, _openvino_runner):
            run = make(model)
            scores = np.concatenate([run(x[i : i + 8]) for i in range(0, len(x), 8)])  # batches of 8, as deployed
            top1 = float(np.mean(scores.argmax(axis=1) == y))
            one = x[:1]
            for _ in range(5):
                run(one)
            times = []
            for _ in range(repeats):
                begun = time.perf_counter()
                run(one)
                times.append(1000 * (time.perf_counter() - begun))
            cells.append(f"{top1:.4f} | {statistics.median(times):.3f}")
        rows.append(f"| {label} | {' | '.join(cells)} | {len(model) / 2**20:.2f} |")
    import onnxruntime
    import openvino

    print(f"{len(y)} held-out samples; onnxruntime {onnxruntime.__version__}, OpenVINO {openvino.__version__.split('-')[0]}, "
          f"1 thread, median of {repeats} at batch 1\n")
    print("| file | ORT top-1 | ORT ms | OpenVINO top-1 | OpenVINO ms | MiB |\n|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


_OPENVINO_CHILD = """
import json, statistics, sys, time
import numpy as np
import openvino as ov
data, repeats, models = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
x = np.load(data)["x"].astype(np.float32)
core = ov.Core()
config = {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32"}
runs = []
for model in models:
    compiled = core.compile_model(core.read_model(model), "CPU", config)
    request = compiled.create_infer_request()
    runs.append(lambda batch, r=request, c=compiled: np.array(r.infer({0: batch})[c.outputs[0]]))
found = []
for run in runs:
    scores = np.concatenate([run(x[i : i + 8]) for i in range(0, len(x), 8)])
    found.append({"predicted": scores.argmax(axis=1).tolist() if len(scores) == len(x) else None,
                  "shape": list(scores.shape)})
    for _ in range(5):
        run(x[:1])
times = [[] for _ in runs]
for _ in range(repeats):  # the files in turn, so that each meets the same machine
    for run, spent in zip(runs, times):
        begun = time.perf_counter()
        run(x[:1])
        spent.append(1000 * (time.perf_counter() - begun))
for entry, spent in zip(found, times):
    entry["ms"] = statistics.median(spent)
print(json.dumps(found))
"""
"""OpenVINO in a process of its own, so that oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``) can
make it run as on a CPU without VNNI; every file compiled, then timed in turn."""


def _openvino_measure(models: list[Path], data: Path, repeats: int, without_vnni: bool) -> list[dict]:
    import os
    import subprocess

    env = {name: value for name, value in os.environ.items() if name != "ONEDNN_MAX_CPU_ISA"}
    if without_vnni:
        env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    done = subprocess.run([sys.executable, "-c", _OPENVINO_CHILD, str(data), str(repeats), *map(str, models)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _photo_crops(count: int, size: int, seed: int) -> np.ndarray:
    """``count`` random ``size`` crops of scikit-learn's two sample photos, normalised as
    torchvision's ImageNet models expect."""
    from sklearn.datasets import load_sample_images

    photos = [np.asarray(image, dtype=np.float32) / 255.0 for image in load_sample_images().images]
    rng = np.random.default_rng(seed)
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
    crops = []
    for _ in range(count):
        photo = photos[rng.integers(len(photos))]
        top, left = rng.integers(photo.shape[0] - size), rng.integers(photo.shape[1] - size)
        crops.append(((photo[top : top + size, left : left + size] - mean) / std).transpose(2, 0, 1))
    return np.stack(crops).astype(np.float32)


def weights(folder: Path, repeats: int) -> None:
    """7-bit against 8-bit weights (and onnxruntime's other documented remedy, U8U8: uint8
    weights), against the folded FP32 file, in onnxruntime and OpenVINO, and in OpenVINO as on
    a CPU without VNNI: top-1 and median batch-1 latency (one thread), one table per model.
    The digits model is scored on its held-out labels; the 224x224 resnet18 (random weights)
    on agreement with the FP32 file's top-1 over photo crops."""
    import onnxruntime
    import torch
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    from bnrecal.service.export.cpu import cpu_features
    from bnrecal.service.export.int8.options import int8_options
    from bnrecal.service.export.int8.quantizer import prepare
    from bnrecal.service.run.outputs.int8 import quantize_export
    from bnrecal.service.run.outputs.onnx_passes import InProcessPasses
    from bnrecal.workers.data import describe_dataset

    print(f"CPU: {cpu_features().describe()}; onnxruntime {onnxruntime.__version__}, 1 thread, median of "
          f"{repeats} at batch 1\n")
    cases = [("digits resnet18, 3x16x16, top-1 on 360 held-out scans", "fp32.onnx", None),
             ("torchvision resnet18, 3x224x224, top-1 agreement with FP32 on 64 photo crops", "fp32-224.onnx", 224)]
    for title, name, size in cases:
        fp32 = (folder / name).read_bytes()
        if size is None:
            calib_path, held_path = folder / "calib.npy", folder / "eval.npz"
            labels = np.load(held_path)["y"]
        else:
            calib_path, held_path = folder / "weights-calib.npy", folder / "weights-held.npz"
            np.save(calib_path, _photo_crops(64, size, seed=0))
            held = _photo_crops(64, size, seed=1)
            session = onnxruntime.InferenceSession(fp32, providers=["CPUExecutionProvider"])
            labels = np.concatenate([session.run(None, {"input": held[i : i + 8]})[0].argmax(1)
                                     for i in range(0, len(held), 8)])
            np.savez(held_path, x=held, y=labels)
        calib = np.load(calib_path).astype(np.float32)
        dataset, verify = describe_dataset(calib_path), torch.from_numpy(calib[:8])
        files = {"FP32 (folded)": fp32}
        for label, options in (("bnrecal default: 7-bit weights (reduce_range)", {}),
                               ("bnrecal reduce_range false: 8-bit weights", {"reduce_range": False})):
            files[label] = quantize_export(fp32, int8_options(options), InProcessPasses(dataset, BATCH), verify).model
        pre, out = folder / "weights-pre.onnx", folder / "weights-u8u8.onnx"
        pre.write_bytes(prepare(fp32).model)

        with contextlib.redirect_stdout(io.StringIO()):
            quantize_static(str(pre), str(out), _reader(calib, BATCH), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8,
                            calibrate_method=CalibrationMethod.MinMax)
        files["quantize_static U8U8 (uint8 weights)"] = out.read_bytes()
        print(f"{title}\n")
        print("| file | ORT top-1 | ORT ms | OpenVINO top-1 | OpenVINO ms | OpenVINO without VNNI top-1 | ms | MiB |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        held_x = np.load(held_path)["x"].astype(np.float32)
        paths = []
        for index, model in enumerate(files.values()):
            paths.append(folder / f"weights-model-{index}.onnx")
            paths[-1].write_bytes(model)
        runs = [_onnxruntime_runner(model) for model in files.values()]
        predicted = [np.concatenate([run(held_x[i : i + 8]).argmax(1) for i in range(0, len(held_x), 8)]) for run in runs]
        times: list[list[float]] = [[] for _ in runs]
        for run in runs:
            for _ in range(5):
                run(held_x[:1])
        for _ in range(repeats):  # the files in turn, so that each meets the same machine
            for run, spent in zip(runs, times):
                begun = time.perf_counter()
                run(held_x[:1])
                spent.append(1000 * (time.perf_counter() - begun))
        openvino = [_openvino_measure(paths, held_path, repeats, capped) for capped in (False, True)]
        for index, (label, model) in enumerate(files.items()):
            cells = [f"{np.mean(predicted[index] == labels):.4f} | {statistics.median(times[index]):.3f}"]
            for measured in openvino:
                got = measured[index]
                top1 = (f"{np.mean(np.array(got['predicted']) == labels):.4f}" if got["predicted"] is not None
                        else f"outputs of shape {got['shape']}")
                cells.append(f"{top1} | {got['ms']:.3f}")
            print(f"| {label} | {' | '.join(cells)} | {len(model) / 2**20:.2f} |")
        print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("prepare", "ranks", "ort", "latency", "compare", "weights"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.mode == "prepare":
        prepare(args.folder)
    elif args.mode == "ranks":
        ranks(args.folder, args.workers)
    elif args.mode == "ort":
        ort(args.folder)
    elif args.mode == "compare":
        compare(args.folder, args.repeats)
    elif args.mode == "weights":
        weights(args.folder, args.repeats)
    else:
        latency(args.folder, args.repeats, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``bnrecal sweep --server URL``: the sweep as one job on a bnrecal server (docs/sweeps.md,
"Over HTTP"), its files laid out in ``--out-dir`` as a sweep here lays them out."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from bnrecal.errors import RunError

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.jobserver.records.spec import JobSpec
from bnrecal.service.run.options import RunOptions
from bnrecal.service.sweep.cells import SweepFiles
from bnrecal.service.sweep.matrix import SweepReport

from .console import connect, print_line

ARCHIVE = ".bnrecal-sweep.zip"
"""Where the job's archive is saved in ``--out-dir`` before it is unpacked there (then removed)."""


@dataclass(frozen=True)
class RemoteSweep:
    """A sweep as the command line gave it, and the options of its cells."""

    files: SweepFiles
    options: RunOptions
    rank_by: str
    eval_max_samples: int | None
    outputs: frozenset[str]
    """Each cell's files besides its model and reports (the spec's output names)."""
    int8: Int8Options | None
    onnx_opset: int
    onnx_dtype: str
    cells_at_once: int = 1

    def job(self) -> tuple[JobSpec, dict[str, Path | str]]:
        """The typed job spec, its inputs named by digest (local files, hashed here) or URI,
        and those inputs' sources by spec field."""
        from ..client import input_digests

        models = self.files.models
        kinds = ["program" if model.program else "checkpoint" for model in models]
        inputs: dict[str, Path | str] = {}
        for i, (model, kind) in enumerate(zip(models, kinds, strict=True)):
            source = model.program or model.checkpoint
            assert source is not None
            inputs[f"models[{i}].{kind}"] = source
        for calibration in self.files.sets:
            inputs[f"datasets.{calibration.name}.data"] = calibration.data
            if calibration.eval_data is not None:
                inputs[f"datasets.{calibration.name}.eval.data"] = calibration.eval_data
        named = input_digests(inputs)
        model_specs = [
            {"name": model.name, kind: named[f"models[{i}].{kind}"]} if model.program else
            {"name": model.name, "arch": model.arch, "model_kwargs": model.model_kwargs, kind: named[f"models[{i}].{kind}"]}
            for i, (model, kind) in enumerate(zip(models, kinds, strict=True))
        ]
        datasets = {
            s.name: {"data": named[f"datasets.{s.name}.data"]}
            | ({"eval": {"data": named[f"datasets.{s.name}.eval.data"], "max_samples": self.eval_max_samples}}
               if s.eval_data is not None else {})
            for s in self.files.sets
        }
        index = {model.name: i for i, model in enumerate(models)}
        spec = JobSpec.checked(  # checked here as the server checks its fields (a SpecError names one)
            **self.options.run_options(), models=model_specs, datasets=datasets,
            outputs=[kind for kind in ("checkpoint", "program") if kind in kinds]
            + sorted(self.outputs),
            onnx={"opset": self.onnx_opset, "dtype": self.onnx_dtype}, rank_by=self.rank_by,
            cells_at_once=self.cells_at_once, int8=self.int8,
            pairs=sorted([index[model], set_name] for model, set_name in self.files.pairs)
            if self.files.pairs is not None else None,
        )
        return spec, inputs


def sweep_on_server(sweep: RemoteSweep, server: str, api_key: str | None, out_dir: Path) -> SweepReport:
    """Run the sweep as one job on ``server``: checked there first (a bad sweep is refused
    before any upload), the files it lacks uploaded once each, the job followed to its end,
    and its archive unpacked into ``out_dir``. The matrix report; a sweep some of whose cells
    failed is returned as well (its good cells' files are written), one that failed whole raises."""
    from bnrecal.service.run.progress import progress_bar

    from ..client import run_remote_job
    from .remote import cancel_on_interrupt

    spec, inputs = sweep.job()
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / ARCHIVE
    with connect(server, api_key) as client:
        def submitted(job: Any) -> None:
            print_line(f"job {job.id} queued on {client.server}")

        job = run_remote_job(
            client, spec, inputs,
            follow=progress_bar, downloads=lambda job: [("archive", archive)], on_submitted=submitted,
            on_interrupt=lambda job_id: cancel_on_interrupt(client, job_id), keep_failed=True,
        )
    try:
        _unpack(archive, out_dir)
    finally:
        archive.unlink(missing_ok=True)
    if job.report is None:
        raise RunError(f"job {job.id} on {server} left no sweep report")
    return SweepReport.model_validate(job.report)


def _unpack(archive: Path, out_dir: Path) -> None:
    """Unpack the job's archive into ``out_dir``, refusing any name that would land outside it."""
    with zipfile.ZipFile(archive) as opened:
        for name in opened.namelist():
            path = PurePosixPath(name)
            if path.is_absolute() or ".." in path.parts:
                raise RunError(f"the server's archive names {name!r}, outside the sweep's folder")
        opened.extractall(out_dir)

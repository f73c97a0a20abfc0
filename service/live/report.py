"""The report ``bnrecal.recalibrate`` returns: the run's typed report, readable at a glance."""

from __future__ import annotations

import os
from typing import Any

from bnrecal.service.run.report.document import Report, write_report


class RecalibrationReport(Report):
    """The run report (docs/report.md): the typed :class:`~bnrecal.service.run.report.document.Report`
    the run core builds, read by attribute (``report.samples``) or by ``report.json``'s
    keys (``report["samples"]``), whose ``repr`` is a short summary; :meth:`save`
    writes it as ``report.json``."""

    @classmethod
    def of(cls, report: Report) -> RecalibrationReport:
        """The same report (its parts shared, not copied), with the Python API's summary and ``save``."""
        return cls.model_validate({**report.__dict__, **(report.__pydantic_extra__ or {})})

    def summary(self) -> str:
        """A few lines: what ran where, and the layers whose statistics moved most."""
        lines = [
            f"recalibrated {len(self.layers)} BN layers on {self.samples} samples in "
            f"{self.steps} steps ({self.world_size} x {self.backend}, {self.mode}, "
            f"{self.device}) in {self.seconds or 0:.2f} s"
        ]
        layers = sorted(self.layers, key=lambda layer: -(layer.mean_shift or 0))
        for layer in layers[:5]:
            lines.append(
                f"  {layer.name}: mean shift {_number(layer.mean_shift)} std, "
                f"var ratio {_number(layer.var_ratio_min)}..{_number(layer.var_ratio_max)}"
            )
        if len(layers) > 5:
            lines.append(f"  ... {len(layers) - 5} more layers")
        for skipped in self.skipped:
            lines.append(f"  skipped {skipped.name}: {skipped.reason}")
        return "\n".join(lines)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the report as ``report.json`` (indented JSON, atomically)."""
        write_report(self, path)

    def __repr__(self) -> str:
        return f"<RecalibrationReport\n{self.summary()}\n>"

    def __str__(self) -> str:
        """What ``print(report)`` shows: the short summary (docs/python.md), not pydantic's
        every field (several thousand characters for a resnet)."""
        return repr(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython / Jupyter
        printer.text(self.summary())


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"

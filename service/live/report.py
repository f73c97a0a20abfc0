"""The report ``bnrecal.recalibrate`` returns: ``report.json``'s fields, readable at a glance."""

from __future__ import annotations

import os
from typing import Any

from bnrecal.service.run.report import write_report


class RecalibrationReport(dict[str, Any]):
    """The run report (contract section 5; docs/report.md): a ``dict`` with the same keys as
    ``report.json`` (``mode``, ``world_size``, ``samples``, ``steps``, ``layers``...), whose
    ``repr`` is a short summary; :meth:`save` writes it as ``report.json``."""

    def summary(self) -> str:
        """A few lines: what ran where, and the layers whose statistics moved most."""
        lines = [
            f"recalibrated {len(self.get('layers', []))} BN layers on {self.get('samples')} samples in "
            f"{self.get('steps')} steps ({self.get('world_size')} x {self.get('backend')}, {self.get('mode')}, "
            f"{self.get('device')}) in {self.get('seconds', 0):.2f} s"
        ]
        layers = sorted(self.get("layers", []), key=lambda layer: -(layer.get("mean_shift") or 0))
        for layer in layers[:5]:
            lines.append(
                f"  {layer['name']}: mean shift {_number(layer.get('mean_shift'))} std, "
                f"var ratio {_number(layer.get('var_ratio_min'))}..{_number(layer.get('var_ratio_max'))}"
            )
        if len(layers) > 5:
            lines.append(f"  ... {len(layers) - 5} more layers")
        for skipped in self.get("skipped", []):
            lines.append(f"  skipped {skipped['name']}: {skipped['reason']}")
        return "\n".join(lines)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the report as ``report.json`` (indented JSON, atomically)."""
        write_report(dict(self), path)

    def __repr__(self) -> str:
        return f"<RecalibrationReport\n{self.summary()}\n>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython / Jupyter
        printer.text(self.summary())


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"

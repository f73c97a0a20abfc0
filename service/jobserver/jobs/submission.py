"""A submission checked before a job exists (docs/api.md): the spec's model, blobs, data
paths and URIs, architecture and sweep fields against the tenant's blobs, the settings and
the cluster, each refusal a ``SpecError`` (or the input's own error) naming the field. The
spec's schema is ``spec.JobSpec``, which a client builds without loading any of this."""

from __future__ import annotations

import os
from pathlib import Path

from bnrecal.workers.data.storage.objectstore import parse_data_uri, uri_allowed
from bnrecal.workers.data.shards.listing import expand_braces, has_brace_pattern, is_manifest_name
from bnrecal.workers.data.file_formats import array_sample_shape
from bnrecal.errors import DatasetError, InputError, SpecError
from bnrecal.workers.models.architectures import check_architecture_exists as check_reference
from bnrecal.workers.models.architectures import check_model_kwargs
from bnrecal.workers.models.model_check import check_checkpoint_fits, check_data_fits
from bnrecal.workers.programs import check_program

from bnrecal.service.run.options import check_model_choice
from bnrecal.service.settings import Settings
from bnrecal.service.sweep.cells import check_name
from bnrecal.service.sweep.matrix import check_metric
from bnrecal.service.jobserver.cluster.capacity import Node, check_fits_cluster
from bnrecal.service.jobserver.storage.blobs import BlobStore

from bnrecal.service.export.products import products_of
from bnrecal.service.jobserver.records.spec import DataPath, DataUri, JobSpec


def check_submission(
    spec: JobSpec, tenant: str, blobs: BlobStore, settings: Settings, nodes: list[Node] | None = None
) -> None:
    """Refuse a spec whose model, blobs, data path or architecture cannot work, or whose ranks
    the cluster as it is (``nodes``, as last seen; None: asked now) could never place, naming the field.
    A sweep's models are checked as far as the sweep as a whole goes (their blobs exist, their
    architectures are allowed); what is wrong with one model's file fails its cells alone (docs/sweeps.md)."""
    if spec.is_sweep:
        _check_sweep(spec, settings)
    else:
        if spec.data is None:
            raise SpecError("data: give the calibration data (or datasets, for a sweep)", field="data")
        for name in ("pairs", "rank_by"):
            if getattr(spec, name) is not None:
                raise SpecError(f"{name} goes with a sweep (models or datasets)", field=name)
        if spec.cells_at_once != 1:
            raise SpecError("cells_at_once goes with a sweep (models or datasets)", field="cells_at_once")
        check_model_choice(spec.arch, spec.checkpoint, spec.program, spec.model_kwargs)
        check_model_kwargs(spec.model_kwargs)
        if spec.arch is not None:
            check_architecture(spec.arch, settings)
    _check_outputs(spec)
    check_fits_cluster(spec.model_copy(update={"workers": spec.ranks}), settings, nodes)
    named = spec.input_sources()
    for name, source in named.items():
        if isinstance(source, str) and not blobs.exists(tenant, source):
            raise SpecError(f"{name}: no blob {source} for this API key; upload it to /v1/blobs first", field=name)
        if isinstance(source, DataPath):
            resolve_data_path(source.path, settings, field=f"{name}.path")
        if isinstance(source, DataUri):
            check_data_uri(source.uri, settings, field=f"{name}.uri")
    if spec.transform is not None and len(repr(spec.transform)) > 4096:
        raise SpecError("transform is too large", field="transform")
    if spec.is_sweep:
        return  # a model's file is its cells' to fail on
    if spec.program is not None:
        check_program(blobs.path(tenant, spec.program), blobs.filename(tenant, spec.program) or spec.program)
    if spec.arch is not None and isinstance(spec.checkpoint, str):  # the costliest check last
        check_checkpoint_fits(
            spec.arch, spec.model_kwargs, blobs.path(tenant, spec.checkpoint),
            allowed_modules=tuple(settings.model_modules), max_bytes=settings.max_model_bytes,
            name=blobs.filename(tenant, spec.checkpoint) or spec.checkpoint,
        )
        for name, source in named.items():  # the data the model takes, as cheaply (a forward on meta)
            if name in ("data", "eval.data") and isinstance(source, str):
                check_data_fits(
                    spec.arch, spec.model_kwargs, array_sample_shape(blobs.path(tenant, source)),
                    allowed_modules=tuple(settings.model_modules), field=name, name=blobs.filename(tenant, source) or source,
                )


def _check_sweep(spec: JobSpec, settings: Settings) -> None:
    """A sweep's own fields: models in place of the single model, named sets in place of the
    data, each model's choice and architecture, names, pairs and the ranking metric."""
    if spec.models is not None:
        for name in ("checkpoint", "program"):
            if getattr(spec, name) is not None:
                raise SpecError(f"{name} does not go with models: give each model in models", field=name)
    if spec.datasets is not None:
        for name in ("data", "eval"):
            if getattr(spec, name) is not None:
                raise SpecError(f"{name} does not go with datasets: give each set in datasets", field=name)
    elif spec.data is None:
        raise SpecError("data: give the calibration data, or datasets", field="data")
    names: set[str] = set()
    for index, model in enumerate(spec.sweep_models()):
        where = f"models[{index}]" if spec.models is not None else ""
        arch = model.arch or (None if model.program else spec.arch)
        kwargs = model.model_kwargs if model.model_kwargs is not None else ({} if model.program else spec.model_kwargs)
        try:
            check_model_choice(arch, model.checkpoint, model.program, kwargs)
            check_model_kwargs(kwargs)
            if arch is not None:
                try:
                    check_architecture(arch, settings)
                except InputError as exc:  # its own problem type, the field named in full
                    if where and not isinstance(exc, SpecError):
                        exc.field = f"{where}.arch"  # type: ignore[attr-defined]
                    raise
            if model.name is not None:
                check_name(model.name, "model", "name")
        except SpecError as exc:
            if not where:
                raise
            field_name = f"{where}.{exc.field}" if exc.field else where
            raise SpecError(f"{where}: {exc.message}", field=field_name) from None
        if model.name is not None:
            if model.name in names:
                raise SpecError(f"{where}.name: the name {model.name!r} is given twice", field=f"{where}.name")
            names.add(model.name)
    sets = spec.sweep_sets()
    for name, calibration in sets.items():
        check_name(name, "set", f"datasets.{name}")
        if spec.int8 is not None and spec.int8.max_top1_drop is not None and calibration.eval is None:
            raise SpecError(f"datasets.{name}.eval: int8.max_top1_drop measures top-1 on every set's eval data",
                            field=f"datasets.{name}.eval")
    count = len(spec.sweep_models())
    for index, (model_index, set_name) in enumerate(spec.pairs or []):
        if not 0 <= model_index < count:
            raise SpecError(f"pairs[{index}]: no model {model_index} (models 0-{count - 1})", field=f"pairs[{index}]")
        if set_name not in sets:
            raise SpecError(f"pairs[{index}]: no set named {set_name!r} (sets: {', '.join(sets)})",
                            field=f"pairs[{index}]")
    if spec.rank_by is not None:
        check_metric(spec.rank_by)


def _check_outputs(spec: JobSpec) -> None:
    """The model artifact asked for is the one the model can give: a checkpoint for an
    architecture, a program for a program."""
    wrong = "checkpoint" if spec.program is not None else "program"
    if spec.outputs is not None and wrong in spec.outputs and not spec.is_sweep:  # a sweep's cells: each its own
        have = "program" if spec.program is not None else "checkpoint"
        raise SpecError(f"outputs: a job on a {have} gives a {have}, not a {wrong}", field="outputs")
    asked = products_of(spec.outputs)
    if spec.int8 is not None and not any(product.int8 for product in asked):
        raise SpecError('int8: the INT8 options go with "onnx_int8" or "openvino_int8" in outputs', field="int8")
    openvino = [product.name for product in asked if product.openvino_ir]
    if openvino:
        from bnrecal.service.export.runtimes import openvino_version

        if openvino_version() is None:
            raise SpecError(f"outputs: {openvino[0]} needs OpenVINO on the server (the openvino extra)", field="outputs")
    if spec.int8 is not None and spec.int8.max_top1_drop is not None and spec.eval is None and not spec.is_sweep:
        raise SpecError("int8.max_top1_drop: give eval (labelled data) to measure top-1 on", field="int8.max_top1_drop")


def check_architecture(arch: str, settings: Settings) -> None:
    """Refuse an architecture that cannot be built (outside the allowlist, an unknown name,
    a missing callable) before a job exists; the error suggests close names."""
    check_reference(arch, settings.model_modules)


def resolve_data_path(path: str, settings: Settings, field: str = "data.path") -> Path:
    """The real location of server-side data, which must lie under a configured data root.

    Symlinks are resolved first, so a link cannot lead out of a root. ``field`` names the
    spec field in errors.
    """
    if not settings.data_roots:
        raise SpecError(
            f"{field}: this server reads no server-side paths (the operator sets BNRECAL_DATA_ROOTS); "
            "upload the data to /v1/blobs instead",
            field=field,
        )
    requested = Path(path)
    if not requested.is_absolute():
        raise SpecError(f"{field} must be absolute, got {path!r}", field=field)
    _refuse_manifest(path, field)
    if has_brace_pattern(path):  # shards: every one it names lies under the root its folder lies in
        try:
            names = expand_braces(path)
        except DatasetError as exc:
            raise SpecError(f"{field}: {exc.message}", field=field) from exc
        folder = _under_root(str(requested.parent), settings, field, path)
        for name in names:
            _under_root(name, settings, field, path)
        return folder / requested.name
    return _under_root(path, settings, field, path)


def _under_root(path: str, settings: Settings, field: str, shown: str) -> Path:
    """The real location of ``path`` (symlinks resolved), which must exist under a data root."""
    resolved = Path(os.path.realpath(path))
    for root in settings.data_roots:
        real_root = Path(os.path.realpath(root))
        if resolved == real_root or resolved.is_relative_to(real_root):
            if not resolved.exists():
                missing = shown if path == shown else f"{shown}: {Path(path).name}"
                raise SpecError(f"{field} {missing!r} does not exist", field=field)
            return resolved
    raise SpecError(f"{field} {shown!r} is outside the server's data roots (BNRECAL_DATA_ROOTS)", field=field)


def _refuse_manifest(location: str, field: str) -> None:
    """A manifest names shards anywhere: a server reads only what its roots and prefixes allow,
    so it takes the shards' folder, prefix or brace pattern instead (docs/data.md)."""
    if is_manifest_name(location):
        raise SpecError(
            f"{field}: a server does not read manifests (their lines could name any file or bucket); give the "
            "shards' folder or prefix, or a brace pattern such as train-{000000..000146}.tar",
            field=field,
        )


def check_data_uri(uri: str, settings: Settings, field: str = "data.uri") -> str:
    """The normalised URI of object-storage data, which must lie under a prefix of
    ``BNRECAL_DATA_URIS`` (an open server must not read the operator's whole storage)."""
    normalised = parse_data_uri(uri, field)
    _refuse_manifest(normalised, field)
    if has_brace_pattern(normalised):
        try:
            expand_braces(normalised)  # braces only in the last component: the allowlist check below holds for all
        except DatasetError as exc:
            raise SpecError(f"{field}: {exc.message}", field=field) from exc
    if not settings.data_uris:
        raise SpecError(
            f"{field}: this server reads no object storage (the operator sets BNRECAL_DATA_URIS); "
            "upload the data to /v1/blobs instead",
            field=field,
        )
    if not uri_allowed(normalised, settings.data_uris):
        raise SpecError(f"{field} {uri!r} is outside the server's allowed prefixes (BNRECAL_DATA_URIS)", field=field)
    return normalised

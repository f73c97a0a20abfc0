"""Building models from architecture references: torchvision, timm, allow-listed modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from bnrecal.errors import ArchitectureError, SpecError
from bnrecal.workers.models.architectures import (
    MAX_KWARGS_DEPTH,
    build_model,
    check_model_kwargs,
    parse_allowed_modules,
)

from tests.workers.models import model_zoo

ZOO = "tests.workers.models.model_zoo"


def test_torchvision_model_is_built_untrained_in_float32_on_cpu() -> None:
    model = build_model("torchvision:resnet18", {"num_classes": 7})
    assert type(model).__name__ == "ResNet"
    assert model.fc.out_features == 7
    tensors = list(model.state_dict().values())
    assert all(t.device.type == "cpu" for t in tensors)
    assert all(t.dtype in (torch.float32, torch.int64) for t in tensors)
    # weights=None: BN layers carry their fresh initial statistics, not ImageNet ones
    assert torch.equal(model.bn1.running_mean, torch.zeros(64))
    assert torch.equal(model.bn1.running_var, torch.ones(64))


def test_torchvision_detection_builder_never_downloads_a_backbone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fasterrcnn defaults to weights_backbone=IMAGENET1K_V1; with an empty hub cache and
    # no network this would fail if the download switch were left on.
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    model = build_model(
        "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn", {"num_classes": 3}
    )
    assert isinstance(model, nn.Module)
    assert not any(tmp_path.iterdir())


def test_torchvision_unknown_name_suggests_close_matches() -> None:
    with pytest.raises(ArchitectureError) as info:
        build_model("torchvision:resnt18")
    message = str(info.value)
    assert "resnt18" in message
    assert "resnet18" in message


def test_torchvision_refuses_pretrained_weights() -> None:
    with pytest.raises(SpecError) as info:
        build_model("torchvision:resnet18", {"weights": "DEFAULT"})
    assert "model_kwargs.weights" in str(info.value)
    assert info.value.field == "model_kwargs"


def test_torchvision_bad_kwargs_name_model_kwargs() -> None:
    with pytest.raises(SpecError) as info:
        build_model("torchvision:resnet18", {"no_such_option": 1})
    assert "model_kwargs" in str(info.value)
    assert "no_such_option" in str(info.value)
    assert info.value.field == "model_kwargs"


def test_timm_without_the_extra_says_how_to_install_it() -> None:
    try:
        import timm  # noqa: F401
    except ImportError:
        with pytest.raises(ArchitectureError) as info:
            build_model("timm:resnet18")
        assert "bnrecal[timm]" in str(info.value)
    else:
        pytest.skip("timm is installed; the missing-extra message cannot be observed")


def test_timm_model_is_built_without_pretrained_weights() -> None:
    pytest.importorskip("timm")
    model = build_model("timm:resnet18", {"num_classes": 5})
    assert model.get_classifier().out_features == 5
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ArchitectureError, match="resnet18"):
        build_model("timm:resnet18x")
    with pytest.raises(SpecError, match="checkpoint_path"):
        build_model("timm:resnet18", {"checkpoint_path": "/etc/passwd"})


def test_allowed_module_factory_builds_the_model_with_kwargs() -> None:
    kwargs = {"num_classes": 3, "width": 4}
    model = build_model(f"{ZOO}:small_cnn", kwargs, allowed_modules=["tests"])
    assert isinstance(model, model_zoo.SmallCNN)
    assert model.head.out_features == 3
    assert model.features[0].out_channels == 4


def test_allowed_module_class_can_be_named_directly() -> None:
    model = build_model(f"{ZOO}:SmallCNN", allowed_modules=("tests.workers",))
    assert isinstance(model, model_zoo.SmallCNN)


def test_model_from_a_float64_factory_comes_back_float32() -> None:
    model = build_model(f"{ZOO}:double_precision_cnn", allowed_modules=["tests"])
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.neck_bn.running_var.dtype == torch.float32
    assert model.neck_bn.num_batches_tracked.dtype == torch.int64


@pytest.mark.parametrize("allowed", [(), ("testsevil",), ("tests.api",), ("other", "tests.work")])
def test_module_outside_the_allowlist_is_refused(allowed: tuple[str, ...]) -> None:
    with pytest.raises(ArchitectureError) as info:
        build_model(f"{ZOO}:small_cnn", allowed_modules=allowed)
    assert "not allowed" in str(info.value)
    assert "BNRECAL_MODEL_MODULES" in str(info.value)


def test_prefix_matches_on_dotted_boundaries_only() -> None:
    with pytest.raises(ArchitectureError, match="BNRECAL_MODEL_MODULES"):
        build_model(f"{ZOO}:small_cnn", allowed_modules=["tes"])
    model = build_model(f"{ZOO}:small_cnn", allowed_modules=[ZOO])
    assert isinstance(model, model_zoo.SmallCNN)


def test_missing_module_attribute_and_non_callable_are_named() -> None:
    with pytest.raises(ArchitectureError, match="tests.workers.no_such_module"):
        build_model("tests.workers.no_such_module:f", allowed_modules=["tests"])
    with pytest.raises(ArchitectureError, match="no_such_factory"):
        build_model(f"{ZOO}:no_such_factory", allowed_modules=["tests"])
    with pytest.raises(ArchitectureError, match="not callable"):
        build_model(f"{ZOO}:NOT_CALLABLE", allowed_modules=["tests"])


def test_factory_that_returns_no_module_is_refused() -> None:
    with pytest.raises(ArchitectureError) as info:
        build_model(f"{ZOO}:not_a_module", allowed_modules=["tests"])
    assert "dict" in str(info.value)
    assert "torch.nn.Module" in str(info.value)


def test_kwargs_the_factory_rejects_are_a_spec_error() -> None:
    with pytest.raises(SpecError) as info:
        build_model(f"{ZOO}:small_cnn", {"depth": 3}, allowed_modules=["tests"])
    assert info.value.field == "model_kwargs"
    assert "depth" in str(info.value)


def test_model_kwargs_must_be_an_object() -> None:
    with pytest.raises(SpecError, match="model_kwargs"):
        build_model("torchvision:resnet18", [1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "arch",
    [
        "resnet18",
        ":resnet18",
        "torchvision:",
        "os:system; rm",
        "a..b:f",
        "pkg:f(x)",
        "pkg:__import__('os')",
    ],
)
def test_malformed_arch_shows_the_accepted_forms(arch: str) -> None:
    with pytest.raises(ArchitectureError) as info:
        build_model(arch, allowed_modules=["pkg", "os", "a"])
    assert "<module.path>:<callable>" in str(info.value)


def test_parse_allowed_modules_cleans_the_setting() -> None:
    assert parse_allowed_modules(None) == ()
    assert parse_allowed_modules("") == ()
    assert parse_allowed_modules(" pkg., other ,,pkg") == ("pkg", "other")
    assert parse_allowed_modules(["a.b", "c, d"]) == ("a.b", "c", "d")
    with pytest.raises(SpecError, match="BNRECAL_MODEL_MODULES"):
        parse_allowed_modules("pkg,*")
    with pytest.raises(SpecError, match="BNRECAL_MODEL_MODULES"):
        parse_allowed_modules("../evil")


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("2layers", "not an argument name"),
        ("num-classes", "not an argument name"),
        ("", "not an argument name"),
        ("class", "a Python keyword"),
        ("lambda", "a Python keyword"),
        ("__class__", "a reserved (dunder) name"),
        ("__init__", "a reserved (dunder) name"),
    ],
)
def test_model_kwargs_keys_that_cannot_be_argument_names_are_refused_naming_the_key(key: str, why: str) -> None:
    kwargs = {"num_classes": 10, key: 1}
    with pytest.raises(SpecError) as info:
        check_model_kwargs(kwargs)
    assert info.value.field == f"model_kwargs.{key}"
    assert str(info.value).startswith(f"model_kwargs key {key!r} is {why}")
    with pytest.raises(SpecError) as built:  # building refuses it the same way, before calling anything
        build_model(f"{ZOO}:small_cnn", kwargs, allowed_modules=["tests"])
    assert built.value.field == f"model_kwargs.{key}"


def test_model_kwargs_values_may_nest_up_to_the_bound_and_no_deeper() -> None:
    def nested(levels: int) -> object:
        value: object = 1
        for level in range(levels):
            value = [value] if level % 2 else {"x": value}
        return value

    check_model_kwargs({"_private": 1, "config": nested(MAX_KWARGS_DEPTH), "flat": list(range(1000))})
    with pytest.raises(SpecError) as info:
        check_model_kwargs({"ok": 1, "config": nested(MAX_KWARGS_DEPTH + 1)})
    assert info.value.field == "model_kwargs.config"
    assert f"deeper than {MAX_KWARGS_DEPTH} levels" in str(info.value)
    with pytest.raises(SpecError, match="model_kwargs.config"):  # any depth, without recursing through it
        check_model_kwargs({"config": nested(100_000)})

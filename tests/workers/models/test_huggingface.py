"""``transformers:<ModelClass>`` references: built from config.json, loaded from the
model.safetensors of ``save_pretrained``, and everything else refused with one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bnrecal.workers.engine.evaluation import model_logits
from bnrecal.errors import ArchitectureError, SpecError
from bnrecal.workers.models.architectures import build_model, check_architecture_exists
from bnrecal.workers.models.checkpoints import load_checkpoint, load_into_model, save_checkpoint

from tests.hf import SIZE, TINY, save_pretrained, tiny_model

transformers = pytest.importorskip(
    "transformers", reason="the transformers extra is part of the test extras: pip install -e '.[test]'"
)

RESNET = "transformers:ResNetForImageClassification"


def saved(folder: Path, name: str) -> tuple[torch.nn.Module, dict, Path]:
    """A tiny model of class ``name``, saved with save_pretrained: the model, the content
    of its config.json, and its model.safetensors."""
    model = tiny_model(name)
    return (model, *save_pretrained(model, folder))


@pytest.mark.parametrize("name", list(TINY))
def test_config_json_builds_the_class_and_save_pretrained_weights_load_strictly(tmp_path, name):
    original, config, weights = saved(tmp_path, name)
    model = build_model(f"transformers:{name}", config)
    assert type(model) is type(original)
    assert all(t.dtype in (torch.float32, torch.int64) and t.device.type == "cpu" for t in model.state_dict().values())
    checkpoint = load_checkpoint(weights)
    assert checkpoint.format == "safetensors" and checkpoint.prefix == ""
    load_into_model(model, checkpoint)
    for key, value in original.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        torch.testing.assert_close(model_logits(model.eval()(x)), original(x).logits, rtol=0, atol=0)


def test_recalibrated_safetensors_keep_their_metadata_and_load_back_into_transformers(tmp_path):
    original, config, weights = saved(tmp_path / "in", "ResNetForImageClassification")
    checkpoint = load_checkpoint(weights)
    key = "resnet.embedder.embedder.normalization.running_mean"
    new_mean = torch.arange(8, dtype=torch.float32)
    out = tmp_path / "out"
    out.mkdir()
    save_checkpoint(checkpoint, {key: new_mean}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(out / "model.safetensors").metadata == checkpoint.metadata == {"format": "pt"}
    reloaded = transformers.ResNetForImageClassification.from_pretrained(out, local_files_only=True)
    assert torch.equal(reloaded.state_dict()[key], new_mean)
    for name, value in original.state_dict().items():
        if name != key:
            assert torch.equal(reloaded.state_dict()[name], value), name


def test_submission_check_accepts_model_classes_and_refuses_unknown_names_with_suggestions():
    check_architecture_exists(RESNET)
    with pytest.raises(ArchitectureError) as info:
        check_architecture_exists("transformers:ResNetForImageClasification")
    assert "ResNetForImageClasification" in str(info.value)
    assert "did you mean ResNetForImageClassification" in str(info.value)
    assert info.value.field == "arch"
    with pytest.raises(ArchitectureError, match="did you mean ResNetForImageClassification"):
        build_model("transformers:resnetforimageclassification")
    with pytest.raises(ArchitectureError, match=r"did you mean transformers:ResNetForImageClassification\?"):
        check_architecture_exists("ResNetForImageClassification")  # the source left out


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("ResNetConfig", "configuration class, not a model"),
        ("AutoModelForImageClassification", "Auto class"),
        ("PreTrainedModel", "without a config class"),
        ("is_torch_available", "function, not a model class"),
        ("logging", "module, not a model class"),
        ("os.system", "not a class name"),
        ("TFResNetForImageClassification", "unknown transformers model class"),
    ],
)
def test_names_that_are_not_model_classes_are_refused(name, says):
    with pytest.raises(ArchitectureError, match=says) as info:
        check_architecture_exists(f"transformers:{name}")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"auto_map": {"AutoModelForImageClassification": "evil.modeling.Net"}}, "model_kwargs.auto_map"),
        ({"trust_remote_code": True}, "model_kwargs.trust_remote_code"),
        ({"custom_pipelines": {"x": {"impl": "evil.Pipe"}}}, "model_kwargs.custom_pipelines"),
        ({"text_config": {"auto_map": {"AutoConfig": "evil.Config"}}}, "model_kwargs.text_config.auto_map"),
        ({"use_pretrained_backbone": True}, "model_kwargs.use_pretrained_backbone"),
        ({"backbone": "microsoft/resnet-50"}, "model_kwargs.backbone"),
        ({"backbone_config": {"model_type": "timm_backbone", "backbone": "hf-hub:evil/net"}},
         "model_kwargs.backbone_config.backbone"),
        ({"heads": [{"model_type": "timm_wrapper", "architecture": "local-dir:/etc"}]},
         "model_kwargs.heads[0].architecture"),
    ],
)
def test_configs_that_would_fetch_or_run_code_are_refused(tmp_path, extra, key):
    _, config, _ = saved(tmp_path, "ResNetForImageClassification")
    with pytest.raises(SpecError) as info:
        build_model(RESNET, {**config, **extra})
    assert str(info.value).startswith(key + " ")
    assert info.value.field == "model_kwargs"


def test_harmless_values_of_those_keys_are_accepted(tmp_path):
    _, config, _ = saved(tmp_path, "ResNetForImageClassification")
    model = build_model(RESNET, {**config, "auto_map": {}, "trust_remote_code": False,
                                 "use_pretrained_backbone": False, "backbone": None})
    assert isinstance(model, transformers.ResNetForImageClassification)


def test_another_models_config_and_bad_values_name_model_kwargs(tmp_path):
    _, config, _ = saved(tmp_path, "RegNetForImageClassification")
    with pytest.raises(SpecError, match="config of a 'regnet' model.*takes model_type 'resnet'") as info:
        build_model(RESNET, config)
    assert "RegNetForImageClassification" in str(info.value)
    with pytest.raises(SpecError, match="model_kwargs do not make a ResNetConfig.*layer_type") as info:
        build_model(RESNET, {"layer_type": "nope"})
    assert info.value.field == "model_kwargs" and "\n" not in str(info.value)


def test_build_runs_with_the_hub_offline_and_restores_the_setting():
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import get_session

    from bnrecal.workers.models.huggingface import hub_offline

    before = constants.HF_HUB_OFFLINE
    with hub_offline():
        with hub_offline():
            assert constants.is_offline_mode()
        assert constants.is_offline_mode()
        with pytest.raises(OfflineModeIsEnabled):  # refused before any connection is tried
            get_session().get("https://huggingface.co/api/models/microsoft/resnet-50")
    assert constants.HF_HUB_OFFLINE == before


def test_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when absent
    with pytest.raises(ArchitectureError, match=r"bnrecal\[transformers\]"):
        check_architecture_exists(RESNET)


def test_logits_are_read_from_model_outputs():
    from transformers.modeling_outputs import ImageClassifierOutputWithNoAttention

    logits = torch.randn(3, 5)
    hidden = (torch.randn(3, 4, 2, 2),)
    assert model_logits(ImageClassifierOutputWithNoAttention(logits=logits, hidden_states=hidden)) is logits
    assert model_logits({"out": logits, "aux": hidden[0]}) is logits  # torchvision's segmentation models

"""Adapter dispatch by pipeline class, and loading pipelines from local directories."""

import json
import sys
import types

import pytest
import torch
from diffusers import FluxPipeline, QwenImagePipeline, StableDiffusion3Pipeline

from flowgrpo.models import registry
from flowgrpo.models.registry import (
    SUPPORTED_PIPELINES,
    build_adapter,
    load_pipeline,
    resolve_adapter_path,
)
from flowgrpo.testing.families import doubles, params, sequence_parallel_spec
from flowgrpo.testing.tiny import tiny_pipeline, tiny_size


def test_dispatch_table_resolves_names_and_subclasses():
    assert resolve_adapter_path(QwenImagePipeline) == "flowgrpo.models.qwen_image:QwenImageAdapter"
    assert resolve_adapter_path(StableDiffusion3Pipeline) == "flowgrpo.models.sd3:SD3Adapter"
    assert resolve_adapter_path(FluxPipeline) == "flowgrpo.models.flux:FluxAdapter"
    assert SUPPORTED_PIPELINES["ToyDigitsPipeline"] == "flowgrpo.toy.pipeline:ToyAdapter"

    class MyFlux(FluxPipeline):
        pass

    assert resolve_adapter_path(MyFlux) == SUPPORTED_PIPELINES["FluxPipeline"]


def test_build_adapter_imports_lazily_and_passes_kwargs(monkeypatch):
    module = types.ModuleType("fake_adapter_mod")

    class FakeAdapter:
        def __init__(self, pipe, **kwargs):
            self.pipe, self.kwargs = pipe, kwargs

    module.FakeAdapter = FakeAdapter
    monkeypatch.setitem(sys.modules, "fake_adapter_mod", module)
    monkeypatch.setitem(
        registry.SUPPORTED_PIPELINES, "FakePipeline", "fake_adapter_mod:FakeAdapter"
    )

    class FakePipeline:
        pass

    class SubFake(FakePipeline):
        pass

    pipe = SubFake()
    adapter = build_adapter(pipe, dtype="fp32")
    assert isinstance(adapter, FakeAdapter) and adapter.pipe is pipe
    assert adapter.kwargs == {"dtype": "fp32"}


def test_build_adapter_unsupported_class():
    class StableDiffusionXLPipeline:
        pass

    with pytest.raises(ValueError) as err:
        build_adapter(StableDiffusionXLPipeline())
    msg = str(err.value)
    assert "'StableDiffusionXLPipeline'" in msg
    for name in SUPPORTED_PIPELINES:
        assert name in msg


def test_load_pipeline_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"model.path '{missing}' does not exist"):
        load_pipeline(missing)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="is not a diffusers pipeline directory"):
        load_pipeline(empty)
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"no model_index\.json"):
        load_pipeline(a_file)

    # Unsupported class: rejected from model_index.json alone (no component folders exist).
    sdxl = tmp_path / "sdxl"
    sdxl.mkdir()
    (sdxl / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ValueError) as err:
        load_pipeline(sdxl)
    msg = str(err.value)
    assert "unsupported pipeline 'StableDiffusionXLPipeline'" in msg
    assert all(name in msg for name in SUPPORTED_PIPELINES)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model_index.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_pipeline(broken)


def test_load_pipeline_finds_custom_classes_beside_their_adapter(monkeypatch, tmp_path):
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    class CustomPipeline(DiffusionPipeline):
        def __init__(self, scheduler):
            super().__init__()
            self.register_modules(scheduler=scheduler)

    module = types.ModuleType("fake_custom_mod")
    module.CustomPipeline = CustomPipeline
    monkeypatch.setitem(sys.modules, "fake_custom_mod", module)
    monkeypatch.setitem(registry.SUPPORTED_PIPELINES, "CustomPipeline", "fake_custom_mod:Adapter")
    CustomPipeline(FlowMatchEulerDiscreteScheduler(shift=2.0)).save_pretrained(tmp_path)
    loaded = load_pipeline(tmp_path)
    assert type(loaded) is CustomPipeline and loaded.scheduler.config.shift == 2.0


#: the text-to-image families with a stock diffusers pipeline (video and editing families
#: save and load through the same code; their own tests load them)
T2I = [f for f in doubles() if f.stock and f.saves and f.num_frames is None and f.sources is None]


@pytest.mark.parametrize("fam", params(T2I))
def test_save_then_load_pipeline_reproduces_latents(fam, tmp_path):
    kind = fam.kind
    pipe = tiny_pipeline(kind)
    height, width = tiny_size(kind)
    kwargs = dict(num_inference_steps=2, height=height, width=width)
    kwargs["output_type"] = "latent"
    kwargs.update(fam.call_options)
    kwargs[fam.guidance_arg] = 4.0
    if fam.guidance_arg == "true_cfg_scale":
        kwargs["negative_prompt"] = ["blurry"]

    def run(p):  # a fresh prompt list: ZImagePipeline writes its chat template into the list
        return p(prompt=["a cat"], generator=torch.Generator().manual_seed(3), **kwargs).images

    expected = run(pipe)
    pipe.save_pretrained(tmp_path)
    loaded = load_pipeline(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded) is type(pipe)
    # Not bitwise: safetensors-mmapped weights are not 64-byte aligned, so BLAS may sum in
    # another order (~1e-7). Cloning the parameters restores bitwise equality.
    assert (run(loaded) - expected).abs().max() < 1e-5


def test_load_pipeline_in_bf16(tmp_path):
    tiny_pipeline("sd3").save_pretrained(tmp_path)
    half = load_pipeline(tmp_path, torch_dtype=torch.bfloat16)
    assert half.transformer.dtype == torch.bfloat16


def test_family_options_are_settings_and_come_from_the_adapters():
    from flowgrpo.config.checks import option_keys
    from flowgrpo.config.loader import valid_keys
    from flowgrpo.models.registry import adapter_options, family_options

    keys = option_keys()  # every option an adapter takes is a setting: its family's, or model's
    assert set(keys) == family_options() and set(keys.values()) <= set(valid_keys())
    assert keys["true_cfg_scale"] == "flux.true_cfg_scale"
    assert keys["max_sequence_length"] == "model.max_sequence_length"
    assert family_options() == {
        "true_cfg_scale",
        "max_sequence_length",
        "num_frames",
        "guidance_scale_2",
        "cfg_normalization",
        "cfg_truncation",
        "source_size",
    }
    assert adapter_options(FluxPipeline) == {"true_cfg_scale", "max_sequence_length"}
    assert adapter_options(StableDiffusion3Pipeline) == {"max_sequence_length"}


SP_FAMILIES = [f for f in doubles() if sequence_parallel_spec(f) is not None]


@pytest.mark.parametrize("fam", params(SP_FAMILIES))
def test_declared_sequence_parallel_spec_is_for_the_family_transformer(fam):
    """What the engine gets from a family (``engine_declarations``): its LoRA targets and its
    SP spec, which names a class of its transformer (FLUX.1 Kontext shares FLUX.1's; the toy
    is an SD3 transformer), also through a subclass as FSDP makes (``fully_shard``)."""
    adapter = build_adapter(tiny_pipeline(fam.kind))
    declared = adapter.engine_declarations()
    assert declared.sequence_parallel is type(adapter).sequence_parallel
    assert declared.lora_targets == tuple(adapter.lora_target_modules) != ()
    cls = type(adapter.transformer)
    fsdp = type(f"FSDP{cls.__name__}", (cls,), {})  # as fully_shard does
    assert declared.sequence_parallel.transformer_class in {c.__name__ for c in fsdp.__mro__}


def test_sequence_parallel_specs_are_named_for_their_family_and_checked():
    """Specs carry their family's name; without one (Wan) diffusers' plan applies; a spec
    passed for another transformer is refused before any mesh is touched."""
    from flowgrpo.engine.sp import enable_sequence_parallel
    from flowgrpo.models.flux import FluxAdapter

    assert build_adapter(tiny_pipeline("sd3")).engine_declarations().sequence_parallel.name == "sd3"
    wan = build_adapter(tiny_pipeline("wan")).engine_declarations()
    assert wan.sequence_parallel is None and wan.fsdp_blocks is None  # diffusers' plan, blocks
    sd3 = tiny_pipeline("sd3").transformer
    with pytest.raises(ValueError, match="spec 'flux' is for FluxTransformer2DModel, not SD3"):
        enable_sequence_parallel(sd3, None, 2, spec=FluxAdapter.sequence_parallel)


def test_padding_rules_of_the_families():
    """Text of 3 tokens padded by 1 for sp = 2: the model's own mask (Qwen-Image) extended
    with a 0; else a full-length key mask through joint_attention_kwargs (SD3, FLUX) and
    FLUX's text position ids extended with zeros; the originals untouched."""
    from flowgrpo.models.flux import FluxAdapter
    from flowgrpo.models.qwen_image import QwenImageAdapter
    from flowgrpo.models.sd3 import SD3Adapter

    ehs = torch.randn(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    got = QwenImageAdapter.sequence_parallel.pad_text(
        {"encoder_hidden_states": ehs, "encoder_hidden_states_mask": mask}, 1
    )
    assert torch.equal(got["encoder_hidden_states"][:, :3], ehs)
    assert torch.equal(got["encoder_hidden_states"][:, 3], torch.zeros(2, 4))
    assert got["encoder_hidden_states_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert "joint_attention_kwargs" not in got
    plain = QwenImageAdapter.sequence_parallel.pad_text({"encoder_hidden_states": ehs}, 1)
    assert plain["encoder_hidden_states_mask"].tolist() == [[1, 1, 1, 0]] * 2

    key_mask = [[True, True, True, False]] * 2
    got = SD3Adapter.sequence_parallel.pad_text({"encoder_hidden_states": ehs}, 1)
    assert got["joint_attention_kwargs"]["text_key_mask"].tolist() == key_mask
    ids = torch.arange(9.0).reshape(3, 3) + 1
    kwargs = {"encoder_hidden_states": ehs, "txt_ids": ids, "joint_attention_kwargs": {"a": 1}}
    got = FluxAdapter.sequence_parallel.pad_text(kwargs, 1)
    assert set(got["joint_attention_kwargs"]) == {"a", "text_key_mask"}
    assert got["joint_attention_kwargs"]["text_key_mask"].tolist() == key_mask
    assert got["txt_ids"].tolist() == [*ids.tolist(), [0.0, 0.0, 0.0]]
    assert kwargs["txt_ids"] is ids and kwargs["joint_attention_kwargs"] == {"a": 1}
    with pytest.raises(ValueError, match="text_key_mask is set by enable_sequence_parallel"):
        SD3Adapter.sequence_parallel.pad_text(
            {"encoder_hidden_states": ehs, "joint_attention_kwargs": {"text_key_mask": 0}}, 1
        )

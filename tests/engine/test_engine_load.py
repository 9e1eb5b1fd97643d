"""Sharded loading (flowgrpo.engine.load): the trained transformer(s) built on the meta device,
sharded, then each rank's shards read from the files. The weights, buffers, reference copy and
EMA equal today's whole-model path bit for bit, before and after a training step, for every
family (LoRA and full: both on the core families, one on each other), 1 and 2 ranks, with SP, HSDP and CPU offload; and no whole transformer
is ever allocated while building."""

from __future__ import annotations

import load_ranks
import pytest
import torch

from flowgrpo.testing.families import cross_params, kinds
from flowgrpo.testing.ranks import spawn

#: every family with a diffusers pipeline to save (its cost tier marks its rows, ``params``);
#: LoRA and full on the core families, one of them on each other family (``cross``)
CASES = cross_params(kinds(lambda f: f.stock), ["lora", "full"])


class _Saved(dict):
    """kind -> its tiny pipeline saved in fp32 files, saved on first use."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, kind):
        self[kind] = load_ranks.save(kind, self.root)
        return self[kind]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _Saved(tmp_path_factory.mktemp("pipelines"))


@pytest.mark.parametrize(("kind", "case"), CASES)
def test_one_rank_equals_whole_model_path(dist1, saved, kind, case):
    out = load_ranks.compare(saved[kind], case)
    assert out["count"][0] > 20
    assert out["loaded"] == []
    assert out["trained"] == []


def test_fp32_files_loaded_in_fp32(dist1, saved):
    out = load_ranks.compare(saved["sd3"], "full", dtype="fp32")
    assert out["loaded"] == [] and out["trained"] == []


def test_trained_components_built_on_meta(saved):
    from flowgrpo.engine.load import WEIGHTS_ATTR, is_empty
    from flowgrpo.models.registry import build_adapter, load_pipeline

    pipe = load_pipeline(saved["wan22"], torch_dtype=torch.bfloat16, empty_trained=True)
    assert is_empty(pipe.transformer) and is_empty(pipe.transformer_2)
    assert not is_empty(pipe.text_encoder) and not is_empty(pipe.vae)
    assert getattr(pipe.transformer_2, WEIGHTS_ATTR).folder == saved["wan22"] / "transformer_2"
    assert is_empty(build_adapter(pipe, num_frames=5).transformer)  # both experts
    wan21 = load_pipeline(saved["wan"], empty_trained=True)
    assert wan21.transformer_2 is None


def test_missing_weight_is_a_clear_error(saved, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from flowgrpo.models.registry import load_pipeline

    path = tmp_path / "sd3"
    shutil.copytree(saved["sd3"], path)
    file = path / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(file)
    state.pop("proj_out.weight")
    save_file(state, file)
    with pytest.raises(ValueError, match="lack proj_out.weight"):
        load_pipeline(path, empty_trained=True)


def test_wrong_shape_is_a_clear_error(saved, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from flowgrpo.models.registry import load_pipeline

    path = tmp_path / "sd3"
    shutil.copytree(saved["sd3"], path)
    file = path / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(file)
    state["proj_out.weight"] = state["proj_out.weight"][:-1]
    save_file(state, file)
    with pytest.raises(ValueError, match="proj_out.weight has shape"):
        load_pipeline(path, empty_trained=True)


def test_weights_in_several_files_with_an_index(dist1, saved, tmp_path):
    """A transformer saved in several safetensors files (``.index.json``) loads the same."""
    import shutil

    from diffusers import SD3Transformer2DModel

    path = tmp_path / "sd3"
    shutil.copytree(saved["sd3"], path)
    folder = path / "transformer"
    model = SD3Transformer2DModel.from_pretrained(folder)
    shutil.rmtree(folder)
    model.save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 3
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    out = load_ranks.compare(path, "full")
    assert out["loaded"] == [] and out["trained"] == []


@pytest.mark.slow  # spawns 2 ranks
def test_two_ranks_equal_whole_model_path(saved, tmp_path):
    """Every case of load_ranks.CASES on 2 ranks (SP, HSDP, CPU offload among them); and each
    rank reads about half of the transformer's bytes (twice: the reference is read too)."""
    for kind in {kind for kind, _, _ in load_ranks.CASES.values()}:
        (tmp_path / kind).symlink_to(saved[kind], target_is_directory=True)
    spawn(load_ranks.job, 2, str(tmp_path))
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    cases = results["cases"]
    assert "error" not in cases, cases.get("error")
    assert set(cases) == set(load_ranks.CASES)
    for name, out in cases.items():
        assert out["loaded"] == [], name
        assert out["trained"] == [], name
    for rank in results["bytes"]:
        assert 0.45 * 2 * rank["file"] <= rank["read"] <= 0.55 * 2 * rank["file"]


def test_no_whole_transformer_is_allocated(dist1, tmp_path):
    """Full fine-tune with reference and EMA of an 8-block SD3 in bf16 (fp32 masters), torch's
    allocator watched by the profiler: loading the pipeline allocates no more than loading it
    without its transformer (plus the transformer's buffers and one block), and building the
    engine no more than the engine's own state plus one block. Today's path, measured alike,
    allocates the whole transformer while loading (the measurement sees it)."""
    from flowgrpo.testing.tiny import tiny_pipeline

    path = tmp_path / "deep"
    tiny_pipeline("sd3", num_layers=8, pos_embed_max_size=16).save_pretrained(path)
    new = load_ranks.measure_construction(path, empty=True)
    old = load_ranks.measure_construction(path, empty=False)
    base = new["load_peak_without_transformer"]
    assert new["load_peak"] <= base + new["buffers"] + new["block_fp32"]
    assert new["engine_peak"] <= new["engine_state"] + new["block_fp32"]
    assert old["load_peak"] >= base + old["whole_bf16"]

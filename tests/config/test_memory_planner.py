"""``flowgrpo memory``: the planner's parameter counts equal the built models', its total is
within 15% of the measured per-rank peak of training (LoRA and full fine-tune with KL, 1 and 2
ranks; a small SD3 on the CPU), and bad input is a one-line error."""

from __future__ import annotations

import json
import math

import memory_ranks as MR
import pytest
import torch

from flowgrpo import cli
from flowgrpo.config import load_config
from flowgrpo.planner import GB, known_models, plan_memory, read_model_configs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    MR.save_small_pipeline(root)
    return root


def test_param_counts_equal_the_loaded_pipeline(root):
    from flowgrpo.models.registry import load_pipeline

    pipe = load_pipeline(root / "small-sd3")
    cfg = load_config(str(root / "preset.yaml"), MR.overrides(root, "lora"), check_paths=False)
    plan = plan_memory(cfg, 1, 80, device="cpu")
    real = {
        name: sum(p.numel() for p in comp.parameters())
        for name, comp in pipe.components.items()
        if isinstance(comp, torch.nn.Module)
    }
    assert plan.params["trained"] == real.pop("transformer")
    for name, n in real.items():
        assert plan.params[name] == n, name
    # LoRA: r (in + out) on each targeted Linear, counted by peft itself
    from peft import LoraConfig

    from flowgrpo.models.sd3 import SD3Adapter

    model = pipe.transformer
    model.add_adapter(LoraConfig(r=8, target_modules=list(SD3Adapter.lora_target_modules)))
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert plan.params["lora"] == lora


#: every configuration on 1 rank and LoRA and the full fine-tune on 2 as well (the reward model
#: runs whole on every rank; the NF4 base shards as LoRA's bf16 one does, its 2-rank figure is
#: in docs/memory.md from ``python tests/config/memory_ranks.py``): each row is ~20 s of CI
MEASURED = [(name, world) for world in (1, 2) for name in MR.CONFIGS]
MEASURED.remove(("lora-clip", 2))
MEASURED.remove(("lora-nf4", 2))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "world"), MEASURED, ids=[f"{w}-{n}" for n, w in MEASURED])
def test_total_within_15_percent_of_the_measured_peak(root, name, world):
    measured = MR.measure(root, name, world)
    planned = MR.planned(root, name, world)
    assert abs(planned / measured - 1) <= 0.15, (planned / 2**20, measured / 2**20)


#: the model cards' sizes, in billions, as they state them (rounded figures): the trained
#: transformer and, where the card names it, the text encoder (Qwen3-4B 4.0B, Qwen3-8B 8.2B,
#: Qwen3-VL-8B 8.77B)
CARD_SIZES = {
    "flux.2-klein-4b": {"transformer": 4.0, "text_encoder": 4.0},
    "flux.2-klein-9b": {"transformer": 9.0, "text_encoder": 8.2},
    "z-image": {"transformer": 6.0, "text_encoder": 4.0},
    "qwen-image-2.1": {"transformer": 7.0, "text_encoder": 8.77},
    "hunyuan-video-1.5-480p-t2v": {"transformer": 8.3},
    "hunyuan-video-1.5-720p-t2v": {"transformer": 8.3},
}


@pytest.mark.parametrize("name", known_models())
def test_shipped_configs_build_on_meta(name):
    configs = read_model_configs(f"known:{name}")
    from flowgrpo.config.shipped import preset_pipelines

    pipeline = configs["model_index"]["_class_name"]
    fits = [p for p, classes in preset_pipelines().items() if pipeline in classes]
    cfg = load_config(
        fits[0] if fits else "qwen-image-edit-counting",
        [f"model.path=known:{name}"],
        check_paths=False,
    )
    cfg.preset = None  # a custom config (QwenImageEditPlusPipeline has no preset of its own)
    plan = plan_memory(cfg, 8, 80)
    published = {  # billions of transformer parameters, as the model cards give them
        "qwen-image": 20.4,
        "flux.1-dev": 11.9,
        "sd3.5-large": 8.1,
        "sd3.5-medium": 2.2,  # 2.5B with the text-side projections the card counts
        "wan2.1-t2v-1.3b": 1.4,
        "wan2.2-t2v-a14b": 2 * 14.3,  # two experts
        "flux.2-dev": 32.2,  # the card's 32B
        "z-image": 12.3 / 2,  # its 12.3 GB of bf16 transformer shards (the card's 6B)
        "qwen-image-2.1": 14.2 / 2,  # its 14.2 GB of bf16 transformer weights (the card's 7B)
        "hunyuan-video-1.5-480p-t2v": 8.3,  # the card's 8.3B
        "hunyuan-video-1.5-720p-t2v": 8.3,
        "flux.1-kontext-dev": 11.9,  # the card's 12B: FLUX.1 [dev]'s transformer
        "qwen-image-edit": 40.9 / 2,  # its 40.9 GB of bf16 transformer shards (20B)
        "qwen-image-edit-2509": 40.9 / 2,  # likewise (Comfy-Org's 40.9 GB bf16 file)
    }  # FLUX.2-klein: only the cards' rounded 4B / 9B (CARD_SIZES below)
    if name in published:
        assert plan.params["trained"] / 1e9 == pytest.approx(published[name], abs=0.05)
    assert "sources" in configs and plan.total > 0
    # the model cards' rounded sizes (the newer families' sets): within 4%
    counted = {"transformer": plan.params["trained"], **plan.params}
    for part, billions in CARD_SIZES.get(name, {}).items():
        assert counted[part] / 1e9 == pytest.approx(billions, rel=0.04), part


def test_text_encoder_sizes_and_the_cache_setting():
    qwen = ["model.path=known:qwen-image"]
    cfg = load_config("qwen-image-ocr", qwen, check_paths=False)
    plan = plan_memory(cfg, 8, 80)
    assert plan.parts["frozen text encoders"] / GB == pytest.approx(
        16.6e9 / 2**30, abs=0.1
    )  # bf16, GiB
    free = ["model.embed_cache_dir=/tmp/x", "model.text_encoder_offload=free"]
    cfg = load_config("qwen-image-ocr", [*qwen, *free], check_paths=False)
    assert plan_memory(cfg, 8, 80).parts["frozen text encoders"] == 0
    cfg = load_config("wan-t2v-ocr", ["model.path=known:wan2.1-t2v-1.3b"], check_paths=False)
    assert plan_memory(cfg, 8, 80).parts["frozen text encoders"] / GB == pytest.approx(
        11.4e9 / 2**30, abs=0.1
    )


def test_sharding_divides_the_state_and_checkpointing_shrinks_activations():
    over = ["model.path=known:flux.1-dev", "lora.enabled=false", "flow_grpo.kl_beta=0.04"]
    cfg = load_config("flux-pickscore", over, check_paths=False)
    one, eight = plan_memory(cfg, 1, 80), plan_memory(cfg, 8, 80)
    n = one.params["trained"]
    assert one.parts["optimizer"] == 8 * n and eight.parts["optimizer"] == n
    assert eight.parts["reference"] == pytest.approx(2 * n / 8)  # bf16 on the GPU
    assert one.parts["(activations with checkpointing)"] < one.parts["activations"] / 5


def _cli(capsys, *args):
    code = cli.main(["memory", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prints_parts_verdict_and_what_to_turn(capsys):
    code, out, _ = _cli(
        capsys,
        "flux-pickscore",
        "model.path=known:flux.1-dev",
        "lora.enabled=false",
        "--gpus",
        "1",
        "--gpu-gb",
        "80",
    )
    assert code == 0
    for part in (
        "trained weights",
        "grads",
        "optimizer",
        "reference",
        "EMA",
        "frozen",
        "activations",
        "trajectories",
        "reward models",
        "CUDA context",
        "peak: training",
        "total",
    ):
        assert part in out
    assert "does NOT fit" in out and "lora.enabled=true" in out and "--gpus" in out
    code, out, _ = _cli(
        capsys, "wan-t2v-ocr", "model.path=known:wan2.1-t2v-1.3b", "--gpus", "8", "--gpu-gb", "141"
    )
    assert code == 0 and "\nfits" in out


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["no-such-preset", "--gpus", "8", "--gpu-gb", "80"], "no-such-preset"),
        (["sd3-ocr", "model.path=known:sd3.5-medium", "--gpus", "0", "--gpu-gb", "80"], "--gpus"),
        (["sd3-ocr", "model.path=known:sd3.5-medium", "--gpus", "8", "--gpu-gb", "0"], "--gpu-gb"),
        (["sd3-ocr", "model.path=known:sd3.5-medium", "--gpus", "8", "--gpu-gb", "-5"], "--gpu-gb"),
        (["sd3-ocr", "model.path=known:nope", "--gpus", "8", "--gpu-gb", "80"], "known:nope"),
    ],
)
def test_bad_input_is_one_line(capsys, args, culprit):
    code, out, err = _cli(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowgrpo: error:") and culprit in lines[0]


def test_a_model_folder_without_configs_is_one_line(capsys, tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    code, _, err = _cli(
        capsys, "sd3-ocr", f"model.path={tmp_path}", "--gpus", "8", "--gpu-gb", "80"
    )
    assert code == 2 and "transformer/config.json" in err and len(err.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _cli(capsys, "sd3-ocr", f"model.path={empty}", "--gpus", "8", "--gpu-gb", "80")
    assert code == 2 and "model_index.json" in err and len(err.strip().splitlines()) == 1


def test_the_banner_line_is_the_planners_total_or_absent():
    from flowgrpo.config import load_config
    from flowgrpo.planner import GB, plan_memory, planned_line
    from flowgrpo.trainer.logging import startup_banner

    cfg = load_config(
        "flux-pickscore", ["model.path=known:flux.1-dev", "lora.enabled=false"], check_paths=False
    )
    total = plan_memory(cfg, 1, 80e9 / 2**30).total / GB  # the trainer gives 10^9-byte GB
    line = planned_line(cfg, 1, "cuda", 80.0)
    assert line.startswith(f"  memory     planned {total:.1f} GiB per rank of 75 GiB (may NOT fit")
    assert "(fits;" in planned_line(cfg, 1, "cuda", 1e6)
    toy = load_config(None, [])
    assert planned_line(toy, 1, "cpu", 24.0) is None  # the built-in toy has no component configs
    kw = dict(world_size=1, device="cuda", trainable=1, total=1, output_dir="runs/x")
    assert line in startup_banner(cfg, planned=line, **kw).splitlines()
    assert "memory" not in startup_banner(cfg, **kw)


def test_every_preset_with_a_known_model_plans():
    """Every row of docs/memory.md's table plans (the preset as shipped): its preset names a
    pipeline the known set holds, and the family answers the planner's questions."""
    from flowgrpo.config.shipped import preset_models, preset_pipelines

    for preset, model, extra in preset_models():
        configs = read_model_configs(f"known:{model}")
        assert configs["model_index"]["_class_name"] in preset_pipelines()[preset], preset
        over = [f"model.path=known:{model}", *extra]
        plan = plan_memory(load_config(preset, over, check_paths=False), 8, 80)
        assert plan.total > 0 and plan.parts["activations"] > 0, (preset, model)
        assert plan.parts["(rollout forward)"] > 0, (preset, model)


def _write_component_configs(pipe, root) -> None:
    """A diffusers folder holding only what the planner reads: model_index.json and each
    module component's config.json (the configs the tiny pipeline was built from)."""
    import diffusers

    index = {"_class_name": type(pipe).__name__}
    for name, comp in pipe.components.items():
        if not isinstance(comp, torch.nn.Module):
            continue
        lib = "diffusers" if isinstance(comp, diffusers.ModelMixin) else "transformers"
        index[name] = [lib, type(comp).__name__]
        (root / name).mkdir()
        if lib == "diffusers":
            comp.save_config(root / name)
        else:
            comp.config.to_json_file(root / name / "config.json")
    (root / "model_index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "kind, preset",
    [
        ("flux2_klein", "flux2-klein-pickscore"),
        ("z_image", "z-image-pickscore"),
        ("qwen_image21", "qwen-image-21-pickscore"),
        ("hunyuan_video15", "hunyuan-video15-pickscore"),
    ],
)
def test_new_families_param_counts_equal_their_tiny_pipelines(kind, preset, tmp_path):
    """The planner's counts for the newer families equal the instantiated models' (every
    component) and peft's LoRA count with the preset's rank and the family's targets."""
    from peft import LoraConfig

    from flowgrpo.models.registry import SUPPORTED_PIPELINES, import_adapter
    from flowgrpo.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline(kind)
    _write_component_configs(pipe, tmp_path)
    cfg = load_config(preset, [f"model.path={tmp_path}"], check_paths=False)
    plan = plan_memory(cfg, 1, 80, device="cpu")
    real = {
        name: sum(p.numel() for p in comp.parameters())
        for name, comp in pipe.components.items()
        if isinstance(comp, torch.nn.Module)
    }
    assert plan.params["trained"] == real.pop("transformer")
    assert {k: plan.params[k] for k in real} == real
    adapter_cls = import_adapter(SUPPORTED_PIPELINES[type(pipe).__name__])
    model = pipe.transformer
    targets = list(adapter_cls.lora_target_modules)
    model.add_adapter(LoraConfig(r=cfg.lora.rank, target_modules=targets))
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert plan.params["lora"] == lora > 0


def _calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """diffusers' qwenimage ``calculate_dimensions`` (pipeline_qwenimage_edit.py), transcribed:
    (width, height) of ~``area`` pixels at ``ratio`` = w / h, each rounded to a multiple of 32."""
    w = math.sqrt(area * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


@pytest.mark.parametrize(
    "adapter, vl_area, height, width",
    [
        ("QwenImageEditAdapter", 1024 * 1024, 512, 512),  # the preset
        ("QwenImageEditAdapter", 1024 * 1024, 512, 768),
        ("QwenImageEditPlusAdapter", 384 * 384, 512, 512),  # CONDITION_IMAGE_SIZE
        ("QwenImageEditPlusAdapter", 384 * 384, 768, 512),
    ],
)
def test_edit_token_counts_add_the_pipelines_source_tokens(adapter, vl_area, height, width):
    """Qwen-Image-Edit(-Plus)'s planner counts = the noised tokens plus the source's, sized as
    the pipelines size them, computed here from their lines: the VAE source at
    ``calculate_dimensions(1024 * 1024, w / h)`` (VAE 8, packed 2x2, pipeline_qwenimage_edit.py
    ``prepare_latents`` / ``img_shapes``); the VL view at ``calculate_dimensions(vl_area, w /
    h)`` (Edit: the same image; Edit-Plus: ``CONDITION_IMAGE_SIZE``), which Qwen2-VL's
    processor rounds to multiples of 28 (``smart_resize``; the pixel bounds do not bind here)
    and turns into one token per 2x2 patches of 14 px; the prompt's 512 tokens as Qwen-Image's."""
    from flowgrpo.models import qwen_image_edit

    cls = getattr(qwen_image_edit, adapter)
    configs = read_model_configs("known:qwen-image-edit")
    counts = cls.token_counts(configs, height, width, {})
    sw, sh = _calculate_dimensions(1024 * 1024, width / height)
    noised = (height // 16) * (width // 16)
    assert counts.image == noised + (sh // 16) * (sw // 16)
    vw, vh = _calculate_dimensions(vl_area, width / height)
    rh, rw = round(vh / 28) * 28, round(vw / 28) * 28
    assert 3136 <= rh * rw <= 12845056  # the bounds of Qwen2.5-VL's preprocessor_config
    vision = (rh // 28) * (rw // 28)  # 28 = patch 14 x merge 2: one token per merged patch
    assert counts.text == 512 + vision and counts.prompt == (512 + vision, 3584)
    assert counts.latent == 16 * (height // 8) * (width // 8)
    if (adapter, height, width) == ("QwenImageEditAdapter", 512, 512):  # the preset, by hand
        assert (counts.image, counts.text) == (32 * 32 + 64 * 64, 512 + 37 * 37)


# -- one set of checks with the trainer (issue 39 item 11, issue 40 item 8) ----------------------
def _folder(tmp_path, name):
    """The shipped config set ``name`` written out as a pipeline folder (config files only)."""
    configs = read_model_configs(f"known:{name}")
    root = tmp_path / name
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps(configs["model_index"]))
    for comp, config in configs.items():
        if comp not in ("model_index", "sources"):
            (root / comp).mkdir()
            (root / comp / "config.json").write_text(json.dumps(config))
    return root


REFUSED = [  # (preset, model set, overrides, --gpus, what the one line names)
    ("wan-t2v-ocr", "wan2.1-t2v-1.3b", ["model.num_frames=30"], 8, "model.num_frames"),
    ("wan-t2v-ocr", "wan2.1-t2v-1.3b", ["model.num_frames=10000"], 8, "model.num_frames"),
    ("wan-t2v-ocr", "wan2.1-t2v-1.3b", ["model.num_frames=10001"], 8, "model.num_frames"),
    ("sd3-ocr", "sd3.5-medium", ["model.num_frames=5"], 8, "model.num_frames"),
    ("sd3-ocr", "sd3.5-medium", ["model.width=22"], 8, "model.width"),
    ("flux2-pickscore", "flux.2-dev", ["model.height=1000", "model.width=1000"], 8, "height"),
    ("z-image-pickscore", "z-image", ["fsdp.sp_degree=4"], 8, "fsdp.sp_degree"),
    ("flux-pickscore", "sd3.5-medium", [], 8, "model.path"),
    (
        "flux-pickscore",
        "flux.1-dev",
        ["flux_kontext.source_size=512"],
        8,
        "flux_kontext.source_size",
    ),
    (
        "qwen-image-edit-counting",
        "qwen-image-edit",
        ["flux_kontext.source_size=17"],
        8,
        "source_size",
    ),
    (
        "flux-kontext-counting",
        "flux.1-kontext-dev",
        ["flux_kontext.source_size=17"],
        8,
        "source_size",
    ),
    ("sd3-ocr", "sd3.5-medium", ["sample.prompts_per_step=64", "sample.group_size=8"], 3, "512"),
    ("sd3-ocr", "sd3.5-medium", [], 7, "sample.prompts_per_step"),
    ("sd3-ocr", "sd3.5-medium", [], 10**12, "sample.prompts_per_step"),
    ("sd3-ocr", "sd3.5-medium", ["fsdp.sp_degree=2"], 3, "--gpus 3"),
]


@pytest.mark.parametrize("preset, model, overrides, gpus, culprit", REFUSED)
def test_the_planner_refuses_what_the_trainer_refuses(
    capsys, preset, model, overrides, gpus, culprit
):
    args = [preset, f"model.path=known:{model}", *overrides, "--gpus", str(gpus), "--gpu-gb", "80"]
    code, out, err = _cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and "fits" not in out, out
    assert len(lines) == 1 and lines[0].startswith("flowgrpo: error:") and culprit in lines[0]


@pytest.mark.parametrize("preset, model, overrides, gpus, culprit", REFUSED)
def test_train_refuses_them_with_the_planners_line(
    tmp_path, monkeypatch, preset, model, overrides, gpus, culprit
):
    from flowgrpo.config import ConfigError
    from flowgrpo.planner import plan_memory

    if gpus > 64:  # torchrun cannot start 10^12 ranks; the layout check is the same function
        gpus = 7
    folder = _folder(tmp_path, model)
    prompts = tmp_path / "p.jsonl"
    record = {"prompt": "a cat"}
    if "edit" in preset or "kontext" in preset:
        from PIL import Image

        Image.new("RGB", (64, 64)).save(tmp_path / "src.png")
        record["image"] = "src.png"
    prompts.write_text(json.dumps(record) + "\n")
    over = [f"model.path={folder}", f"data.train_prompts={prompts}", *overrides]
    over += [f"reward.{r}.options.path={tmp_path}" for r in ("pickscore",) if "pickscore" in preset]
    monkeypatch.setenv("WORLD_SIZE", str(gpus))
    with pytest.raises(ConfigError) as trained:
        load_config(preset, over, command="train")
    with pytest.raises(ConfigError) as planned:
        plan_memory(load_config(preset, over, check_paths=False), gpus, 80)
    train_line, plan_line = str(trained.value), str(planned.value)
    assert "\n" not in train_line and culprit.replace("--gpus", "world size") in train_line
    assert plan_line == train_line.replace(f"world size {gpus}", f"--gpus {gpus}")


@pytest.mark.parametrize("gpu_gb", ["inf", "nan"])
def test_gpu_gb_must_be_finite(capsys, gpu_gb):
    code, out, err = _cli(
        capsys, "sd3-ocr", "model.path=known:sd3.5-medium", "--gpus", "8", "--gpu-gb", gpu_gb
    )
    assert code == 2 and "fits" not in out and "--gpu-gb must be a finite number" in err


# -- the planner's advice (issue 39 item 12) --------------------------------------------------------
def test_no_model_path_plans_the_presets_own_model(capsys):
    code, out, _ = _cli(capsys, "sd3-ocr", "--gpus", "8", "--gpu-gb", "80")
    assert code == 0 and "planning the preset's model, model.path=known:sd3.5-medium" in out
    assert "sd3-ocr (known:sd3.5-medium)" in out


def test_when_nothing_fits_alone_it_names_the_cheapest_combination(capsys):
    over = ["model.path=known:flux.2-dev", "lora.enabled=false", "lora.target_modules=null"]
    code, out, _ = _cli(capsys, "flux2-pickscore", *over, "--gpus", "8", "--gpu-gb", "80")
    assert code == 0 and "does NOT fit: 233.4 GiB" in out and ", fits" not in out
    line = next(x for x in out.splitlines() if "cheapest combination that fits" in x)
    settings = line.split("fits: ", 1)[1].rsplit(":", 1)[0].split()
    assert settings == ["fsdp.activation_checkpointing=true", "fsdp.cpu_offload=true"]
    plan = plan_memory(load_config("flux2-pickscore", [*over, *settings], check_paths=False), 8, 80)
    assert plan.fits and f"{plan.total / GB:.1f} GiB" in line
    for alone in settings:  # and neither alone fits
        cfg = load_config("flux2-pickscore", [*over, alone], check_paths=False)
        assert not plan_memory(cfg, 8, 80).fits


HUNYUAN_720 = [
    "model.path=known:hunyuan-video-1.5-720p-t2v",
    "model.height=720",
    "model.width=1280",
    "model.num_frames=121",
]


def test_decoded_videos_are_host_memory_and_sp_keeps_each_groups_samples(capsys):
    """The adapters' decode returns videos on the CPU: they are not GPU memory (the total was
    216 GB at sp 1, 1730 GB at sp 8). Every rank of an SP group holds its group's latents."""
    per_video = 3 * 121 * 720 * 1280 * 4  # fp32 [3, F, H, W]
    for sp in (1, 8):
        cfg = load_config(
            "hunyuan-video15-pickscore", [*HUNYUAN_720, f"fsdp.sp_degree={sp}"], check_paths=False
        )
        plan = plan_memory(cfg, 8, 80)
        local = 48 * 24 // (8 // sp)  # samples per data-parallel rank
        assert plan.parts["(host: decoded images)"] == local * per_video
        latents = plan.parts["trajectories"]  # the decoded videos wait on the host
        assert 0 < latents < local * 0.2 * GB
        assert plan.total < plan.parts["(host: decoded images)"]
    code, out, _ = _cli(
        capsys, "hunyuan-video15-pickscore", *HUNYUAN_720, "--gpus", "8", "--gpu-gb", "80"
    )
    for knob in ("sample.prompts_per_step=24", "sample.group_size=12", "--gpus 16"):
        assert knob in out
    assert "1436 GiB per node of 8 GPUs" in out  # 8 x 192.7e9 B of decoded videos on the host


def test_a_tight_fit_warns():
    from flowgrpo.planner import format_plan

    cfg = load_config("sd3-ocr", ["model.path=known:sd3.5-medium"], check_paths=False)
    total = plan_memory(cfg, 8, 80).total / GB
    for share, warned in ((0.99, True), (0.8, False)):
        plan = plan_memory(cfg, 8, total / share)
        text = format_plan(plan, "t")
        assert plan.fits and ("warning: tight" in text) == warned


def test_hunyuan_sets_say_their_own_resolution():
    cfg = load_config(
        "hunyuan-video15-pickscore",
        ["model.path=known:hunyuan-video-1.5-720p-t2v"],
        check_paths=False,
    )
    notes = plan_memory(cfg, 8, 80).notes
    assert any("generates 720x1280 x 121 frames" in n and "480x480 x 5 frames" in n for n in notes)
    cfg = load_config("hunyuan-video15-pickscore", HUNYUAN_720, check_paths=False)
    assert not any("generates" in n for n in plan_memory(cfg, 8, 80).notes)


def test_off_policy_counts_the_behaviour_copy_and_a_second_rollout():
    """``trainer.off_policy_steps=1``: one more fp32 shadow of the trained params (the
    behaviour policy) and the next step's trajectories held while one trains."""
    qwen = ["model.path=known:qwen-image"]
    on = plan_memory(load_config("qwen-image-ocr", qwen, check_paths=False), 8, 80)
    cfg = load_config("qwen-image-ocr", [*qwen, "trainer.off_policy_steps=1"], check_paths=False)
    off = plan_memory(cfg, 8, 80)
    lora = on.parts["grads"] / 4  # the trained (LoRA) params' count per GPU: grads are fp32
    assert off.parts["EMA"] - on.parts["EMA"] == pytest.approx(4 * lora)
    assert off.parts["trajectories"] == pytest.approx(2 * on.parts["trajectories"])
    assert "off-policy model copy" not in off.parts
    over = [*qwen, "trainer.off_policy_steps=1", "trainer.off_policy_overlap=true"]
    copy = plan_memory(load_config("qwen-image-ocr", over, check_paths=False), 1, 80)
    parts = ("trained weights", "frozen text encoders", "frozen VAE etc.")
    assert copy.parts["off-policy model copy"] == pytest.approx(sum(copy.parts[k] for k in parts))

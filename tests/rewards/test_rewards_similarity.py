"""image_similarity with a tiny random CLIPModel saved offline: the score against transformers'
own CLIPModel.get_image_features + cosine, identical images, the registry, the config check."""

import pytest
import torch
import torch.nn.functional as F

from flowgrpo.config import load_config
from flowgrpo.rewards import MultiReward, RewardSpec, build_reward, registered_rewards
from flowgrpo.rewards.base import _with_device
from flowgrpo.rewards.clip import CLIP_MEAN, CLIP_STD
from flowgrpo.settings import ConfigError


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A full CLIPModel folder (what openai/clip-vit-large-patch14 is), tiny and random."""
    from transformers import CLIPConfig, CLIPModel

    path = tmp_path_factory.mktemp("tiny_clip_vision")
    text = dict(
        vocab_size=40, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
        pad_token_id=1,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8,
    )  # fmt: skip
    torch.manual_seed(0)
    CLIPModel(
        CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    ).save_pretrained(path)
    return path


def _reference(path, images: torch.Tensor, sources: list[list[torch.Tensor]]) -> torch.Tensor:
    """transformers' CLIPModel called directly on hand-normalised 32x32 pixels (the crop size:
    no resize), mean over each sample's sources of the cosine of get_image_features."""
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(path, local_files_only=True).eval()
    mean, std = torch.tensor(CLIP_MEAN).view(3, 1, 1), torch.tensor(CLIP_STD).view(3, 1, 1)

    def feats(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.get_image_features(pixel_values=(x - mean) / std).pooler_output

    out = []
    for img, srcs in zip(images, sources):
        f = feats(img[None])
        out.append(torch.stack([F.cosine_similarity(f, feats(s[None]))[0] for s in srcs]).mean())
    return torch.stack(out)


def _data(b: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(b, 3, 32, 32, generator=g)
    src = [torch.rand(3, 32, 32, generator=g) for _ in range(2)]
    # sample 0: one source; 1: two (Edit-Plus); 2: sample 0's source again (a group shares it)
    sources = [[src[0]], [src[0], src[1]], [src[0].clone()]]
    return images, sources


def test_score_equals_clip_image_features_cosine(tiny_clip):
    reward = build_reward("image_similarity", path=str(tiny_clip), batch_size=2)
    images, sources = _data()
    meta = [{"source_images": s} for s in sources]
    embedded, embed = [], reward.embed
    reward.embed = lambda pix: embedded.append(pix.shape[0]) or embed(pix)
    got = reward(images, ["p"] * 3, meta)
    assert embedded == [3, 2]  # the results, then each distinct source once
    assert got.shape == (3,) and got.dtype == torch.float32
    want = _reference(tiny_clip, images, sources)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert abs(float(got[1] - got[0])) > 1e-3  # the second source changes the mean
    first = build_reward("image_similarity", path=str(tiny_clip), source=1)
    torch.testing.assert_close(
        first(images[1:2], ["p"], meta[1:2]),
        _reference(tiny_clip, images[1:2], [[sources[1][1]]]),
        atol=1e-6,
        rtol=0,
    )


def test_identical_images_score_one_at_any_size(tiny_clip):
    reward = build_reward("image_similarity", path=str(tiny_clip))
    g = torch.Generator().manual_seed(1)
    for shape in ((2, 3, 32, 32), (2, 3, 48, 40)):  # 48x40: resized and centre-cropped
        images = torch.rand(*shape, generator=g)
        meta = [{"source_images": [img.clone()]} for img in images]
        torch.testing.assert_close(
            reward(images, ["p"] * 2, meta), torch.ones(2), atol=1e-6, rtol=0
        )


def test_registry_device_dtype_and_errors(tiny_clip):
    assert "image_similarity" in registered_rewards()
    multi = MultiReward(
        [RewardSpec("image_similarity", 0.2, {"path": str(tiny_clip)})], device="cpu"
    )
    fn = multi.fns["image_similarity"]
    # MultiReward builds it on the run's device (it takes a `device` option)
    assert _with_device("image_similarity", {"path": "p"}, "cuda:3")["device"] == "cuda:3"
    images, sources = _data()
    scores = multi(images, ["p"] * 3, [{"source_images": s} for s in sources])
    assert multi.weights_of(scores) == {"image_similarity": 0.2} and scores[
        "image_similarity"
    ].shape == (3,)
    bf16 = build_reward("image_similarity", path=str(tiny_clip), dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16  # scored in the model's dtype
    torch.testing.assert_close(
        bf16(images, ["p"] * 3, [{"source_images": s} for s in sources]),
        scores["image_similarity"],
        atol=3e-2,
        rtol=0,
    )
    with pytest.raises(ValueError, match="sample 1 has none"):
        fn(images[:2], ["p"] * 2, [{"source_images": sources[0]}, {}])
    with pytest.raises(ValueError, match="source=2 but sample 0 has 1 source image"):
        build_reward("image_similarity", path=str(tiny_clip), source=2)(
            images[:1], ["p"], [{"source_images": sources[0]}]
        )
    with pytest.raises(ValueError, match="needs option 'path'"):
        build_reward("image_similarity")


def test_a_text_to_image_run_with_it_is_a_one_line_config_error(tiny_clip, tmp_path):
    from PIL import Image

    sim = [f"reward.image_similarity.options.path={tiny_clip}"]
    with pytest.raises(ConfigError) as e:
        load_config(None, ["reward=image_similarity"])  # the toy: builtin prompts
    msg = str(e.value)
    assert "\n" not in msg and "reward 'image_similarity' compares each result" in msg
    assert "data.train_prompts have none (a text-to-image run)" in msg
    txt = tmp_path / "t2i.txt"
    txt.write_text("a cat\n")
    run = [f"model.path={tmp_path}", f"data.train_prompts={txt}"]
    with pytest.raises(ConfigError, match="reward 'sim' compares each result"):
        load_config(
            None,
            [*run, "reward=[{name: image_similarity, alias: sim, options: {path: x}}]"],
        )
    Image.new("RGB", (8, 8), "red").save(tmp_path / "cat.png")
    edits = tmp_path / "edits.jsonl"
    edits.write_text('{"prompt": "make it blue", "image": "cat.png"}\n')
    cfg = load_config(
        None,
        [f"model.path={tmp_path}", f"data.train_prompts={edits}", "reward=image_similarity", *sim],
    )
    assert cfg.reward[0].name == "image_similarity"


def _flow_grpo_reference(path, images: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
    """flow_grpo's image_similarity, transcribed (zhtmike/flow_grpo@9745241): the source as
    its script gives it, ``ref_image.resize((resolution, resolution))`` on the PIL image
    (scripts/train_qwenimage_edit.py:614) then uint8 / 255 (flow_grpo/rewards.py:70-74);
    ``ClipScorer._process`` = T.Resize(32) (bilinear, antialias) + T.CenterCrop(32) +
    T.Normalize on both (clip_scorer.py:22-28, 38-43), written out for a 48 x 40 result:
    torchvision resizes it to 38 x 32 (int(32 * 48 / 40)) and crops rows 3..35
    (round((38 - 32) / 2)); then get_image_features, L2-normalised, the diagonal of sim."""
    import numpy as np
    from PIL import Image
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(path, local_files_only=True).eval()
    mean, std = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    assert images.shape[-2:] == (48, 40)
    refs = []
    for s in sources:
        pil = Image.fromarray((s * 255).round().byte().permute(1, 2, 0).numpy())
        refs.append(torch.tensor(np.array(pil.resize((40, 48)))).permute(2, 0, 1))
    ref_pixels = torch.stack(refs).to(torch.uint8) / 255.0

    def process(x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, size=(38, 32), mode="bilinear", align_corners=False, antialias=True)
        return (x[..., 3:35, :] - mean) / std

    with torch.no_grad():
        a = model.get_image_features(pixel_values=process(images)).pooler_output
        b = model.get_image_features(pixel_values=process(ref_pixels)).pooler_output
    a, b = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
    return torch.diagonal(a @ b.T)


def test_flow_grpo_preprocessing_equals_its_scorer(tiny_clip):
    """preprocess='flow_grpo_scorer': bilinear, the source resized to the result's size first (the
    counting_edit presets); the default 'clip' form scores the same pair differently."""
    g = torch.Generator().manual_seed(3)
    images = torch.rand(2, 3, 48, 40, generator=g)
    sources = [(torch.rand(3, 64, 56, generator=g) * 255).round() / 255 for _ in range(2)]
    meta = [{"source_images": [s]} for s in sources]
    want = _flow_grpo_reference(tiny_clip, images, sources)
    ours = build_reward("image_similarity", path=str(tiny_clip), preprocess="flow_grpo_scorer")
    torch.testing.assert_close(ours(images, ["p"] * 2, meta), want, atol=1e-6, rtol=0)
    clip = build_reward("image_similarity", path=str(tiny_clip))
    assert (clip(images, ["p"] * 2, meta) - want).abs().max() > 1e-3
    with pytest.raises(ValueError, match="preprocess must be 'clip' or 'flow_grpo_scorer'"):
        build_reward("image_similarity", path=str(tiny_clip), preprocess="bilinear")
    for preset in ("qwen-image-edit-counting", "flux-kontext-counting"):
        cfg = load_config(preset, [], check_paths=False)
        spec = next(r for r in cfg.reward if r.name == "image_similarity")
        assert spec.options["preprocess"] == "flow_grpo_scorer", preset


def test_a_clipmodel_folder_loads_without_a_load_report(tiny_clip, tmp_path, capfd):
    """The vision model leaves a CLIPModel folder's text tower unused by design: transformers'
    ~23-line LOAD REPORT of its keys (per rank) is not printed; anything else missing or
    unused is one warning line."""
    import warnings

    from safetensors.torch import load_file, save_file

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        build_reward("image_similarity", path=str(tiny_clip))
    out = capfd.readouterr()
    assert "LOAD REPORT" not in out.out + out.err and "UNEXPECTED" not in out.out + out.err
    broken = tmp_path / "no_projection"  # a folder without the vision projection
    broken.mkdir()
    for f in tiny_clip.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    state = load_file(str(broken / "model.safetensors"))
    save_file({k: v for k, v in state.items() if "visual_projection" not in k},
              str(broken / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    with pytest.warns(UserWarning, match=r"loaded with weights missing 1 \(e.g. visual_proj"):
        build_reward("image_similarity", path=str(broken))

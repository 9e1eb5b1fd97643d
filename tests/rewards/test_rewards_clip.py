"""CLIP score / PickScore with a tiny random CLIPModel and a CLIPTokenizer built offline."""

import json

import pytest
import torch

from flowgrpo.rewards import build_reward
from flowgrpo.rewards.clip import CLIP_MEAN, CLIP_STD


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    path = tmp_path_factory.mktemp("tiny_clip")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77).save_pretrained(path)
    text = dict(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
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


def test_clip_score_finite_and_matches_manual(tiny_clip):
    reward = build_reward("clip_score", path=str(tiny_clip))
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 48, 40, generator=g)  # non-square: resize + centre crop
    prompts = ["a red cat", "two dogs", "a sign that says hello"]
    scores = reward(images, prompts, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all() and scores.abs().max() > 0

    # the torch preprocessing: shortest side -> 32, centre crop 32x32, CLIP mean/std
    pix = reward.preprocess(images)
    assert pix.shape == (3, 3, 32, 32)
    flat = reward.preprocess(torch.full((1, 1, 32, 32), 0.5))  # grayscale, no resize
    exp = (0.5 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    torch.testing.assert_close(flat[0, :, 0, 0], exp)

    # score = logit_scale.exp() * cos / 30, recomputed from the model's own outputs
    model, tok = reward.model, reward.tokenizer
    ids = tok(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    with torch.no_grad():
        t = model.get_text_features(**ids).pooler_output
        v = model.get_image_features(pixel_values=pix).pooler_output
    cos = torch.nn.functional.cosine_similarity(t, v, dim=-1)
    torch.testing.assert_close(scores, model.logit_scale.exp() * cos / 30.0)

    pick = build_reward("pickscore", path=str(tiny_clip), processor_path=str(tiny_clip))
    torch.testing.assert_close(pick(images, prompts, [{}] * 3), scores * 30.0 / 26.0)


def test_preprocessor_config_is_honoured(tiny_clip, tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (proc / f).write_bytes((tiny_clip / f).read_bytes())
    cfg = {"size": {"shortest_edge": 40}, "crop_size": {"height": 32, "width": 32}}
    (proc / "preprocessor_config.json").write_text(json.dumps(cfg | {"image_mean": [0, 0, 0]}))
    reward = build_reward("clip_score", path=str(tiny_clip), processor_path=str(proc))
    assert (reward.resize, reward.crop) == (40, 32)
    img = torch.full((1, 3, 64, 64), 0.25)
    torch.testing.assert_close(reward.preprocess(img)[0, :, 0, 0], 0.25 / torch.tensor(CLIP_STD))


def test_missing_path_errors(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=rf"path='{missing}' is not an existing"):
        build_reward("clip_score", path=str(missing))
    with pytest.raises(ValueError, match="reward 'pickscore' needs option 'path'"):
        build_reward("pickscore")

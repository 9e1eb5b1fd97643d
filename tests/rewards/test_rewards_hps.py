"""``hpsv2`` equals hpsv2's own scoring on the same weights: a tiny random open_clip CLIP
(the ViT-H-14 architecture: GELU, vision heads of width 80) saved in HPS_v2.1_compressed.pt's
layout (``{"state_dict": open_clip keys}``), scored by the reward (converted to transformers
at load) and by the transcribed open_clip forward + eval transform (hpsv2/img_score.py:57-84,
tgxs002/HPSv2@866735e): <= 1e-5 in fp32."""

import pytest
import torch
from PIL import Image
from tests.rewards import pref_refs as ref

from flowgrpo.rewards import build_reward


def clip_tokenizer(path):
    """A CLIPTokenizer built offline whose end-of-text token has the highest id, as in the
    real vocabulary (open_clip pools at ``text.argmax``)."""
    from transformers import CLIPTokenizer

    vocab = {}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77, pad_token="<|endoftext|>")
    tok.save_pretrained(path)
    return tok


TINY = dict(embed_dim=48, image_size=56, patch=14, v_width=160, v_layers=2, v_head_width=80,
            context=77, t_width=128, t_layers=2, t_heads=2)  # fmt: skip


@pytest.fixture(scope="module")
def hps(tmp_path_factory):
    root = tmp_path_factory.mktemp("hps")
    tok = clip_tokenizer(root / "tok")
    torch.manual_seed(0)
    model = ref.randomize_(ref.OpenClipCLIP(vocab=len(tok), **TINY), seed=1)
    ckpt = root / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict()}, ckpt)
    return model, tok, ckpt, root / "tok"


def reference_scores(model, tok, images, prompts, size):
    """hpsv2 ``score`` per image: open_clip tokens (padded with 0), preprocess_val, cosine."""
    out = []
    for img, prompt in zip(images, prompts):
        arr = (img * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        image = ref.open_clip_preprocess_val(Image.fromarray(arr), size).unsqueeze(0)
        ids = tok(prompt)["input_ids"][:77]
        text = torch.zeros(1, 77, dtype=torch.long)
        text[0, : len(ids)] = torch.tensor(ids)
        with torch.no_grad():
            o = model(image, text)
        out.append(torch.diagonal(o["image_features"] @ o["text_features"].T)[0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def reward(hps):
    _, _, ckpt, tok_dir = hps
    return build_reward("hpsv2", path=str(ckpt), processor_path=str(tok_dir), batch_size=2)


@pytest.mark.parametrize("shape", [(3, 96, 80), (3, 56, 56), (3, 512, 512)])
def test_hpsv2_equals_reference(hps, reward, shape):
    model, tok, _, _ = hps
    g = torch.Generator().manual_seed(sum(shape))
    images = torch.rand(3, *shape, generator=g)
    prompts = ["a red cat", "two dogs on a sofa", "a sign that says hello 42"]
    got = reward(images, prompts, [{}] * 3)
    want = reference_scores(model, tok, images, prompts, TINY["image_size"])
    assert got.shape == (3,) and want.abs().min() > 1e-3  # not a degenerate comparison
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_hpsv2_conversion_is_checked(hps, reward, tmp_path):
    """Weights that differ from the converted ones change the score (the test can fail), and
    a checkpoint in another layout is one line naming the missing key."""
    model, tok, ckpt, tok_dir = hps
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["visual.transformer.resblocks.1.attn.in_proj_weight"][200:] *= 1.5  # only the V rows
    bad = tmp_path / "bad.pt"
    torch.save({"state_dict": sd}, bad)
    images = torch.rand(2, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    prompts = ["a cat", "a dog"]
    other = build_reward("hpsv2", path=str(bad), processor_path=str(tok_dir))
    assert (reward(images, prompts, [{}] * 2) - other(images, prompts, [{}] * 2)).abs().max() > 1e-4
    torch.save({"state_dict": {"foo.weight": torch.zeros(2)}}, bad)
    with pytest.raises(ValueError, match="no 'visual.conv1.weight'"):
        build_reward("hpsv2", path=str(bad), processor_path=str(tok_dir))


def test_hpsv2_missing_paths(tmp_path):
    with pytest.raises(ValueError, match="reward 'hpsv2' needs option 'path'"):
        build_reward("hpsv2")
    missing = tmp_path / "HPS_v2.1_compressed.pt"
    with pytest.raises(FileNotFoundError, match=r"path='.*HPS_v2.1_compressed.pt' is not an"):
        build_reward("hpsv2", path=str(missing), processor_path=str(tmp_path))

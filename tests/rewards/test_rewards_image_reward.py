"""``image_reward`` equals ImageReward's ``score`` on the same weights: a tiny random BLIP
(timm ViT with qkv bias and eps 1e-6, med.py BERT with cross-attention) + MLP head saved in
ImageReward.pt's key layout, scored by the reward (converted to transformers at load) and by
the transcribed ImageReward forward + ``_transform`` (ImageReward/ImageReward.py,
THUDM/ImageReward@c1392c6): <= 1e-5 in fp32."""

import pytest
import torch
from PIL import Image
from tests.rewards import pref_refs as ref

from flowgrpo.rewards import build_reward

WORDS = "a red cat two dogs on sofa sign that says hello blue sky over the sea".split()
TINY = dict(image_size=64, patch=16, v_dim=128, v_depth=2, v_heads=2, hidden=128, layers=2,
            heads=2, inter=256)  # fmt: skip


def blip_tokenizer(root):
    """bert-base-uncased's shape, built offline, and BLIP's ``init_tokenizer`` additions."""
    from transformers import BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"0123456789"]
    vocab = list(dict.fromkeys(vocab))
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(root)
    tok = BertTokenizer.from_pretrained(root)
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


@pytest.fixture(scope="module")
def imagereward(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagereward")
    (root / "tok").mkdir()
    tok = blip_tokenizer(root / "tok")
    model = ref.randomize_(ref.ImageRewardRef(vocab=len(tok), **TINY), seed=3)
    ckpt = root / "ImageReward.pt"
    sd = model.state_dict()  # + the buffer med.py's BertEmbeddings saves
    sd["blip.text_encoder.embeddings.position_ids"] = torch.arange(512).expand(1, -1)
    torch.save(sd, ckpt)
    return model, tok, ckpt, root / "tok"


def reference_scores(model, tok, images, prompts):
    out = []
    for img, prompt in zip(images, prompts):
        arr = (img * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        pil = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
        image = ref.clip_transform(pil, TINY["image_size"]).unsqueeze(0)
        t = tok(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        with torch.no_grad():
            out.append(model.score(t.input_ids, t.attention_mask, image))
    return torch.tensor(out)


@pytest.fixture(scope="module")
def reward(imagereward):
    _, _, ckpt, tok_dir = imagereward
    return build_reward("image_reward", path=str(ckpt), processor_path=str(tok_dir), batch_size=2)


@pytest.mark.parametrize("shape", [(3, 80, 100), (3, 64, 64), (1, 512, 512)])
def test_image_reward_equals_reference(imagereward, reward, shape):
    model, tok, _, _ = imagereward
    g = torch.Generator().manual_seed(sum(shape))
    images = torch.rand(3, *shape, generator=g)
    prompts = ["a red cat", "two dogs on the sofa " * 8, "a sign that says hello 42"]
    got = reward(images, prompts, [{}] * 3)
    want = reference_scores(model, tok, images, prompts)
    assert got.shape == (3,) and (want - want.mean()).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_image_reward_conversion_is_checked(imagereward, reward, tmp_path):
    model, tok, ckpt, tok_dir = imagereward
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["blip.text_encoder.encoder.layer.1.crossattention.self.value.weight"] *= 1.5
    bad = tmp_path / "bad.pt"
    torch.save(sd, bad)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    prompts = ["a cat", "a dog"]
    other = build_reward("image_reward", path=str(bad), processor_path=str(tok_dir))
    assert (reward(images, prompts, [{}] * 2) - other(images, prompts, [{}] * 2)).abs().max() > 1e-4
    del sd["mlp.layers.0.weight"]
    torch.save(sd, bad)
    with pytest.raises(ValueError, match="no mlp.layers.0.weight"):
        build_reward("image_reward", path=str(bad), processor_path=str(tok_dir))


def test_image_reward_missing_paths(tmp_path):
    with pytest.raises(ValueError, match="reward 'image_reward' needs option 'path'"):
        build_reward("image_reward")
    (tmp_path / "ImageReward.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="needs option 'processor_path'"):
        build_reward("image_reward", path=str(tmp_path / "ImageReward.pt"))

"""``aesthetic`` equals the LAION improved aesthetic predictor's forward on the same weights:
a tiny random OpenAI-layout CLIP (QuickGELU, heads of 64) and a random MLP in the .pth's
layout; the reward loads the CLIP as transformers' CLIPModel (as openai/clip-vit-large-patch14
is published) and the reference runs simple_inference.py's path (clip ``preprocess``,
``encode_image``, numpy ``normalized``, ``MLP``; christophschuhmann/improved-aesthetic-predictor
@6934dd8) on the original weights: <= 1e-5 in fp32."""

import pytest
import torch
from PIL import Image
from tests.rewards import pref_refs as ref

from flowgrpo.rewards import build_reward

TINY = dict(embed_dim=64, image_size=56, patch=14, v_width=128, v_layers=2, v_head_width=64,
            context=77, vocab=50, t_width=64, t_layers=1, t_heads=1, quick_gelu=True)  # fmt: skip


@pytest.fixture(scope="module")
def aesthetic(tmp_path_factory):
    from transformers import CLIPModel

    from flowgrpo.rewards.convert import open_clip_config, open_clip_to_hf

    root = tmp_path_factory.mktemp("aesthetic")
    clip = ref.randomize_(ref.OpenClipCLIP(**TINY), seed=5)
    mlp = ref.randomize_(ref.RewardMLP(TINY["embed_dim"]), seed=6, std=0.2)
    torch.save(mlp.state_dict(), root / "sac+logos+ava1-l14-linearMSE.pth")
    # the user's side: a transformers CLIPModel directory (what the Hub publishes for OpenAI's
    # ViT-L/14), made here from the original weights
    sd = clip.state_dict()
    cfg = open_clip_config(sd, hidden_act="quick_gelu", bos_token_id=48, eos_token_id=49)
    hf = CLIPModel(cfg)
    hf.load_state_dict(open_clip_to_hf(sd))
    hf.save_pretrained(root / "clip")
    return clip, mlp, root


def reference_scores(clip, mlp, images):
    out = []
    for img in images:
        arr = (img * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        image = ref.clip_transform(Image.fromarray(arr), TINY["image_size"]).unsqueeze(0)
        with torch.no_grad():
            feats = clip.encode_image(image)
            emb = ref.laion_normalized(feats.numpy())
            out.append(mlp(torch.from_numpy(emb).float())[0, 0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def reward(aesthetic):
    path = aesthetic[2] / "sac+logos+ava1-l14-linearMSE.pth"
    clip_path = str(aesthetic[2] / "clip")
    return build_reward("aesthetic", path=str(path), clip_path=clip_path, batch_size=2)


@pytest.mark.parametrize("shape", [(3, 90, 70), (3, 56, 56), (3, 512, 512)])
def test_aesthetic_equals_reference(aesthetic, reward, shape):
    clip, mlp, root = aesthetic
    images = torch.rand(3, *shape, generator=torch.Generator().manual_seed(sum(shape)))
    got = reward(images, ["ignored"] * 3, [{}] * 3)
    want = reference_scores(clip, mlp, images)
    assert got.shape == (3,) and (want - want.mean()).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_aesthetic_bad_input(aesthetic, tmp_path):
    clip, mlp, root = aesthetic
    with pytest.raises(ValueError, match="reward 'aesthetic' needs option 'clip_path'"):
        build_reward("aesthetic", path=str(root / "sac+logos+ava1-l14-linearMSE.pth"))
    wrong = ref.RewardMLP(32)
    torch.save(wrong.state_dict(), tmp_path / "mlp.pth")
    with pytest.raises(ValueError, match="takes 32-d embeddings, the CLIP .* gives 64-d"):
        build_reward("aesthetic", path=str(tmp_path / "mlp.pth"), clip_path=str(root / "clip"))

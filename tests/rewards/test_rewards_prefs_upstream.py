"""The preference rewards against the UPSTREAM code itself (not a transcription): hpsv2's
bundled open_clip (model, ``image_transform``, tokenizer with its BPE vocabulary), ImageReward's
``ImageReward.score`` (BLIP vit.py / med.py through timm and transformers) and OpenAI's
``clip`` (``build_model``, ``_transform``) under the LAION MLP; torchvision's own transforms.

Skipped unless ``FLOWGRPO_PREF_UPSTREAM`` names a folder holding ``src/`` (the upstream
sources: ``clip/`` of openai/CLIP@d05afc4, ``hpsv2/src/open_clip/`` of tgxs002/HPSv2@866735e,
``ImageReward/ImageReward.py`` + ``ImageReward/models/BLIP/`` of THUDM/ImageReward@c1392c6)
and ``site/`` (unpacked wheels: torchvision 0.28, timm, ftfy, wcwidth, and a ``fairscale``
stub whose ``checkpoint_wrapper`` returns its module: it only serves gradient checkpointing).
torchvision's C ops do not load beside torch 2.13; their schemas are defined (never called) so
that its Python transforms import. transformers 5 moved three helpers med.py imports from
``modeling_utils``, and two ``PreTrainedModel`` helpers (``invert_attention_mask``,
``get_head_mask``); they are put back, and med.py's ``init_weights`` (whose transformers 5
version needs ``post_init``) is skipped: every weight is drawn by the test. None of this
changes a forward."""

import gzip
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from tests.rewards import pref_refs as ref

from flowgrpo.rewards import build_reward

# The folder, once (run from the repository root, U=build/prefs_upstream):
#   pip download --no-deps -d $U/whl torchvision==0.28.0 timm ftfy wcwidth
#   mkdir -p $U/site $U/src && for w in $U/whl/*.whl; do unzip -q -o $w -d $U/site; done
#   mkdir -p $U/site/fairscale/nn/checkpoint && touch $U/site/fairscale/__init__.py \
#     $U/site/fairscale/nn/__init__.py $U/site/fairscale/nn/checkpoint/__init__.py && echo \
#     'def checkpoint_wrapper(m, *a, **k): return m' \
#     > $U/site/fairscale/nn/checkpoint/checkpoint_activations.py
#   git -C CLIP archive d05afc4 clip | tar x -C $U/src
#   git -C HPSv2 archive 866735e hpsv2/src/open_clip | tar x -C $U/src
#   git -C ImageReward archive c1392c6 ImageReward/ImageReward.py ImageReward/models/BLIP \
#     | tar x -C $U/src
#   git -C ImageReward show c1392c6:train/src/config/med_config.json > $U/src/med_config.json
# then FLOWGRPO_PREF_UPSTREAM=$U pytest tests/rewards/test_rewards_prefs_upstream.py (~70 s).
UP = os.environ.get("FLOWGRPO_PREF_UPSTREAM")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not UP, reason="FLOWGRPO_PREF_UPSTREAM (upstream sources) not set"),
]
TV_OPS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward": "(Tensor grad, Tensor rois, float spatial_scale, SymInt "
    "pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, float "
    "spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt "
    "batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt "
    "height, SymInt width) -> Tensor",
    "ps_roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, float "
    "spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt "
    "channels, SymInt height, SymInt width) -> Tensor",
    "qroi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "deform_conv2d": "(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt "
    "dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward": "(Tensor grad, Tensor input, Tensor weight, Tensor offset, "
    "Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, "
    "SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool "
    "use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}
_LIB = []
PROMPTS = [
    "A photo of an Astronaut riding a horse, 4K!",
    "two dogs & a cat on the sofa (oil painting)",
    "a sign that says 'hello world 42' " * 12,  # past 77 CLIP / 35 BERT tokens: truncated
]


@pytest.fixture(scope="module")
def upstream():
    import transformers.modeling_utils as mu
    import transformers.pytorch_utils as pu

    if not hasattr(torch.ops.torchvision, "nms"):
        lib = torch.library.Library("torchvision", "DEF")
        for name, schema in TV_OPS.items():
            lib.define(name + schema)
        _LIB.append(lib)
    for p in (Path(UP) / "site", Path(UP) / "src"):
        sys.path.insert(0, str(p))
    mu.apply_chunking_to_forward = pu.apply_chunking_to_forward
    mu.prune_linear_layer = pu.prune_linear_layer
    mu.find_pruneable_heads_and_indices = getattr(pu, "find_pruneable_heads_and_indices", None)
    import torchvision  # noqa: F401

    return Path(UP) / "src"


def _pil(img: torch.Tensor) -> Image.Image:
    arr = (img * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(arr)


def _images(shape, n=3, seed=0):
    return torch.rand(n, *shape, generator=torch.Generator().manual_seed(seed))


def hf_clip_tokenizer(bpe_gz: Path, out: Path):
    """The transformers CLIPTokenizer of open_clip's SimpleTokenizer vocabulary, built as
    SimpleTokenizer builds it (what laion/CLIP-ViT-H-14's tokenizer files hold)."""
    from hpsv2.src.open_clip.tokenizer import bytes_to_unicode
    from transformers import CLIPTokenizer

    merges = gzip.open(bpe_gz).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = CLIPTokenizer(str(out / "vocab.json"), str(out / "merges.txt"), model_max_length=77,
                        pad_token="<|endoftext|>")  # fmt: skip
    tok.save_pretrained(out)
    return tok


@pytest.mark.parametrize("shape", [(3, 96, 80), (3, 512, 512)])
def test_hpsv2_equals_hpsv2_open_clip(upstream, tmp_path, shape):
    from hpsv2.src.open_clip import get_tokenizer
    from hpsv2.src.open_clip.model import CLIP
    from hpsv2.src.open_clip.transform import image_transform

    torch.manual_seed(0)
    vision = dict(image_size=56, layers=2, width=160, head_width=80, patch_size=14)
    text = dict(context_length=77, vocab_size=49408, width=128, heads=2, layers=2)
    model = ref.randomize_(CLIP(48, vision, text, output_dict=True), seed=11)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "HPS_v2.1_compressed.pt")
    hf_clip_tokenizer(
        upstream / "hpsv2/src/open_clip/bpe_simple_vocab_16e6.txt.gz", tmp_path / "tok"
    )
    preprocess_val = image_transform(56, is_train=False)  # create_model_and_transforms' own
    tokenizer = get_tokenizer("ViT-H-14")
    images = _images(shape)
    want = []
    for img, prompt in zip(images, PROMPTS):  # hpsv2/img_score.py score(), fp32
        with torch.no_grad():
            out = model(preprocess_val(_pil(img)).unsqueeze(0), tokenizer([prompt]))
            want.append(torch.diagonal(out["image_features"] @ out["text_features"].T)[0])
    reward = build_reward("hpsv2", path=str(tmp_path / "HPS_v2.1_compressed.pt"),
                          processor_path=str(tmp_path / "tok"))  # fmt: skip
    got = reward(images, PROMPTS, [{}] * 3)
    ids = reward.tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=77)
    ours = torch.tensor(ids["input_ids"])
    theirs = tokenizer(PROMPTS)
    assert torch.equal(ours * (theirs != 0), theirs)  # same tokens (padding apart)
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 80, 100), (3, 512, 512)])
def test_image_reward_equals_image_reward_score(upstream, tmp_path, shape, monkeypatch):
    import ImageReward.models.BLIP.blip_pretrain as bp
    from ImageReward.ImageReward import ImageReward
    from ImageReward.models.BLIP.vit import VisionTransformer
    from tests.rewards.test_rewards_image_reward import blip_tokenizer
    from transformers import BertTokenizer

    (tmp_path / "tok").mkdir()
    tok = blip_tokenizer(tmp_path / "tok")
    med = json.loads((upstream / "med_config.json").read_text())
    med.update(num_hidden_layers=2, vocab_size=len(tok))  # BERT-base width (MLP(768)), 2 layers
    (tmp_path / "med_config.json").write_text(json.dumps(med))

    def tiny_vit(vit, image_size, *a, **k):  # create_vit('large') at width 256, depth 2
        return VisionTransformer(img_size=image_size, patch_size=16, embed_dim=256, depth=2,
                                 num_heads=4), 256  # fmt: skip

    # transformers 5's init_weights needs attributes its post_init sets, which med.py's 4.x-era
    # BertModel never calls; every weight is drawn below anyway
    monkeypatch.setattr(bp.BertModel, "init_weights", lambda self: None)
    # two PreTrainedModel helpers med.py calls that transformers 5 dropped, as 4.x had them
    # (an all-ones encoder mask and no head mask: both are no-ops here)
    monkeypatch.setattr(
        bp.BertModel,
        "invert_attention_mask",
        lambda self, m: (1.0 - m[:, None, None, :].float()) * torch.finfo(torch.float32).min,
        raising=False,
    )
    monkeypatch.setattr(
        bp.BertModel, "get_head_mask", lambda self, hm, n, *a: [None] * n, raising=False
    )
    monkeypatch.setattr(bp, "create_vit", tiny_vit)
    monkeypatch.setattr(bp, "init_tokenizer", lambda: tok)
    model = ImageReward(med_config=str(tmp_path / "med_config.json"), device="cpu").eval()
    ref.randomize_(model, seed=12)
    model.mlp.layers[-1].bias.data += 0.5
    torch.save(model.state_dict(), tmp_path / "ImageReward.pt")
    images = _images(shape, seed=1)
    with torch.no_grad():
        want = torch.tensor([model.score(p, _pil(im)) for p, im in zip(PROMPTS, images)])
    assert isinstance(tok, BertTokenizer)
    reward = build_reward("image_reward", path=str(tmp_path / "ImageReward.pt"),
                          processor_path=str(tmp_path / "tok"))  # fmt: skip
    torch.testing.assert_close(reward(images, PROMPTS, [{}] * 3), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 90, 70), (3, 512, 512)])
def test_aesthetic_equals_laion_predictor(upstream, tmp_path, shape):
    import clip
    from clip.model import build_model
    from transformers import CLIPModel

    from flowgrpo.rewards.convert import open_clip_config, open_clip_to_hf

    # an OpenAI CLIP state dict (ViT-L/14's layout, tiny), built by clip's own CLIP class
    net = clip.model.CLIP(64, 56, 2, 128, 14, 77, 49408, 64, 1, 1)
    # OpenAI publishes its CLIP weights in fp16 and build_model casts to fp16: draw values
    # fp16 holds exactly, so both sides hold the same numbers
    sd = {k: v.half().float() for k, v in ref.randomize_(net, seed=13).state_dict().items()}
    model = build_model({k: v.clone() for k, v in sd.items()}).float().eval()  # as clip.load
    mlp = ref.randomize_(ref.RewardMLP(64), seed=14, std=0.2)
    torch.save(mlp.state_dict(), tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    cfg = open_clip_config(sd, hidden_act="quick_gelu", bos_token_id=49406, eos_token_id=49407)
    hf = CLIPModel(cfg)  # the user's openai/clip-vit-large-patch14 directory
    hf.load_state_dict(open_clip_to_hf(sd))
    hf.save_pretrained(tmp_path / "clip")
    preprocess = clip.clip._transform(model.visual.input_resolution)
    images = _images(shape, seed=2)
    want = []
    for img in images:  # simple_inference.py
        with torch.no_grad():
            feats = model.encode_image(preprocess(_pil(img)).unsqueeze(0))
        emb = ref.laion_normalized(feats.numpy())
        want.append(mlp(torch.from_numpy(emb).float())[0, 0])
    reward = build_reward("aesthetic", path=str(tmp_path / "sac+logos+ava1-l14-linearMSE.pth"),
                          clip_path=str(tmp_path / "clip"))  # fmt: skip
    torch.testing.assert_close(reward(images, [""] * 3, [{}] * 3), torch.stack(want), rtol=0,
                               atol=1e-5)  # fmt: skip

"""Reference forwards of the preference models, transcribed plainly from their sources with
the ORIGINAL parameter names (so ``state_dict()`` is the published checkpoints' key layout),
and their preprocessing (torchvision's PIL / tensor transforms). Independent of flowgrpo:
nothing here imports the package's conversion or preprocessing.

- open_clip ``CLIP`` (ViT image tower, plain text tower): hpsv2/src/open_clip/model.py
  (``CLIP.encode_image/encode_text/forward``) and transformer.py (``ResidualAttentionBlock``,
  ``VisionTransformer.forward``), tgxs002/HPSv2@866735ecaae999fa714bd9edfa05aa2672669ee3.
  OpenAI CLIP has the same layout with QuickGELU (``quick_gelu=True``).
- BLIP as ImageReward uses it: ImageReward/models/BLIP/vit.py (timm ``VisionTransformer``,
  LayerNorm eps 1e-6, qkv bias) and med.py (``BertModel`` with cross-attention, mode
  "multimodal"), ImageReward/ImageReward.py (``MLP``, ``score``: mean 0.16717362830052426,
  std 1.0333394966054072), THUDM/ImageReward@c1392c6dd0fd6ecd6d416c96959ab744a6d0a8fb.
- LAION improved aesthetic predictor: simple_inference.py (``MLP``, ``normalized``),
  christophschuhmann/improved-aesthetic-predictor@6934dd81792f086e613a121dbce43082cb8be85e.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch
from PIL import Image
from torch import nn

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


# ---- torchvision transforms (torchvision/transforms/functional.py), transcribed ----------
def _tv_size(h: int, w: int, size: int) -> tuple[int, int]:
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    return new_h, new_w


def to_tensor(pil: Image.Image) -> torch.Tensor:
    """``ToTensor``: HWC uint8 -> CHW float / 255."""
    return torch.from_numpy(np.array(pil)).permute(2, 0, 1).contiguous().float().div(255)


def center_crop(x, size: int):
    """``CenterCrop`` of a PIL image or a CHW tensor."""
    if isinstance(x, Image.Image):
        w, h = x.size
        top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
        return x.crop((left, top, left + size, top + size))
    h, w = x.shape[-2:]
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return x[..., top : top + size, left : left + size]


def resize_pil(pil: Image.Image, size: int) -> Image.Image:
    """``Resize(size, BICUBIC)`` on a PIL image (F_pil.resize -> Image.resize)."""
    w, h = pil.size
    nh, nw = _tv_size(h, w, size)
    return pil if (nh, nw) == (h, w) else pil.resize((nw, nh), Image.BICUBIC)


def resize_tensor(x: torch.Tensor, size: int) -> torch.Tensor:
    """``Resize(size, BICUBIC)`` on a float CHW tensor (F_t.resize; antialias=True, the
    default since torchvision 0.17; no clamp for float input)."""
    h, w = x.shape[-2:]
    nh, nw = _tv_size(h, w, size)
    if (nh, nw) == (h, w):
        return x
    y = torch.nn.functional.interpolate(
        x[None], size=[nh, nw], mode="bicubic", align_corners=False, antialias=True
    )
    return y[0]


def normalize(x: torch.Tensor) -> torch.Tensor:
    m, s = torch.tensor(OPENAI_MEAN).view(3, 1, 1), torch.tensor(OPENAI_STD).view(3, 1, 1)
    return (x - m) / s


def open_clip_preprocess_val(pil: Image.Image, size: int) -> torch.Tensor:
    """hpsv2 open_clip ``image_transform(is_train=False)`` (transform.py:159-170):
    convert RGB, ToTensor, Resize(BICUBIC) on the tensor, CenterCrop, Normalize."""
    x = to_tensor(pil.convert("RGB"))
    return normalize(center_crop(resize_tensor(x, size), size))


def clip_transform(pil: Image.Image, size: int) -> torch.Tensor:
    """CLIP's / ImageReward's ``_transform(n_px)``: Resize(BICUBIC) + CenterCrop on the PIL
    image, convert RGB, ToTensor, Normalize."""
    return normalize(to_tensor(center_crop(resize_pil(pil, size), size).convert("RGB")))


# ---- open_clip ----------------------------------------------------------------------------
class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, act) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            OrderedDict(
                [("c_fc", nn.Linear(d_model, 4 * d_model)), ("gelu", act()),
                 ("c_proj", nn.Linear(4 * d_model, d_model))]
            )
        )  # fmt: skip

    def forward(self, x, attn_mask=None):  # x: LND
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=attn_mask)[0]
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, act) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList(
            [ResidualAttentionBlock(width, heads, act) for _ in range(layers)]
        )

    def forward(self, x, attn_mask=None):
        for r in self.resblocks:
            x = r(x, attn_mask=attn_mask)
        return x


class VisionTransformer(nn.Module):
    def __init__(self, image_size, patch, width, layers, heads, out_dim, act) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch, stride=patch, bias=False)
        scale = width**-0.5
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(
            scale * torch.randn((image_size // patch) ** 2 + 1, width)
        )
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = Transformer(width, layers, heads, act)
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(scale * torch.randn(width, out_dim))

    def forward(self, x):
        x = self.conv1(x)
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
        cls = self.class_embedding + torch.zeros(x.shape[0], 1, x.shape[-1])
        x = torch.cat([cls, x], dim=1) + self.positional_embedding
        x = self.ln_pre(x).permute(1, 0, 2)
        x = self.transformer(x).permute(1, 0, 2)
        pooled = self.ln_post(x[:, 0])  # _global_pool (cls token), then ln_post
        return pooled @ self.proj


class OpenClipCLIP(nn.Module):
    """open_clip ``CLIP`` with a ViT tower: top-level text keys, ``visual.*`` image keys."""

    def __init__(self, *, embed_dim, image_size, patch, v_width, v_layers, v_head_width,
                 context, vocab, t_width, t_layers, t_heads, quick_gelu=False) -> None:  # fmt: skip
        super().__init__()
        act = QuickGELU if quick_gelu else nn.GELU
        self.visual = VisionTransformer(
            image_size, patch, v_width, v_layers, v_width // v_head_width, embed_dim, act
        )
        self.transformer = Transformer(t_width, t_layers, t_heads, act)
        self.token_embedding = nn.Embedding(vocab, t_width)
        self.positional_embedding = nn.Parameter(0.01 * torch.randn(context, t_width))
        self.ln_final = nn.LayerNorm(t_width)
        self.text_projection = nn.Parameter(t_width**-0.5 * torch.randn(t_width, embed_dim))
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))
        mask = torch.empty(context, context).fill_(float("-inf")).triu_(1)
        self.register_buffer("attn_mask", mask, persistent=False)

    def encode_image(self, image, normalize=False):
        f = self.visual(image)
        return nn.functional.normalize(f, dim=-1) if normalize else f

    def encode_text(self, text, normalize=False):
        x = self.token_embedding(text) + self.positional_embedding
        x = self.transformer(x.permute(1, 0, 2), attn_mask=self.attn_mask).permute(1, 0, 2)
        x = self.ln_final(x)
        x = x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.text_projection
        return nn.functional.normalize(x, dim=-1) if normalize else x

    def forward(self, image, text):
        return {
            "image_features": self.encode_image(image, normalize=True),
            "text_features": self.encode_text(text, normalize=True),
        }


# ---- BLIP (ImageReward) -------------------------------------------------------------------
class Mlp(nn.Module):
    def __init__(self, dim, hidden) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim, num_heads) -> None:
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3, bias=True), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, num_heads) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn, self.mlp = Attention(dim, num_heads), Mlp(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch, dim) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class BlipViT(nn.Module):
    def __init__(self, image_size, patch, dim, depth, heads) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(patch, dim)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, (image_size // patch) ** 2 + 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embed[:, : x.size(1), :]
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class _Dense(nn.Module):  # BertSelfOutput / BertOutput
    def __init__(self, d_in, d_out) -> None:
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(d_in, d_out), nn.LayerNorm(d_out, eps=1e-12)

    def forward(self, h, residual):
        return self.LayerNorm(self.dense(h) + residual)


class _SelfAttn(nn.Module):  # BertSelfAttention
    def __init__(self, hidden, heads, kv_width) -> None:
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key, self.value = nn.Linear(kv_width, hidden), nn.Linear(kv_width, hidden)

    def forward(self, h, mask, enc=None, enc_mask=None):
        kv = h if enc is None else enc
        mask = mask if enc is None else enc_mask

        def split(t):
            return t.view(*t.shape[:-1], self.heads, self.d).permute(0, 2, 1, 3)

        q, k, v = split(self.query(h)), split(self.key(kv)), split(self.value(kv))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d) + mask
        ctx = (scores.softmax(dim=-1) @ v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(*ctx.shape[:-2], self.heads * self.d)


class _Attention(nn.Module):  # BertAttention
    def __init__(self, hidden, heads, kv_width) -> None:
        super().__init__()
        self.self, self.output = _SelfAttn(hidden, heads, kv_width), _Dense(hidden, hidden)

    def forward(self, h, mask, enc=None, enc_mask=None):
        return self.output(self.self(h, mask, enc, enc_mask), h)


class _Intermediate(nn.Module):
    def __init__(self, hidden, inter) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, inter)

    def forward(self, h):
        return nn.functional.gelu(self.dense(h))


class BertLayer(nn.Module):
    def __init__(self, hidden, heads, inter, enc_width) -> None:
        super().__init__()
        self.attention = _Attention(hidden, heads, hidden)
        self.crossattention = _Attention(hidden, heads, enc_width)
        self.intermediate, self.output = _Intermediate(hidden, inter), _Dense(inter, hidden)

    def forward(self, h, mask, enc, enc_mask):  # mode == "multimodal"
        a = self.crossattention(self.attention(h, mask), mask, enc, enc_mask)
        return self.output(self.intermediate(a), a)


class _Embeddings(nn.Module):  # med.py BertEmbeddings: words + absolute positions, no types
    def __init__(self, vocab, hidden, max_pos) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_pos, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1])[None]
        return self.LayerNorm(self.word_embeddings(ids) + self.position_embeddings(pos))


class _Encoder(nn.Module):
    def __init__(self, n, *args) -> None:
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(*args) for _ in range(n)])


class MedBert(nn.Module):
    """med.py ``BertModel(add_pooling_layer=False)``; extended masks are (1 - m) * -10000."""

    def __init__(self, vocab, hidden, layers, heads, inter, enc_width, max_pos=512) -> None:
        super().__init__()
        self.embeddings = _Embeddings(vocab, hidden, max_pos)
        self.encoder = _Encoder(layers, hidden, heads, inter, enc_width)

    def forward(self, ids, attention_mask, enc, enc_mask):
        mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
        emask = (1.0 - enc_mask[:, None, None, :].float()) * -10000.0
        h = self.embeddings(ids)
        for layer in self.encoder.layer:
            h = layer(h, mask, enc, emask)
        return h


class BlipPretrain(nn.Module):
    """The parts of BLIP_Pretrain that ImageReward.pt carries (plus its unused projections)."""

    def __init__(self, image_size, patch, v_dim, v_depth, v_heads, vocab, hidden, layers,
                 heads, inter) -> None:  # fmt: skip
        super().__init__()
        self.visual_encoder = BlipViT(image_size, patch, v_dim, v_depth, v_heads)
        self.text_encoder = MedBert(vocab, hidden, layers, heads, inter, v_dim)
        self.vision_proj, self.text_proj = nn.Linear(v_dim, 16), nn.Linear(hidden, 16)


class RewardMLP(nn.Module):
    """ImageReward's and LAION's ``MLP`` (no activations; dropouts are identity in eval)."""

    def __init__(self, input_size) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )  # fmt: skip

    def forward(self, x):
        return self.layers(x)


class ImageRewardRef(nn.Module):
    mean, std = 0.16717362830052426, 1.0333394966054072

    def __init__(self, **blip) -> None:
        super().__init__()
        self.blip = BlipPretrain(**blip)
        self.mlp = RewardMLP(blip["hidden"])

    def score(self, input_ids, attention_mask, image):
        """``ImageReward.score`` for one (prompt, preprocessed image)."""
        emb = self.blip.visual_encoder(image)
        atts = torch.ones(emb.shape[:-1], dtype=torch.long)
        h = self.blip.text_encoder(input_ids, attention_mask, emb, atts)
        return ((self.mlp(h[:, 0, :].float()) - self.mean) / self.std).item()


def laion_normalized(a: np.ndarray, axis: int = -1, order: int = 2) -> np.ndarray:
    """simple_inference.py ``normalized``."""
    l2 = np.atleast_1d(np.linalg.norm(a, order, axis))
    l2[l2 == 0] = 1
    return a / np.expand_dims(l2, axis)


def randomize_(module: nn.Module, seed: int, std: float = 0.05) -> nn.Module:
    """Random weights everywhere (LayerNorms around 1), so no parameter is a no-op."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "ln" in name or "norm" in name or "LayerNorm" in name:
                p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                p.copy_(std * noise)
    return module.eval()

"""Published preference-model checkpoints -> transformers models, at load time.

open_clip (and OpenAI CLIP, the same key layout) -> ``CLIPModel``; BLIP as ImageReward
ships it (timm ViT + BLIP's ``med.py`` BERT) -> ``BlipVisionModel`` + ``BlipTextModel``.
Only keys are renamed and the fused attention input split: the numbers are the published
ones. Sizes are read from the tensors; head counts, which tensors do not show, come from the
architecture's head width (open_clip ViT-H-14: vision 80, text 64; BLIP: 64).
"""

from __future__ import annotations

import re
from typing import Any

import torch

_RES = re.compile(r"^(?P<tower>visual\.)?transformer\.resblocks\.(?P<i>\d+)\.(?P<rest>.+)$")
_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
    "attn.out_proj": "self_attn.out_proj",
}


_CLIP_KEYS = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
_VIT_KEYS = {  # BLIP's timm ViT, outside its blocks
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}


def _need(sd: dict[str, torch.Tensor], key: str, what: str) -> torch.Tensor:
    if key not in sd:
        raise ValueError(f"{what} checkpoint has no {key!r}: not the expected key layout")
    return sd[key]


def _layers(sd: dict[str, torch.Tensor], prefix: str) -> int:
    pat = re.compile(rf"^{re.escape(prefix)}(\d+)\.")
    found = {int(m.group(1)) for k in sd if (m := pat.match(k))}
    return max(found) + 1 if found else 0


def open_clip_config(
    sd: dict[str, torch.Tensor],
    *,
    vision_head_width: int = 64,
    text_head_width: int = 64,
    hidden_act: str = "gelu",
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> Any:
    """The ``CLIPConfig`` of an open_clip/OpenAI CLIP state dict (ViT image tower, plain
    text tower), sizes from the tensors. ``hidden_act``: "gelu" (open_clip ViT-H-14) or
    "quick_gelu" (OpenAI's models); the text tower pools at the first ``eos_token_id``
    (open_clip pools at the highest id, which the end-of-text token is)."""
    from transformers import CLIPConfig

    what = "open_clip"
    conv = _need(sd, "visual.conv1.weight", what)
    v_pos = _need(sd, "visual.positional_embedding", what)
    width, patch = conv.shape[0], conv.shape[-1]
    grid = int(round((v_pos.shape[0] - 1) ** 0.5))
    t_emb = _need(sd, "token_embedding.weight", what)
    t_width = t_emb.shape[1]
    proj = _need(sd, "text_projection", what)
    for w, hw, tower in ((width, vision_head_width, "vision"), (t_width, text_head_width, "text")):
        if w % hw:
            raise ValueError(f"{what} {tower} width {w} is not a multiple of head width {hw}")
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    text = dict(
        vocab_size=t_emb.shape[0],
        hidden_size=t_width,
        intermediate_size=_need(sd, "transformer.resblocks.0.mlp.c_fc.weight", what).shape[0],
        num_hidden_layers=_layers(sd, "transformer.resblocks."),
        num_attention_heads=t_width // text_head_width,
        max_position_embeddings=_need(sd, "positional_embedding", what).shape[0],
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        projection_dim=proj.shape[1],
        **{k: v for k, v in ids.items() if v is not None},
    )
    vision = dict(
        hidden_size=width,
        intermediate_size=_need(sd, "visual.transformer.resblocks.0.mlp.c_fc.weight", what).shape[
            0
        ],
        num_hidden_layers=_layers(sd, "visual.transformer.resblocks."),
        num_attention_heads=width // vision_head_width,
        image_size=grid * patch,
        patch_size=patch,
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        projection_dim=proj.shape[1],
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=proj.shape[1])


def open_clip_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip/OpenAI CLIP keys -> transformers ``CLIPModel`` keys (fused ``in_proj``
    split into q/k/v, ``proj`` matrices transposed into Linear weights). Keys CLIPModel has
    no use for (``attn_mask``) are dropped; an unknown key is an error."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        m = _RES.match(key)
        if m:
            base = ("vision_model" if m["tower"] else "text_model") + f".encoder.layers.{m['i']}."
            rest = m["rest"]
            if rest.startswith("attn.in_proj_"):
                kind = rest.rsplit("_", 1)[1]  # weight | bias
                for name, part in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3, dim=0)):
                    out[f"{base}self_attn.{name}.{kind}"] = part.contiguous()
                continue
            stem, _, kind = rest.rpartition(".")
            if stem not in _BLOCK:
                raise ValueError(f"open_clip checkpoint key {key!r} has no transformers twin")
            out[base + _BLOCK[stem] + "." + kind] = t
            continue
        if key in _CLIP_KEYS:
            out[_CLIP_KEYS[key]] = t
        elif key == "visual.proj":
            out["visual_projection.weight"] = t.t().contiguous()
        elif key == "text_projection":
            out["text_projection.weight"] = t.t().contiguous()
        elif key in ("attn_mask", "input_resolution", "context_length", "vocab_size"):
            continue  # buffers / OpenAI JIT metadata: rebuilt by CLIPModel
        else:
            raise ValueError(f"open_clip checkpoint key {key!r} has no transformers twin")
    return out


def blip_configs(sd: dict[str, torch.Tensor], prefix: str = "blip.") -> tuple[Any, Any]:
    """(BlipVisionConfig, BlipTextConfig) of a BLIP state dict (ImageReward.pt's
    ``blip.visual_encoder.*``, ``blip.text_encoder.*``), sizes from the tensors, heads of
    width 64 (ViT-L/16: 16, BERT-base: 12), layer-norm eps as BLIP builds them (timm ViT
    1e-6, med_config.json 1e-12)."""
    from transformers import BlipTextConfig, BlipVisionConfig

    what, v, t = "BLIP", prefix + "visual_encoder.", prefix + "text_encoder."
    patch_w = _need(sd, v + "patch_embed.proj.weight", what)
    pos = _need(sd, v + "pos_embed", what)
    width, patch = patch_w.shape[0], patch_w.shape[-1]
    grid = int(round((pos.shape[1] - 1) ** 0.5))
    vision = BlipVisionConfig(
        hidden_size=width,
        intermediate_size=_need(sd, v + "blocks.0.mlp.fc1.weight", what).shape[0],
        num_hidden_layers=_layers(sd, v + "blocks."),
        num_attention_heads=width // 64,
        image_size=grid * patch,
        patch_size=patch,
        hidden_act="gelu",
        layer_norm_eps=1e-6,
    )
    words = _need(sd, t + "embeddings.word_embeddings.weight", what)
    hidden = words.shape[1]
    cross = _need(sd, t + "encoder.layer.0.crossattention.self.key.weight", what)
    text = BlipTextConfig(
        vocab_size=words.shape[0],
        hidden_size=hidden,
        encoder_hidden_size=cross.shape[1],
        intermediate_size=_need(sd, t + "encoder.layer.0.intermediate.dense.weight", what).shape[0],
        num_hidden_layers=_layers(sd, t + "encoder.layer."),
        num_attention_heads=hidden // 64,
        max_position_embeddings=_need(sd, t + "embeddings.position_embeddings.weight", what).shape[
            0
        ],
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        pad_token_id=0,
        bos_token_id=None,
        sep_token_id=None,
    )
    return vision, text


_VIT = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def blip_to_hf(
    sd: dict[str, torch.Tensor], prefix: str = "blip."
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """BLIP's timm ViT keys -> ``BlipVisionModel`` keys and ``med.py`` BERT keys ->
    ``BlipTextModel`` keys (the same names: transformers ported med.py). Returns (vision,
    text); keys outside the two encoders, and ``position_ids`` buffers, are left out."""
    vision: dict[str, torch.Tensor] = {}
    text: dict[str, torch.Tensor] = {}
    v, t = prefix + "visual_encoder.", prefix + "text_encoder."
    for key, tensor in sd.items():
        if key.startswith(v):
            rest = key[len(v) :]
            m = re.match(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$", rest)
            if m and m[2] in _VIT:
                vision[f"encoder.layers.{m[1]}.{_VIT[m[2]]}.{m[3]}"] = tensor
            elif rest in _VIT_KEYS:
                vision[_VIT_KEYS[rest]] = tensor
            else:
                raise ValueError(f"BLIP checkpoint key {key!r} has no transformers twin")
        elif key.startswith(t) and not key.endswith("position_ids"):
            text[key[len(t) :]] = tensor
    return vision, text

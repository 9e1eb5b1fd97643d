"""What each built-in reward costs per image: images/s at 512 x 512 on this machine, with the
real-size architecture and random weights (a reward's cost does not depend on its weights).

One row per reward in ``ROWS``; adding a reward to the table is one ``RewardRow``: its name,
the architecture it runs, and a builder ``(tiny, device, tmp) -> reward callable``. Rewards
that load a transformers model from a directory (``from_pretrained``) are built as users
build them, from a directory that holds only a config.json and tokenizer files:
``random_weights()`` makes ``from_pretrained`` return the model with random weights.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

SIZE = 512  # the image side users score at (flow_grpo's 512 px runs)


@dataclass
class RewardRow:
    name: str
    arch: str  # what runs per image, for the table
    build: Callable[[bool, str, Path], Any]  # (tiny, device, tmp dir) -> reward callable
    metadata: Callable[[int], list[dict]] | None = None  # per-sample metadata, if it needs any


# ---- random models of a given config, without initialising them twice ---------------------
def random_model(cls: type, config: Any, dtype: torch.dtype = torch.float32, **kw: Any) -> Any:
    """``cls(config)`` with N(0, 0.02) weights, LayerNorms at (1, 0): a forward costs what the
    real weights' does."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = cls(config, **kw)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod in model.modules():
            for name, p in mod.named_parameters(recurse=False):
                if isinstance(mod, torch.nn.LayerNorm):
                    p.fill_(1.0 if name == "weight" else 0.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.to(dtype).eval()


@contextmanager
def random_weights():
    """``PreTrainedModel.from_pretrained(dir)`` builds ``random_model`` from dir's config."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]

    def fake(cls, path, *args, config=None, dtype=torch.float32, **kw):
        config = config or cls.config_class.from_pretrained(path)
        model = random_model(cls, config, dtype)
        if kw.get("output_loading_info"):  # as transformers returns it: nothing unexpected
            info = dict.fromkeys(("missing_keys", "unexpected_keys", "mismatched_keys"), [])
            return model, {**info, "error_msgs": []}
        return model

    PreTrainedModel.from_pretrained = classmethod(fake)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


# ---- architectures (sizes from the published configs) -------------------------------------
def clip_config(arch: str, tiny: bool, eos: int) -> Any:
    """CLIPConfig of OpenAI ViT-L/14 (``vit_l14``, QuickGELU) or open_clip ViT-H-14
    (``vit_h14``, HPS / PickScore); ``tiny``: two narrow layers at the same input size."""
    from transformers import CLIPConfig

    big = arch == "vit_h14"
    t = (1024, 4096, 24, 16) if big else (768, 3072, 12, 12)
    v = (1280, 5120, 32, 16) if big else (1024, 4096, 24, 16)
    if tiny:
        t, v = (64, 128, 1, 2), (64, 128, 1, 2)
    act = "gelu" if big else "quick_gelu"
    text = dict(vocab_size=49408, hidden_size=t[0], intermediate_size=t[1],
                num_hidden_layers=t[2], num_attention_heads=t[3], max_position_embeddings=77,
                hidden_act=act, bos_token_id=eos - 1, eos_token_id=eos)  # fmt: skip
    vision = dict(hidden_size=v[0], intermediate_size=v[1], num_hidden_layers=v[2],
                  num_attention_heads=v[3], image_size=224, patch_size=14, hidden_act=act)  # fmt: skip
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=1024 if big else 768)


def clip_tokenizer(path: Path) -> Any:
    """A CLIPTokenizer built offline (end-of-text the highest id); its cost is negligible."""
    from transformers import CLIPTokenizer

    vocab = {}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789":
        vocab[ch], vocab[ch + "</w>"] = len(vocab), len(vocab) + 1
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77, pad_token="<|endoftext|>")
    tok.save_pretrained(path)
    return tok


def _clip_dir(tmp: Path, arch: str, tiny: bool) -> Path:
    path = tmp / f"{arch}{'_tiny' if tiny else ''}"
    if not path.is_dir():
        tok = clip_tokenizer(path)
        clip_config(arch, tiny, tok.eos_token_id).save_pretrained(path)
    return path


def _from_dir(name: str, arch: str, **options: Any) -> Callable[[bool, str, Path], Any]:
    def build(tiny: bool, device: str, tmp: Path) -> Any:
        from flowgrpo.rewards import build_reward

        path = str(_clip_dir(tmp, arch, tiny))
        with random_weights():
            return build_reward(name, path=path, processor_path=path, device=device, **options)

    return build


def _hpsv2(tiny: bool, device: str, tmp: Path) -> Any:
    from transformers import CLIPModel

    from flowgrpo.rewards.hps import HPSv2

    tok = clip_tokenizer(tmp / "hps_tok")
    model = random_model(CLIPModel, clip_config("vit_h14", tiny, tok.eos_token_id))
    return HPSv2.from_model(model, tok, device=device)


def _aesthetic(tiny: bool, device: str, tmp: Path) -> Any:
    from transformers import CLIPModel

    from flowgrpo.rewards.aesthetic import Aesthetic
    from flowgrpo.rewards.image_reward import RewardHead

    config = clip_config("vit_l14", tiny, 49407)
    head = random_model(lambda _c: RewardHead(config.projection_dim), None)
    return Aesthetic.from_model(random_model(CLIPModel, config), head, device=device)


def _image_reward(tiny: bool, device: str, tmp: Path) -> Any:
    from transformers import BertTokenizer, BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    from flowgrpo.rewards.image_reward import ImageReward, RewardHead

    v = (64, 128, 1, 2) if tiny else (1024, 4096, 24, 16)  # BLIP ViT-L/16 (create_vit large)
    t = (64, 128, 1, 2) if tiny else (768, 3072, 12, 12)  # med_config.json (BERT-base)
    vision = BlipVisionConfig(hidden_size=v[0], intermediate_size=v[1], num_hidden_layers=v[2],
                              num_attention_heads=v[3], image_size=224, patch_size=16,
                              layer_norm_eps=1e-6)  # fmt: skip
    text = BlipTextConfig(vocab_size=30524, hidden_size=t[0], intermediate_size=t[1],
                          num_hidden_layers=t[2], num_attention_heads=t[3],
                          encoder_hidden_size=v[0], bos_token_id=None, sep_token_id=None)  # fmt: skip
    (tmp / "bert").mkdir(exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz"]
    (tmp / "bert" / "vocab.txt").write_text("\n".join(words) + "\n")
    tok = BertTokenizer(str(tmp / "bert" / "vocab.txt"))
    tok.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    return ImageReward.from_model(
        random_model(BlipVisionModel, vision),
        random_model(BlipTextModel, text, add_pooling_layer=False),
        random_model(lambda _c: RewardHead(t[0]), None),
        tok,
        device=device,
    )


def _ocr(tiny: bool, device: str, tmp: Path) -> Any:
    from flowgrpo.rewards import build_reward

    return build_reward("ocr")


def _jpeg(tiny: bool, device: str, tmp: Path) -> Any:
    from flowgrpo.rewards import build_reward

    return build_reward("jpeg_compressibility")


def _geneval(tiny: bool, device: str, tmp: Path) -> Any:
    """GenEval with its in-process detector: OWLv2 base/16 at 960² (transformers'
    ``Owlv2Config`` defaults: google/owlv2-base-patch16-ensemble) and the CLIP ViT-L/14
    colour rule, built from directories as users build it."""
    from transformers import Owlv2Config

    from flowgrpo.rewards import build_reward

    owl = tmp / f"owlv2{'_tiny' if tiny else ''}"
    if not owl.is_dir():
        tok = clip_tokenizer(owl)
        if tiny:
            text = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                        num_attention_heads=2)  # fmt: skip
            vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                          num_attention_heads=2, image_size=64, patch_size=16)  # fmt: skip
        else:
            text, vision = {}, {}
        text.update(vocab_size=49408, bos_token_id=tok.eos_token_id - 1,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)  # fmt: skip
        Owlv2Config(text_config=text, vision_config=vision,
                    projection_dim=32 if tiny else 512).save_pretrained(owl)  # fmt: skip
    clip = _clip_dir(tmp, "vit_l14", tiny)
    with random_weights():
        return build_reward("geneval", path=str(owl), clip_path=str(clip), device=device)


def _geneval_metadata(n: int) -> list[dict]:
    """A colour clause (so the CLIP colour rule runs on every detected object) per sample."""
    clause = {"class": "cat", "count": 1, "color": "red"}
    return [{"tag": "colors", "include": [clause], "prompt": "a photo of a red cat"}] * n


def _one_source(n: int) -> list[dict]:
    """An editing group: every sample shares one 512 px source image."""
    src = _images(1)[0]
    return [{"source_images": [src]} for _ in range(n)]


ROWS: list[RewardRow] = [
    RewardRow("hpsv2", "open_clip ViT-H-14 (image + text towers)", _hpsv2),
    RewardRow("pickscore", "CLIP ViT-H-14 (image + text towers)", _from_dir("pickscore", "vit_h14")),
    RewardRow("image_reward", "BLIP ViT-L/16 + BERT-base cross-attention + MLP", _image_reward),
    RewardRow("aesthetic", "CLIP ViT-L/14 image tower + MLP", _aesthetic),
    RewardRow("clip_score", "CLIP ViT-L/14 (image + text towers)", _from_dir("clip_score", "vit_l14")),
    RewardRow(
        "image_similarity",
        "CLIP ViT-L/14 image tower, result + shared source",
        _from_dir("image_similarity", "vit_l14"),
        _one_source,
    ),
    RewardRow(
        "geneval",
        "OWLv2 base/16 at 960² (80 class queries) + CLIP ViT-L/14 colour per object",
        _geneval,
        _geneval_metadata,
    ),
    RewardRow("ocr", "rapidocr PP-OCRv4 (ONNX, real weights)", _ocr),
    RewardRow("jpeg_compressibility", "PIL JPEG encode", _jpeg),
]  # fmt: skip


def _images(n: int) -> torch.Tensor:
    """``n`` 512 px images with a line of text on a textured background (OCR finds a box)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        pil = Image.new("RGB", (SIZE, SIZE), (240, 235, 225))
        ImageDraw.Draw(pil).text((60, 240), f"hello world {i}", fill=(10, 10, 10))
        x = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1) / 255.0
        out.append((0.9 * x + 0.1 * torch.rand(x.shape, generator=g)).clamp(0, 1))
    return torch.stack(out)


def bench_rewards(
    *,
    quick: bool = False,
    device: str = "cpu",
    batch: int = 2,
    repeats: int = 2,
    only: tuple[str, ...] = (),
) -> dict[str, dict[str, object]]:
    """images/s per row of ``ROWS`` (median of ``repeats`` calls on ``batch`` images after a
    warm-up call); ``quick``: tiny architectures, one repeat (the smoke test)."""
    if quick:
        repeats = 1
    images = _images(batch)
    prompts = [f'a sign that says "hello world {i}"' for i in range(batch)]
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in ROWS:
            if only and row.name not in only:
                continue
            t0 = time.perf_counter()
            reward = row.build(quick, device, Path(tmp))
            load_s = time.perf_counter() - t0
            meta = row.metadata(batch) if row.metadata else [{} for _ in range(batch)]
            reward(images, prompts, meta)  # warm-up
            times, cpu = [], []
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                reward(images, prompts, meta)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            params = sum(
                p.numel()
                for m in vars(reward).values()
                if isinstance(m, torch.nn.Module)
                for p in m.parameters()
            )
            sec = statistics.median(times)
            results[row.name] = {
                "arch": row.arch + (" (tiny)" if quick else ""),
                "params_m": round(params / 1e6, 1),
                "batch": batch,
                "s_per_batch": sec,
                "images_per_s": batch / sec,
                "s_per_image": sec / batch,
                # CPU seconds of this process per image: on a shared machine wall time counts
                # other jobs' load; threads x wall on an idle machine is about this
                "cpu_s_per_image": statistics.median(cpu) / batch,
                "build_s": load_s,
            }
            del reward
    return results


def format_rewards(results: dict[str, dict[str, object]]) -> str:
    """A markdown table of ``bench_rewards``' output (docs/performance.md)."""
    lines = [
        "| reward | runs | params (M) | images/s | s/image (wall) | CPU s/image |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| `{name}` | {r['arch']} | {r['params_m']} | {r['images_per_s']:.2f} | "
            f"{r['s_per_image']:.2f} | {r['cpu_s_per_image']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m bench.rewards [--quick]: print the table only
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.rewards")
    parser.add_argument("--quick", action="store_true", help="tiny architectures, one repeat")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated reward names")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    res = bench_rewards(
        quick=args.quick,
        device=args.device,
        batch=args.batch,
        only=tuple(n for n in args.only.split(",") if n),
    )
    print(json.dumps(res, indent=2))
    print(format_rewards(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")

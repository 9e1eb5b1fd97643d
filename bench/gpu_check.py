"""The checks that need a GPU, in one script: ``python -m bench.gpu_check --out DIR``.

Writes ``DIR/gpu_check.json`` with
- ``cuda_overheads``: device memory a run pays outside PyTorch's allocator (CUDA context,
  cuBLAS workspace, a 1-rank NCCL communicator), read with ``cudaMemGetInfo`` after each is
  created (what the memory planner must add to its sum);
- ``bf16_on_policy``: every conformance family with bf16 weights on the GPU, fp32
  trajectories: |log r| of the training pass against the rollout, with the rollout's split,
  reversed rows and two other splits (on the CPU the first two are exactly 0);
- ``activations``: real-size transformers (SD3.5-Medium, FLUX.1-dev, Qwen-Image, from the
  shipped config sets, random bf16 weights) — their weights' bytes and the allocator's peak
  of one forward + backward with frozen weights (the LoRA case: gradients flow to the input),
  with and without activation checkpointing, at 512² and 1024², batch 1.
``--dry`` runs it all on the CPU with one block per transformer (a check of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

GIB = 1024**3


def _used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def cuda_overheads() -> dict[str, Any]:
    """Device bytes used outside the allocator after each CUDA-side object is created."""
    out: dict[str, Any] = {}
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        out["nvidia_smi_before_mib"] = smi
    except Exception as exc:  # noqa: BLE001 - a reading, not a requirement
        out["nvidia_smi_before_mib"] = repr(exc)
    torch.cuda.init()
    x = torch.ones(1, device="cuda")
    out["context_mib"] = (_used_bytes() - torch.cuda.memory_reserved()) / 2**20
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    out["after_bf16_matmul_mib"] = (_used_bytes() - torch.cuda.memory_reserved()) / 2**20
    q = torch.randn(1, 24, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    out["after_sdpa_fwd_bwd_mib"] = (_used_bytes() - torch.cuda.memory_reserved()) / 2**20
    import os

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    out["after_nccl_allreduce_mib"] = (_used_bytes() - torch.cuda.memory_reserved()) / 2**20
    dist.destroy_process_group()
    del x, a, q, t
    out["total_mib"] = torch.cuda.mem_get_info()[1] / 2**20
    return out


def bf16_on_policy(device: str, kinds: set[str] | None = None) -> dict[str, Any]:
    """|log r| per family with bf16 weights on ``device`` (SDE rollout, 4 steps)."""
    from flowgrpo.testing import conformance as C

    results: dict[str, Any] = {}
    for fam in C.FAMILIES:
        if kinds and fam.kind not in kinds:
            continue
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                pipe = fam.pipeline()
                if fam.bf16_via_load:
                    from flowgrpo.models.registry import load_pipeline

                    pipe.save_pretrained(tmp)
                    pipe = load_pipeline(tmp, torch_dtype=torch.bfloat16)
                    pipe.set_progress_bar_config(disable=True)
                else:
                    pipe.to(dtype=torch.bfloat16)
                pipe.to(device)
                adapter = fam.adapter(pipe, cfg=True)
                traj = C._sde_rollout(fam, adapter, "sde")
                n = len(fam.prompts)
                row = {
                    "same_split": float(C.log_ratios(adapter, traj, [list(range(n))]).max()),
                    "reversed": float(
                        C.log_ratios(adapter, traj, [list(reversed(range(n)))]).max()
                    ),
                    "other_splits": max(
                        float(C.log_ratios(adapter, traj, s).max()) for s in C.SPLITS[1:3]
                    ),
                    "cpu_split_atol": fam.bf16_split_atol,
                    "log_prob_dtype": str(traj.log_probs.dtype),
                    "device": str(traj.log_probs.device),
                }
        except Exception:  # noqa: BLE001 - one family's failure must not hide the others
            row = {"error": traceback.format_exc()[-2000:]}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        results[fam.kind] = row
        print(fam.kind, row, flush=True)
    return results


def _inputs(kind: str, cfg: dict, size: int, device: str, dtype: torch.dtype) -> dict:
    """One sample's transformer inputs at ``size``² (text lengths as the references use)."""

    def r(*shape, grad=False):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    lat = size // 8
    t = torch.full((1,), 500.0, device=device)
    if kind == "sd3":
        return dict(
            hidden_states=r(1, 16, lat, lat, grad=True),
            encoder_hidden_states=r(1, 333, cfg["joint_attention_dim"]),
            pooled_projections=r(1, cfg["pooled_projection_dim"]),
            timestep=t,
            return_dict=False,
        )
    n = (lat // 2) ** 2
    if kind == "flux":
        ids = torch.zeros(n, 3, device=device)
        return dict(
            hidden_states=r(1, n, 64, grad=True),
            encoder_hidden_states=r(1, 512, cfg["joint_attention_dim"]),
            pooled_projections=r(1, cfg["pooled_projection_dim"]),
            timestep=t / 1000,
            img_ids=ids,
            txt_ids=torch.zeros(512, 3, device=device),
            guidance=torch.full((1,), 3.5, device=device),
            return_dict=False,
        )
    if kind == "qwen_image":
        text = 128
        return dict(
            hidden_states=r(1, n, 64, grad=True),
            encoder_hidden_states=r(1, text, cfg["joint_attention_dim"]),
            encoder_hidden_states_mask=torch.ones(1, text, device=device, dtype=torch.long),
            timestep=t / 1000,
            img_shapes=[[(1, lat // 2, lat // 2)]],
            return_dict=False,
        )
    raise ValueError(kind)


REAL = (("sd3", "sd3.5-medium"), ("flux", "flux.1-dev"), ("qwen_image", "qwen-image"))


def activations(device: str, dry: bool) -> dict[str, Any]:
    """Weights and fwd+bwd allocator peaks of real-size transformers, frozen weights."""
    import diffusers

    from flowgrpo.planner import read_model_configs

    results: dict[str, Any] = {}
    dtype = torch.bfloat16
    if os.environ.get("GPU_CHECK_NO_CUDNN_SDPA"):  # torch 2.11's cuDNN attention backward
        torch.backends.cuda.enable_cudnn_sdp(False)  # failed on FLUX shapes on an H200
    for kind, known in REAL:
        if os.environ.get("GPU_CHECK_REAL") and kind not in os.environ["GPU_CHECK_REAL"]:
            continue
        cfg = dict(read_model_configs(f"known:{known}")["transformer"])
        if dry:
            cfg.update(num_layers=1, num_single_layers=1, dual_attention_layers=[0])
        klass = getattr(diffusers, cfg.pop("_class_name"))
        row: dict[str, Any] = {}
        try:
            torch.set_default_dtype(dtype)
            with torch.device(device):
                model = klass.from_config(cfg)
            torch.set_default_dtype(torch.float32)
            model.requires_grad_(False)
            if device == "cuda":
                torch.cuda.synchronize()
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            row["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
            row["weights_gib"] = weights / GIB
            for ckpt in (False, True):
                if ckpt:
                    model.enable_gradient_checkpointing()
                model.train()
                for size in (256,) if dry else (512, 1024):
                    key = f"{size}px_{'ckpt' if ckpt else 'no_ckpt'}"
                    try:
                        if device == "cuda":
                            torch.cuda.empty_cache()
                            torch.cuda.reset_peak_memory_stats()
                            base = torch.cuda.memory_allocated()
                        inputs = _inputs(kind, cfg, size, device, dtype)
                        t0 = time.perf_counter()
                        out = model(**inputs)[0]
                        out.float().square().mean().backward()
                        if device == "cuda":
                            torch.cuda.synchronize()
                            peak = torch.cuda.max_memory_allocated() - base
                        else:
                            peak = 0
                        row[key] = {
                            "fwd_bwd_peak_over_weights_gib": peak / GIB,
                            "seconds": round(time.perf_counter() - t0, 3),
                            "image_tokens": out.shape[1] if out.dim() == 3 else None,
                        }
                        del out, inputs
                    except Exception:  # noqa: BLE001
                        row[key] = {"error": traceback.format_exc()[-1500:]}
                    print(kind, key, row[key], flush=True)
            del model
        except Exception:  # noqa: BLE001
            torch.set_default_dtype(torch.float32)
            row["error"] = traceback.format_exc()[-2000:]
        results[known] = row
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def reward_models(device: str, dry: bool) -> dict[str, Any]:
    """Images/s and weight bytes of the CLIP towers the preference rewards use (random
    weights; ViT-H-14: PickScore, HPSv2.1; ViT-L-14: CLIP score, the LAION aesthetic MLP's
    backbone), fp32 and bf16, batch 16 at 224² after preprocessing, with a 77-token prompt."""
    from transformers import CLIPConfig, CLIPModel

    shapes = {
        "clip_vit_h_14": dict(
            text_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                             num_hidden_layers=24, projection_dim=1024),
            vision_config=dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=16,
                               num_hidden_layers=32, patch_size=14, image_size=224,
                               projection_dim=1024),
            projection_dim=1024,
        ),
        "clip_vit_l_14": dict(
            text_config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                             num_hidden_layers=12, projection_dim=768),
            vision_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                               num_hidden_layers=24, patch_size=14, image_size=224,
                               projection_dim=768),
            projection_dim=768,
        ),
    }  # fmt: skip
    out: dict[str, Any] = {}
    batch = 2 if dry else 16
    for name, kw in shapes.items():
        if dry:
            kw["text_config"]["num_hidden_layers"] = kw["vision_config"]["num_hidden_layers"] = 1
        for dtype in (torch.float32, torch.bfloat16):
            key = f"{name}_{str(dtype).split('.')[-1]}"
            try:
                with torch.device(device):
                    model = CLIPModel(CLIPConfig(**kw)).to(dtype).eval()
                weights = sum(p.numel() * p.element_size() for p in model.parameters())
                pix = torch.randn(batch, 3, 224, 224, device=device, dtype=dtype)
                ids = torch.randint(0, 49000, (batch, 77), device=device)
                with torch.no_grad():
                    for _ in range(2):
                        model(input_ids=ids, pixel_values=pix)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    reps = 1 if dry else 10
                    for _ in range(reps):
                        model(input_ids=ids, pixel_values=pix)
                    if device == "cuda":
                        torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / reps
                out[key] = {"weights_gib": weights / GIB, "images_per_s": batch / dt}
                del model
            except Exception:  # noqa: BLE001
                out[key] = {"error": traceback.format_exc()[-1500:]}
            print(key, out[key], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check")
    parser.add_argument("--out", default=".")
    parser.add_argument("--dry", action="store_true", help="CPU, one block: check the script")
    parser.add_argument("--parts", default="overheads,activations,rewards,bf16")
    parser.add_argument("--families", default="", help="comma-separated family kinds (bf16)")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry else "cuda"
    parts = set(args.parts.split(","))
    res: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(args.out) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(res, indent=2) + "\n")

    if "overheads" in parts and not args.dry:
        try:
            res["cuda_overheads"] = cuda_overheads()
        except Exception:  # noqa: BLE001
            res["cuda_overheads"] = {"error": traceback.format_exc()[-2000:]}
        print(res["cuda_overheads"], flush=True)
        save()
    if "activations" in parts:
        res["activations"] = activations(device, args.dry)
        save()
    if "rewards" in parts:
        res["reward_models"] = reward_models(device, args.dry)
        save()
    if "bf16" in parts:
        res["bf16_on_policy"] = bf16_on_policy(device, set(filter(None, args.families.split(","))))
        save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

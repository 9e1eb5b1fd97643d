"""Pretrain the toy generator (rectified flow on scikit-learn digits) and the reward classifier.

``flowgrpo toy pretrain --out DIR`` writes the pipeline directory ``DIR/toy-digits/`` (what
``model.path=builtin:toy-digits`` loads; with ``--classifier`` also
``DIR/digits_classifier.safetensors``). Pretraining stops as soon as
the fixed-seed ODE eval accuracy (10 Euler steps, 10 digits x 16) lands in a "good but
imperfect" window (default 0.60-0.70), so the RL demo has room to improve it; the figures go in
the JSON's ``info``. To refresh the shipped weights:
``flowgrpo toy pretrain --out src/flowgrpo/assets --classifier``.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path
from typing import Any

import torch

from flowgrpo.toy.data import load_digits_data, to_unit
from flowgrpo.toy.pipeline import EMPTY_ID, SHIPPED, ToyDigitsPipeline
from flowgrpo.toy.reward import CLASSIFIER_ASSET, DigitsClassifier, to_classifier_input


def train_digits_classifier(
    output_path: str | Path | None,
    *,
    epochs: int = 60,
    seed: int = 0,
    noise_std: float = 0.05,
    verbose: bool = True,
) -> DigitsClassifier:
    """Train the reward MLP (64-256-256-10, dropout 0.2, Gaussian-noise augmentation) on the
    train split; print and return it (eval mode), saved to ``output_path`` unless None.
    Test accuracy ~0.99 in ~3 s on 2 cores."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    x, y = load_digits_data("train")
    xt, yt = load_digits_data("test")
    x, xt = to_classifier_input(to_unit(x)), to_classifier_input(to_unit(xt))
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = DigitsClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), 64):
            idx = perm[i : i + 64]
            xb = x[idx] + noise_std * torch.randn(x[idx].shape, generator=gen)
            loss = torch.nn.functional.cross_entropy(model(xb.clamp(-1, 1)), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.random.set_rng_state(state)
    model.eval()
    with torch.no_grad():
        acc = float((model(xt).argmax(-1) == yt).float().mean())
    if verbose:
        print(f"digits classifier: test accuracy {acc:.4f} ({len(yt)} images)")
    if output_path is not None:
        Path(output_path).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(output_path))
    model.test_accuracy = acc  # type: ignore[attr-defined]
    return model


def pretrain_toy(
    output_dir: str | Path | None,
    *,
    steps: int = 400,
    seed: int = 0,
    batch_size: int = 128,
    lr: float = 1e-3,
    uncond_prob: float = 0.1,
    eval_every: int = 5,
    eval_from: int = 60,
    target: tuple[float, float] = (0.60, 0.70),
    eval_samples_per_digit: int = 16,
    classifier: DigitsClassifier | None = None,
    verbose: bool = True,
) -> ToyDigitsPipeline:
    """Rectified-flow pretraining of a fresh ``ToyDigitsPipeline`` on the digits train split.

    x_t = (1 - t) x0 + t eps with t = sigmoid(N(0, 1)) (logit-normal), target v = eps - x0,
    timestep t * 1000, AdamW; the prompt is dropped (empty-prompt entry) with ``uncond_prob``
    so CFG works. Every ``eval_every`` steps from ``eval_from``, the fixed-seed ODE accuracy is
    measured (10 digits x ``eval_samples_per_digit``); training stops at the first one inside ``target`` (else after ``steps``, keeping
    the evaluated state closest to the window's middle). Saved to ``output_dir`` unless None.
    """
    from flowgrpo.toy.eval import evaluate_toy

    lo, hi = target
    start = time.perf_counter()
    pipe = ToyDigitsPipeline.from_config(seed=seed)
    model, enc = pipe.transformer, pipe.text_encoder
    params = list(model.parameters()) + list(enc.parameters())
    opt = torch.optim.AdamW(params, lr=lr)
    x, y = load_digits_data("train")
    gen = torch.Generator().manual_seed(seed)
    history: list[dict[str, float]] = []
    best: tuple[float, int, dict[str, Any], dict[str, Any]] | None = None
    for step in range(1, steps + 1):
        model.train()
        idx = torch.randint(len(y), (batch_size,), generator=gen)
        x0, labels = x[idx], y[idx].clone()
        labels[torch.rand(batch_size, generator=gen) < uncond_prob] = EMPTY_ID
        t = torch.sigmoid(torch.randn(batch_size, generator=gen))
        noise = torch.randn(x0.shape, generator=gen)
        tt = t[:, None, None, None]
        xt = (1 - tt) * x0 + tt * noise
        embeds, pooled = enc(labels)
        pred = model(
            hidden_states=xt,
            timestep=t * 1000,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        loss = torch.nn.functional.mse_loss(pred.float(), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step < eval_from or (step % eval_every and step != steps):
            continue
        model.eval()
        res = evaluate_toy(
            pipe, seed=seed, samples_per_digit=eval_samples_per_digit, classifier=classifier
        )
        elapsed = time.perf_counter() - start
        loss_value = float(loss.detach())
        row = {"step": step, "loss": loss_value, "accuracy": res["accuracy"], "time_s": elapsed}
        history.append(row)
        if verbose:
            print(
                f"step {step:4d}  loss {loss_value:.4f}  ODE accuracy {res['accuracy']:.3f}  "
                f"reward {res['reward_mean']:.3f}  judge {res['judge_accuracy']:.3f}  "
                f"diversity {res['diversity']:.3f}  ({elapsed:.1f} s)",
                flush=True,
            )
        gap = abs(res["accuracy"] - (lo + hi) / 2)
        if best is None or gap < best[0]:
            snap = copy.deepcopy((model.state_dict(), enc.state_dict()))
            best = (gap, step, snap, {k: v for k, v in res.items() if k != "images"})
        if lo <= res["accuracy"] <= hi:
            break
    if best is None:
        raise ValueError(f"no evaluation ran: steps={steps} < eval_from={eval_from}")
    _, best_step, (model_state, enc_state), res = best
    model.load_state_dict(model_state)
    enc.load_state_dict(enc_state)
    model.eval()
    pipe.info = {
        "base_ode_accuracy": round(res["accuracy"], 4),
        "base_reward_mean": round(res["reward_mean"], 4),
        "base_judge_accuracy": round(res["judge_accuracy"], 4),
        "base_diversity": round(res["diversity"], 4),
        "eval": f"10 digits x {eval_samples_per_digit}, Euler ODE 10 steps, guidance 1, "
        "flowgrpo.toy.eval.evaluate_toy(seed=pretrain_seed)",
        "pretrain_seed": seed,
        "pretrain_steps": best_step,
        "pretrain_time_s": round(time.perf_counter() - start, 1),
        "torch_threads": torch.get_num_threads(),
        "batch_size": batch_size,
        "lr": lr,
        "uncond_prob": uncond_prob,
        "target_window": [lo, hi],
        "history": history,
    }
    if classifier is not None and hasattr(classifier, "test_accuracy"):
        pipe.info["classifier_test_accuracy"] = round(classifier.test_accuracy, 4)
    if output_dir is not None:
        out = Path(output_dir) / SHIPPED
        pipe.save_pretrained(out)
        if verbose:
            print(f"saved {out}/ (step {best_step})")
    return pipe


def _run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    classifier = None
    if args.classifier:
        classifier = train_digits_classifier(out / CLASSIFIER_ASSET, seed=args.seed)
    pretrain_toy(
        out,
        steps=args.steps,
        seed=args.seed,
        eval_every=args.eval_every,
        target=(args.target_lo, args.target_hi),
        classifier=classifier,
    )
    return 0


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="toy_pretrain", help="output folder (default: ./toy_pretrain)")
    p.add_argument("--steps", type=int, default=400, help="max training steps (default 400)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--target-lo", type=float, default=0.60, help="stop window: min ODE accuracy")
    p.add_argument("--target-hi", type=float, default=0.70, help="stop window: max ODE accuracy")
    p.add_argument(
        "--classifier", action="store_true", help="also retrain the reward classifier into --out"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")


def add_toy_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``toy pretrain`` on an argparse subparsers object; the handler is ``args.func``
    (``func(args) -> int`` exit code). The RL check of the toy is ``flowgrpo train``."""
    toy = subparsers.add_parser("toy", help="the built-in toy digits model")
    sub = toy.add_subparsers(dest="toy_command", required=True)
    p = sub.add_parser("pretrain", help="pretrain the toy generator by flow matching")
    _add_arguments(p)
    p.set_defaults(func=_run)
    return toy


def main(argv: list[str] | None = None) -> int:
    """``python -m flowgrpo.toy.pretrain [--out DIR] [--steps N] [--seed S]``."""
    parser = argparse.ArgumentParser(prog="flowgrpo toy pretrain", description=__doc__)
    _add_arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

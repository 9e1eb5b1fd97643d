"""Rewards and checks for the toy digits model (``flowgrpo.toy``), registered by import path
as ``digits`` (the training reward) and ``digits_eval`` (the eval-only scores).

- ``digits_reward``: the probability, under a small MLP classifier (64-256-256-10, trained on
  scikit-learn's digits; weights shipped in ``flowgrpo/assets/digits_classifier.safetensors``),
  that each image shows its prompt's digit.
- ``digits_judge``: accuracy under an independent SVC (fit at first use, < 1 s) that the policy
  never sees, so reward hacking (images the MLP likes but are not digits) shows as a gap.
- ``diversity``: mean per-pixel std across samples of the same digit (real data: 0.33), which
  falls when the policy collapses to one image per prompt.
- ``digits_ink`` (mean brightness, a term to hack) and ``digits_pairwise`` (``digits``
  judged in pairs, optionally plus ink: a pairwise reward, ``flowgrpo.rewards.is_pairwise``).
- ``digits_eval``: the three as per-sample scores for ``eval_reward`` (accuracy under the
  reward classifier, accuracy under the judge, the sample's digit's diversity).

Images are [B, C, H, W] floats in [0, 1] (C = 1 or 3; sizes other than 8x8 are average-pooled
to 8x8).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch

CLASSIFIER_ASSET = "digits_classifier.safetensors"


class DigitsClassifier(torch.nn.Module):
    """MLP on flattened 8x8 images in [-1, 1]: [B, 64] -> logits [B, 10]."""

    def __init__(self, hidden: int = 256, dropout: float = 0.2):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(64, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def to_classifier_input(images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] (or [B, H, W]) in [0, 1] -> [B, 64] in [-1, 1] (grey, 8x8)."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"images must be a tensor [B, C, H, W], got {type(images).__name__}")
    x = images.detach().float().cpu()
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise ValueError(f"images must be [B, C, H, W], got shape {tuple(images.shape)}")
    x = x.mean(dim=1, keepdim=True).clamp(0, 1)
    if x.shape[-2:] != (8, 8):
        x = torch.nn.functional.adaptive_avg_pool2d(x, 8)
    return (x * 2 - 1).reshape(x.shape[0], 64)


def _asset(name: str):
    return resources.files("flowgrpo") / "assets" / name


def load_classifier(path: str | Path | None = None) -> DigitsClassifier:
    """The reward classifier in eval mode; ``path`` None = the shipped weights."""
    from safetensors.torch import load_file

    model = DigitsClassifier()
    if path is None:
        with resources.as_file(_asset(CLASSIFIER_ASSET)) as shipped:
            if not shipped.is_file():
                raise FileNotFoundError(
                    f"the shipped digits classifier {shipped} is missing: "
                    "flowgrpo toy pretrain --out src/flowgrpo/assets --classifier writes it"
                )
            state = load_file(str(shipped))
    else:
        if not Path(path).is_file():
            raise FileNotFoundError(f"digits classifier weights '{path}' do not exist")
        state = load_file(str(path))
    model.load_state_dict(state)
    return model.eval()


@lru_cache(maxsize=1)
def _classifier() -> DigitsClassifier:
    return load_classifier()


@torch.no_grad()
def digit_probs(images: torch.Tensor, classifier: DigitsClassifier | None = None) -> torch.Tensor:
    """Classifier softmax [B, 10] for images [B, C, H, W] in [0, 1] (default: the shipped one)."""
    model = classifier if classifier is not None else _classifier()
    return torch.softmax(model(to_classifier_input(images)), dim=-1)


def target_digits(prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> list[int]:
    """metadata[i]["digit"] when present, else the digit parsed from prompts[i]."""
    from flowgrpo.toy.pipeline import parse_digit

    out = []
    for i, prompt in enumerate(prompts):
        meta = metadata[i] if metadata is not None and i < len(metadata) else None
        digit: Any = meta.get("digit") if isinstance(meta, dict) else None
        if digit is None:
            digit = parse_digit(prompt)
            if digit is None:
                raise ValueError(f"prompt {prompt!r} names no digit for the digits reward")
        if isinstance(digit, bool) or not isinstance(digit, (int, str)) or not str(digit).isdigit():
            raise ValueError(f"metadata 'digit' must be an integer 0-9, got {digit!r}")
        digit = int(digit)
        if not 0 <= digit <= 9:
            raise ValueError(f"digit {digit} of prompt {prompt!r} is not in 0-9")
        out.append(digit)
    return out


def digits_reward(
    images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
) -> list[float]:
    """P(image shows the prompt's digit) under the shipped MLP classifier: B floats in [0, 1]."""
    if len(prompts) != images.shape[0]:
        raise ValueError(f"got {len(prompts)} prompts for {images.shape[0]} images")
    digits = torch.tensor(target_digits(prompts, metadata), dtype=torch.long)
    probs = digit_probs(images)
    return probs.gather(1, digits[:, None])[:, 0].tolist()


def digits_ink(
    images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
) -> list[float]:
    """Mean brightness of each image on the classifier's 8x8 grey grid, B floats in [0, 1]:
    "ink". A term an image maximises by painting its background, not by being a better digit:
    added to ``digits`` (``reward=digits:1,digits_ink:W``) it makes the toy's reward hackable
    (docs/reward_hacking.md)."""
    if len(prompts) != images.shape[0]:
        raise ValueError(f"got {len(prompts)} prompts for {images.shape[0]} images")
    return ((to_classifier_input(images) + 1) / 2).mean(dim=1).tolist()


def digits_pairwise(
    images_a: torch.Tensor,
    images_b: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[dict] | None = None,
    ink_weight: float = 0.0,
    margin: float = 0.0,
) -> list[float]:
    """A pairwise version of ``digits`` (Pref-GRPO's pairwise judge, on the toy): 1 where
    image a's score beats image b's by more than ``margin``, 0 where b's beats a's, 0.5
    otherwise (a tie). The score is the classifier's probability of the prompt's digit, plus
    ``ink_weight`` x ``digits_ink`` (the hackable reward ``digits:1,digits_ink:W`` judged in
    pairs). B outcomes."""
    if images_a.shape != images_b.shape or len(prompts) != images_a.shape[0]:
        raise ValueError(
            f"got images {tuple(images_a.shape)} and {tuple(images_b.shape)} for "
            f"{len(prompts)} prompts"
        )
    scores = []
    for images in (images_a, images_b):
        p = torch.tensor(digits_reward(images, prompts, metadata))
        if ink_weight:
            p = p + ink_weight * torch.tensor(digits_ink(images, prompts, metadata))
        scores.append(p)
    diff = scores[0] - scores[1]
    return torch.where(diff > margin, 1.0, torch.where(diff < -margin, 0.0, 0.5)).tolist()


digits_pairwise.pairwise = True  # type: ignore[attr-defined]


def digits_accuracy(
    images: torch.Tensor,
    digits: Sequence[int] | torch.Tensor,
    classifier: DigitsClassifier | None = None,
) -> float:
    """Fraction of images whose classifier argmax is the given digit."""
    digits = torch.as_tensor(digits, dtype=torch.long).reshape(-1)
    return float((digit_probs(images, classifier).argmax(-1) == digits).float().mean())


@lru_cache(maxsize=1)
def _judge() -> Any:
    from flowgrpo.toy.data import load_digits_data

    x, y = load_digits_data("train")  # first: a clear error when scikit-learn is missing
    from sklearn.svm import SVC

    return SVC(C=10.0, gamma="scale").fit(x.reshape(len(y), 64).numpy(), y.numpy())


def digits_judge(images: torch.Tensor, digits: Sequence[int] | torch.Tensor) -> float:
    """Accuracy of an independent SVC (test accuracy ~0.99) on ``images`` vs ``digits``."""
    digits = torch.as_tensor(digits, dtype=torch.long).reshape(-1)
    if digits.numel() != images.shape[0]:
        raise ValueError(f"got {digits.numel()} digits for {images.shape[0]} images")
    pred = _judge().predict(to_classifier_input(images).numpy())
    return float((torch.as_tensor(pred) == digits).float().mean())


def digits_judge_reward(
    images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
) -> torch.Tensor:
    """Registered as ``digits_judge``: 1 where the independent SVC judge reads the prompt's
    digit, else 0, per sample (its mean is ``digits_judge``'s accuracy). The toy's gold
    reward (``eval.gold_reward=digits_judge``): the policy never trains on it."""
    digits = torch.tensor(target_digits(prompts, metadata), dtype=torch.long)
    pred = torch.as_tensor(_judge().predict(to_classifier_input(images).numpy()))
    return (pred == digits).float()


def diversity(images: torch.Tensor, digits: Sequence[int] | torch.Tensor | None = None) -> float:
    """Mean over digits of the mean per-pixel std across that digit's samples, on the data's
    [-1, 1] scale (real digits: 0.33; a collapsed policy: -> 0). ``digits`` None = one group.
    Groups of one sample are skipped; 0.0 when none has two."""
    x = to_classifier_input(images)
    groups = (
        torch.zeros(len(x), dtype=torch.long)
        if digits is None
        else torch.as_tensor(digits, dtype=torch.long).reshape(-1)
    )
    if groups.numel() != len(x):
        raise ValueError(f"got {groups.numel()} digits for {len(x)} images")
    stds = [x[groups == g].std(0, unbiased=False).mean() for g in groups.unique()]
    stds = [s for g, s in zip(groups.unique(), stds) if int((groups == g).sum()) > 1]
    return float(torch.stack(stds).mean()) if stds else 0.0


def digits_eval(
    images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
) -> dict[str, torch.Tensor]:
    """The toy's hacking-aware eval scores, per sample [B] each: ``accuracy`` (the reward
    classifier's argmax is the prompt's digit), ``judge_accuracy`` (the independent SVC
    agrees) and ``diversity`` (the per-pixel std across the samples of the sample's digit in
    this batch; 0 for a digit with one sample). Means over an eval set equal
    ``digits_accuracy``, ``digits_judge`` and ``diversity``; score the whole set at once."""
    digits = torch.tensor(target_digits(prompts, metadata), dtype=torch.long)
    accuracy = (digit_probs(images).argmax(-1) == digits).float()
    judge = torch.as_tensor(_judge().predict(to_classifier_input(images).numpy()))
    x = to_classifier_input(images)
    spread = torch.zeros(len(digits))
    for d in digits.unique():
        rows = digits == d
        if int(rows.sum()) > 1:
            spread[rows] = x[rows].std(0, unbiased=False).mean()
    return {
        "accuracy": accuracy,
        "judge_accuracy": (judge == digits).float(),
        "diversity": spread,
    }


__all__ = [
    "DigitsClassifier",
    "digit_probs",
    "digits_accuracy",
    "digits_eval",
    "digits_ink",
    "digits_judge",
    "digits_judge_reward",
    "digits_pairwise",
    "digits_reward",
    "diversity",
    "load_classifier",
    "target_digits",
    "to_classifier_input",
]

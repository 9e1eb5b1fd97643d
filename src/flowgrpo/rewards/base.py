"""Reward registry, multi-reward evaluation with validation, and async scoring.

A reward is a callable ``(images [B, C, H, W] float in [0, 1] on CPU, prompts list[str],
metadata list[dict]) -> B floats`` (list, array or tensor) or ``dict key -> B floats``
(docs/rewards.md). Videos are [B, C, F, H, W]: an image reward scores their frames
(``lift_to_video``), a reward with ``accepts_video = True`` the whole video. Built-ins are registered lazily by name so that importing this
module never imports transformers or onnxruntime.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from flowgrpo.rewards.spec import RewardSpec, check_frames, check_labels, parse_reward_specs
from flowgrpo.rewards.video import frame_indices
from flowgrpo.settings import did_you_mean

RewardOutput = Sequence[float] | torch.Tensor | Mapping[str, Sequence[float] | torch.Tensor]
RewardFn = Callable[[torch.Tensor, list[str], list[dict]], RewardOutput]

# name -> the reward object, or "package.module:attr" resolved on first use (lazy built-ins).
_REGISTRY: dict[str, Any] = {
    "ocr": "flowgrpo.rewards.ocr:OcrReward",
    "jpeg_compressibility": "flowgrpo.rewards.jpeg:jpeg_compressibility",
    "jpeg_incompressibility": "flowgrpo.rewards.jpeg:jpeg_incompressibility",
    "digits": "flowgrpo.toy.reward:digits_reward",
    "digits_eval": "flowgrpo.toy.reward:digits_eval",
    "digits_ink": "flowgrpo.toy.reward:digits_ink",
    "digits_judge": "flowgrpo.toy.reward:digits_judge_reward",
    "digits_pairwise": "flowgrpo.toy.reward:digits_pairwise",
    "clip_score": "flowgrpo.rewards.clip:ClipScore",
    "pickscore": "flowgrpo.rewards.clip:PickScore",
    "remote": "flowgrpo.rewards.remote:RemoteReward",
    "geneval": "flowgrpo.rewards.geneval_detectors:GenEval",
    "temporal_consistency": "flowgrpo.rewards.video:temporal_consistency",
    "image_similarity": "flowgrpo.rewards.similarity:ImageSimilarity",
    "vlm_judge": "flowgrpo.rewards.vlm_judge:VlmJudge",
    "hpsv2": "flowgrpo.rewards.hps:HPSv2",
    "image_reward": "flowgrpo.rewards.image_reward:ImageReward",
    "aesthetic": "flowgrpo.rewards.aesthetic:Aesthetic",
}


def register_reward(name: str) -> Callable[[Any], Any]:
    """Decorator registering a reward function or class under ``name`` (overrides a built-in).

    >>> @register_reward("brightness")
    ... def brightness(images, prompts, metadata):
    ...     return images.mean(dim=(1, 2, 3))
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward name must be a non-empty string without ':', got {name!r}")

    def deco(obj: Any) -> Any:
        _REGISTRY[name] = obj
        return obj

    return deco


def registered_rewards() -> list[str]:
    """Sorted names of all registered rewards."""
    return sorted(_REGISTRY)


def _import_path(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"reward import path must look like 'package.module:function', got {path!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if module_name.strip() in _REGISTRY:  # 'digits:abc': a registered reward, a bad weight
            raise ValueError(
                f"weight of reward {module_name.strip()!r} must be a number, got "
                f"{attr.strip()!r} in {path!r} (a reward of your own is named by its import "
                "path, module:function)"
            ) from None
        raise ValueError(f"cannot import module {module_name!r} of reward {path!r}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (reward {path!r})")
        obj = getattr(obj, part)
    return obj


def _resolve(name: str) -> Any:
    if ":" in name:
        return _import_path(name)
    if name not in _REGISTRY:
        hint = did_you_mean(name, _REGISTRY)
        raise ValueError(
            f"unknown reward {name!r}{hint}; registered rewards: {', '.join(registered_rewards())} "
            "(or give an import path 'package.module:function')"
        )
    obj = _REGISTRY[name]
    return _import_path(obj) if isinstance(obj, str) else obj  # modules are cached by Python


def build_reward(name_or_import_path: str, **options: Any) -> RewardFn:
    """Return the reward callable for a registry name or ``package.module:function`` path.

    A class is instantiated with ``options``; a function with options gets them bound as
    keyword arguments. Unknown names or options raise ValueError naming them.
    """
    obj = _resolve(name_or_import_path)
    if isinstance(obj, type):
        _check_options(obj.__init__, options, name_or_import_path, skip=1)  # self
        return obj(**options)
    if not callable(obj):
        raise ValueError(f"reward {name_or_import_path!r} resolved to a non-callable {obj!r}")
    if not options:
        return obj
    # images, prompts, metadata (a pairwise reward: images_a, images_b, prompts, metadata)
    _check_options(obj, options, name_or_import_path, skip=4 if is_pairwise(obj) else 3)

    def bound(*args: Any) -> RewardOutput:
        return obj(*args, **options)

    bound.__name__ = getattr(obj, "__name__", "reward")
    bound.accepts_video = getattr(obj, "accepts_video", False)  # type: ignore[attr-defined]
    bound.pairwise = is_pairwise(obj)  # type: ignore[attr-defined]
    return bound


def is_pairwise(fn: Any) -> bool:
    """Whether ``fn`` is a pairwise reward (``pairwise = True``): it is called as
    ``fn(images_a, images_b, prompts, metadata)`` on two batches of B images of the same
    prompts and returns B outcomes in [0, 1], how far each image of ``images_a`` beats its
    partner in ``images_b`` (1 better, 0 worse, 0.5 a tie; a judge's probability is
    allowed). The trainer turns its outcomes over every pair of a group into win rates
    (``flowgrpo.functional.advantages.win_rates``, Pref-GRPO)."""
    return bool(getattr(fn, "pairwise", False))


def _check_options(fn: Callable, options: Mapping[str, Any], name: str, skip: int) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())[skip:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(
            f"reward {name!r} got unknown option(s) {unknown}; it accepts {sorted(accepted)}"
        )


def validate_images(images: Any, prompts: Any, metadata: Any) -> None:
    """Check the reward input contract; ValueError naming the culprit otherwise."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"reward images must be a torch.Tensor, got {type(images).__name__}")
    if images.dim() not in (4, 5) or images.shape[1] not in (1, 3):
        raise ValueError(
            "reward images must be [B, C, H, W] (videos [B, C, F, H, W]) with C in (1, 3), "
            f"got {tuple(images.shape)}"
        )
    if not images.is_floating_point():
        raise ValueError(
            f"reward images must be a float tensor in [0, 1], got dtype {images.dtype}"
        )
    if images.device.type != "cpu":
        raise ValueError(f"reward images must be on the CPU, got device {images.device}")
    if images.numel():
        lo, hi = float(images.min()), float(images.max())
        if not (lo >= 0.0 and hi <= 1.0):  # also catches NaN
            raise ValueError(f"reward images must lie in [0, 1], got range [{lo:.4g}, {hi:.4g}]")
    b = images.shape[0]
    if not isinstance(prompts, (list, tuple)) or len(prompts) != b:
        n = len(prompts) if isinstance(prompts, (list, tuple)) else type(prompts).__name__
        raise ValueError(f"reward prompts must be a list of {b} strings (one per image), got {n}")
    if not isinstance(metadata, (list, tuple)) or len(metadata) != b:
        n = len(metadata) if isinstance(metadata, (list, tuple)) else type(metadata).__name__
        raise ValueError(f"reward metadata must be a list of {b} dicts (one per image), got {n}")


def to_score_tensor(values: Any, batch_size: int, name: str) -> torch.Tensor:
    """Scores -> float32 CPU tensor [B]; ValueError naming ``name`` if not B finite numbers."""
    try:  # fp64 first: a finite score beyond fp32's range is named as such, not "non-finite"
        if isinstance(values, torch.Tensor):
            t = values.detach().to("cpu", torch.float64)
        else:
            t = torch.as_tensor([float(v) for v in values], dtype=torch.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward {name!r} returned non-numeric scores: {e}") from e
    if t.dim() != 1 or t.numel() != batch_size:
        raise ValueError(
            f"reward {name!r} returned scores of shape {tuple(t.shape)}, expected {batch_size} "
            "(one per image)"
        )
    if not bool(torch.isfinite(t).all()):
        bad = torch.nonzero(~torch.isfinite(t)).flatten().tolist()
        raise ValueError(f"reward {name!r} returned non-finite scores at indices {bad}")
    big = t.abs() > torch.finfo(torch.float32).max
    if bool(big.any()):
        bad = torch.nonzero(big).flatten().tolist()
        raise ValueError(
            f"reward {name!r} returned scores beyond float32's range (|score| > 3.4e38) at "
            f"indices {bad}: scale the reward down"
        )
    return t.to(torch.float32)


def takes_video(fn: Any) -> bool:
    """Whether ``fn`` scores whole videos itself (``accepts_video = True``)."""
    return bool(getattr(fn, "accepts_video", False))


def lift_to_video(fn: Any, frames: str | int = "all", name: str = "reward") -> Any:
    """``fn`` unchanged when it takes videos; otherwise a reward that passes images through and
    scores a video [B, C, F, H, W] as the mean of ``fn`` over its chosen frames (each frame
    gets its video's prompt and a copy of its metadata). A dict reward's entries are averaged
    entry by entry. A video reward that sets ``scores_chosen_frames = True`` (the remote
    client) gets the videos cut to the chosen frames [B, C, n, H, W]."""
    frames = check_frames(frames, f"reward {name!r} option frames")
    if is_pairwise(fn):  # a pairwise judge gets what it is given (images or videos)
        return fn
    if takes_video(fn):
        if frames == "all" or not getattr(fn, "scores_chosen_frames", False):
            return fn

        def chosen(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> Any:
            if images.dim() == 5:
                images = images[:, :, frame_indices(images.shape[2], frames)]
            return fn(images, prompts, metadata)

        chosen.__name__ = getattr(fn, "__name__", name)
        chosen.accepts_video = True  # type: ignore[attr-defined]
        return chosen

    def per_frame(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> Any:
        if images.dim() != 5:
            return fn(images, prompts, metadata)
        b, c, f, h, w = images.shape
        idx = frame_indices(f, frames)
        n = len(idx)
        flat = images[:, :, idx].transpose(1, 2).reshape(b * n, c, h, w)
        raw = fn(
            flat,
            [p for p in prompts for _ in range(n)],
            [copy.deepcopy(m) for m in metadata for _ in range(n)],
        )

        def mean(values: Any, label: str) -> torch.Tensor:
            return to_score_tensor(values, b * n, label).view(b, n).mean(dim=1)

        if isinstance(raw, Mapping):
            return {k: mean(v, f"{name}/{k}") for k, v in raw.items()}
        return mean(raw, name)

    per_frame.__name__ = getattr(fn, "__name__", name)
    return per_frame


class RewardUnavailable(RuntimeError):
    """A reward's service could not be reached or did not answer in time (a remote reward
    server down or hung): the failure is not the samples', so scoring them one by one to find
    a culprit would only wait again."""


def reward_unavailable(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an exception it was raised from is a ``RewardUnavailable``."""
    while exc is not None:
        if isinstance(exc, RewardUnavailable):
            return True
        exc = exc.__cause__
    return False


def _tag(exc: BaseException, name: str) -> BaseException:
    exc.reward_name = name  # type: ignore[attr-defined]
    return exc


def takes_option(name_or_import_path: str, option: str) -> bool:
    """Whether the reward named ``name_or_import_path`` accepts the option ``option``."""
    obj = _resolve(name_or_import_path)
    fn = obj.__init__ if isinstance(obj, type) else obj
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return option in params


def needs_source_images(name_or_import_path: str) -> bool:
    """Whether the reward compares results with their source images (its object says so
    with ``needs_source_images = True``): an editing run's reward only."""
    return bool(getattr(_resolve(name_or_import_path), "needs_source_images", False))


def _with_device(name: str, options: Mapping[str, Any], device: Any) -> dict[str, Any]:
    """``options`` plus ``device`` (the run's) for a reward model that takes one and was not
    given one: reward models run where the run runs unless told otherwise."""
    out = dict(options)
    if device is not None and "device" not in out and takes_option(name, "device"):
        out["device"] = str(device)
    return out


class MultiReward:
    """Evaluate several rewards on one batch -> ``{name: Tensor[B] float32}``.

    A component returning a dict contributes entries named ``"<label>/<key>"``. Pairwise
    rewards (``is_pairwise``) are not scored by a call: ``score_pairs`` scores them on pairs
    of images (``pairwise_labels`` names them). ``weight_of`` gives an output name's weight,
    ``weights_of`` those of a scored batch (what the algorithm combines them with). Each
    reward gets its own
    copy of the images and metadata; any exception it raises, SystemExit included (not
    KeyboardInterrupt), becomes ``RuntimeError("reward 'NAME' failed: ...")``.
    """

    def __init__(self, specs: Sequence[RewardSpec] | Any, device: Any = None) -> None:
        self.specs = parse_reward_specs(specs)
        if not self.specs:
            raise ValueError("MultiReward needs at least one reward")
        check_labels(self.specs)
        for spec in self.specs:
            spec.check()
        self.fns: dict[str, RewardFn] = {
            s.label: lift_to_video(
                build_reward(s.name, **_with_device(s.name, s.options, device)), s.frames, s.label
            )
            for s in self.specs
        }

    @property
    def pairwise_labels(self) -> list[str]:
        """Labels of the pairwise rewards (scored by ``score_pairs``, not by a call)."""
        return [k for k, fn in self.fns.items() if is_pairwise(fn)]

    def score_pairs(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[dict] | None,
        firsts: Sequence[int],
        seconds: Sequence[int],
        *,
        chunk: int = 512,
    ) -> dict[str, torch.Tensor]:
        """Each pairwise reward's outcomes on the pairs (images[firsts[p]], images[seconds[p]])
        -> {label: [P] float32 in [0, 1]}; the pair's prompt and metadata are its first
        sample's. Scored ``chunk`` pairs a call. A failure is a RuntimeError naming the
        reward, as a call's is."""
        if metadata is None:
            metadata = [{} for _ in prompts]
        validate_images(images, prompts, metadata)
        firsts, seconds = list(firsts), list(seconds)
        out: dict[str, torch.Tensor] = {}
        for label in self.pairwise_labels:
            fn, parts = self.fns[label], []
            for lo in range(0, len(firsts), chunk):
                a, b = firsts[lo : lo + chunk], seconds[lo : lo + chunk]
                try:
                    raw = fn(
                        images[a].to(torch.float32, copy=True),
                        images[b].to(torch.float32, copy=True),
                        [prompts[i] for i in a],
                        copy.deepcopy([metadata[i] for i in a]),
                    )
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # as in __call__: never end the run quietly
                    what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                    raise _tag(RuntimeError(f"reward {label!r} failed: {what}"), label) from e
                try:
                    t = to_score_tensor(raw, len(a), label)
                    if not bool(((t >= 0) & (t <= 1)).all()):
                        raise ValueError(
                            f"pairwise reward {label!r} returned outcomes outside [0, 1]: "
                            f"{t[(t < 0) | (t > 1)][:3].tolist()}"
                        )
                except ValueError as e:
                    raise _tag(e, label) from None
                parts.append(t)
            out[label] = torch.cat(parts) if parts else torch.zeros(0)
        return out

    @classmethod
    def from_functions(
        cls, fns: Mapping[str, RewardFn], weights: Mapping[str, float] | None = None
    ) -> MultiReward:
        """Wrap already-built callables ``{name: fn}`` (weights default to 1)."""
        m = cls.__new__(cls)
        m.specs = [RewardSpec(k, float((weights or {}).get(k, 1.0)), alias=k) for k in fns]
        m.fns = {k: lift_to_video(fn, "all", k) for k, fn in fns.items()}
        return m

    @property
    def names(self) -> list[str]:
        return [s.label for s in self.specs]

    def weight_of(self, name: str) -> float | None:
        """The weight of output ``name`` ("label", or "label/key" of a dict reward), known
        without calling the reward (None for a name no reward gives)."""
        label, _, key = name.partition("/")
        for s in self.specs:
            if s.label == label:
                if not key or s.key_weights is None:
                    return float(s.weight)
                return float(s.weight) * float(s.key_weights.get(key, 0.0))
        return None

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
    ) -> dict[str, torch.Tensor]:
        if metadata is None:
            metadata = [{} for _ in prompts]
        validate_images(images, prompts, metadata)
        prompts, metadata = list(prompts), list(metadata)
        b = images.shape[0]
        out: dict[str, torch.Tensor] = {}
        for label, fn in self.fns.items():
            if is_pairwise(fn):  # scored on pairs: score_pairs
                continue
            # Each reward gets its own copy of the inputs: one that edits them in place
            # (images.mul_(0), metadata[i]["k"] = ...) cannot corrupt the caller's eval images
            # and grids, nor the next reward's input. A copy is cheap next to any real reward.
            mine = images.to(torch.float32, copy=True)
            try:
                raw = fn(mine, list(prompts), copy.deepcopy(metadata))
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # SystemExit too: a reward must not end the run quietly
                what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                raise _tag(RuntimeError(f"reward {label!r} failed: {what}"), label) from e
            try:
                if isinstance(raw, Mapping):
                    if not raw:
                        raise ValueError(f"reward {label!r} returned an empty dict")
                    for k, v in raw.items():
                        out[f"{label}/{k}"] = to_score_tensor(v, b, f"{label}/{k}")
                else:
                    out[label] = to_score_tensor(raw, b, label)
            except ValueError as e:
                raise _tag(e, label) from None
        return out

    def weights_of(self, names: Iterable[str]) -> dict[str, float]:
        """{name: weight} of the outputs ``names`` (the keys of a scored batch) that a reward
        gives: what the algorithm weighs the scores by when it forms advantages."""
        weights = {k: self.weight_of(k) for k in names}
        return {k: w for k, w in weights.items() if w is not None}


class RewardFuture:
    """Result of ``AsyncRewardScorer.submit``: ``.result()`` -> {name: Tensor[B]} in sample order."""

    def __init__(self, future: cf.Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> dict[str, torch.Tensor]:
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            raise
        except Exception as e:
            name = getattr(e, "reward_name", None)
            if name is None:
                raise RuntimeError(f"reward scoring failed: {type(e).__name__}: {e}") from e
            msg = str(e)
            prefix = f"reward {name!r} failed: "
            raise RuntimeError(msg if msg.startswith(prefix) else prefix + msg) from e


class AsyncRewardScorer:
    """Score batches in a worker thread while the trainer does other work.

    Inputs are copied at submit time, so the caller may reuse its buffers. Results keep the
    submitted sample order; a failing reward is re-raised by ``.result()`` as
    ``RuntimeError("reward 'NAME' failed: ...")``. Use as a context manager or call close().
    """

    def __init__(self, reward: MultiReward | RewardFn, *, max_workers: int = 1) -> None:
        self.reward = reward if isinstance(reward, MultiReward) else _single(reward)
        self._pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")

    def submit(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
    ) -> RewardFuture:
        if isinstance(images, torch.Tensor):
            images = images.detach().to("cpu", copy=True)
        prompts = list(prompts)
        metadata = [dict(m) for m in metadata] if metadata is not None else None
        return RewardFuture(self._pool.submit(self.reward, images, prompts, metadata))

    def close(self, cancel: bool = False) -> None:
        """Wait for the submitted batches; ``cancel``: drop those not started yet."""
        self._pool.shutdown(wait=True, cancel_futures=cancel)

    def __enter__(self) -> AsyncRewardScorer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(cancel=exc_type is not None)  # after a failure nobody reads the rest


def _single(fn: RewardFn) -> MultiReward:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return MultiReward.from_functions({name: fn})

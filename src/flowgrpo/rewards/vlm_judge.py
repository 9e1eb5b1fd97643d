"""``vlm_judge``: a reward scored by a vision-language model behind any OpenAI-compatible
chat-completions endpoint (``vllm serve``, SGLang, hosted providers). Standard library only.

Each sample is one request: its image (a video: its chosen frames) as data URLs, then the
question (``template`` filled with the prompt and the sample's metadata). The answer becomes a
score in [0, 1] by one of three rules:

- ``yes_probability``: the probability that the first answer token is "Yes", read from the
  returned top log-probs (VQAScore's rule). Tokens that spell the answer with other case or
  surrounding spaces (" Yes", "yes", "YES") are different tokens for the same answer: their
  probabilities are added. Not among the top log-probs: its probability is below the smallest
  listed one, and it counts 0, as VQAScore counts it. ``normalize=true`` scores
  P(yes) / (P(yes) + P(no)) instead (an error for a sample where neither is listed).
- ``number``: the first number ``pattern`` finds in the answer (``reduce=mean``: the mean
  of all it finds, as for UnifiedReward's three axes), mapped from ``scale`` [lo, hi] to
  [0, 1]. No number, or one outside the scale, is that sample's error, never a silent 0.
- ``text_match``: the answer is a transcription, scored against the text the prompt asks to
  render as the ``ocr`` reward scores its OCR (1 - normalised edit distance).

A sample the judge answered with nonsense fails the batch naming every such sample, or, with
``fallback`` set, scores ``fallback`` (one warning line naming them). A request that fails is
retried with exponential backoff, on the next server when several are given, all within
``timeout`` seconds per sample; each failed attempt logs one line naming the server and the
sample. A server that cannot be reached or does not answer in time raises
``RewardUnavailable`` (the trainer reports it at once); HTTP 401/403 fails at once naming
the environment variable the token is read from. The token is only ever read from the
environment (``token_env``), so that no config or log the run writes holds it.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import itertools
import json
import logging
import math
import os
import re
import string
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flowgrpo.rewards._image import to_pil
from flowgrpo.rewards.base import RewardUnavailable
from flowgrpo.rewards.remote import _is_timeout, flatten_videos

log = logging.getLogger(__name__)

TOKEN_ENV = "FLOWGRPO_JUDGE_TOKEN"
SCORES = ("yes_probability", "number", "text_match")
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"


@dataclass(frozen=True)
class JudgeTemplate:
    """A shipped question, the scoring rule it is meant for, and where it comes from."""

    text: str
    score: str
    source: str
    pattern: str | None = None
    scale: tuple[float, float] | None = None
    reduce: str = "first"


TEMPLATES: dict[str, JudgeTemplate] = {
    # t2v_metrics (VQAScore), t2v_metrics/models/vqascore_models/gpt4v_model.py at
    # 0ab6f3ea98aa7ca066e69f362f5a870f4fa28970: default_question_template, answer "Yes"
    "vqascore": JudgeTemplate(
        text='Does this figure show "{prompt}"? Please answer yes or no.',
        score="yes_probability",
        source="linzhiqiu/t2v_metrics t2v_metrics/models/vqascore_models/gpt4v_model.py "
        "@0ab6f3ea98aa7ca066e69f362f5a870f4fa28970",
    ),
    # UnifiedReward 2.0 point score, CodeGoat24/UnifiedReward
    # inference_qwen/UnifiedReward-2.0-inference/point_score_ACS_image_generation.py at
    # ff6f520247a2d36e2aff7b2ba53a935afd437f66; three 1-5 axes, averaged and mapped to [0, 1]
    # as verl-omni's unified_reward.py does (verl_omni/utils/reward_score/unified_reward.py)
    "unifiedreward": JudgeTemplate(
        text=(
            "You are presented with a generated image and its associated text caption. "
            "Your task is to analyze the image across multiple dimensions in relation to the "
            "caption. Specifically:\n"
            "Provide overall assessments for the image along the following axes (each rated "
            "from 1 to 5):\n"
            "- Alignment Score: How well the image matches the caption in terms of content.\n"
            "- Coherence Score: How logically consistent the image is (absence of visual "
            "glitches, object distortions, etc.).\n"
            "- Style Score: How aesthetically appealing the image looks, regardless of "
            "caption accuracy.\n\n"
            "Output your evaluation using the format below:\n\n"
            "Alignment Score (1-5): X\n"
            "Coherence Score (1-5): Y\n"
            "Style Score (1-5): Z\n\n"
            "Your task is provided as follows:\n"
            "Text Caption: [{prompt}]"
        ),
        score="number",
        pattern=r"(?:Alignment|Coherence|Style)\s+Score\s*(?:\(1-5\))?\s*:\s*(" + _NUMBER + ")",
        scale=(1.0, 5.0),
        reduce="mean",
        source="CodeGoat24/UnifiedReward inference_qwen/UnifiedReward-2.0-inference/"
        "point_score_ACS_image_generation.py @ff6f520247a2d36e2aff7b2ba53a935afd437f66",
    ),
    # flow_grpo's UnifiedReward-7b-v1.5 prompt (served by SGLang), yifan123/flow_grpo
    # flow_grpo/rewards.py `unifiedreward_score_sglang` at ac4c86e8cae021841f1fde853d340e0db67690dd;
    # flow_grpo scores an unparseable answer 0 and maps x to x / 5, here (x - 1) / 4
    "unifiedreward_flowgrpo": JudgeTemplate(
        text=(
            "<image>\nYou are given a text caption and a generated image based on that caption. "
            "Your task is to evaluate this image based on two key criteria:\n1. Alignment with "
            "the Caption: Assess how well this image aligns with the provided caption. Consider "
            "the accuracy of depicted objects, their relationships, and attributes as described "
            "in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, "
            "including clarity, detail preservation, color accuracy, and overall aesthetic "
            "appeal.\nBased on the above criteria, assign a score from 1 to 5 after 'Final "
            "Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
        ),
        score="number",
        pattern=r"Final Score:\s*([1-5](?:\.\d+)?)",
        scale=(1.0, 5.0),
        # (the repository's name is an algorithm's registry name, which no string here spells)
        source="Flow-GRPO's repository (yifan123), its package's rewards.py "
        "unifiedreward_score_sglang @ac4c86e8cae021841f1fde853d340e0db67690dd",
    ),
    # verl-omni's OCR judge (a VLM transcribes, Levenshtein against the ground truth),
    # verl_omni/utils/reward_score/genrm_ocr.py at a1139bafffb5b9711f0a6b6edff8ecaa60bfff30
    "text_rendering": JudgeTemplate(
        text="Please output only the text content from the image without any additional "
        "descriptions or formatting.",
        score="text_match",
        source="verl-project/verl-omni verl_omni/utils/reward_score/genrm_ocr.py "
        "@a1139bafffb5b9711f0a6b6edff8ecaa60bfff30",
    ),
}


class _NotSent(RewardUnavailable):
    """A sample left unsent because another one's request failed (that one is reported)."""


class JudgeAnswerError(ValueError):
    """The judge answered, but not with something the scoring rule can read."""


class VlmJudge:
    """Reward scored by a VLM behind OpenAI-compatible ``/v1/chat/completions`` (module doc).

    ``url``: one base URL (``http://host:8000`` or ``.../v1``) or a list: samples are spread
    over them in turn and a failed request moves on to the next. ``model``: the served model
    name (default: the first one ``GET /v1/models`` lists). ``template``: a shipped name
    (``vqascore``, ``unifiedreward``, ``unifiedreward_flowgrpo``, ``text_rendering``) or a text with ``{prompt}`` and
    metadata fields ``{name}``; ``score`` defaults to the shipped template's rule.
    """

    accepts_video = True
    scores_chosen_frames = True  # lift_to_video cuts videos to the spec's ``frames``

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        model: str | None = None,
        template: str = "vqascore",
        score: str | None = None,
        answer: str = "Yes",
        negative: str = "No",
        normalize: bool = False,
        top_logprobs: int = 20,
        pattern: str | None = None,
        scale: Sequence[float] | None = None,
        reduce: str | None = None,
        fallback: float | None = None,
        system: str | None = None,
        max_tokens: int | None = None,
        image_format: str = "png",
        jpeg_quality: int = 95,
        concurrency: int = 8,
        timeout: float = 60.0,
        retries: int = 2,
        backoff: float = 1.0,
        token_env: str = TOKEN_ENV,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        urls = [url] if isinstance(url, str) else list(url or [])
        if not urls or not all(str(u).startswith(("http://", "https://")) for u in urls):
            raise ValueError(
                f"vlm_judge needs option 'url' (http://host:port, or a list of them), got {url!r}"
            )
        self.urls = [_endpoint(str(u)) for u in urls]
        shipped = TEMPLATES.get(template)
        self.template = shipped.text if shipped else str(template)
        fields = _template_fields(self.template)
        if shipped is None and "prompt" not in fields:
            raise ValueError(
                f"vlm_judge option template must be one of {sorted(TEMPLATES)} or a text with "
                f"'{{prompt}}', got {template!r}"
            )
        self.fields = fields - {"prompt"}
        self.score = score or (shipped.score if shipped else "yes_probability")
        if self.score not in SCORES:
            raise ValueError(f"vlm_judge option score must be one of {SCORES}, got {score!r}")
        try:
            self.pattern = re.compile(pattern or (shipped and shipped.pattern) or f"({_NUMBER})")
        except re.error as e:
            raise ValueError(
                f"vlm_judge option pattern is not a regex ({e}): {pattern!r}"
            ) from None
        if self.pattern.groups > 1:
            raise ValueError(f"vlm_judge option pattern may have one group, got {pattern!r}")
        lo_hi = scale if scale is not None else (shipped and shipped.scale) or (0.0, 1.0)
        if len(lo_hi) != 2 or not float(lo_hi[0]) < float(lo_hi[1]):
            raise ValueError(f"vlm_judge option scale must be [lo, hi] with lo < hi, got {scale!r}")
        self.scale = (float(lo_hi[0]), float(lo_hi[1]))
        self.reduce = reduce or (shipped.reduce if shipped else "first")
        if self.reduce not in ("first", "mean"):
            raise ValueError(f"vlm_judge option reduce must be first or mean, got {reduce!r}")
        if image_format not in ("png", "jpeg"):
            raise ValueError(
                f"vlm_judge option image_format must be png or jpeg, got {image_format!r}"
            )
        if not 1 <= int(jpeg_quality) <= 100:
            raise ValueError(
                f"vlm_judge option jpeg_quality must be in 1..100, got {jpeg_quality!r}"
            )
        if concurrency < 1 or timeout <= 0 or retries < 0 or backoff < 0 or top_logprobs < 1:
            raise ValueError(
                "vlm_judge: need concurrency >= 1, timeout > 0, retries >= 0, backoff >= 0 and "
                f"top_logprobs >= 1, got {concurrency}, {timeout}, {retries}, {backoff}, "
                f"{top_logprobs}"
            )
        if fallback is not None and not math.isfinite(float(fallback)):
            raise ValueError(f"vlm_judge option fallback must be a finite number, got {fallback!r}")
        self.model = model
        self.answer, self.negative = answer.strip().lower(), negative.strip().lower()
        self.normalize = bool(normalize)
        self.top_logprobs = int(top_logprobs)
        self.fallback = None if fallback is None else float(fallback)
        self.system = system
        self.max_tokens = max_tokens
        self.image_format, self.jpeg_quality = image_format, int(jpeg_quality)
        self.concurrency, self.timeout = int(concurrency), float(timeout)
        self.retries, self.backoff = int(retries), float(backoff)
        self.token_env = token_env
        self.extra_body = dict(extra_body or {})
        self._turn = itertools.count()  # spreads samples over the servers across calls
        self._down_at: float | None = None  # monotonic time the servers were last found down

    # ----------------------------------------------------------------- the request
    def _token(self) -> str | None:
        return os.environ.get(self.token_env) or None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _served_model(self) -> str:
        """``model``, else the first model the first answering server lists (asked once)."""
        if self.model:
            return self.model
        errors = []
        for url in self.urls:
            models_url = url.rsplit("/chat/completions", 1)[0] + "/models"
            req = urllib.request.Request(models_url, headers=self._headers())
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    self.model = str(json.loads(resp.read())["data"][0]["id"])
                return self.model
            except Exception as e:  # noqa: BLE001 - the next server, then one error
                errors.append(f"{models_url}: {_describe(e)}")
        raise RewardUnavailable(
            "vlm_judge: no server listed its model (give option model=...): " + "; ".join(errors)
        )

    def _body(self, frames: torch.Tensor, text: str, model: str) -> bytes:
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": url}} for url in self._data_urls(frames)
        ]
        content.append({"type": "text", "text": text})
        messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
        if self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        body: dict[str, Any] = {"model": model, "messages": messages, "temperature": 0.0}
        if self.score == "yes_probability":
            body.update(max_tokens=1, logprobs=True, top_logprobs=self.top_logprobs)
        else:
            body["max_tokens"] = self.max_tokens or 512
        body.update(self.extra_body)
        return json.dumps(body).encode("utf-8")

    def _data_urls(self, frames: torch.Tensor) -> list[str]:
        out = []
        for img in to_pil(frames):
            buf = io.BytesIO()
            if self.image_format == "png":
                img.save(buf, format="PNG", compress_level=1)
            else:
                img.convert("RGB").save(buf, format="JPEG", quality=self.jpeg_quality)
            data = base64.b64encode(buf.getvalue()).decode("ascii")
            out.append(f"data:image/{self.image_format};base64,{data}")
        return out

    def _ask(self, i: int, body: bytes, first: int, down: threading.Event) -> dict:
        """POST sample ``i``'s request: retries with backoff, the next server each time, all
        within ``timeout`` seconds; one log line per failed attempt."""
        deadline = time.monotonic() + self.timeout
        attempts = self.retries + 1
        last, unavailable, made = "", True, 0
        for attempt in range(attempts):
            if down.is_set():
                raise _NotSent(f"vlm_judge: sample {i} not sent (another request failed)")
            url = self.urls[(first + attempt) % len(self.urls)]
            if attempt:
                time.sleep(
                    min(self.backoff * 2 ** (attempt - 1), max(0.0, deadline - time.monotonic()))
                )
            left = deadline - time.monotonic()
            if left <= 0:
                break
            req = urllib.request.Request(url, data=body, headers=self._headers(), method="POST")
            made += 1
            try:
                with urllib.request.urlopen(req, timeout=left) as resp:
                    raw = resp.read()
                try:
                    return json.loads(raw)
                except json.JSONDecodeError:
                    last, unavailable = f"not JSON: {raw[:120]!r}", False
            except urllib.error.HTTPError as e:
                detail = _http_detail(e)
                if e.code in (401, 403):
                    raise RuntimeError(
                        f"vlm_judge: {url} refused the token (HTTP {e.code} {detail}); the token "
                        f"is read from ${self.token_env} ({'set' if self._token() else 'not set'})"
                    ) from None
                if 400 <= e.code < 500 and e.code not in (408, 429):
                    raise RuntimeError(
                        f"vlm_judge: {url} rejected the request of sample {i}: HTTP {e.code} {detail}"
                    ) from None
                last, unavailable = f"HTTP {e.code} {detail}", True  # the server's failure
            except (urllib.error.URLError, OSError) as e:
                timed_out = _is_timeout(e)
                last = f"no answer within {self.timeout:g}s" if timed_out else _describe(e)
                unavailable = True
            log.warning(
                "vlm_judge: request for sample %d to %s failed (attempt %d/%d): %s",
                i, url, attempt + 1, attempts, last,
            )  # fmt: skip
        tried = ", ".join(
            dict.fromkeys(self.urls[(first + a) % len(self.urls)] for a in range(made))
        )
        message = (
            f"vlm_judge: sample {i} failed on {tried} after {made} attempt(s) within "
            f"{self.timeout:g}s: {last}"
        )
        if unavailable:
            down.set()
            raise RewardUnavailable(message)
        raise RuntimeError(message)

    # ----------------------------------------------------------------- the answer
    def _score(self, answer: Any, prompt: str, meta: Mapping[str, Any]) -> float:
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise JudgeAnswerError(f"no choices in the answer {str(answer)[:120]!r}") from None
        if self.score == "yes_probability":
            return self._yes_probability(choice)
        text = (choice.get("message") or {}).get("content")
        if not isinstance(text, str):
            raise JudgeAnswerError(f"no text in the answer {str(choice)[:120]!r}")
        if self.score == "number":
            return self._number(text)
        from flowgrpo.rewards.ocr import ocr_score, ocr_target

        return ocr_score(text, ocr_target(prompt, dict(meta)))

    def _yes_probability(self, choice: Mapping[str, Any]) -> float:
        try:
            top = choice["logprobs"]["content"][0]["top_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise JudgeAnswerError(
                "the answer carries no top log-probs (does the server support logprobs?)"
            ) from None
        seen: dict[str, float] = {}  # one probability per distinct token text
        try:
            for entry in top:
                seen.setdefault(str(entry["token"]), math.exp(float(entry["logprob"])))
        except (KeyError, TypeError, ValueError):
            raise JudgeAnswerError(f"malformed top log-probs {str(top)[:120]!r}") from None
        p_yes = sum(p for t, p in seen.items() if t.strip().lower() == self.answer)
        if not self.normalize:
            return min(p_yes, 1.0)
        p_no = sum(p for t, p in seen.items() if t.strip().lower() == self.negative)
        if p_yes + p_no <= 0:
            raise JudgeAnswerError(
                f"neither {self.answer!r} nor {self.negative!r} among the top "
                f"{len(seen)} tokens {list(seen)[:5]}"
            )
        return p_yes / (p_yes + p_no)

    def _number(self, text: str) -> float:
        try:
            found = [float(m) for m in self.pattern.findall(text)]
        except ValueError:
            raise JudgeAnswerError(f"pattern matched a non-number in {text[:80]!r}") from None
        if not found:
            raise JudgeAnswerError(f"no score in the answer {text[:80]!r}")
        value = found[0] if self.reduce == "first" else sum(found) / len(found)
        lo, hi = self.scale
        if not lo <= value <= hi:
            raise JudgeAnswerError(
                f"score {value:g} outside the scale [{lo:g}, {hi:g}] in {text[:80]!r}"
            )
        return (value - lo) / (hi - lo)

    # ----------------------------------------------------------------- the reward
    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> list[float]:
        frames, num_frames = flatten_videos(images)
        per = num_frames or 1
        b = len(prompts)
        texts = [
            self._question(i, p, m) for i, (p, m) in enumerate(zip(prompts, metadata, strict=True))
        ]
        since = None if self._down_at is None else time.monotonic() - self._down_at
        if since is not None and since < self.timeout:  # no second wait for a dead server
            raise RewardUnavailable(
                f"vlm_judge: {', '.join(self.urls)} unreachable or hung {since:.0f}s ago "
                f"(within the {self.timeout:g}s timeout); not asked again yet"
            )
        model = self._served_model()
        start = next(self._turn) * b
        down = threading.Event()
        scores: list[float | None] = [None] * b
        bad: dict[int, str] = {}

        def one(i: int) -> None:
            body = self._body(frames[i * per : (i + 1) * per], texts[i], model)
            answer = self._ask(i, body, (start + i) % len(self.urls), down)
            try:
                scores[i] = self._score(answer, prompts[i], metadata[i])
            except JudgeAnswerError as e:
                bad[i] = str(e)

        workers = min(self.concurrency, b) or 1
        pool = cf.ThreadPoolExecutor(workers, "vlm-judge")
        futures = [pool.submit(one, i) for i in range(b)]
        # each sample's request is bounded by ``timeout``; the batch by its waves of them (a
        # server trickling bytes could hold a socket past its per-read timeout)
        bound = self.timeout * math.ceil(b / workers) + 1.0
        done, late = cf.wait(futures, timeout=bound, return_when=cf.FIRST_EXCEPTION)
        errors: list[BaseException] = [e for f in done if (e := f.exception()) is not None]
        if errors or late:
            down.set()  # stop sending the rest: the batch fails anyway
        if errors and late:  # the requests in flight end within their own timeout
            done, late = cf.wait(late, timeout=self.timeout + 1.0)
            errors += [e for f in done if (e := f.exception()) is not None]
        pool.shutdown(wait=not late, cancel_futures=True)
        if late and not errors:
            errors.append(
                RewardUnavailable(
                    f"vlm_judge: {len(late)} request(s) to {', '.join(self.urls)} still "
                    f"unanswered after {bound:g}s"
                )
            )
        if errors:
            raised = next((e for e in errors if not isinstance(e, _NotSent)), errors[0])
            if isinstance(raised, RewardUnavailable):  # the servers are down or hung
                self._down_at = time.monotonic()
            raise raised
        if bad:
            listed = "; ".join(f"sample {i}: {bad[i]}" for i in sorted(bad))
            if self.fallback is None:
                raise RuntimeError(
                    f"vlm_judge could not score {len(bad)} of {b} sample(s) ({listed}); set "
                    "option fallback=<score> to score such answers instead"
                )
            log.warning(
                "vlm_judge: %d sample(s) scored fallback %g (%s)", len(bad), self.fallback, listed
            )
            for i in bad:
                scores[i] = self.fallback
        return [float(s) for s in scores]  # type: ignore[arg-type]

    def _question(self, i: int, prompt: str, meta: Mapping[str, Any]) -> str:
        values = {"prompt": prompt}
        for name in self.fields:
            if name not in meta:
                raise ValueError(
                    f"vlm_judge template field {{{name}}} is not in sample {i}'s metadata "
                    f"(it has {sorted(meta)})"
                )
            values[name] = meta[name]
        return self.template.format_map(values)


def _template_fields(template: str) -> set[str]:
    try:
        return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"vlm_judge option template is not a valid format text: {e}") from None


def _endpoint(url: str) -> str:
    """A base URL -> its chat-completions endpoint (a full endpoint is kept)."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if not url.endswith("/v1"):
        url += "/v1"
    return url + "/chat/completions"


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {getattr(e, 'reason', e)}"


def _http_detail(e: urllib.error.HTTPError) -> str:
    """The message of an error answer: OpenAI's ``{"error": {"message"}}``, vLLM's
    ``{"message"}``, or the status reason."""
    try:
        body = json.loads(e.read())
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:200]
    except Exception:  # noqa: BLE001 - any unreadable body: the reason
        return str(e.reason)

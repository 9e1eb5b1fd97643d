"""Remote reward client (standard library only) and the JSON protocol it shares with server.py.

Protocol: ``POST <url>`` with JSON ``{"images": [base64 PNG, ...], "prompts": [...],
"metadata": [...]}`` (optional header ``Authorization: Bearer <token>``); videos
[B, C, F, H, W] travel as their B·F frames in order (video by video) plus ``"frames": F``;
editing samples' ``metadata["source_images"]`` travel as PNGs too, each distinct image once:
``"source_images": [base64 PNG, ...]`` and ``"source_index": [[j, ...] per sample]`` (the
server puts the decoded [C, H, W] tensors back in each sample's metadata); the answer is
``{"scores": [B floats]}`` or ``{"scores": {key: [B floats]}}``, or on error ``{"error": msg}``
with a 4xx/5xx status. ``GET <base>/health`` answers ``{"status": "ok", "reward": name}``.
The server (server.py) refuses images over its pixel caps with 413, read from the PNG headers.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import io
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
from typing import Any

import torch
from PIL import Image

from flowgrpo.rewards._image import from_pil, to_pil, to_uint8
from flowgrpo.rewards.base import RewardUnavailable

TOKEN_ENV = "FLOWGRPO_REWARD_TOKEN"
DEFAULT_MAX_ANSWER_MB = 16.0  # scores are ~20 bytes each: room for 800,000 of them
MAX_RETRY_AFTER = 60.0  # the longest a 503's Retry-After makes the client wait, in seconds


def encode_images(images: torch.Tensor) -> list[str]:
    """[B, C, H, W] in [0, 1] -> B base64 PNG strings (lossless after uint8 rounding)."""
    out = []
    for img in to_pil(images):
        buf = io.BytesIO()
        img.save(buf, format="PNG", compress_level=1)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def flatten_videos(images: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """Videos [B, C, F, H, W] -> (their frames [B·F, C, H, W], F); images -> (images, None)."""
    if images.dim() != 5:
        return images, None
    b, c, f, h, w = images.shape
    return images.transpose(1, 2).reshape(b * f, c, h, w), f


def unflatten_videos(frames: torch.Tensor, num_frames: int | None) -> torch.Tensor:
    """The inverse of ``flatten_videos``: [B·F, C, H, W] -> [B, C, F, H, W]."""
    if num_frames is None:
        return frames
    n, c, h, w = frames.shape
    return frames.view(n // num_frames, num_frames, c, h, w).transpose(1, 2)


def decode_images(data: list[str]) -> torch.Tensor:
    """B base64 PNG strings -> [B, C, H, W] float32 in [0, 1]."""
    pils = []
    for i, s in enumerate(data):
        try:
            img = Image.open(io.BytesIO(base64.b64decode(s, validate=True)))
            img.load()
        except Exception as e:
            raise ValueError(f"image {i} is not a base64 PNG: {e}") from e
        pils.append(img)
    return from_pil(pils)


def encode_sources(
    metadata: list[dict],
) -> tuple[list[dict], list[str], list[list[int]]] | None:
    """Editing samples' ``source_images`` ([C, H, W] in [0, 1]) -> (the metadata without
    them, each distinct image as one base64 PNG, each sample's indices into that list); None
    when no sample has any. A group's K samples share their sources: each is sent once."""
    if not any(m.get("source_images") for m in metadata):
        return None
    pngs: list[str] = []
    seen: dict[bytes, int] = {}
    index: list[list[int]] = []
    rest = []
    for m in metadata:
        row = []
        for src in m.get("source_images") or []:
            img = torch.as_tensor(src).unsqueeze(0)
            key = hashlib.blake2b(to_uint8(img).tobytes(), digest_size=16)
            key.update(repr(tuple(img.shape)).encode())
            j = seen.setdefault(key.digest(), len(pngs))
            if j == len(pngs):
                pngs += encode_images(img)
            row.append(j)
        index.append(row)
        rest.append({k: v for k, v in m.items() if k != "source_images"})
    return rest, pngs, index


def _jsonable(meta: Any) -> Any:
    """Metadata made JSON-safe: tensors/arrays to lists, unknown objects to strings."""
    if isinstance(meta, dict):
        return {str(k): _jsonable(v) for k, v in meta.items()}
    if isinstance(meta, (list, tuple)):
        return [_jsonable(v) for v in meta]
    if isinstance(meta, (str, int, float, bool)) or meta is None:
        return meta
    if hasattr(meta, "tolist"):
        return meta.tolist()
    return str(meta)


class RemoteReward:
    """Reward computed by a server (``flowgrpo reward-server``) at ``url``.

    Each call POSTs the batch; a connection error or 5xx answer is retried up to ``retries``
    times with exponential ``backoff`` (s), a 503 after its ``Retry-After`` (at most 60 s)
    when it gives one; 4xx answers are not retried. ``timeout`` bounds a whole attempt
    (connecting, sending, every byte of the answer: a server trickling its answer is cut at
    the deadline), and an answer over ``max_answer_mb`` is refused unread. A timeout is not
    retried (a server that did not answer within ``timeout`` is hung), and calls
    made within ``timeout`` seconds after one fail at once: a hung server is reported after
    one timeout. A server that timed out or cannot be reached raises ``RewardUnavailable``,
    other failures RuntimeError, both naming the URL. ``token`` defaults to
    $FLOWGRPO_REWARD_TOKEN. Videos are sent as the frames the reward's ``frames`` setting
    chooses (all by default); the server lifts an image reward to them.
    """

    accepts_video = True
    scores_chosen_frames = True  # lift_to_video sends only the frames ``frames`` picks

    def __init__(
        self,
        url: str | None = None,
        timeout: float = 60.0,
        retries: int = 2,
        backoff: float = 1.0,
        token: str | None = None,
        max_answer_mb: float = DEFAULT_MAX_ANSWER_MB,
    ) -> None:
        if not url or not str(url).startswith(("http://", "https://")):
            raise ValueError(f"remote reward needs option 'url' (http://host:port/), got {url!r}")
        if retries < 0 or timeout <= 0 or max_answer_mb <= 0:
            raise ValueError(
                "remote reward: need retries >= 0, timeout > 0 and max_answer_mb > 0, got "
                f"{retries}, {timeout}, {max_answer_mb}"
            )
        self.url = str(url)
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.max_answer_bytes = int(max_answer_mb * 2**20)
        self._timed_out_at: float | None = None  # monotonic time of the last timeout

    def _post(self, body: bytes) -> dict:
        """One attempt: POST ``body`` and parse the answer, all within ``timeout`` seconds
        (a timer shuts the socket at the deadline: a per-read timeout would let a server
        that trickles its answer hold the call for ever). HTTPError for a 4xx/5xx."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        url = urllib.parse.urlsplit(self.url)
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = kind(url.hostname, url.port, timeout=self.timeout)
        expired = threading.Event()

        def cut() -> None:
            expired.set()
            with contextlib.suppress(OSError, AttributeError):
                conn.sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self.timeout, cut)
        timer.daemon = True
        timer.start()
        try:
            conn.connect()  # bounded by ``timeout`` itself
            if expired.is_set():  # the timer fired while connecting: nothing to cut then
                raise TimeoutError(f"no connection within {self.timeout:g}s")
            conn.request("POST", path, body, headers)
            resp = conn.getresponse()
            data = self._read_answer(resp)
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set():
                raise TimeoutError(f"no whole answer within {self.timeout:g}s") from None
            if isinstance(e, OSError):
                raise
            raise ConnectionError(f"{type(e).__name__}: {e}") from None
        finally:
            timer.cancel()
            conn.close()
        if resp.status >= 400:
            raise urllib.error.HTTPError(
                self.url, resp.status, resp.reason, resp.headers, io.BytesIO(data)
            )
        return json.loads(data)

    def _read_answer(self, resp: http.client.HTTPResponse) -> bytes:
        """The answer's bytes, at most ``max_answer_bytes`` (read no further: one line)."""
        cap = self.max_answer_bytes
        declared = resp.getheader("Content-Length", "")
        size = int(declared) if declared.isascii() and declared.isdigit() else None
        data = resp.read(cap + 1) if size is None or size <= cap else b""
        if size is not None and size > cap or len(data) > cap:
            raise AnswerTooLarge(
                f"remote reward at {self.url} sent an answer of "
                f"{size if size is not None else f'over {cap}'} bytes, over the client's cap "
                f"of {cap / 2**20:g} MB (option max_answer_mb)"
            )
        return data

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> list[float] | dict[str, list[float]]:
        frames, num_frames = flatten_videos(images)
        metadata = list(metadata)
        sources = encode_sources(metadata)
        if sources is not None:
            metadata = sources[0]
        payload = {
            "images": encode_images(frames),
            "prompts": list(prompts),
            "metadata": _jsonable(metadata),
        }
        if sources is not None:
            payload["source_images"], payload["source_index"] = sources[1], sources[2]
        if num_frames is not None:
            payload["frames"] = num_frames
        body = json.dumps(payload).encode("utf-8")
        since = None if self._timed_out_at is None else time.monotonic() - self._timed_out_at
        if since is not None and since < self.timeout:
            raise RewardUnavailable(
                f"remote reward at {self.url} did not answer within {self.timeout:g}s "
                f"({since:.0f}s ago); is the server hung? (GET {self.url}health)"
            )
        attempts = self.retries + 1
        last, unavailable, wait = "", False, None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1) if wait is None else wait)
            try:
                answer = self._post(body)
                break
            except urllib.error.HTTPError as e:
                detail = _error_detail(e)
                if 400 <= e.code < 500:
                    raise RuntimeError(
                        f"remote reward at {self.url} rejected the request: HTTP {e.code} {detail}"
                    ) from None
                last, unavailable = f"HTTP {e.code} {detail}", False
                wait = _retry_after(e) if e.code == 503 else None
            except AnswerTooLarge as e:
                raise RuntimeError(str(e)) from None
            except json.JSONDecodeError as e:
                last, unavailable, wait = f"invalid JSON answer: {e}", False, None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                if _is_timeout(e):  # hung: a retry would wait as long again
                    self._timed_out_at = time.monotonic()
                    raise RewardUnavailable(
                        f"remote reward at {self.url} did not answer within {self.timeout:g}s "
                        f"(attempt {attempt + 1}, not retried); is the server hung? "
                        f"(GET {self.url}health)"
                    ) from None
                last, unavailable = f"{type(e).__name__}: {getattr(e, 'reason', e)}", True
                wait = None
        else:
            error = RewardUnavailable if unavailable else RuntimeError
            raise error(
                f"remote reward at {self.url} failed after {attempts} attempt(s) "
                f"(timeout {self.timeout:g}s): {last}"
            )
        self._timed_out_at = None
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if scores is None:
            raise RuntimeError(
                f"remote reward at {self.url} answered without 'scores': {answer!r:.200}"
            )
        return scores


class AnswerTooLarge(ValueError):
    """An answer over the client's ``max_answer_mb``: refused, not retried."""


def _retry_after(e: urllib.error.HTTPError) -> float | None:
    """A 503's ``Retry-After`` in seconds (at most ``MAX_RETRY_AFTER``), None without one (an
    HTTP date is not read: the backoff applies)."""
    value = (e.headers.get("Retry-After") or "").strip() if e.headers else ""
    try:
        seconds = float(value)
    except ValueError:
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER) if seconds == seconds else None


def _is_timeout(e: BaseException) -> bool:
    """A socket timeout, raw or wrapped in URLError (a timeout while connecting)."""
    return isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read()).get("error", ""))
    except Exception:
        return str(e.reason)

"""HTTP server exposing any registered reward with the protocol of remote.py.

``flowgrpo reward-server --reward ocr --port 8000`` binds 127.0.0.1 unless ``--host`` says
otherwise. Optional bearer token (401 on mismatch), request size limit (413), ``GET /health``.
One request is scored at a time (rewards need not be thread-safe); requests queue meanwhile.

Memory is bounded by pixels, not only bytes: a PNG of a blank 12000x12000 image is 0.2 MB but
holds 144 M pixels (0.4 GB as RGB, 1.7 GB as a float32 RGB tensor). Each image's size is read from its PNG header before any
decoding, and a request over ``--max-pixels`` per image or ``--max-request-pixels`` in all is
refused with 413 (a video counts all its frames). Only base64 PNG is accepted (415 otherwise);
metadata must be a list of objects (400 otherwise). Videos arrive as their frames plus
``"frames": F``; an image reward scores every frame and averages (``lift_to_video``).

What the server holds at once is bounded too: images are decoded only inside a server-wide
budget of ``--max-decoded-pixels`` (requests beyond it wait), the bodies held at once are
bounded by ``--max-pending-mb`` (a request beyond it gets 503), a body's JSON values are counted
before it is parsed (``--max-json-values``; a body of millions of ``{}`` would cost GBs as
Python objects), metadata is capped in bytes (``--max-metadata-mb``), JSON nested too deeply
is a 400, and a client has ``--read-timeout`` seconds to send its request (a slow or idle
connection is closed). Each request is logged in one line: client, method, status, bytes,
images and seconds.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import hmac
import io
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from PIL import Image

from flowgrpo.rewards._image import from_pil
from flowgrpo.rewards.base import (
    RewardFn,
    build_reward,
    lift_to_video,
    to_score_tensor,
    validate_images,
)
from flowgrpo.rewards.remote import TOKEN_ENV, unflatten_videos

log = logging.getLogger(__name__)
DEFAULT_MAX_REQUEST_MB = 256.0
# Per image: 4x the largest size the supported models generate (FLUX at 2048x2048 = 4.2 MP);
# decoding one costs ~20 bytes a pixel (uint8 planes + float32 tensor), 0.3 GB at the cap.
DEFAULT_MAX_PIXELS = 4096 * 4096
# Per request: a batch of 64 images of 1024x1024 (16 of 2048x2048); ~0.8 GB as float32.
DEFAULT_MAX_REQUEST_PIXELS = 64 * 1024 * 1024
# Server-wide: pixels decoded and held at once by all requests together (one full request).
DEFAULT_MAX_DECODED_PIXELS = DEFAULT_MAX_REQUEST_PIXELS
# JSON values per body, counted before parsing: each costs 30-70 bytes as a Python object.
DEFAULT_MAX_JSON_VALUES = 4_000_000
DEFAULT_MAX_METADATA_MB = 16.0
DEFAULT_READ_TIMEOUT = 60.0  # seconds a client has to send its whole request
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class RequestError(ValueError):
    """A request the server refuses: HTTP ``code`` with a one-line message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _png_header(i: int, data: Any) -> tuple[bytes, int, int]:
    """Base64 PNG -> (bytes, width, height), the size read from the IHDR chunk (the first
    chunk of every PNG); nothing is decoded."""
    if not isinstance(data, str):
        raise RequestError(400, f"image {i} must be a base64 string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(400, f"image {i} is not valid base64: {e}") from None
    if not raw.startswith(PNG_SIGNATURE):
        raise RequestError(
            415, f"image {i} is not a PNG (starts with {raw[:8]!r}); send base64 PNG images"
        )
    if len(raw) < 24 or raw[12:16] != b"IHDR":
        raise RequestError(400, f"image {i} is not a valid PNG: no IHDR header")
    width, height = struct.unpack(">II", raw[16:24])
    return raw, width, height


def _decode_png(i: int, raw: bytes) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(raw), formats=["PNG"])
        img.load()
    except Image.DecompressionBombError as e:  # PIL's own cap, when --max-pixels is above it
        raise RequestError(413, f"image {i}: {e}") from None
    except Exception as e:
        raise RequestError(400, f"image {i} is not a valid PNG: {e}") from None
    return img


class Budget:
    """A counting semaphore of pixels or bytes: ``hold(n)`` waits until ``n`` of ``total`` are
    free (``wait=False``: None at once when they are not). The server decodes and scores a
    request's images inside ``hold(its pixels)`` of one budget, and holds a request's body
    inside ``hold(its bytes)`` of another, so all requests together stay within both."""

    def __init__(self, total: int) -> None:
        self.total, self.used, self.peak = int(total), 0, 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int, wait: bool = True) -> Iterator[bool]:
        """Yields True while ``n`` are held; False (nothing held) when ``wait`` is False and
        they are not free now."""
        if n > self.total:
            raise ValueError(f"cannot hold {n} of a budget of {self.total}")
        with self._cond:
            if not wait and self.used + n > self.total:
                got = False
            else:
                self._cond.wait_for(lambda: self.used + n <= self.total)
                self.used += n
                self.peak = max(self.peak, self.used)
                got = True
        try:
            yield got
        finally:
            if got:
                with self._cond:
                    self.used -= n
                    self._cond.notify_all()


def check_body(body: bytes | bytearray, max_values: int) -> None:
    """Refuse (413) a body with more JSON values than ``max_values`` before parsing it: its
    ``{``, ``[`` and ``,`` bound the values from above (base64 has none of them)."""
    n = body.count(b"{") + body.count(b"[") + body.count(b",")
    if n > max_values:
        raise RequestError(
            413,
            f"the body holds up to {n} JSON values, over the cap of {max_values} "
            "(--max-json-values); keep metadata small",
        )


def parse_json(body: bytes | bytearray, max_values: int) -> Any:
    """The JSON body, or a 400 naming what is wrong (deep nesting included)."""
    check_body(body, max_values)
    try:
        return json.loads(body)
    except RecursionError:
        raise RequestError(400, "the body's JSON is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None


def _check_sizes(data: Any, max_pixels: int, max_request_pixels: int) -> tuple[list, int]:
    """Base64 PNGs -> ([(bytes, width, height)], total pixels), checked against the pixel
    caps (413) from the PNG headers alone."""
    if not isinstance(data, list) or not data:
        raise RequestError(400, "'images' must be a non-empty list of base64 PNG strings")
    headers = [_png_header(i, d) for i, d in enumerate(data)]
    total = 0
    for i, (_, w, h) in enumerate(headers):
        if w * h > max_pixels:
            raise RequestError(
                413,
                f"image {i} is {w}x{h} = {w * h} pixels, over the cap of {max_pixels} per "
                "image (--max-pixels)",
            )
        total += w * h
    if total > max_request_pixels:
        raise RequestError(
            413,
            f"{len(headers)} images of {total} pixels in all, over the cap of "
            f"{max_request_pixels} per request (--max-request-pixels); send smaller batches",
        )
    sizes = sorted({(w, h) for _, w, h in headers})
    if len(sizes) > 1:
        raise RequestError(400, f"images in one request must share a size, got {sizes}")
    return headers, total


def read_images(data: Any, max_pixels: int, max_request_pixels: int) -> torch.Tensor:
    """Base64 PNGs -> [B, C, H, W] float32 in [0, 1]. Sizes come from the PNG headers and are
    checked against the pixel caps (413) before anything is decoded."""
    headers, _ = _check_sizes(data, max_pixels, max_request_pixels)
    return from_pil([_decode_png(i, raw) for i, (raw, _, _) in enumerate(headers)])


class Request:
    """A checked request whose images are not decoded yet: ``pixels`` in all; ``decode()``
    -> (images [B, C, H, W] or videos [B, C, F, H, W], prompts, metadata)."""

    def __init__(self, headers: list, pixels: int, prompts: list, metadata: list, frames) -> None:
        self.headers, self.pixels = headers, pixels
        self.prompts, self.metadata, self.frames = prompts, metadata, frames

    def decode(self) -> tuple:
        headers, frames, prompts = self.headers, self.frames, self.prompts
        images = from_pil([_decode_png(i, raw) for i, (raw, _, _) in enumerate(headers)])
        self.headers = []  # the PNG bytes are not needed any more
        if frames is not None:
            images = unflatten_videos(images, frames)
        validate_images(images, prompts, self.metadata)
        return images, prompts, self.metadata


def parse_request(req: Any, max_pixels: int, max_request_pixels: int) -> tuple:
    """The JSON body -> (images, prompts, metadata), or RequestError naming what is wrong."""
    return check_request(req, max_pixels, max_request_pixels).decode()


def check_request(
    req: Any, max_pixels: int, max_request_pixels: int, max_metadata_bytes: int | None = None
) -> Request:
    """The parsed JSON body -> a ``Request`` (nothing decoded), or RequestError naming what is
    wrong: the fields' types, the pixel caps, the metadata's size in bytes."""
    if not isinstance(req, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(req).__name__}")
    missing = [k for k in ("images", "prompts") if k not in req]
    if missing:
        raise RequestError(400, f"the body misses {missing}: send images, prompts, metadata")
    prompts = req["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError(400, "'prompts' must be a list of strings")
    metadata = req.get("metadata")
    if metadata is None:
        metadata = [{} for _ in prompts]
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise RequestError(400, "'metadata' must be a list of JSON objects, one per image")
    frames = req.get("frames")
    if frames is not None and (
        isinstance(frames, bool) or not isinstance(frames, int) or frames < 1
    ):
        raise RequestError(400, f"'frames' must be a whole number >= 1, got {frames!r}")
    if max_metadata_bytes is not None:
        size = len(json.dumps(metadata, separators=(",", ":")))
        if size > max_metadata_bytes:
            raise RequestError(
                413,
                f"metadata of {size} bytes exceeds {max_metadata_bytes / 2**20:g} MB "
                "(--max-metadata-mb)",
            )
    headers, pixels = _check_sizes(req["images"], max_pixels, max_request_pixels)
    if frames is not None and len(headers) != frames * len(prompts):
        raise RequestError(
            400,
            f"{len(headers)} frames do not make {len(prompts)} videos of {frames} frames "
            "(send each video's frames in order, one prompt per video)",
        )
    return Request(headers, pixels, prompts, metadata, frames)


class RewardHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer holding one reward; ``.url`` is its scoring endpoint."""

    daemon_threads = True

    def __init__(
        self,
        reward: RewardFn,
        *,
        name: str = "reward",
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_request_bytes: int = int(DEFAULT_MAX_REQUEST_MB * 2**20),
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS,
        max_decoded_pixels: int | None = None,
        max_pending_bytes: int | None = None,
        max_json_values: int = DEFAULT_MAX_JSON_VALUES,
        max_metadata_bytes: int = int(DEFAULT_MAX_METADATA_MB * 2**20),
        read_timeout: float = DEFAULT_READ_TIMEOUT,
    ) -> None:
        limits = {
            "max_request_bytes": max_request_bytes,
            "max_pixels": max_pixels,
            "max_request_pixels": max_request_pixels,
            "max_json_values": max_json_values,
            "max_metadata_bytes": max_metadata_bytes,
            "read_timeout": read_timeout,
        }
        if max_decoded_pixels is None:  # one request at the cap at a time
            max_decoded_pixels = max_request_pixels
        limits["max_decoded_pixels"] = max_decoded_pixels
        if max_pending_bytes is None:  # two requests at the size cap
            max_pending_bytes = 2 * max_request_bytes
        limits["max_pending_bytes"] = max_pending_bytes
        if min(limits.values()) <= 0:
            raise ValueError(f"reward server limits must be > 0, got {limits}")
        if max_decoded_pixels < max_request_pixels:
            raise ValueError(
                f"max_decoded_pixels ({max_decoded_pixels}) must be >= max_request_pixels "
                f"({max_request_pixels}): a request at the cap could never be decoded"
            )
        if max_pending_bytes < max_request_bytes:
            raise ValueError(
                f"max_pending_bytes ({max_pending_bytes}) must be >= max_request_bytes "
                f"({max_request_bytes}): a request at the cap could never be read"
            )
        self.reward = lift_to_video(reward, "all", name)
        self.reward_name = name
        self.token = token or None
        self.max_request_bytes = int(max_request_bytes)
        self.max_pixels = int(max_pixels)
        self.max_request_pixels = int(max_request_pixels)
        self.max_json_values = int(max_json_values)
        self.max_metadata_bytes = int(max_metadata_bytes)
        self.read_timeout = float(read_timeout)
        self.pixel_budget = Budget(max_decoded_pixels)
        self.body_budget = Budget(max_pending_bytes)
        self.score_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    def handle_error(self, request, client_address) -> None:
        """A client that gave up (timeout) is not a server error: log it, skip the traceback."""
        import sys

        if isinstance(sys.exc_info()[1], (OSError, ConnectionError)):  # timeouts included
            log.info("client %s: connection lost (%s)", client_address, sys.exc_info()[1])
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def start_in_thread(self) -> RewardHTTPServer:
        """Serve in a daemon thread (for tests and in-process use); stop with ``close()``."""
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    server: RewardHTTPServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        """Every read waits at most ``read_timeout`` s, and a watchdog closes the connection
        when the whole request has not arrived by then (a client trickling bytes)."""
        self.timeout = self.server.read_timeout
        super().setup()
        self._t0, self._nbytes, self._nimages = time.monotonic(), 0, 0
        self._watchdog = threading.Timer(self.server.read_timeout, self._cut)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _cut(self) -> None:
        log.info(
            "%s: request not received within %gs; connection closed",
            self.client_address[0],
            self.server.read_timeout,
        )
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self._watchdog.cancel()
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), fmt % args)

    def _send(self, code: int, obj: dict) -> None:
        self._watchdog.cancel()
        log.info(
            "%s %s %s %d %d bytes %d images %.3fs",
            self.client_address[0],
            self.command,
            self.path,
            code,
            self._nbytes,
            self._nimages,
            time.monotonic() - self._t0,
        )
        body = json.dumps(obj).encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorised(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        got = self.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

    def do_GET(self) -> None:
        self.close_connection = True  # one request per connection (the watchdog's unit)
        if self.path.rstrip("/").split("?")[0] == "/health":
            self._send(200, {"status": "ok", "reward": self.server.reward_name})
        else:
            self._send(404, {"error": f"unknown path {self.path!r}; POST / to score, GET /health"})

    def _read(self, length: int) -> bytearray | None:
        """The body (read into one buffer), or None when the client stopped sending (timeout
        or closed)."""
        body, left = bytearray(length), length
        view = memoryview(body)
        try:
            while left > 0:
                got = self.rfile.readinto(view[length - left : length - left + 2**20])
                if not got:
                    break
                left -= got
        except OSError:  # a read timed out
            pass
        view.release()
        self._nbytes = length - left
        if left:
            log.info(
                "%s POST %s: %d of %d bytes received in %.3fs, then the connection timed out "
                "or closed; no answer",
                self.client_address[0],
                self.path,
                length - left,
                length,
                time.monotonic() - self._t0,
            )
            return None
        return body

    def _drain(self, length: int) -> None:
        """Read and drop an unwanted body (bounded) so the client sees our answer, not a reset."""
        left = min(length, 4 * self.server.max_request_bytes + 2**20)
        with contextlib.suppress(OSError):
            while left > 0:
                chunk = self.rfile.read(min(left, 2**20))
                if not chunk:
                    break
                left -= len(chunk)
                self._nbytes += len(chunk)

    def do_POST(self) -> None:
        self.close_connection = True
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            self._send(411, {"error": "Content-Length required"})
            return
        if not self._authorised():
            self._drain(int(length))
            self._send(401, {"error": "missing or wrong bearer token"})
            return
        if int(length) > self.server.max_request_bytes:
            self._drain(int(length))
            limit_mb = self.server.max_request_bytes / 2**20
            self._send(413, {"error": f"request of {int(length)} bytes exceeds {limit_mb:g} MB"})
            return
        with self.server.body_budget.hold(int(length), wait=False) as held:
            if not held:
                self._drain(int(length))
                self._send(
                    503,
                    {
                        "error": "busy: other requests' bodies fill --max-pending-mb "
                        f"({self.server.body_budget.total / 2**20:g} MB); retry later"
                    },
                )
                return
            self._post(int(length))

    def _post(self, length: int) -> None:
        """Read, check, decode and score a request of ``length`` bytes, and answer it."""
        body = self._read(length)
        if body is None:
            return
        self._watchdog.cancel()  # the request is in: scoring (and waiting for it) may take long
        srv = self.server
        try:
            req = parse_json(body, srv.max_json_values)
            del body
            pending = check_request(
                req, srv.max_pixels, srv.max_request_pixels, srv.max_metadata_bytes
            )
            self._nimages = len(pending.headers)
            del req  # the base64 text: the PNG bytes are in ``pending``
            with srv.pixel_budget.hold(pending.pixels):  # decoded images live only in here
                images, prompts, metadata = pending.decode()
                code, answer = self._score(images, prompts, metadata)
                del images
        except RequestError as e:
            self._send(e.code, {"error": str(e)})
            return
        except (ValueError, KeyError, TypeError) as e:
            self._send(400, {"error": f"bad request: {type(e).__name__}: {e}"})
            return
        self._send(code, answer)

    def _score(self, images: torch.Tensor, prompts: list, metadata: list) -> tuple[int, dict]:
        name = self.server.reward_name
        try:
            with self.server.score_lock:
                raw = self.server.reward(images, prompts, metadata)
            b = images.shape[0]
            if isinstance(raw, dict):
                scores: Any = {
                    k: to_score_tensor(v, b, f"{name}/{k}").tolist() for k, v in raw.items()
                }
            else:
                scores = to_score_tensor(raw, b, name).tolist()
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit from a reward: a 500, not a dropped connection
            log.exception("reward %r failed", name)
            return 500, {"error": f"reward {name!r} failed: {type(e).__name__}: {e}"}
        return 200, {"reward": name, "scores": scores}


def serve_reward(
    name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS,
    max_decoded_pixels: int | None = None,
    max_pending_mb: float | None = None,
    max_json_values: int = DEFAULT_MAX_JSON_VALUES,
    max_metadata_mb: float = DEFAULT_MAX_METADATA_MB,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    options: dict[str, Any] | None = None,
) -> RewardHTTPServer:
    """Build the reward ``name`` (registry name or import path) and a server for it (not started)."""
    reward = build_reward(name, **(options or {}))
    return RewardHTTPServer(
        reward,
        name=name,
        host=host,
        port=port,
        token=token,
        max_request_bytes=int(max_request_mb * 2**20),
        max_pixels=max_pixels,
        max_request_pixels=max_request_pixels,
        max_decoded_pixels=max_decoded_pixels,
        max_pending_bytes=None if max_pending_mb is None else int(max_pending_mb * 2**20),
        max_json_values=max_json_values,
        max_metadata_bytes=int(max_metadata_mb * 2**20),
        read_timeout=read_timeout,
    )


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option must look like key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_reward_server_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``reward-server`` subcommand to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "reward-server",
        help="serve a registered reward over HTTP (see docs/rewards.md)",
        description="Serve a reward over HTTP: POST / with base64 PNG images, GET /health.",
    )
    p.add_argument("--reward", required=True, help="registry name or package.module:function")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--token", default=None, help=f"bearer token (default ${TOKEN_ENV})")
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=DEFAULT_MAX_REQUEST_MB,
        help=f"largest request body in MB (default {DEFAULT_MAX_REQUEST_MB:g}); larger: 413",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        help=f"most pixels per image, read from the PNG header before decoding (default "
        f"{DEFAULT_MAX_PIXELS} = 4096x4096); larger: 413",
    )
    p.add_argument(
        "--max-request-pixels",
        type=int,
        default=DEFAULT_MAX_REQUEST_PIXELS,
        help=f"most pixels per request, all images together (default {DEFAULT_MAX_REQUEST_PIXELS}"
        " = 64 images of 1024x1024); larger: 413",
    )
    p.add_argument(
        "--max-decoded-pixels",
        type=int,
        default=None,
        help="most pixels decoded and held at once by all requests together; others wait "
        "(default: --max-request-pixels, one full request at a time)",
    )
    p.add_argument(
        "--max-pending-mb",
        type=float,
        default=None,
        help="most MB of request bodies held at once by all requests together; a request "
        "beyond it is answered 503 (the client retries) (default: 2 x --max-request-mb)",
    )
    p.add_argument(
        "--max-json-values",
        type=int,
        default=DEFAULT_MAX_JSON_VALUES,
        help=f"most JSON values in a body, counted before parsing (default "
        f"{DEFAULT_MAX_JSON_VALUES}); more: 413",
    )
    p.add_argument(
        "--max-metadata-mb",
        type=float,
        default=DEFAULT_MAX_METADATA_MB,
        help=f"largest metadata as JSON, in MB (default {DEFAULT_MAX_METADATA_MB:g}); larger: 413",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT,
        help=f"seconds a client has to send its whole request; a slower or idle connection "
        f"is closed (default {DEFAULT_READ_TIMEOUT:g})",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        type=_parse_option,
        metavar="KEY=VALUE",
        help="reward option (value parsed as JSON when possible); repeatable",
    )
    p.set_defaults(func=run_reward_server_cli)
    return p


def run_reward_server_cli(
    args: argparse.Namespace, on_start: Callable[[RewardHTTPServer], None] | None = None
) -> int:
    """Run the server until interrupted or ``server.shutdown()`` (blocking); returns 0.

    ``on_start(server)`` is called once it listens (tests use it to learn the port).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV)
    server = serve_reward(
        args.reward,
        host=args.host,
        port=args.port,
        token=token,
        max_request_mb=args.max_request_mb,
        max_pixels=args.max_pixels,
        max_request_pixels=args.max_request_pixels,
        max_decoded_pixels=args.max_decoded_pixels,
        max_pending_mb=args.max_pending_mb,
        max_json_values=args.max_json_values,
        max_metadata_mb=args.max_metadata_mb,
        read_timeout=args.read_timeout,
        options=dict(args.option),
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not token:
        log.warning("serving on %s without a token: anyone who can reach it may use it", args.host)
    log.info("reward %r at %s (health: %shealth)", args.reward, server.url, server.url)
    if on_start is not None:
        on_start(server)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0

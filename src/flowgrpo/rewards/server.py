"""HTTP server exposing any registered reward with the protocol of remote.py.

``flowgrpo reward-server --reward ocr --port 8000`` binds 127.0.0.1 unless ``--host`` says
otherwise. Optional bearer token (401 on mismatch), request size limit (413), ``GET /health``.
One request is scored at a time (rewards need not be thread-safe); requests queue meanwhile.
Every request is answered: a backlog of 128 connections waits to be accepted, only ``POST /``
is scored (other paths: 404), and a refused request (400, 401, 404, 411, 413, 503 with
``Retry-After``) is answered before the rest of its body is read and dropped.

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
import contextlib
import hmac
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from flowgrpo.rewards.base import RewardFn, build_reward, lift_to_video, to_score_tensor
from flowgrpo.rewards.remote import TOKEN_ENV
from flowgrpo.rewards.server_request import (  # noqa: F401 - parse_request, read_images: API
    Budget,
    RequestError,
    check_request,
    parse_json,
    parse_request,
    read_images,
)

log = logging.getLogger(__name__)
DEFAULT_MAX_REQUEST_MB = 256.0
# Per image: 4x the largest size the supported models generate (FLUX at 2048x2048 = 4.2 MP);
# decoding one costs ~20 bytes a pixel (uint8 planes + float32 tensor), 0.3 GB at the cap.
DEFAULT_MAX_PIXELS = 4096 * 4096
# Per request: a batch of 64 images of 1024x1024 (16 of 2048x2048); ~0.8 GB as float32.
DEFAULT_MAX_REQUEST_PIXELS = 64 * 1024 * 1024
# JSON values per body, counted before parsing: each costs 30-70 bytes as a Python object.
DEFAULT_MAX_JSON_VALUES = 4_000_000
DEFAULT_MAX_METADATA_MB = 16.0
DEFAULT_READ_TIMEOUT = 60.0  # seconds a client has to send its whole request


class RewardHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer holding one reward; ``.url`` is its scoring endpoint."""

    daemon_threads = True
    # listen() backlog: connections waiting to be accepted. socketserver's 5 reset 51 of 192
    # requests of 64 concurrent clients on loopback; 128 (the usual somaxconn) answered all
    request_queue_size = 128

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

    def _send(self, code: int, obj: dict, headers: dict[str, str] | None = None) -> None:
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
        for key, value in (headers or {}).items():
            self.send_header(key, value)
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

    def _refuse(self, code: int, obj: dict, length: int, **headers: str) -> None:
        """Answer ``code`` at once, then read and drop the body the client is still sending
        (at most ``length`` bytes, until the read timeout counted from the connection's
        start), so that the client, which reads only after sending, finds the answer instead
        of a reset: closing a socket with unread bytes resets it."""
        self._send(code, obj, headers)
        with contextlib.suppress(OSError, ValueError):
            self.connection.shutdown(socket.SHUT_WR)  # the answer is whole: the client may go
            end = self._t0 + self.server.read_timeout
            left = length
            while left > 0:
                wait = end - time.monotonic()
                if wait <= 0:
                    break
                self.connection.settimeout(wait)
                chunk = self.rfile.read1(min(left, 2**20))
                if not chunk:
                    break
                left -= len(chunk)
                self._nbytes += len(chunk)

    def do_POST(self) -> None:
        self.close_connection = True
        length = _content_length(self.headers.get("Content-Length"))
        if isinstance(length, tuple):  # missing or malformed: drain until the client stops
            self._refuse(*length, length=sys.maxsize)
            return
        if self.path.split("?", 1)[0] != "/":  # the one scoring path
            self._refuse(404, {"error": f"unknown path {self.path!r}; POST / to score"}, length)
            return
        if not self._authorised():
            self._refuse(401, {"error": "missing or wrong bearer token"}, length)
            return
        if length > self.server.max_request_bytes:
            limit_mb = self.server.max_request_bytes / 2**20
            msg = f"request of {length} bytes exceeds {limit_mb:g} MB (--max-request-mb)"
            self._refuse(413, {"error": msg}, length)
            return
        with self.server.body_budget.hold(length, wait=False) as held:
            if not held:
                pending_mb = self.server.body_budget.total / 2**20
                msg = f"busy: other requests' bodies fill --max-pending-mb ({pending_mb:g} MB)"
                self._refuse(503, {"error": f"{msg}; retry later"}, length, **{"Retry-After": "1"})
                return
            self._post(length)

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


_MAX_LENGTH_DIGITS = 18  # 10^18 bytes: beyond any cap, and int() stays cheap


def _content_length(value: str | None) -> int | tuple[int, dict]:
    """The Content-Length header -> its byte count, or (status, error) to answer: 411 when
    missing, 400 when not plain ASCII digits ('²' passes str.isdigit, '1e20' is no integer),
    413 when too long to be under any cap."""
    if value is None or not value.strip():
        return 411, {"error": "Content-Length required"}
    text = value.strip()
    if not (text.isascii() and text.isdigit()):
        return 400, {"error": f"Content-Length must be a whole number of bytes, got {text!r:.40}"}
    if len(text) > _MAX_LENGTH_DIGITS:
        return 413, {"error": f"request of a {len(text)}-digit number of bytes is over the cap"}
    return int(text)


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

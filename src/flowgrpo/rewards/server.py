"""HTTP server exposing any registered reward with the protocol of remote.py.

``flowgrpo reward-server --reward ocr --port 8000`` binds 127.0.0.1 unless ``--host`` says
otherwise. Optional bearer token (401 on mismatch), request size limit (413), ``GET /health``.
One request is scored at a time (rewards need not be thread-safe); requests queue meanwhile.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from flowgrpo.rewards.base import RewardFn, build_reward, to_score_tensor, validate_images
from flowgrpo.rewards.remote import TOKEN_ENV, decode_images

log = logging.getLogger(__name__)
DEFAULT_MAX_REQUEST_MB = 256.0


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
    ) -> None:
        self.reward = reward
        self.reward_name = name
        self.token = token or None
        self.max_request_bytes = int(max_request_bytes)
        self.score_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    def handle_error(self, request, client_address) -> None:
        """A client that gave up (timeout) is not a server error: log it, skip the traceback."""
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            log.info("client %s disconnected before the answer was sent", client_address)
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

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), fmt % args)

    def _send(self, code: int, obj: dict) -> None:
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
        if self.path.rstrip("/").split("?")[0] == "/health":
            self._send(200, {"status": "ok", "reward": self.server.reward_name})
        else:
            self._send(404, {"error": f"unknown path {self.path!r}; POST / to score, GET /health"})

    def _drain(self, length: int) -> None:
        """Read and drop an unwanted body (bounded) so the client sees our answer, not a reset."""
        left = min(length, 4 * self.server.max_request_bytes + 2**20)
        while left > 0:
            chunk = self.rfile.read(min(left, 2**20))
            if not chunk:
                break
            left -= len(chunk)

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
        try:
            req = json.loads(self.rfile.read(int(length)))
            images = decode_images(req["images"])
            prompts = [str(p) for p in req["prompts"]]
            metadata = req.get("metadata") or [{} for _ in prompts]
            validate_images(images, prompts, metadata)
        except (ValueError, KeyError, TypeError) as e:
            self._send(400, {"error": f"bad request: {type(e).__name__}: {e}"})
            return
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
        except Exception as e:
            log.exception("reward %r failed", name)
            self._send(500, {"error": f"reward {name!r} failed: {type(e).__name__}: {e}"})
            return
        self._send(200, {"reward": name, "scores": scores})


def serve_reward(
    name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
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
    p.add_argument("--max-request-mb", type=float, default=DEFAULT_MAX_REQUEST_MB)
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

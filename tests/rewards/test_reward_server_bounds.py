"""What a reward server holds at once is bounded: decoded pixels over all requests, JSON
values and metadata bytes per body, nesting depth, and the time a client may take to send its
request; every request is logged in one line. Loopback only, small sizes, bounded waits."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from flowgrpo.rewards import build_reward
from flowgrpo.rewards import server_request as srv_mod
from flowgrpo.rewards.remote import encode_images
from flowgrpo.rewards.server import RewardHTTPServer


def _post(url: str, body: bytes, timeout: float = 20) -> tuple[int, object]:
    req = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def _body(n: int = 2, side: int = 24, **extra) -> bytes:
    images = torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(n))
    body = {"images": encode_images(images), "prompts": ["p"] * n, **extra}
    return json.dumps(body).encode()


def test_decoded_pixels_of_concurrent_requests_stay_within_the_server_budget(monkeypatch):
    """3 requests at once, each 2 images of 24x24 (1152 pixels), a budget of one request: the
    images decoded and not yet scored never exceed 1152 pixels (old server: 3456)."""
    live, peak, lock = [0], [0], threading.Lock()
    from_pil = srv_mod.from_pil

    def counting_from_pil(pils):
        with lock:
            live[0] += sum(p.width * p.height for p in pils)
            peak[0] = max(peak[0], live[0])
        return from_pil(pils)

    def slow_reward(images, prompts, metadata):
        time.sleep(0.3)  # the others arrive while this one is scored
        with lock:
            live[0] -= images.shape[0] * images.shape[-1] * images.shape[-2]
        return [0.5] * images.shape[0]

    monkeypatch.setattr(srv_mod, "from_pil", counting_from_pil)
    server = RewardHTTPServer(slow_reward, max_request_pixels=1152).start_in_thread()
    try:
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(_post(server.url, _body())))
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert [r[0] for r in results] == [200, 200, 200]
        assert peak[0] == 1152, peak  # one request's images at a time
        assert server.pixel_budget.total == server.pixel_budget.peak == 1152  # the default
    finally:
        server.close()
    with pytest.raises(ValueError, match="must be >= max_request_pixels"):
        RewardHTTPServer(slow_reward, max_request_pixels=100, max_decoded_pixels=99)


def test_too_many_json_values_are_refused_before_parsing(monkeypatch):
    """A body of 20000 '{}' metadata entries is refused (413) before json.loads sees it: the
    old server parsed it first (a 200 MB one cost +4.9 GB) and then answered 400."""
    parsed = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda s, **kw: parsed.append(len(s)) or loads(s, **kw))
    server = RewardHTTPServer(lambda i, p, m: [0.0] * len(p), max_json_values=1000)
    server.start_in_thread()
    try:
        bomb = _body(1, metadata=[{}] * 20000)
        status, msg = _post(server.url, bomb)
        assert status == 413 and "over the cap of 1000 (--max-json-values)" in msg, msg
        assert len(bomb) not in parsed  # never parsed
        assert _post(server.url, _body(1, metadata=[{"a": [1, 2]}]))[0] == 200
    finally:
        server.close()


def test_metadata_over_its_byte_cap_is_413():
    server = RewardHTTPServer(lambda i, p, m: [0.0] * len(p), max_metadata_bytes=1000)
    server.start_in_thread()
    try:
        status, msg = _post(server.url, _body(1, metadata=[{"note": "x" * 2000}]))
        assert status == 413 and "exceeds" in msg and "--max-metadata-mb" in msg, msg
        assert _post(server.url, _body(1, metadata=[{"note": "x" * 500}]))[0] == 200
    finally:
        server.close()


def test_deeply_nested_json_is_a_400_not_a_dropped_connection():
    server = RewardHTTPServer(build_reward("jpeg_compressibility")).start_in_thread()
    try:
        body = _body(1)[:-1] + b', "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        status, msg = _post(server.url, body)
        assert status == 400 and "nested too deeply" in msg
    finally:
        server.close()


def _closed_by_server(sock: socket.socket, send: list[bytes], gap: float, limit: float) -> float:
    """Send ``send`` pieces ``gap`` s apart (stopping once the server closed), then wait for
    EOF; the seconds until the server closed the connection (AssertionError after ``limit``)."""
    t0 = time.monotonic()
    sock.settimeout(gap)
    for piece in send:
        try:
            sock.sendall(piece)
            if sock.recv(1) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    sock.settimeout(max(0.01, limit - (time.monotonic() - t0)))
    try:
        data = sock.recv(1)
    except TimeoutError:
        raise AssertionError(f"connection still open after {limit}s") from None
    except OSError:
        data = b""
    assert data == b"", data
    return time.monotonic() - t0


def test_idle_and_slow_clients_are_cut_after_the_read_timeout():
    """An idle connection, a header sent one byte every 0.15 s (each read under the timeout)
    and a body that stops half-way are all closed ~0.6 s after they connected; the old server
    kept each one (and its thread) forever."""
    server = RewardHTTPServer(lambda i, p, m: [0.0] * len(p), read_timeout=0.6)
    server.start_in_thread()
    host, port = server.server_address[:2]
    header = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    cases = {
        "idle": [],
        "slow header": [header[i : i + 1] for i in range(len(header))],
        "partial body": [header + b'{"images": '],
    }
    try:
        for name, pieces in cases.items():
            with socket.create_connection((host, port), timeout=5) as sock:
                took = _closed_by_server(sock, pieces, gap=0.15, limit=3.0)
            assert 0.5 <= took < 1.5, (name, took)
        assert _post(server.url, _body(1))[0] == 200  # and the server still serves
    finally:
        server.close()


def test_the_read_timeout_does_not_cut_a_request_being_scored():
    def slow(images, prompts, metadata):
        time.sleep(0.8)
        return [0.25] * len(prompts)

    server = RewardHTTPServer(slow, read_timeout=0.3).start_in_thread()
    try:
        assert _post(server.url, _body(1)) == (200, {"reward": "reward", "scores": [0.25]})
    finally:
        server.close()


def test_each_request_is_logged_in_one_line(caplog):
    server = RewardHTTPServer(
        build_reward("jpeg_compressibility"), token="t0k", max_request_bytes=5000
    ).start_in_thread()
    try:
        with caplog.at_level(logging.INFO, logger="flowgrpo.rewards.server"):
            ok = _body(1)
            req = urllib.request.Request(
                server.url, data=ok, headers={"Authorization": "Bearer t0k"}, method="POST"
            )
            with urllib.request.urlopen(req, timeout=20) as resp:
                assert resp.status == 200
            assert _post(server.url, ok)[0] == 401
            big = urllib.request.Request(
                server.url, data=_body(8), headers={"Authorization": "Bearer t0k"}, method="POST"
            )
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(big, timeout=20)
            assert e.value.code == 413
            time.sleep(0.1)
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records if " POST / " in r.getMessage()]
    assert len(lines) == 3, lines
    for line, code in zip(lines, (200, 401, 413)):
        assert line.startswith("127.0.0.1 POST / ") and f" {code} " in line, line
        assert " bytes " in line and line.endswith("s") and "\n" not in line
    assert f" {len(ok)} bytes 1 images " in lines[0]


def test_bodies_beyond_the_pending_budget_are_answered_503():
    """One request's body fills the budget while it is scored: a second gets 503 at once
    (the client retries 5xx) instead of a third buffer; after the first, requests pass."""
    entered, release = threading.Event(), threading.Event()

    def blocking(images, prompts, metadata):
        entered.set()
        release.wait(10)
        return [1.0] * len(prompts)

    body = _body(1)
    server = RewardHTTPServer(
        blocking, max_request_bytes=len(body) + 100, max_pending_bytes=len(body) + 100
    ).start_in_thread()
    try:
        first = []
        thread = threading.Thread(target=lambda: first.append(_post(server.url, body)))
        thread.start()
        assert entered.wait(10)
        t0 = time.monotonic()
        status, msg = _post(server.url, body)
        assert status == 503 and "--max-pending-mb" in msg and time.monotonic() - t0 < 2
        release.set()
        thread.join(10)
        assert first == [(200, {"reward": "reward", "scores": [1.0]})]
        assert _post(server.url, body)[0] == 200 and server.body_budget.peak == len(body)
    finally:
        release.set()
        server.close()

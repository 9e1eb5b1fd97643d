"""Reward server + remote client on a free loopback port."""

import argparse
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from flowgrpo.rewards import MultiReward, RewardSpec, build_reward
from flowgrpo.rewards.remote import decode_images, encode_images
from flowgrpo.rewards.server import (
    RewardHTTPServer,
    add_reward_server_parser,
    serve_reward,
)


@pytest.fixture
def jpeg_server():
    server = serve_reward("jpeg_compressibility", port=0, token="s3cret").start_in_thread()
    yield server
    server.close()


def _batch(b=3):
    g = torch.Generator().manual_seed(0)
    images = torch.rand(b, 3, 24, 24, generator=g)
    images[0] = 0.5  # one flat image: a very different score
    return images, [f"prompt {i}" for i in range(b)], [{"i": i} for i in range(b)]


def test_png_roundtrip_is_exact_after_quantisation():
    images = torch.rand(2, 1, 5, 7)
    back = decode_images(encode_images(images))
    torch.testing.assert_close(back, (images * 255).round() / 255)


def test_remote_matches_local_and_health(jpeg_server):
    images, prompts, meta = _batch()
    assert jpeg_server.server_address[0] == "127.0.0.1"
    local = build_reward("jpeg_compressibility")(images, prompts, meta)
    remote = build_reward("remote", url=jpeg_server.url, token="s3cret", timeout=10)
    got = torch.tensor(remote(images, prompts, meta))
    torch.testing.assert_close(got, local)
    # through MultiReward with a weight, as the trainer uses it
    multi = MultiReward([RewardSpec("remote", 0.5, {"url": jpeg_server.url, "token": "s3cret"})])
    torch.testing.assert_close(multi(images, prompts, meta)["remote"], local)
    with urllib.request.urlopen(jpeg_server.url + "health", timeout=5) as resp:
        assert json.loads(resp.read()) == {"status": "ok", "reward": "jpeg_compressibility"}


def test_wrong_token_is_401(jpeg_server, monkeypatch):
    images, prompts, meta = _batch(1)
    monkeypatch.delenv("FLOWGRPO_REWARD_TOKEN", raising=False)
    for token in ("wrong", None):
        remote = build_reward("remote", url=jpeg_server.url, token=token, retries=2, backoff=5)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rejected the request: HTTP 401"):
            remote(images, prompts, meta)
        assert time.monotonic() - t0 < 2  # 4xx is not retried
    req = urllib.request.Request(jpeg_server.url, data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401


def test_request_size_limit_is_413_and_bad_body_400():
    server = RewardHTTPServer(
        build_reward("jpeg_compressibility"), max_request_bytes=2000
    ).start_in_thread()
    try:
        images, prompts, meta = _batch(2)  # two 24x24 noise PNGs: > 2000 bytes
        with pytest.raises(RuntimeError, match="HTTP 413"):
            build_reward("remote", url=server.url)(images, prompts, meta)
        req = urllib.request.Request(server.url, data=b'{"images": ["xx"]}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 400
    finally:
        server.close()


@contextlib.contextmanager
def _hung_server(seconds: float = 20.0):
    """A loopback port that accepts connections and never answers; yields (url, accepted
    connection count). Its thread stops by itself after ``seconds``."""
    import socket

    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.05)
    accepted, held, stop = [], [], threading.Event()

    def serve():
        end = time.monotonic() + seconds
        while not stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            accepted.append(time.monotonic())
            held.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/", accepted
    finally:
        stop.set()
        thread.join(timeout=5)
        for c in held:
            c.close()
        sock.close()


def test_hung_server_is_reported_after_one_timeout_and_not_retried():
    from flowgrpo.rewards.base import RewardUnavailable

    with _hung_server() as (url, accepted):
        remote = build_reward("remote", url=url, timeout=0.4, retries=2, backoff=0.05)
        t0 = time.monotonic()
        with pytest.raises(RewardUnavailable) as e:
            remote(*_batch(1))
        took = time.monotonic() - t0
        assert 0.4 <= took < 0.8, took  # one timeout; the old client waited 3 x 0.4 s + backoff
        assert url in str(e.value) and "did not answer within 0.4s" in str(e.value)
        t0 = time.monotonic()
        with pytest.raises(RewardUnavailable, match="did not answer within 0.4s"):
            remote(*_batch(1))  # right after a timeout: fails at once, no second wait
        assert time.monotonic() - t0 < 0.2
        assert len(accepted) == 1


def test_unreachable_server_retries_connection_errors_then_names_url():
    import socket

    from flowgrpo.rewards.base import RewardUnavailable

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed below: nothing listens there
    remote = build_reward(
        "remote", url=f"http://127.0.0.1:{port}/", timeout=5, retries=1, backoff=0.05
    )
    with pytest.raises(RewardUnavailable) as e:
        remote(*_batch(1))
    assert f"127.0.0.1:{port}" in str(e.value) and "after 2 attempt(s)" in str(e.value)


def test_a_hung_server_stops_training_after_one_timeout_without_a_per_sample_search():
    """The trainer's failure report (sync and async scoring) waits one timeout, not
    timeout x retries x (1 + samples)."""
    from flowgrpo.errors import RunError
    from flowgrpo.rewards import AsyncRewardScorer
    from flowgrpo.trainer.loop import reward_failures

    images, prompts, meta = _batch(4)
    where = [f"prompts.txt:{i + 1}" for i in range(4)]
    with _hung_server() as (url, accepted):
        spec = RewardSpec("remote", options={"url": url, "timeout": 0.4, "retries": 2})
        multi = MultiReward([spec])
        t0 = time.monotonic()
        with pytest.raises(RunError, match="did not answer within 0.4s") as e:
            with reward_failures(multi, images, prompts, meta, where, "step 3"):
                multi(images, prompts, meta)
        assert time.monotonic() - t0 < 0.8 and len(accepted) == 1
        assert "prompts.txt" not in str(e.value)  # not blamed on a sample
        time.sleep(0.45)  # past the fail-fast window: the async path waits one timeout again
        t0 = time.monotonic()
        with pytest.raises(RunError, match="did not answer within 0.4s"):
            with reward_failures(multi, images, prompts, meta, where, "step 3"):
                with AsyncRewardScorer(multi) as scorer:
                    futures = [
                        scorer.submit(images[i : i + 1], prompts[i : i + 1]) for i in range(4)
                    ]
                    [f.result() for f in futures]
        assert time.monotonic() - t0 < 0.8 and len(accepted) == 2


def test_dict_reward_over_http_and_cli_parser():
    server = RewardHTTPServer(lambda i, p, m: {"a": [1.0] * len(p), "b": [2.0] * len(p)})
    server.start_in_thread()
    try:
        out = MultiReward([RewardSpec("remote", options={"url": server.url})])(*_batch(2))
        assert {k: v.tolist() for k, v in out.items()} == {"remote/a": [1, 1], "remote/b": [2, 2]}
    finally:
        server.close()

    parser = argparse.ArgumentParser()
    add_reward_server_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(
        ["reward-server", "--reward", "clip_score", "--port", "9", "--option", "path=/m"]
        + ["--option", "batch_size=8"]
    )
    assert (args.host, args.port, args.max_request_mb) == ("127.0.0.1", 9, 256.0)
    assert (args.max_pixels, args.max_request_pixels) == (4096 * 4096, 64 * 1024 * 1024)
    assert dict(args.option) == {"path": "/m", "batch_size": 8}
    assert args.func.__name__ == "run_reward_server_cli"


def test_cli_entry_serves_until_shutdown(monkeypatch):
    parser = argparse.ArgumentParser()
    add_reward_server_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["reward-server", "--reward", "jpeg_incompressibility", "--port", "0"])
    monkeypatch.setenv("FLOWGRPO_REWARD_TOKEN", "from-env")
    started = []
    thread = threading.Thread(target=lambda: started.append(args.func(args, started.append)))
    thread.start()
    try:
        for _ in range(100):
            if started:
                break
            time.sleep(0.05)
        server = started[0]
        assert server.token == "from-env" and server.server_address[0] == "127.0.0.1"
        images, prompts, meta = _batch(2)
        remote = build_reward("remote", url=server.url)  # token taken from the env too
        local = build_reward("jpeg_incompressibility")(images, prompts, meta)
        torch.testing.assert_close(torch.tensor(remote(images, prompts, meta)), local)
    finally:
        if started:
            started[0].shutdown()
        thread.join(timeout=5)
    assert started[-1] == 0  # exit code


def _blank_png(w, h):
    """A valid grayscale PNG of a black w x h image, built row by row (never held decoded)."""
    import struct
    import zlib

    def chunk(kind, data):
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    comp, row = zlib.compressobj(9), bytes(1 + w)  # filter byte 0 + w zero pixels
    idat = b"".join(comp.compress(row) for _ in range(h)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _post(url, body):
    """POST a JSON body -> (status, error message or answer)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def _vm(pid, field):
    """VmHWM / VmRSS of a process in MiB, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_pixel_bomb_is_413_without_decoding_and_rss_stays_flat():
    """Two blank 12000x12000 PNGs are 0.37 MB of base64 but 288 M pixels: decoding them takes
    >= 0.29 GB as uint8 and 1.2 GB as float (old server: 3.8 GB). The header says so first."""
    import base64
    import subprocess
    import sys

    script = (
        "import argparse\n"
        "from flowgrpo.rewards.server import add_reward_server_parser\n"
        "p = argparse.ArgumentParser()\n"
        "add_reward_server_parser(p.add_subparsers(dest='cmd'))\n"
        "a = p.parse_args(['reward-server', '--reward', 'jpeg_compressibility', '--port', '0'])\n"
        "a.func(a, lambda s: print(s.url, flush=True))\n"
    )
    png = base64.b64encode(_blank_png(12000, 12000)).decode()
    body = {"images": [png, png], "prompts": ["a", "b"], "metadata": [{}, {}]}
    assert len(json.dumps(body)) < 0.4e6
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        status, _ = _post(url, {"images": [encode_images(torch.rand(1, 3, 8, 8))[0]],
                                "prompts": ["warm-up"]})  # fmt: skip
        assert status == 200  # the server is warm: imports, first PIL decode, first reward call
        before = _vm(proc.pid, "VmHWM")
        status, msg = _post(url, body)
        after = _vm(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    print(f"reward server peak RSS {before:.0f} MiB -> {after:.0f} MiB")
    assert status == 413
    assert "image 0 is 12000x12000 = 144000000 pixels" in msg and "--max-pixels" in msg
    assert after - before < 32, (before, after)  # decoding would add >= 275 MiB


def test_pixel_caps_per_image_and_per_request(monkeypatch):
    from PIL import PngImagePlugin

    decoded = []
    load = PngImagePlugin.PngImageFile.load
    monkeypatch.setattr(
        PngImagePlugin.PngImageFile, "load", lambda self: decoded.append(self.size) or load(self)
    )
    fn = build_reward("jpeg_compressibility")
    server = RewardHTTPServer(fn, max_pixels=24 * 24, max_request_pixels=2 * 24 * 24)
    server.start_in_thread()
    try:
        images, prompts, meta = _batch(3)
        body = {"images": encode_images(images), "prompts": prompts, "metadata": meta}
        status, msg = _post(server.url, body)  # 3 images of 576 pixels: 1728 > 1152
        assert status == 413 and "3 images of 1728 pixels in all" in msg
        assert "--max-request-pixels" in msg
        status, msg = _post(server.url, {**body, "images": encode_images(torch.rand(3, 3, 24, 25))})
        assert status == 413 and msg.startswith("image 0 is 25x24 = 600 pixels, over the cap")
        assert decoded == []  # neither request decoded a single image
        two = {"images": body["images"][:2], "prompts": prompts[:2], "metadata": meta[:2]}
        status, answer = _post(server.url, two)  # at the caps: scored
        assert status == 200 and set(decoded) == {(24, 24)}
        torch.testing.assert_close(
            torch.tensor(answer["scores"]), fn(images[:2], prompts[:2], meta[:2])
        )
    finally:
        server.close()


def test_only_png_and_object_metadata_are_accepted():
    import base64
    import io

    from PIL import Image

    def encoded(fmt):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format=fmt)
        return base64.b64encode(buf.getvalue()).decode()

    server = RewardHTTPServer(build_reward("jpeg_compressibility")).start_in_thread()
    png = encoded("PNG")
    ok = {"images": [png, png], "prompts": ["a", "b"], "metadata": [{}, {"k": 1}]}
    cases = [
        ({"metadata": "x"}, 400, "'metadata' must be a list of JSON objects"),
        ({"metadata": [1, 2]}, 400, "'metadata' must be a list of JSON objects"),
        ({"metadata": [{}]}, 400, "metadata must be a list of 2 dicts"),
        ({"prompts": ["a", 2]}, 400, "'prompts' must be a list of strings"),
        ({"images": [png, encoded("JPEG")]}, 415, "image 1 is not a PNG"),
        ({"images": [encoded("GIF"), png]}, 415, "image 0 is not a PNG"),
        ({"images": [png, "not base64!"]}, 400, "image 1 is not valid base64"),
        (
            {"images": [png, base64.b64encode(b"\x89PNG\r\n\x1a\nrest").decode()]},
            400,
            "not a valid PNG",
        ),
        ({"images": png}, 400, "'images' must be a non-empty list"),
    ]
    try:
        assert _post(server.url, ok)[0] == 200
        assert _post(server.url, {**ok, "metadata": None})[0] == 200  # absent: empty objects
        for change, code, text in cases:
            status, msg = _post(server.url, {**ok, **change})
            assert (status, text in msg) == (code, True), (change, status, msg)
        other = encode_images(torch.rand(1, 3, 8, 9))[0]
        status, msg = _post(server.url, {**ok, "images": [png, other]})
        assert status == 400 and "must share a size" in msg
        assert _post(server.url, [ok]) == (400, "the body must be a JSON object, got list")
    finally:
        server.close()


def test_reward_calling_sys_exit_is_a_500_not_a_dropped_connection():
    import sys

    server = RewardHTTPServer(lambda i, p, m: sys.exit(2), name="quitter").start_in_thread()
    try:
        body = {"images": encode_images(torch.rand(1, 3, 8, 8)), "prompts": ["a"]}
        assert _post(server.url, body) == (500, "reward 'quitter' failed: SystemExit: 2")
        assert _post(server.url, body)[0] == 500  # the server still serves
    finally:
        server.close()

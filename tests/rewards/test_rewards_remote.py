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


def test_timeout_retries_then_names_url():
    hits = []

    def sleepy(images, prompts, metadata):
        hits.append(time.monotonic())
        time.sleep(0.6)
        return [0.0] * images.shape[0]

    server = RewardHTTPServer(sleepy, name="sleepy").start_in_thread()
    server.score_lock = contextlib.nullcontext()  # let the retry in while the first sleeps
    try:
        remote = build_reward("remote", url=server.url, timeout=0.3, retries=1, backoff=0.05)
        with pytest.raises(RuntimeError) as e:
            remote(*_batch(1))
        msg = str(e.value)
        assert server.url in msg and "after 2 attempt(s)" in msg and "timeout 0.3s" in msg
        time.sleep(0.1)
        assert len(hits) == 2  # the first try and one retry
    finally:
        server.close()


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

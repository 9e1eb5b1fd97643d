"""Editing samples' source images over the remote reward protocol: sent as PNGs (each distinct
image once), back as [C, H, W] tensors in each sample's metadata; their pixels count."""

import json
import urllib.error
import urllib.request

import torch

from flowgrpo.rewards import build_reward
from flowgrpo.rewards.remote import RemoteReward, encode_images
from flowgrpo.rewards.server import RewardHTTPServer


def _q(x: torch.Tensor) -> torch.Tensor:
    return (x * 255).round() / 255  # what a PNG of uint8 holds


def _edit_batch():
    g = torch.Generator().manual_seed(0)
    images = torch.rand(4, 3, 16, 16, generator=g)
    cat, dog = torch.rand(3, 20, 12, generator=g), torch.rand(3, 8, 24, generator=g)
    # a group of two sharing one source (copies, as the trainer's metadata holds), an Edit-Plus
    # sample with two sources of other sizes, and a text-only sample
    meta = [
        {"source_images": [cat], "include": [{"class": "cat", "count": 2}]},
        {"source_images": [cat.clone()], "include": [{"class": "cat", "count": 2}]},
        {"source_images": [cat.clone(), dog], "t2i_prompt": "a photo"},
        {"k": 1},
    ]
    return images, ["p0", "p1", "p2", "p3"], meta


def test_source_images_arrive_as_tensors_each_sent_once(monkeypatch):
    got = {}

    def record(images, prompts, metadata):
        got["images"], got["metadata"] = images, metadata
        return [0.0] * images.shape[0]

    server = RewardHTTPServer(record).start_in_thread()
    bodies = []
    post = RemoteReward._post
    monkeypatch.setattr(
        RemoteReward, "_post", lambda self, body: bodies.append(body) or post(self, body)
    )
    try:
        images, prompts, meta = _edit_batch()
        assert build_reward("remote", url=server.url)(images, prompts, meta) == [0.0] * 4
    finally:
        server.close()
    sent = json.loads(bodies[0])
    assert len(sent["source_images"]) == 2  # cat once (three copies), dog once
    assert sent["source_index"] == [[0], [0], [0, 1], []]
    assert all("source_images" not in m for m in sent["metadata"])  # no nested float lists
    back = got["metadata"]
    for mine, theirs in zip(meta, back, strict=True):
        assert {k: v for k, v in mine.items() if k != "source_images"} == {
            k: v for k, v in theirs.items() if k != "source_images"
        }
        srcs = mine.get("source_images", [])
        assert len(theirs.get("source_images", [])) == len(srcs)
        for a, b in zip(srcs, theirs.get("source_images", [])):
            assert b.shape == a.shape and b.dtype == torch.float32
            torch.testing.assert_close(b, _q(a), atol=0, rtol=0)  # lossless after uint8
    torch.testing.assert_close(got["images"], _q(images), atol=0, rtol=0)


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def test_source_pixels_count_against_the_caps_and_bad_indices_are_400():
    server = RewardHTTPServer(
        build_reward("jpeg_compressibility"), max_pixels=16 * 16, max_request_pixels=3 * 16 * 16
    ).start_in_thread()
    try:
        images = encode_images(torch.rand(2, 3, 16, 16))
        base = {"images": images, "prompts": ["a", "b"], "metadata": [{}, {}]}
        one = encode_images(torch.rand(1, 3, 16, 16))
        ok = {**base, "source_images": one, "source_index": [[0], [0]]}
        assert _post(server.url, ok)[0] == 200  # 2 images + 1 distinct source: 768 pixels
        two = {**base, "source_images": one * 2, "source_index": [[0], [1]]}
        status, msg = _post(server.url, two)  # 1024 > 768
        assert status == 413 and "2 images and 2 source images of 1024 pixels" in msg
        big = {
            **base,
            "source_images": encode_images(torch.rand(1, 3, 16, 17)),
            "source_index": [[0], []],
        }
        status, msg = _post(server.url, big)
        assert status == 413 and msg.startswith("source image 0 is 17x16 = 272 pixels")
        status, msg = _post(server.url, {**ok, "source_index": [[0], [1]]})
        assert status == 400 and "'source_index' rows must list indices in [0, 1)" in msg
        status, msg = _post(server.url, {**ok, "source_index": [[0]]})
        assert status == 400 and "a list of 2 lists (one per sample)" in msg
    finally:
        server.close()

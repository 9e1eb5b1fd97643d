"""Rewards on videos [B, C, F, H, W] (issue 17): image rewards lifted to frames, a video reward
gets the whole video, temporal consistency, the spec's `frames`, and the remote protocol."""

import json
import urllib.error
import urllib.request

import pytest
import torch

from flowgrpo.config import ConfigError, load_config
from flowgrpo.rewards import MultiReward, RewardSpec
from flowgrpo.rewards.base import lift_to_video, validate_images
from flowgrpo.rewards.remote import RemoteReward, encode_images
from flowgrpo.rewards.server import RewardHTTPServer
from flowgrpo.rewards.video import frame_indices, temporal_consistency


def _videos(b=2, f=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, 3, f, 6, 8, generator=g)


def brightness(images, prompts, metadata):
    assert images.dim() == 4  # an image reward only ever sees images
    return images.mean(dim=(1, 2, 3))


def test_frame_indices():
    assert frame_indices(9) == list(range(9))
    assert frame_indices(33, 9) == list(range(0, 33, 4))  # flow_grpo's every 4th frame
    assert frame_indices(9, 3) == [0, 4, 8]
    assert frame_indices(9, 1) == [4]
    assert frame_indices(5, 12) == list(range(5))


def test_an_image_reward_scores_the_frames_and_averages():
    v = _videos()
    seen = []

    def recording(images, prompts, metadata):
        seen.append((images.shape, list(prompts), [dict(m) for m in metadata]))
        return brightness(images, prompts, metadata)

    lifted = lift_to_video(recording, "all", "brightness")
    got = torch.as_tensor(lifted(v, ["a", "b"], [{"k": 0}, {"k": 1}]))
    want = torch.stack([v[i, :, f].mean() for i in range(2) for f in range(9)]).view(2, 9)
    torch.testing.assert_close(got, want.mean(1))
    shape, prompts, meta = seen[0]
    assert shape == (18, 3, 6, 8) and prompts == ["a"] * 9 + ["b"] * 9
    assert meta == [{"k": 0}] * 9 + [{"k": 1}] * 9
    three = lift_to_video(brightness, 3, "brightness")(v, ["a", "b"], [{}, {}])
    torch.testing.assert_close(three, want[:, [0, 4, 8]].mean(1))
    images = v[:, :, 0]  # images pass through untouched
    torch.testing.assert_close(lifted(images, ["a", "b"], [{}, {}]), brightness(images, 0, 0))


def test_dict_reward_entries_are_averaged_and_video_rewards_get_the_video():
    v = _videos()

    def two(images, prompts, metadata):
        return {"mean": images.mean(dim=(1, 2, 3)), "max": images.amax(dim=(1, 2, 3))}

    out = lift_to_video(two, "all", "two")(v, ["a", "b"], [{}, {}])
    torch.testing.assert_close(out["max"], v.amax(dim=(1, 3, 4)).mean(1))

    def whole(videos, prompts, metadata):
        assert videos.dim() == 5
        return videos.mean(dim=(1, 2, 3, 4))

    whole.accepts_video = True
    assert lift_to_video(whole, 3) is whole


def test_temporal_consistency():
    still = _videos(f=1).expand(-1, -1, 5, -1, -1).contiguous()
    torch.testing.assert_close(temporal_consistency(still, ["a", "b"], [{}, {}]), torch.ones(2))
    v = torch.zeros(1, 3, 3, 2, 2)
    v[:, :, 1] = 0.5  # 0 -> 0.5 -> 0: mean change 0.5
    assert temporal_consistency(v, ["a"], [{}]).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"scores videos \[B, C, F, H, W\]"):
        temporal_consistency(v[:, :, 0], ["a"], [{}])


def test_multi_reward_on_videos_and_the_frames_setting():
    v = _videos()
    reward = MultiReward.from_functions({"brightness": brightness})
    multi = MultiReward([RewardSpec("temporal_consistency", 0.1)])
    out = {**reward(v, ["a", "b"]), **multi(v, ["a", "b"])}
    torch.testing.assert_close(out["brightness"], v.mean(dim=(1, 3, 4)).mean(1))
    assert out["temporal_consistency"].shape == (2,)
    validate_images(v, ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match=r"\[B, C, F, H, W\]"):
        validate_images(v[None], ["a"], [{}])
    cfg = load_config(None, ["reward=jpeg_compressibility", "reward.jpeg_compressibility.frames=3"])
    assert cfg.reward[0].frames == 3
    with pytest.raises(ConfigError, match="reward.jpeg_compressibility.frames"):
        MultiReward([RewardSpec("jpeg_compressibility", frames=0)])
    with pytest.raises(ConfigError, match="reward.digits.frames"):
        load_config(None, ["reward.digits.frames=some"])


def test_videos_over_http_equal_the_local_lifted_reward():
    server = RewardHTTPServer(brightness, name="brightness").start_in_thread()
    try:
        v = _videos(f=5)
        remote = MultiReward.from_functions({"remote": RemoteReward(url=server.url)})
        got = remote(v, ["a", "b"])["remote"]
        want = lift_to_video(brightness)(v, ["a", "b"], [{}, {}])
        torch.testing.assert_close(got, (v * 255).round().div(255).mean(dim=(1, 3, 4)).mean(1))
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)  # PNG's uint8 rounding
        frames = encode_images(v.transpose(1, 2).reshape(10, 3, 6, 8))
        body = {"images": frames[:9], "prompts": ["a", "b"], "frames": 5}
        req = urllib.request.Request(server.url, data=json.dumps(body).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400 and "do not make 2 videos of 5 frames" in e.value.read().decode()
    finally:
        server.close()


def test_remote_reward_honours_frames_like_the_local_reward():
    seen = []

    def recording(images, prompts, metadata):
        seen.append(tuple(images.shape))
        return brightness(images, prompts, metadata)

    server = RewardHTTPServer(recording, name="brightness").start_in_thread()
    try:
        v = _videos(f=9)
        spec = RewardSpec("remote", options={"url": server.url, "timeout": 10}, frames=3)
        got = MultiReward([spec])(v, ["a", "b"])["remote"]
        want = lift_to_video(brightness, 3)(v, ["a", "b"], [{}, {}])
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)  # PNG's uint8 rounding
        assert seen == [(6, 3, 6, 8)]  # 2 videos x frames 0, 4, 8: only those were sent
        ref = v[:, :, [0, 4, 8]].mul(255).round().div(255).mean(dim=(1, 2, 3, 4))
        torch.testing.assert_close(got, ref)
        seen.clear()
        MultiReward([RewardSpec("remote", options={"url": server.url})])(v, ["a", "b"])
        assert seen == [(18, 3, 6, 8)]  # frames "all" (the default): every frame
    finally:
        server.close()

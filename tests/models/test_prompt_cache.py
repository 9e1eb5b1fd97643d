"""The prompt-embedding cache: bit-identical to encoding each prompt alone (every family's tiny
pipeline), keyed by the text encoders and tokenizers, the encode options and the prompt, safe
when two processes write it, and the text encoders can leave the device once prompts are cached.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from flowgrpo.models import build_adapter
from flowgrpo.models.prompt_cache import PromptEmbedCache, fingerprint, text_components
from flowgrpo.testing.families import doubles, params
from flowgrpo.testing.tiny import tiny_pipeline

PROMPTS = ["a red cat on a mat", "x", "two dogs playing in the snow near a big tree"]


def _same(a, b) -> bool:
    def eq(x, y):
        return (x is None and y is None) or (
            x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y)
        )

    return eq(a.embeds, b.embeds) and eq(a.mask, b.mask) and eq(a.pooled, b.pooled)


#: the families a prompt cache serves: text-to-image/video with a stock pipeline (an editing
#: model's embeddings depend on its sources: the trainer refuses a cache for it)
CACHED = [f for f in doubles() if f.sources is None and f.stock]


@pytest.fixture(scope="module", params=params(CACHED))
def adapter(request):
    fam = request.param
    kw = {**fam.options, **fam.cfg_options}  # FLUX.1-dev's negative branch is true CFG
    if "max_sequence_length" in kw:
        kw["max_sequence_length"] = 32
    return build_adapter(tiny_pipeline(fam.kind), **kw)


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
    if adapter.uses_cfg(4.0):  # as the adapter encodes a negative uncached (SANA: its own way)
        assert _same(neg.select([1]), adapter.encode(["x"], ["blurry"], guidance_scale=4.0)[1])
    else:  # distilled guidance (FLUX.2-dev): no negative branch
        assert neg is None
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
    if hasattr(adapter, "max_sequence_length"):  # a text-length option (not every family's)
        old_len = adapter.max_sequence_length
        adapter.max_sequence_length = old_len - 1
        try:
            assert fingerprint(adapter) != base
        finally:
            adapter.max_sequence_length = old_len
    tok = next(
        (c for n, c in text_components(adapter.pipe).items() if n.startswith("tokenizer")), None
    )
    if tok is not None:  # Qwen-Image 2.1 tokenizes through its processor
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


# -- damaged entries, leftovers and folder errors (issue 40, item 7) ---------------------------


def _copy(e):
    """An entry's tensors copied out of the file's memory (a read maps the file)."""
    return type(e)(*(None if t is None else t.clone() for t in (e.embeds, e.mask, e.pooled)))


def test_a_truncated_or_swapped_entry_is_encoded_again_before_the_encoders_go(tmp_path):
    """Before: both passed the start's check (the file existed), then the run stopped with
    "not in the embedding cache" once the text encoders were freed."""
    adapter = build_adapter(tiny_pipeline("wan"), max_sequence_length=16)
    cache = PromptEmbedCache(tmp_path, adapter)
    assert cache.prepare(PROMPTS) == 3
    want = {p: _copy(cache.get(p)) for p in PROMPTS}
    whole = cache.path(PROMPTS[0]).read_bytes()
    cache.path(PROMPTS[0]).write_bytes(whole[:-7])  # truncated
    cache.path(PROMPTS[1]).write_bytes(cache.path(PROMPTS[2]).read_bytes())  # swapped
    assert cache.missing(PROMPTS) == PROMPTS[:2]
    assert cache.prepare(PROMPTS) == 2  # the start re-encodes them
    adapter.prompt_cache = cache
    cache.release_text_encoders("free")
    cache.encode(PROMPTS)  # every entry read back: no "not in the embedding cache"
    assert all(_same(cache.get(p), want[p]) for p in PROMPTS)  # re-encoded: bit-identical
    # damaged after the start, with the encoders freed: a line naming the entry
    cache.path(PROMPTS[2]).write_bytes(b"\x00" * 16)
    with pytest.raises(RuntimeError, match="embedding-cache entry .* is damaged"):
        cache.encode([PROMPTS[2]])


def _killed_writer(root: str) -> None:
    """Dies (SIGKILL) in the middle of writing an entry."""
    import os
    import signal

    import safetensors.torch

    from flowgrpo.models.base import PromptEmbeds

    def die(*args, **kwargs):
        with open(args[1], "wb") as f:
            f.write(b"half an entry")
        os.kill(os.getpid(), signal.SIGKILL)

    safetensors.torch.save_file = die

    class Fake:
        device = torch.device("cpu")
        pipe = None

    PromptEmbedCache(root, Fake(), key="k").put("p", PromptEmbeds(torch.ones(1, 2, 3), None, None))


def test_a_killed_writers_temporary_file_goes_at_the_next_start(tmp_path):
    """Before: the .tmp of a writer killed mid-write stayed forever."""
    p = mp.get_context("spawn").Process(target=_killed_writer, args=(str(tmp_path),))
    p.start()
    p.join(60)
    assert p.exitcode == -9
    left = list(tmp_path.rglob("*.tmp"))
    assert len(left) == 1
    mine = left[0].parent / ".0123456789abcdef0123456789abcdef01234567.safetensors.x.tmp"
    mine.write_text("a user's file: not of this cache's naming")

    class Fake:
        device = torch.device("cpu")
        pipe = None

    entry = left[0].name.split(".")[1]  # .<entry>.safetensors.<host>.<pid>.<uuid>.tmp
    live = left[0].parent / f".{entry}.safetensors.{_host()}.{os.getpid()}.{'0' * 32}.tmp"
    live.write_text("a live writer's")  # this process is alive: its file stays
    PromptEmbedCache(tmp_path, Fake(), key="k")
    assert sorted(tmp_path.rglob("*.tmp")) == sorted([mine, live])


def _host():
    """The host tag of a temporary file's name (blake2b-4 of the host name)."""
    import hashlib
    import socket

    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def test_cache_folder_errors_are_one_line_naming_the_folder(tmp_path):
    from flowgrpo.errors import RunError

    class Fake:
        device = torch.device("cpu")
        pipe = None

    a_file = tmp_path / "cache"
    a_file.write_text("not a folder")
    for root, why in ((a_file, "it is a file"), (Path("/proc/flowgrpo-cache"), "")):
        with pytest.raises(RunError) as err:
            PromptEmbedCache(root, Fake(), key="k")
        msg = str(err.value)
        assert "\n" not in msg and f"model.embed_cache_dir {root}: cannot create" in msg
        assert why in msg

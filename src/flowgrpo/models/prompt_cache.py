"""A disk cache of prompt embeddings, so that the frozen text encoders can leave the GPU.

Prompt sets are finite and fixed: each prompt (and the negative prompt) is encoded once, stored,
and read back on every later rollout. Once every prompt a run needs is cached, the text encoders
move to the CPU or are freed (``model.text_encoder_offload``): for Qwen-Image that is the 16 GB
bf16 Qwen2.5-VL-7B on every GPU, for Wan the 11 GB UMT5-XXL.

- Exact: an entry is the adapter's ``encode_prompts([prompt])`` (the prompt encoded alone),
  stored as the tensors themselves (safetensors), so a read gives bit-identical embeddings. A
  batch is the concatenation of its prompts' entries (``PromptEmbeds.cat``: zero padding, mask
  0). Encoding a batch together differs from encoding each prompt alone only by float rounding
  in some encoders (Qwen2.5-VL: <= 5e-7 on the tiny model); with the cache, every rollout uses
  the prompt-alone encoding, whatever the batch.
- Keyed: the file name is a hash of the adapter class, its encode options (the max sequence
  length), every text encoder's config and weights, every tokenizer's vocabulary and settings
  (``fingerprint``), and the prompt. A changed model, prompt or max length never reads a stale
  entry; the entry also records its prompt, checked on read.
- Shared safely: each entry is written to a temporary file in the same folder, then renamed
  into place (``os.replace``, atomic): two runs (or ranks) writing the same entry leave one
  complete file and a reader never sees a partial one; an unreadable entry is re-encoded.
  Checked at the start (``missing``: the file's header and length, its prompt and key), so a
  truncated or swapped entry is encoded again before the text encoders leave. The temporary
  file of a writer that was killed (its name carries the host and the process id) is removed
  by the next cache opened on the same host, once that process is gone (or after a day).
- A folder that cannot be used (a file, a path that cannot be created, not writable) is one
  line naming it (``RunError``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from flowgrpo.errors import RunError
from flowgrpo.models.base import PromptEmbeds

#: what happens to the text encoders once every needed prompt is cached
TEXT_ENCODER_OFFLOAD = ("keep", "cpu", "free")


def text_components(pipe: Any) -> dict[str, Any]:
    """The pipeline's text encoders and tokenizers (components named ``text_encoder*`` /
    ``tokenizer*``; every diffusers text-to-image/video pipeline names them so)."""
    comps = getattr(pipe, "components", {}) or {}
    return {
        name: comp
        for name, comp in sorted(comps.items())
        if comp is not None and (name.startswith("text_encoder") or name.startswith("tokenizer"))
    }


def _hash_module(h: Any, module: torch.nn.Module) -> None:
    config = getattr(module, "config", None)
    if config is not None:
        text = config.to_json_string() if hasattr(config, "to_json_string") else repr(config)
        h.update(text.encode())
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _hash_tokenizer(h: Any, tok: Any) -> None:
    h.update(type(tok).__name__.encode())
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        state = json.loads(backend.to_str())
        for transient in ("truncation", "padding"):  # set per call by the tokenizer's __call__
            state.pop(transient, None)
        h.update(json.dumps(state, sort_keys=True).encode())
    elif hasattr(tok, "get_vocab"):
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    for attr in ("model_max_length", "padding_side", "truncation_side"):
        h.update(f"{attr}={getattr(tok, attr, None)}".encode())


def fingerprint(adapter: Any) -> str:
    """A hex digest of everything that decides an adapter's prompt embeddings: its class, its
    ``max_sequence_length``, and every text encoder (config + weights, byte for byte) and
    tokenizer of its pipeline. Reads the weights once (a few seconds per GB)."""
    h = hashlib.blake2b(digest_size=20)
    options = {"max_sequence_length": getattr(adapter, "max_sequence_length", None)}
    h.update(f"{type(adapter).__module__}.{type(adapter).__name__}".encode())
    h.update(json.dumps(options, sort_keys=True).encode())
    for name, comp in text_components(adapter.pipe).items():
        h.update(name.encode())
        if isinstance(comp, torch.nn.Module):
            _hash_module(h, comp)
        else:
            _hash_tokenizer(h, comp)
    return h.hexdigest()


#: a writer's temporary file: ``.<entry>.<host tag>.<pid>.<uuid>.tmp`` (older versions: no host)
_TMP = re.compile(r"\.[0-9a-f]{40}\.safetensors\.(?:([0-9a-f]{8})\.)?(\d+)\.[0-9a-f]{32}\.tmp")
_STALE_TMP_S = 86400.0  # a temporary file older than this is a dead writer's, whatever its host


def _host_tag() -> str:
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _folder_error(root: Path, e: OSError, doing: str) -> RunError:
    why = "it is a file, not a folder" if isinstance(e, FileExistsError) else e.strerror or e
    return RunError(
        f"model.embed_cache_dir {root}: cannot {doing} ({why}); choose a writable folder "
        "(model.embed_cache_dir=...) or unset it"
    )


class PromptEmbedCache:
    """Prompt embeddings of one adapter, one file per prompt under ``root``.

    ``adapter.prompt_cache = PromptEmbedCache(root, adapter)`` makes ``adapter.encode`` read
    and fill it. ``prepare(prompts)`` encodes the missing ones; ``release_text_encoders(mode)``
    then moves the encoders off the GPU (``cpu``) or drops them (``free``).
    """

    def __init__(self, root: str | Path, adapter: Any, *, key: str | None = None):
        self.root = Path(root).expanduser()
        try:
            self.root.mkdir(parents=True, exist_ok=True)  # FileExistsError: a file is there
        except OSError as e:
            raise _folder_error(self.root, e, "create the folder") from None
        self.remove_stale_temporaries()
        self.adapter = adapter
        self.key = key if key is not None else fingerprint(adapter)
        self.released: str = "keep"  # where the text encoders are: keep (on device), cpu, free
        self.hits = self.misses = 0

    # -- entries ---------------------------------------------------------------------------------
    def path(self, prompt: str) -> Path:
        digest = hashlib.blake2b(f"{self.key}\0{prompt}".encode(), digest_size=20).hexdigest()
        return self.root / digest[:2] / f"{digest}.safetensors"

    def remove_stale_temporaries(self) -> list[Path]:
        """Remove the temporary files of writers that were killed mid-write: those this
        host's processes wrote whose process is gone, and any older than a day (the only test
        for another host's, or an older version's without a host tag). Returns them."""
        removed, here, now = [], _host_tag(), time.time()
        for sub in self.root.glob("??"):
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                m = _TMP.fullmatch(f.name)
                if m is None:
                    continue
                try:
                    old = now - f.stat().st_mtime > _STALE_TMP_S
                    if old or (m.group(1) == here and not _alive(int(m.group(2)))):
                        f.unlink()
                        removed.append(f)
                except OSError:  # gone meanwhile (its writer renamed it), or not ours to remove
                    continue
        return removed

    def entry_ok(self, prompt: str) -> bool:
        """Whether ``prompt``'s entry is there, whole (its safetensors header and length agree)
        and this prompt's and key's; reads the header only."""
        path = self.path(prompt)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n <= size - 8:
                    return False
                header = json.loads(f.read(n))
            meta = header.pop("__metadata__", None) or {}
            if meta.get("prompt") != prompt or meta.get("key") != self.key:
                return False
            end = max(int(v["data_offsets"][1]) for v in header.values())
            return "embeds" in header and 8 + n + end == size
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return False

    def get(self, prompt: str) -> PromptEmbeds | None:
        """The cached embeddings of ``prompt`` (on CPU), or None (absent or unreadable)."""
        from safetensors import safe_open

        path = self.path(prompt)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("prompt") != prompt or meta.get("key") != self.key:
                    return None
                names = set(f.keys())
                get = {n: f.get_tensor(n) for n in names}
        except Exception:  # a damaged file is a miss: it is encoded again and replaced
            return None
        return PromptEmbeds(get["embeds"], get.get("mask"), get.get("pooled"))

    def put(self, prompt: str, embeds: PromptEmbeds) -> None:
        """Write one entry atomically (temporary file in the same folder, then rename)."""
        from safetensors.torch import save_file

        path = self.path(prompt)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _folder_error(self.root, e, f"create {path.parent.name}/") from None
        tensors = {"embeds": embeds.embeds}
        if embeds.mask is not None:
            tensors["mask"] = embeds.mask
        if embeds.pooled is not None:
            tensors["pooled"] = embeds.pooled
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        tmp = path.parent / f".{path.name}.{_host_tag()}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            save_file(tensors, str(tmp), metadata={"prompt": prompt, "key": self.key})
            os.replace(tmp, path)
        except OSError as e:
            raise _folder_error(self.root, e, f"write {path.name}") from None
        finally:
            tmp.unlink(missing_ok=True)

    # -- encoding through the cache ----------------------------------------------------------------
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        """Embeddings of ``prompts`` [B, L, ...] on the adapter's device: cached entries read,
        missing ones encoded alone and stored; rows concatenated (``PromptEmbeds.cat``)."""
        if not prompts:
            raise ValueError("encode needs at least one prompt")
        found: dict[str, PromptEmbeds] = {}
        for p in dict.fromkeys(prompts):
            e = self.get(p)
            if e is None:
                self.misses += 1
                e = self._encode_missing(p)
                self.put(p, e)
                e = self.get(p) or e  # what every later read returns
            else:
                self.hits += 1
            found[p] = e
        return PromptEmbeds.cat([found[p] for p in prompts]).to(self.adapter.device)

    def _encode_missing(self, prompt: str) -> PromptEmbeds:
        if self.released == "free":
            path = self.path(prompt)
            if path.exists():  # damaged after the start's check (which re-encodes such entries)
                raise RuntimeError(
                    f"the embedding-cache entry {path} of prompt {prompt[:60]!r} is damaged "
                    "(truncated, or another prompt's) and the text encoders were freed "
                    "(model.text_encoder_offload=free): delete it and resume; the start "
                    "encodes it again"
                )
            raise RuntimeError(
                f"prompt {prompt[:60]!r} is not in the embedding cache and the text encoders were "
                "freed (model.text_encoder_offload=free): every prompt must be cached first"
            )
        if self.released == "cpu":  # back on the device for this one prompt
            self._move_text_encoders(self.adapter.device)
            try:
                return self.adapter.encode_prompts([prompt])
            finally:
                self._move_text_encoders("cpu")
        return self.adapter.encode_prompts([prompt])

    def missing(self, prompts: Iterable[str]) -> list[str]:
        """The distinct prompts with no sound entry (absent, truncated, or another prompt's
        or key's: ``entry_ok``), to be encoded (again) by ``prepare``."""
        return [p for p in dict.fromkeys(prompts) if not self.entry_ok(p)]

    def prepare(self, prompts: Iterable[str]) -> int:
        """Encode and store every prompt of ``prompts`` not cached yet; returns how many."""
        todo = self.missing(prompts)
        for p in todo:
            self.put(p, self._encode_missing(p))
        self.misses += len(todo)
        return len(todo)

    # -- the text encoders -------------------------------------------------------------------------
    def _move_text_encoders(self, device: torch.device | str) -> None:
        for comp in text_components(self.adapter.pipe).values():
            if isinstance(comp, torch.nn.Module):
                comp.to(device)

    def release_text_encoders(self, mode: str) -> None:
        """``keep``: nothing; ``cpu``: move the text encoders to host memory (moved back for a
        prompt that is not cached); ``free``: drop them from the pipeline (a prompt that is not
        cached is then an error)."""
        if mode not in TEXT_ENCODER_OFFLOAD:
            raise ValueError(f"text encoder offload must be one of {TEXT_ENCODER_OFFLOAD}")
        if mode == "cpu":
            self._move_text_encoders("cpu")
        elif mode == "free":
            for name, comp in text_components(self.adapter.pipe).items():
                if isinstance(comp, torch.nn.Module):
                    setattr(self.adapter.pipe, name, None)
        if mode != "keep":
            self.released = mode
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


__all__ = ["TEXT_ENCODER_OFFLOAD", "PromptEmbedCache", "fingerprint", "text_components"]

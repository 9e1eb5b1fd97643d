"""What one request to the reward server may hold, checked before the work it would cost:
the JSON body (its values counted before parsing, nesting depth), the images' sizes from
their PNG headers (pixel caps), the metadata's bytes; and ``Budget``, the counting semaphore
the server shares between requests (decoded pixels, body bytes). server.py serves."""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
import struct
import threading
from collections.abc import Iterator
from typing import Any

import torch
from PIL import Image

from flowgrpo.rewards._image import from_pil
from flowgrpo.rewards.base import validate_images
from flowgrpo.rewards.remote import unflatten_videos

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class RequestError(ValueError):
    """A request the server refuses: HTTP ``code`` with a one-line message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _png_header(i: int, data: Any) -> tuple[bytes, int, int]:
    """Base64 PNG -> (bytes, width, height), the size read from the IHDR chunk (the first
    chunk of every PNG); nothing is decoded."""
    if not isinstance(data, str):
        raise RequestError(400, f"image {i} must be a base64 string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(400, f"image {i} is not valid base64: {e}") from None
    if not raw.startswith(PNG_SIGNATURE):
        raise RequestError(
            415, f"image {i} is not a PNG (starts with {raw[:8]!r}); send base64 PNG images"
        )
    if len(raw) < 24 or raw[12:16] != b"IHDR":
        raise RequestError(400, f"image {i} is not a valid PNG: no IHDR header")
    width, height = struct.unpack(">II", raw[16:24])
    return raw, width, height


def _decode_png(i: int, raw: bytes) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(raw), formats=["PNG"])
        img.load()
    except Image.DecompressionBombError as e:  # PIL's own cap, when --max-pixels is above it
        raise RequestError(413, f"image {i}: {e}") from None
    except Exception as e:
        raise RequestError(400, f"image {i} is not a valid PNG: {e}") from None
    return img


class Budget:
    """A counting semaphore of pixels or bytes: ``hold(n)`` waits until ``n`` of ``total`` are
    free (``wait=False``: None at once when they are not). The server decodes and scores a
    request's images inside ``hold(its pixels)`` of one budget, and holds a request's body
    inside ``hold(its bytes)`` of another, so all requests together stay within both."""

    def __init__(self, total: int) -> None:
        self.total, self.used, self.peak = int(total), 0, 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int, wait: bool = True) -> Iterator[bool]:
        """Yields True while ``n`` are held; False (nothing held) when ``wait`` is False and
        they are not free now."""
        if n > self.total:
            raise ValueError(f"cannot hold {n} of a budget of {self.total}")
        with self._cond:
            if not wait and self.used + n > self.total:
                got = False
            else:
                self._cond.wait_for(lambda: self.used + n <= self.total)
                self.used += n
                self.peak = max(self.peak, self.used)
                got = True
        try:
            yield got
        finally:
            if got:
                with self._cond:
                    self.used -= n
                    self._cond.notify_all()


def check_body(body: bytes | bytearray, max_values: int) -> None:
    """Refuse (413) a body with more JSON values than ``max_values`` before parsing it: its
    ``{``, ``[`` and ``,`` bound the values from above (base64 has none of them)."""
    n = body.count(b"{") + body.count(b"[") + body.count(b",")
    if n > max_values:
        raise RequestError(
            413,
            f"the body holds up to {n} JSON values, over the cap of {max_values} "
            "(--max-json-values); keep metadata small",
        )


def parse_json(body: bytes | bytearray, max_values: int) -> Any:
    """The JSON body, or a 400 naming what is wrong (deep nesting included)."""
    check_body(body, max_values)
    try:
        return json.loads(body)
    except RecursionError:
        raise RequestError(400, "the body's JSON is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None


def _check_sizes(data: Any, max_pixels: int, max_request_pixels: int) -> tuple[list, int]:
    """Base64 PNGs -> ([(bytes, width, height)], total pixels), checked against the pixel
    caps (413) from the PNG headers alone."""
    if not isinstance(data, list) or not data:
        raise RequestError(400, "'images' must be a non-empty list of base64 PNG strings")
    headers = [_png_header(i, d) for i, d in enumerate(data)]
    total = 0
    for i, (_, w, h) in enumerate(headers):
        if w * h > max_pixels:
            raise RequestError(
                413,
                f"image {i} is {w}x{h} = {w * h} pixels, over the cap of {max_pixels} per "
                "image (--max-pixels)",
            )
        total += w * h
    if total > max_request_pixels:
        raise RequestError(
            413,
            f"{len(headers)} images of {total} pixels in all, over the cap of "
            f"{max_request_pixels} per request (--max-request-pixels); send smaller batches",
        )
    sizes = sorted({(w, h) for _, w, h in headers})
    if len(sizes) > 1:
        raise RequestError(400, f"images in one request must share a size, got {sizes}")
    return headers, total


def read_images(data: Any, max_pixels: int, max_request_pixels: int) -> torch.Tensor:
    """Base64 PNGs -> [B, C, H, W] float32 in [0, 1]. Sizes come from the PNG headers and are
    checked against the pixel caps (413) before anything is decoded."""
    headers, _ = _check_sizes(data, max_pixels, max_request_pixels)
    return from_pil([_decode_png(i, raw) for i, (raw, _, _) in enumerate(headers)])


def _check_sources(req: dict, n: int, max_pixels: int) -> tuple[list, list, int]:
    """The editing samples' source images (``source_images``: distinct base64 PNGs,
    ``source_index``: each sample's indices into them) -> ([(bytes, width, height)], the
    indices, their pixels), checked from the PNG headers alone; none sent: ([], [], 0)."""
    data, index = req.get("source_images"), req.get("source_index")
    if data is None and index is None:
        return [], [], 0
    if not isinstance(data, list) or not isinstance(index, list) or len(index) != n:
        raise RequestError(
            400,
            "'source_images' must be a list of base64 PNG strings and 'source_index' a list "
            f"of {n} lists (one per sample) of indices into it",
        )
    headers = []
    for j, d in enumerate(data):
        try:
            headers.append(_png_header(j, d))
        except RequestError as e:
            raise RequestError(e.code, f"source {e}") from None
    for row in index:
        if not isinstance(row, list) or not all(
            isinstance(j, int) and not isinstance(j, bool) and 0 <= j < len(headers) for j in row
        ):
            raise RequestError(
                400, f"'source_index' rows must list indices in [0, {len(headers)}), got {row!r}"
            )
    total = 0
    for j, (_, w, h) in enumerate(headers):
        if w * h > max_pixels:
            raise RequestError(
                413,
                f"source image {j} is {w}x{h} = {w * h} pixels, over the cap of {max_pixels} "
                "per image (--max-pixels)",
            )
        total += w * h
    return headers, index, total


class Request:
    """A checked request whose images are not decoded yet: ``pixels`` in all (source images
    included); ``decode()`` -> (images [B, C, H, W] or videos [B, C, F, H, W], prompts,
    metadata), each editing sample's ``metadata["source_images"]`` a list of [C, H, W]."""

    def __init__(
        self,
        headers: list,
        pixels: int,
        prompts: list,
        metadata: list,
        frames,
        sources: tuple[list, list] = ([], []),
    ) -> None:
        self.headers, self.pixels = headers, pixels
        self.prompts, self.metadata, self.frames = prompts, metadata, frames
        self.sources, self.source_index = sources

    def decode(self) -> tuple:
        headers, frames, prompts = self.headers, self.frames, self.prompts
        images = from_pil([_decode_png(i, raw) for i, (raw, _, _) in enumerate(headers)])
        self.headers = []  # the PNG bytes are not needed any more
        if frames is not None:
            images = unflatten_videos(images, frames)
        if self.sources:
            decoded = []
            for j, (raw, _, _) in enumerate(self.sources):
                try:
                    decoded.append(from_pil([_decode_png(j, raw)])[0])
                except RequestError as e:
                    raise RequestError(e.code, f"source {e}") from None
            self.sources = []
            for m, row in zip(self.metadata, self.source_index, strict=True):
                if row:
                    m["source_images"] = [decoded[j] for j in row]
        validate_images(images, prompts, self.metadata)
        return images, prompts, self.metadata


def parse_request(req: Any, max_pixels: int, max_request_pixels: int) -> tuple:
    """The JSON body -> (images, prompts, metadata), or RequestError naming what is wrong."""
    return check_request(req, max_pixels, max_request_pixels).decode()


def check_request(
    req: Any, max_pixels: int, max_request_pixels: int, max_metadata_bytes: int | None = None
) -> Request:
    """The parsed JSON body -> a ``Request`` (nothing decoded), or RequestError naming what is
    wrong: the fields' types, the pixel caps, the metadata's size in bytes."""
    if not isinstance(req, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(req).__name__}")
    missing = [k for k in ("images", "prompts") if k not in req]
    if missing:
        raise RequestError(400, f"the body misses {missing}: send images, prompts, metadata")
    prompts = req["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError(400, "'prompts' must be a list of strings")
    metadata = req.get("metadata")
    if metadata is None:
        metadata = [{} for _ in prompts]
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise RequestError(400, "'metadata' must be a list of JSON objects, one per image")
    frames = req.get("frames")
    if frames is not None and (
        isinstance(frames, bool) or not isinstance(frames, int) or frames < 1
    ):
        raise RequestError(400, f"'frames' must be a whole number >= 1, got {frames!r}")
    if max_metadata_bytes is not None:
        size = len(json.dumps(metadata, separators=(",", ":")))
        if size > max_metadata_bytes:
            raise RequestError(
                413,
                f"metadata of {size} bytes exceeds {max_metadata_bytes / 2**20:g} MB "
                "(--max-metadata-mb)",
            )
    headers, pixels = _check_sizes(req["images"], max_pixels, max_request_pixels)
    if frames is not None and len(headers) != frames * len(prompts):
        raise RequestError(
            400,
            f"{len(headers)} frames do not make {len(prompts)} videos of {frames} frames "
            "(send each video's frames in order, one prompt per video)",
        )
    sources, index, source_pixels = _check_sources(req, len(metadata), max_pixels)
    if pixels + source_pixels > max_request_pixels:
        raise RequestError(
            413,
            f"{len(headers)} images and {len(sources)} source images of "
            f"{pixels + source_pixels} pixels in all, over the cap of {max_request_pixels} per "
            "request (--max-request-pixels); send smaller batches",
        )
    return Request(headers, pixels + source_pixels, prompts, metadata, frames, (sources, index))


__all__ = [
    "Budget",
    "Request",
    "RequestError",
    "check_body",
    "check_request",
    "parse_json",
    "parse_request",
    "read_images",
]

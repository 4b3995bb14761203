"""Image parts of every dialect, checked once before anything reaches the worker.

A dialect turns each image part of a turn into a ``protocol.ImageInput`` while
it parses the body (``data_url_image``: chat's ``image_url`` and Responses'
``input_image``; ``base64_image``: Anthropic's ``image`` block), and joins the
turn's parts with ``join_parts``. The request path then awaits
``check_images`` with the worker's ``Ready`` and ``ProxySettings.image_limits``;
in order, each refusal a 400 naming the part in the client's terms
(``messages[0].content[1]``):

1. a model that reads text only (``Ready.modalities``): refused, no decoding;
2. more than ``limits.count`` images in the request;
3. a file over ``limits.bytes``;
4. in a thread (``_DECODERS``, two at a time, so a burst of images takes no
   more of the proxy than that; at most ``MAX_CHECKING`` requests in them, the
   next a 503 ``image_checks_busy``): the format by the file's signature (PNG,
   JPEG, WebP, GIF), the pixels (width x height) from its header against
   ``limits.pixels`` (a decompression bomb is refused before it is decoded),
   then a full decode of the first frame (a truncated or damaged file is
   refused here, not in the worker).

Image URLs over ``http(s)`` are fetched only where the operator allows it, after
step 2 and before step 3 (``proxy.core.image_fetch``: off by default, an
allow-list of hosts, no private address unless listed). Formats follow the
OpenAI and Anthropic references (PNG, JPEG, WebP, non-animated GIF; an animated
GIF's first frame is what a vision model is shown).
"""

from __future__ import annotations

import asyncio
import binascii
import io
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec

from protocol.messages import MODALITY_IMAGE, ImageInput, Ready, Submit
from proxy.core.image_fetch import ImageUrl, fetch_image
from proxy.errors import InvalidRequest, ServiceUnavailable
from proxy.settings import MIB, ImageLimits

FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
"""The media types taken, with Pillow's name of each format."""

DECODE_THREADS = 2
_DECODERS = ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix="image-check")
"""The threads that decode images (module docstring): not loop-bound, shared by every app."""

MAX_CHECKING = 16
"""Requests whose images may be in the decoders at once, running or queued; one more
is a 503 ``image_checks_busy`` (``Retry-After``), as a grammar check beyond its
queue is: a burst of image requests waits a bounded time, or is told to retry."""

_checking = 0  # requests in the decoders now; touched only on the event loop


def join_parts(parts: Sequence[str | None]) -> tuple[str, tuple[int, ...]]:
    """A turn's content from its parts in order, text or ``None`` for an image:
    the texts joined with ``"\\n"``, an image an empty part (``ImageInput.offset``).
    Returns the content and each image's offset."""
    content: list[str] = []
    offsets: list[int] = []
    at = 0
    for i, part in enumerate(parts):
        if i:
            content.append("\n")
            at += 1
        if part is None:
            offsets.append(at)
        else:
            content.append(part)
            at += len(part)
    return "".join(content), tuple(offsets)


def data_url_image(url: str, param: str, offset: int = 0) -> ImageInput:
    """The image of a ``data:<media type>;base64,<data>`` URL (RFC 2397), at
    ``offset`` of its turn; an ``http(s)`` URL is an ``ImageUrl``, fetched later
    where allowed (``proxy.core.image_fetch``). Raises ``InvalidRequest`` naming
    ``param`` for another scheme, a data URL that is not base64 or not of a format
    taken (``FORMATS``)."""
    scheme = url[: url.find(":")].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        return ImageUrl(b"", offset, param, url)  # fetched, if allowed, by check_images
    if scheme != "data":
        raise InvalidRequest(f"'{param}' must be a data URL (data:image/png;base64,...)", param=param)
    head, comma, data = url.partition(",")
    meta = head[len("data:") :].split(";")
    if not comma or meta[-1].lower() != "base64":
        raise InvalidRequest(f"'{param}' must be a base64 data URL (data:image/png;base64,...)", param=param)
    return base64_image(meta[0], data, param, offset)


def base64_image(media_type: str, data: str, param: str, offset: int = 0) -> ImageInput:
    """The image of base64 ``data`` declared as ``media_type``, at ``offset`` of
    its turn. Raises ``InvalidRequest`` naming ``param`` for a media type not in
    ``FORMATS`` or data that is not base64."""
    if media_type.lower() not in FORMATS:
        taken = ", ".join(FORMATS)
        raise InvalidRequest(
            f"'{param}' is of media type {media_type or '(none)'!r}; images are taken as {taken}",
            param=param,
        )
    try:
        # In slices: one call holds the GIL throughout, and a 5 MiB image in one
        # call would hold the event loop off for tens of milliseconds.
        raw = b"".join(
            binascii.a2b_base64(data[i : i + _BASE64_SLICE], strict_mode=True)
            for i in range(0, len(data), _BASE64_SLICE)
        )
    except binascii.Error:
        raise InvalidRequest(f"'{param}' is not valid base64", param=param) from None
    return ImageInput(raw, offset, param)


_BASE64_SLICE = 256 * 1024
"""Base64 characters decoded per call (a multiple of 4, so slices decode on their own)."""


def takes_images(worker: Ready) -> bool:
    """The worker's model reads images (``Ready.modalities``)."""
    return MODALITY_IMAGE in worker.modalities


async def check_images(submits: list[Submit], worker: Ready, limits: ImageLimits) -> list[Submit]:
    """``submits`` with their image URLs fetched (``proxy.core.image_fetch``), once
    nothing the worker should not be sent is left (module docstring, steps 1-4).
    Raises ``InvalidRequest`` naming the image's part, ``ServiceUnavailable``
    (``image_checks_busy``) when ``MAX_CHECKING`` requests' images are being checked."""
    images = [im for s in submits for m in s.messages for im in m.images]
    if not images:
        return submits
    if not takes_images(worker):
        param = images[0].param
        raise InvalidRequest(
            f"'{param}' is an image; the model {worker.model_id!r} reads text only", param=param
        )
    if len(images) > limits.count:
        param = images[limits.count].param
        raise InvalidRequest(
            f"The request has {len(images)} images; this server takes at most max_images={limits.count} "
            f"('{param}' is over it)",
            param=param,
        )
    urls = [im for im in images if isinstance(im, ImageUrl)]
    if urls:
        # One at a time: the first refusal ends the request with no fetch left running.
        fetched = {id(u): await fetch_image(u, limits) for u in urls}
        submits = [_replaced(s, fetched) for s in submits]
        images = [fetched.get(id(im), im) for im in images]
    for im in images:
        if len(im.data) > limits.bytes:
            raise InvalidRequest(
                f"'{im.param}' is {len(im.data) / MIB:.1f} MiB; this server takes images of at most "
                f"{limits.bytes / MIB:.1f} MiB (max_image_mb)",
                param=im.param,
            )
    global _checking
    if _checking >= MAX_CHECKING:
        raise ServiceUnavailable(
            f"Images of {MAX_CHECKING} requests are being checked now; retry shortly",
            code="image_checks_busy",
        )
    _checking += 1
    try:
        loop = asyncio.get_running_loop()
        # A repeated image (the same bytes sent again in the history) is checked once,
        # and named by its first part.
        unique: dict[bytes, ImageInput] = {}
        for im in images:
            unique.setdefault(im.data, im)
        for im in unique.values():
            problem = await loop.run_in_executor(_DECODERS, inspect, im.data, limits.pixels)
            if problem is not None:
                raise InvalidRequest(f"'{im.param}' {problem}", param=im.param)
    finally:
        _checking -= 1
    return submits


def _replaced(submit: Submit, fetched: dict[int, ImageInput]) -> Submit:
    if not any(id(im) in fetched for m in submit.messages for im in m.images):
        return submit
    messages = tuple(
        msgspec.structs.replace(m, images=tuple(fetched.get(id(im), im) for im in m.images))
        if m.images
        else m
        for m in submit.messages
    )
    return msgspec.structs.replace(submit, messages=messages)


def inspect(data: bytes, max_pixels: int) -> str | None:
    """What is wrong with the image file ``data`` (module docstring, step 4), as
    the end of a sentence that starts with the part's name; ``None`` when
    nothing is. Blocks: call it off the event loop."""
    from PIL import Image, UnidentifiedImageError

    # Our own pixel limit is checked from the header; Pillow's (a warning, then
    # an error, at 89 and 179 million pixels) would only second-guess it.
    Image.MAX_IMAGE_PIXELS = None
    try:
        with Image.open(io.BytesIO(data), formats=tuple(FORMATS.values())) as img:
            width, height = img.size
            if width * height > max_pixels:
                return (
                    f"is {width} x {height} pixels ({width * height:,}); this server takes images of at "
                    f"most {max_pixels:,} pixels (max_image_pixels)"
                )
            img.load()  # the first frame of an animation
    except UnidentifiedImageError:
        return f"is not an image of a format taken ({', '.join(FORMATS)})"
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        return f"could not be decoded: {e}"
    return None

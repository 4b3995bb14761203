"""``proxy.core.images``: parts joined with their images' offsets, data URLs and
base64 decoded, and every limit checked in its order, before the worker."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
import zlib

import msgspec
import pytest
from PIL import Image

from protocol.messages import MODALITY_IMAGE, MODALITY_TEXT, ChatMessage, ImageInput, SamplingParams, Submit
from proxy.core import images
from proxy.core.images import base64_image, check_images, data_url_image, inspect, join_parts
from proxy.errors import InvalidRequest, ServiceUnavailable
from proxy.settings import ImageLimits
from tests.fakes.engine_client import WORKER

VISION = msgspec.structs.replace(WORKER, modalities=(MODALITY_TEXT, MODALITY_IMAGE))
LIMITS = ImageLimits(count=4, bytes=1 << 20, pixels=1_000_000)


def picture(fmt: str = "PNG", size: tuple[int, int] = (4, 3), frames: int = 1) -> bytes:
    """A real image file of ``size`` in ``fmt``; ``frames`` above 1: an animated GIF."""
    out = io.BytesIO()
    images = [Image.new("RGB", size, (40 * k, 90, 200)) for k in range(frames)]
    extra = {"save_all": True, "append_images": images[1:]} if frames > 1 else {}
    images[0].save(out, format=fmt, **extra)
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` and whose data holds one
    row: what a decompression bomb looks like before anyone decodes it."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = zlib.compress(b"\x00" + b"\x00" * 3 * min(width, 16))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", row) + chunk(b"IEND", b"")


def submit_with(*images: ImageInput) -> Submit:
    return Submit("r", SamplingParams(4), messages=(ChatMessage("user", "look", images=images),))


def test_join_parts_counts_an_image_as_an_empty_part() -> None:
    assert join_parts(["a", None, "b"]) == ("a\n\nb", (2,))
    assert join_parts([None, "text"]) == ("\ntext", (0,))
    assert join_parts(["text", None]) == ("text\n", (5,))
    assert join_parts([None, None]) == ("\n", (0, 1))
    assert join_parts(["only"]) == ("only", ())


def test_data_url_decodes_and_keeps_part_and_offset() -> None:
    raw = picture()
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    assert data_url_image(url, "messages[0].content[1]", 7) == ImageInput(raw, 7, "messages[0].content[1]")
    assert base64_image("image/jpeg", base64.b64encode(b"xyz").decode(), "p").data == b"xyz"


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("file:///etc/passwd", "must be a data URL"),
        ("cat.png", "must be a data URL"),
        ("data:image/png,notbase64", "base64 data URL"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/bmp;base64,AAAA", "'image/bmp'"),
        ("data:;base64,AAAA", "(none)"),
    ],
)
def test_bad_image_urls_name_the_part(url: str, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        data_url_image(url, "messages[0].content[2]")
    assert info.value.param == "messages[0].content[2]"
    assert fragment in info.value.message
    assert "'messages[0].content[2]'" in info.value.message


@pytest.mark.parametrize(("fmt", "frames"), [("PNG", 1), ("JPEG", 1), ("WEBP", 1), ("GIF", 1), ("GIF", 3)])
def test_formats_taken_decode(fmt: str, frames: int) -> None:
    assert inspect(picture(fmt, frames=frames), LIMITS.pixels) is None


def test_a_bomb_is_refused_from_its_header() -> None:
    bomb = png_header_only(50_000, 50_000)  # 2.5 billion pixels, 7.5 GB as RGB
    assert len(bomb) < 200
    problem = inspect(bomb, LIMITS.pixels)
    assert problem is not None and "50000 x 50000 pixels (2,500,000,000)" in problem
    assert "max_image_pixels" in problem


def test_damaged_and_foreign_files_are_refused() -> None:
    whole = picture("PNG", (64, 64))
    truncated = inspect(whole[: len(whole) // 2], LIMITS.pixels)
    assert truncated is not None and truncated.startswith("could not be decoded")
    foreign = inspect(picture("BMP"), LIMITS.pixels)
    assert foreign is not None and "not an image of a format taken" in foreign
    assert inspect(b"not an image at all", LIMITS.pixels) == foreign


async def test_a_text_only_model_refuses_before_any_decoding() -> None:
    garbage = ImageInput(b"not decoded", 4, "messages[0].content[1]")
    with pytest.raises(InvalidRequest) as info:
        await check_images([submit_with(garbage)], WORKER, LIMITS)
    assert info.value.param == "messages[0].content[1]"
    assert "reads text only" in info.value.message and "'fake-model'" in info.value.message


async def test_limits_in_order_each_naming_its_part() -> None:
    good = picture()
    images = [ImageInput(good, 4, f"messages[0].content[{j}]") for j in range(5)]
    with pytest.raises(InvalidRequest) as info:
        await check_images([submit_with(*images)], VISION, LIMITS)
    assert info.value.param == "messages[0].content[4]"  # the fifth, one over max_images=4
    assert "5 images" in info.value.message and "max_images=4" in info.value.message

    big = ImageInput(good + b"\0" * (1 << 20), 4, "messages[0].content[1]")
    with pytest.raises(InvalidRequest) as info:
        await check_images([submit_with(ImageInput(good, 4, "a"), big)], VISION, LIMITS)
    assert info.value.param == "messages[0].content[1]" and "max_image_mb" in info.value.message

    bomb = ImageInput(png_header_only(2000, 1000), 4, "messages[0].content[3]")
    with pytest.raises(InvalidRequest) as info:
        await check_images([submit_with(bomb)], VISION, LIMITS)
    assert info.value.param == "messages[0].content[3]" and "2,000,000" in info.value.message

    await check_images([submit_with(*images[:4])], VISION, LIMITS)  # within every limit


async def test_a_burst_beyond_the_decoders_queue_is_told_to_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def slow(data: bytes, max_pixels: int) -> str | None:
        release.wait(10)
        return None

    monkeypatch.setattr(images, "inspect", slow)
    monkeypatch.setattr(images, "MAX_CHECKING", 1)
    first = asyncio.create_task(check_images([submit_with(ImageInput(picture(), 4, "a"))], VISION, LIMITS))
    await asyncio.sleep(0.05)
    with pytest.raises(ServiceUnavailable) as info:
        await check_images([submit_with(ImageInput(picture(), 4, "b"))], VISION, LIMITS)
    assert info.value.code == "image_checks_busy" and info.value.status == 503
    release.set()
    await first
    await check_images([submit_with(ImageInput(picture(), 4, "c"))], VISION, LIMITS)  # room again

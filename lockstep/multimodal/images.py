"""An image as a client sends it (a data URL, bare base64, or an http(s) URL where the server
allows them) decoded into a PIL image, every limit checked before the work it bounds: the
encoded size before decoding base64 or downloading more, the declared dimensions (read from the
header alone) before decoding pixels, so a decompression bomb is refused unopened. Each problem
is an `ImageError` naming it: the route answers 400."""

from __future__ import annotations

import base64
import binascii
import io
import re
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass

from PIL import Image

# Formats PIL may open here (others, e.g. PostScript through Ghostscript, are never tried).
FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP"}
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.S)


class ImageError(ValueError):
    """A client's image the server will not take: the message says which and why."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 << 20  # encoded, per image
    max_pixels: int = 40_000_000  # declared width x height
    max_images: int = 16  # per request
    allow_urls: bool = False  # fetch http(s) URLs
    url_timeout_s: float = 10.0


def load_image(source: str, limits: ImageLimits, what: str) -> Image.Image:
    """The decoded RGB image of one client source; `what` names it in errors ("image_data[1]")."""
    data = _fetch(source, limits, what)
    return decode(data, limits, what)


def _fetch(source: str, limits: ImageLimits, what: str) -> bytes:
    if len(source) > limits.max_bytes * 4 // 3 + 1024:  # base64 of more than max_bytes
        raise ImageError(f"{what}: larger than {limits.max_bytes} bytes (--max-image-bytes)")
    if source.startswith("data:"):
        m = _DATA_URL.fullmatch(source)
        if m is None:
            raise ImageError(f"{what}: not a valid data URL (data:image/<type>;base64,<data>)")
        media = m["type"].strip().lower()
        if not media.startswith("image/") or media.removeprefix("image/") not in FORMATS:
            raise ImageError(f"{what}: media type {media or '(none)'!r} is not an image this server "
                             f"reads ({', '.join(sorted({f'image/{k}' for k in FORMATS}))})")
        if ";base64" not in m["params"].lower():
            raise ImageError(f"{what}: a data URL's image must be base64 encoded (;base64,)")
        return _b64(m["data"], what)
    if source.startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise ImageError(f"{what}: image URLs are not fetched by this server (start it with "
                             "--allow-image-urls); send the image as a data URL")
        return _download(source, limits, what)
    if "://" in source or source.startswith(("/", "./", "~")):
        raise ImageError(f"{what}: only data URLs, base64 and (with --allow-image-urls) http(s) "
                         "URLs are read; local files never are")
    return _b64(source, what)


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what}: not valid base64") from None


def _download(url: str, limits: ImageLimits, what: str) -> bytes:
    """At most max_bytes + 1 bytes, within url_timeout_s in all (a server that drips bytes
    slowly is cut off too, not only one that stalls)."""
    deadline = time.monotonic() + limits.url_timeout_s
    data = bytearray()
    try:
        with urllib.request.urlopen(url, timeout=limits.url_timeout_s) as resp:  # noqa: S310 - http(s) only
            while len(data) <= limits.max_bytes:
                if time.monotonic() > deadline:
                    raise ImageError(f"{what}: {url!r} took longer than {limits.url_timeout_s:g} s")
                chunk = resp.read(min(1 << 16, limits.max_bytes + 1 - len(data)))
                if not chunk:
                    break
                data += chunk
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImageError(f"{what}: could not fetch {url!r}: {e}") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"{what}: larger than {limits.max_bytes} bytes (--max-image-bytes)")
    return bytes(data)


def decode(data: bytes, limits: ImageLimits, what: str) -> Image.Image:
    if len(data) > limits.max_bytes:
        raise ImageError(f"{what}: {len(data)} bytes, more than {limits.max_bytes} (--max-image-bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=sorted(set(FORMATS.values())))
            width, height = img.size  # from the header: nothing decoded yet
            if width * height > limits.max_pixels:
                raise ImageError(f"{what}: {width}x{height} pixels, more than {limits.max_pixels} "
                                 "(a decompression bomb, or too large an image)")
            img.load()
            return img.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"{what}: declares more pixels than allowed (a decompression bomb)") from None
    except Image.UnidentifiedImageError:
        raise ImageError(f"{what}: not an image this server reads (PNG, JPEG, WebP, GIF, BMP)") from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise ImageError(f"{what}: corrupt or truncated image ({e})") from None

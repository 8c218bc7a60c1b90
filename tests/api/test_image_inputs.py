"""lockstep.multimodal.images without a server: http(s) URLs only with the flag and then within
the byte and time limits (a local HTTP server plays the remote one), data URLs' media types and
and the header-first bomb check."""

from __future__ import annotations

import http.server
import io
import threading
import time
from collections.abc import Iterator

import pytest

from lockstep.multimodal.images import ImageError, ImageLimits, decode, load_image
from lockstep.testing.tiny_vision import data_url, random_image


def _png(seed: int, side: int = 40) -> bytes:
    buf = io.BytesIO()
    random_image(seed, side, side).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def remote() -> Iterator[str]:
    """http://127.0.0.1:PORT serving /small.png, /big.png (300 kB) and /slow.png (answers late)."""
    files = {"/small.png": _png(1), "/big.png": _png(2, 400)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/slow.png":
                time.sleep(2)
            body = files.get(self.path, files["/small.png"])
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading at its byte limit

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_urls_only_with_the_flag_and_within_limits(remote):
    with pytest.raises(ImageError, match="--allow-image-urls"):
        load_image(remote + "/small.png", ImageLimits(), "image 0")
    allowed = ImageLimits(allow_urls=True, max_bytes=100_000, url_timeout_s=0.5)
    assert load_image(remote + "/small.png", allowed, "image 0").size == (40, 40)
    with pytest.raises(ImageError, match="larger than 100000 bytes"):
        load_image(remote + "/big.png", allowed, "image 0")
    with pytest.raises(ImageError, match="could not fetch"):
        load_image(remote + "/slow.png", allowed, "image 0")


@pytest.mark.parametrize("source", ["/etc/hostname", "file:///etc/hostname", "~/x.png", "ftp://h/x.png"])
def test_local_paths_are_never_read(source):
    with pytest.raises(ImageError, match="local files never are"):
        load_image(source, ImageLimits(allow_urls=True), "image 0")


def test_data_urls():
    limits = ImageLimits()
    assert load_image(data_url(random_image(3), "JPEG"), limits, "i").size == (50, 40)
    with pytest.raises(ImageError, match="media type 'image/svg\\+xml'"):
        load_image("data:image/svg+xml;base64,PHN2Zy8+", limits, "i")
    with pytest.raises(ImageError, match="must be base64"):
        load_image("data:image/png,abc", limits, "i")


def test_declared_size_is_checked_before_decoding():
    img = random_image(4, 100, 100)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    with pytest.raises(ImageError, match="100x100 pixels, more than 5000"):
        decode(buf.getvalue(), ImageLimits(max_pixels=5000), "image 2")

"""pipeline/data/imagedecode.py: one decoder for every path; formats by magic bytes, every mode converted right."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipeline.data import imagedecode as dec
from pipeline.core.errors import DataError

GRAY = (np.arange(24 * 40).reshape(24, 40) % 251).astype(np.uint8)


def _encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "WEBP", "GIF"])
def test_lossless_formats_round_trip_in_every_output_mode(fmt):
    rgb = np.stack([GRAY, 255 - GRAY, GRAY // 2], axis=-1)
    data = _encode(Image.fromarray(rgb), fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    assert dec.sniff(data) == fmt
    got = dec.decode(data, mode="RGB")
    if fmt != "GIF":                                   # GIF quantises to a palette
        assert (got == rgb).all()
    assert (dec.decode(data, mode="BGR") == got[..., ::-1]).all()
    assert dec.decode(data, mode="L").shape == GRAY.shape


def test_16bit_gray_is_scaled_not_clipped():
    data = _encode(Image.fromarray(GRAY.astype(np.uint16) * 257))
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    assert (dec.decode(data) == GRAY).all()                             # convert('L') gave all 255
    assert (dec.decode(_encode(Image.fromarray(GRAY.astype(np.uint16) * 257), "TIFF")) == GRAY).all()


def test_alpha_is_composited_on_white_and_palette_transparency_too():
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[:4, :, 3] = 255                                                # top half opaque black, bottom transparent
    got = dec.decode(_encode(Image.fromarray(rgba, "RGBA")))
    assert (got[:4] == 0).all() and (got[4:] == 255).all()
    la = Image.fromarray(rgba[..., [0, 3]], "LA")
    assert (dec.decode(_encode(la)) == got).all()
    pal = Image.fromarray(rgba, "RGBA").convert("P")
    assert (dec.decode(_encode(pal, "GIF", transparency=pal.getpixel((0, 7)))) [4:] == 255).all()


@pytest.mark.parametrize("mode", ["1", "P", "CMYK", "LA", "I", "F"])
def test_other_modes_decode(mode):
    img = Image.fromarray(GRAY).convert(mode)
    fmt = "JPEG" if mode == "CMYK" else "TIFF" if mode in ("I", "F") else "PNG"
    out = dec.decode(_encode(img, fmt))
    assert out.dtype == np.uint8 and out.shape == GRAY.shape


def test_float_images_in_0_1_are_scaled():
    img = Image.fromarray(GRAY.astype(np.float32) / 255.0, "F")
    assert np.abs(dec.decode(_encode(img, "TIFF")).astype(int) - GRAY).max() <= 1


def test_exif_orientation_is_applied():
    img = Image.fromarray(GRAY)
    exif = Image.Exif()
    exif[0x0112] = 6                                                    # rotate 90 degrees clockwise
    data = _encode(img.convert("RGB"), "JPEG", exif=exif, quality=100)
    assert dec.decode(data).shape == (GRAY.shape[1], GRAY.shape[0])


@pytest.mark.parametrize("data", [b"", b"hello", b"%!PS-Adobe-3.0 EPSF-3.0\n", b"DDS " + b"\0" * 380,
                                  b"\x89PNG\r\n\x1a\n" + b"\0" * 40, b"\xff\xd8\xff" + b"\0" * 10])
def test_anything_else_is_one_data_error_without_object_reprs(data):
    with pytest.raises(dec.UnreadableImage) as info:
        dec.decode(data)
    assert "not a readable" in info.value.message and "BytesIO" not in info.value.one_line()


def test_decoder_exceptions_of_any_type_become_unreadable_image(monkeypatch):
    from PIL import PngImagePlugin

    def boom(self, *a, **k):
        raise NotImplementedError("Unknown pixel format flags")
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", boom)
    with pytest.raises(dec.UnreadableImage, match="Unknown pixel format flags"):
        dec.decode(_encode(Image.fromarray(GRAY)))


def test_pixel_limit_is_checked_from_the_header():
    with pytest.raises(dec.ImageTooLarge, match="40x24"):
        dec.decode(_encode(Image.fromarray(GRAY)), max_pixels=100)


def test_content_type_must_name_the_format_of_the_bytes():
    png = _encode(Image.fromarray(GRAY))
    dec.check_content_type("image/png", png)
    dec.check_content_type("application/octet-stream", png)            # not an image type: the bytes decide
    with pytest.raises(dec.UnreadableImage, match="image/jpeg but the body is a PNG"):
        dec.check_content_type("image/jpeg", png)


def test_pages_too_thin_to_read_are_refused():
    with pytest.raises(DataError, match="20000x8"):
        dec.decode_page(_encode(Image.new("L", (20000, 8), 255)))
    assert dec.decode_page(_encode(Image.new("L", (640, 480), 255))).shape == (480, 640)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "x.png"
    bad.write_bytes(b"DDS " + b"\0" * 100)
    with pytest.raises(dec.UnreadableImage, match="x.png"):
        dec.decode_file(bad)
    with pytest.raises(DataError, match="does not exist"):
        dec.decode_file(tmp_path / "nope.png")


def test_fast_path_and_general_path_agree():
    from pipeline.data.preprocess import decode_image_bytes

    spec = {"height": 24, "width": 40, "resize": "stretch"}
    png = _encode(Image.fromarray(GRAY))
    assert (decode_image_bytes(png, spec) == GRAY).all()
    assert (decode_image_bytes(_encode(Image.fromarray(GRAY.astype(np.uint16) * 257)), spec) == GRAY).all()


def test_image_folder_of_16bit_pngs_trains_on_the_real_pixels(tmp_path):
    from pipeline.data.imagefolder import load_image_folder

    for cls, value in (("dark", 20), ("light", 200)):
        (tmp_path / cls).mkdir()
        Image.fromarray(np.full((8, 8), value * 257, np.uint16)).save(tmp_path / cls / "a.png")
    images, labels, names, _ = load_image_folder(tmp_path, 8, 8)
    assert names == ["dark", "light"] and images[0].max() == 20 and images[1].min() == 200


def test_ocr_page_uploads_go_through_the_decoder():
    """/ocr's request path (pipeline/serving/ocr_routes.py) on a stand-in route: the page the OCR system would get."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    from pipeline.serving.ocr_routes import _page_from_request
    from pipeline.serving.http_common import base_app

    app = base_app("t", ThreadPoolExecutor(1), max_concurrency=2, log_requests=False)

    async def ocr(request):
        page = await _page_from_request(request, 4 << 20, 1 << 26, app.state.prep)   # decoded on the prep pool
        return JSONResponse({"shape": list(page.shape), "mean": float(page.mean())})
    app.add_route("/ocr", ocr, methods=["POST"])

    page = np.tile(GRAY, (4, 4))
    post = lambda data, ctype="image/png": client.post("/ocr", content=data, headers={"content-type": ctype})
    with TestClient(app, raise_server_exceptions=False) as client:
        r = post(_encode(Image.fromarray(page.astype(np.uint16) * 257)))                  # 16-bit page
        # OCR pages are decoded in BGR (PaddleOCR's order): a gray page comes back on all three channels
        assert r.status_code == 200 and r.json() == {"shape": [*page.shape, 3], "mean": float(page.mean())}
        for data, words in [(b"DDS " + b"\0" * 380, "not a readable image"), (b"\0garbage" * 9, "not a readable"),
                            (_encode(Image.new("L", (20000, 8), 255)), "20000x8"),
                            (_encode(Image.fromarray(page).convert("RGB"), "JPEG"), "image/png")]:
            r = post(data)
            assert r.status_code == 400 and words in r.json()["error"] and "BytesIO" not in r.text, r.text

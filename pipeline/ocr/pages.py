"""Page images for detection and the OCR system: decoded at full resolution in colour (BGR, as OpenCV and
the PP-OCR models see them), so boxes come back in the page's own pixels."""
from __future__ import annotations

import numpy as np

from pipeline.data.preprocess import fit_image, to_tensor
from pipeline.ocr import ppocr


def decode_page(data: bytes, max_pixels: int | None = None) -> np.ndarray:
    """PNG/JPEG/... bytes → uint8 [H, W, 3] BGR through the one decoder (pipeline/imagedecode: transparency on
    white, 16-bit scaled, EXIF orientation); over max_pixels: ImageTooLarge, unreadable: DataError."""
    from pipeline.data.imagedecode import decode

    return decode(data, mode="BGR", max_pixels=max_pixels, what="page")


def detection_input(page: np.ndarray, pre: dict) -> np.ndarray:
    """A BGR page → the detector's input [1, C, H', W'] by the bundle's preprocess spec (limit or stretch)."""
    if pre.get("resize") == "limit":
        return ppocr.det_input(page, pre)
    import cv2
    from PIL import Image

    gray = cv2.cvtColor(page, cv2.COLOR_BGR2GRAY)
    return to_tensor(fit_image(Image.fromarray(gray), pre)[None], pre)

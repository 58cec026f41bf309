"""Page images for detection and the OCR system: decoded at full resolution in colour (BGR, as OpenCV and
the PP-OCR models see them), so boxes come back in the page's own pixels."""
from __future__ import annotations

import io
import warnings

import numpy as np

from ..errors import DataError
from ..preprocess import ImageTooLarge, fit_image, to_tensor
from . import ppocr


def decode_page(data: bytes, max_pixels: int | None = None) -> np.ndarray:
    """PNG/JPEG bytes → uint8 [H, W, 3] BGR (transparency on white). The pixel limit is read from the header
    before anything is decoded (ImageTooLarge); unreadable bytes raise DataError."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
        with img:
            if max_pixels is not None and img.width * img.height > max_pixels:
                raise ImageTooLarge(f"page is {img.width}x{img.height} = {img.width * img.height:,} pixels; "
                                    f"the limit is {max_pixels:,} (serve.max_pixels)")
            img.load()
            return ppocr.page_from_pil(img)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"not a readable PNG/JPEG page image ({exc})", hint="send a PNG or JPEG file") from None


def detection_input(page: np.ndarray, pre: dict) -> np.ndarray:
    """A BGR page → the detector's input [1, C, H', W'] by the bundle's preprocess spec (limit or stretch)."""
    if pre.get("resize") == "limit":
        return ppocr.det_input(page, pre)
    import cv2
    from PIL import Image

    gray = cv2.cvtColor(page, cv2.COLOR_BGR2GRAY)
    return to_tensor(fit_image(Image.fromarray(gray), pre)[None], pre)

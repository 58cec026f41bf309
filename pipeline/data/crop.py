"""Perspective crops of text quads: the one crop rule for recognition training data and the system."""
from __future__ import annotations

import cv2
import numpy as np


def crop_quad(image: np.ndarray, quad: np.ndarray) -> np.ndarray:
    """uint8 [H, W] or [H, W, 3] page + quad [4, 2] (clockwise from top-left) → upright uint8 crop.

    PaddleOCR's get_rotate_crop_image: width and height are the quad's longer edge lengths, truncated
    to whole pixels; a crop at least 1.5x taller than wide is turned upright.
    """
    q = np.asarray(quad, dtype=np.float32)
    w = int(max(np.linalg.norm(q[0] - q[1]), np.linalg.norm(q[2] - q[3])))
    h = int(max(np.linalg.norm(q[0] - q[3]), np.linalg.norm(q[1] - q[2])))
    w, h = max(w, 1), max(h, 1)
    dst = np.array([[0, 0], [w, 0], [w, h], [0, h]], dtype=np.float32)
    m = cv2.getPerspectiveTransform(q, dst)
    out = cv2.warpPerspective(image, m, (w, h), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE)
    if h >= 1.5 * w:
        out = np.rot90(out).copy()
    return out

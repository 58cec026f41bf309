"""Pages read side by side, one per core (issue 48, "both cores").

An OCR page is a chain of calls (detector, crops, classifier, recogniser) whose parts scale poorly with threads:
the detector's convolutions on one 736-pixel page and the recogniser's small batches leave a second thread idle
much of the time. A lane is one engine set (det, rec, cls) reading one whole page; n lanes read n pages at once.
Each lane's engines run at every core (`serve` and the bench): while both lanes read, the cores are shared; when
one idles (the last page of a batch, a lull) the other's page gets both. Throughput equals lanes of one thread
within the noise (docs/performance.md#both-cores); a lone page's latency is what it buys. The runtimes (OpenVINO,
ONNX Runtime, Paddle Inference) release the GIL inside their calls, and the
page steps are numpy/OpenCV, so Python threads are enough. A page's lines are exactly what `read_page` gives on a
lane's engines: lanes change when a page is read, never what it reads.
"""
from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from pipeline.ocr import ppocr
from pipeline.ocr.system import read_page

EngineSet = tuple        # (det, rec, cls or None, spec): what pipeline.bundle.system.served_system returns


def page_cost(page: np.ndarray, spec) -> int:
    """A page's relative reading time: the pixels of the detector's input (the detector is ~70 % of a page,
    docs/serving_choice.md), at the limit rule's size for a PaddleOCR flow, else the page's own."""
    h, w = page.shape[:2]
    if spec.paddleocr:
        h, w = ppocr.det_resize_shape(h, w, int(spec.det_pre["limit_side_len"]), spec.det_pre["limit_type"])
    return h * w


class PageLanes:
    """n engine sets, each on its own thread for its whole life (a Paddle predictor run on a new thread after the
    thread that ran it exited fails in oneDNN), each reading one page at a time; `read` keeps the pages' order."""

    def __init__(self, load: Callable[[], EngineSet], lanes: int):
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.sets = [load() for _ in range(lanes)]
        self._threads = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ocr-lane{i}") for i in range(lanes)]
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(lanes):
            self._free.put(i)

    @property
    def lanes(self) -> int:
        return len(self.sets)

    def submit(self, page: np.ndarray, max_boxes: int = 0) -> Future:
        """One page on the first free lane (waits for one) → a future of (lines, boxes detected)."""
        i = self._free.get()
        det, rec, cls, spec = self.sets[i]
        fut = self._threads[i].submit(read_page, page, det, rec, spec, cls, max_boxes)
        fut.add_done_callback(lambda _f: self._free.put(i))
        return fut

    def read_one(self, page: np.ndarray, max_boxes: int = 0) -> tuple[list[dict], int]:
        return self.submit(page, max_boxes).result()

    def read(self, pages: list[np.ndarray], max_boxes: int = 0) -> list[tuple[list[dict], int]]:
        """Every page, up to `lanes` at once, results in the pages' order. The pages start largest first (the
        detector's input area, `page_cost`): a big page left for last keeps one lane busy while the others idle,
        so a batch ends when its longest page would have (longest-processing-time order); what each page reads
        does not depend on its lane or its turn."""
        spec = self.sets[0][3]
        order = sorted(range(len(pages)), key=lambda i: -page_cost(pages[i], spec))
        futures = dict(zip(order, [self.submit(pages[i], max_boxes) for i in order]))
        return [futures[i].result() for i in range(len(pages))]

    def close(self) -> None:
        for t in self._threads:
            t.shutdown(wait=True)
        for s in self.sets:
            for e in s[:3]:
                getattr(e, "close", lambda: None)()         # None (no classifier) and closeless stubs alike

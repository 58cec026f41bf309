"""One bundle, opened and loaded as `serve` loads it, reading image files into output rows (pipeline/scale/store.py).

Opening checks what `serve` checks before any model file is parsed (the signature with a key, then every hash) and
loads the same engines: a model bundle's recommendation as this CPU may run it (re-ranked, or fp32, on a CPU with
other kernels: pipeline/bundle/serving_choice.load_engine), an OCR system's parts as /ocr runs them
(pipeline/bundle/system.served_system). Each input is decoded by the one decoder with serving's pixel limit and read
at batch 1 on the path /predict or /ocr takes, so a row holds what `serve` answers for that file. This class is both
the single-process reader and what each Ray worker runs (pipeline/scale/batch.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

import numpy as np

from pipeline.core.errors import DataError, PipelineError
from pipeline.core.resources import rss_mb
from pipeline.data.imagedecode import printable
from pipeline.serving.http_common import MAX_PIXELS


def open_checked(bundle: Path, scratch: Path, key=None, archive_limits: tuple = ()) -> tuple[Path, dict, dict, str]:
    """(folder, infer config, manifest, signature line) of a bundle folder or .tar.gz, signature and hashes checked."""
    from pipeline.bundle.format import load_infer_config, open_bundle, verify_hashes
    from pipeline.bundle.verify import check_signature

    folder = open_bundle(Path(bundle), Path(scratch), *archive_limits)
    signature = check_signature(folder, key)
    manifest = verify_hashes(folder)
    return folder, load_infer_config(folder), manifest, signature


class BundleReader:
    """Reads image files with one bundle; threads: CPU threads per engine instance (0: the bundle's measured ones)."""

    def __init__(self, bundle: str | Path, *, key=None, threads: int = 1, max_pixels: int = MAX_PIXELS,
                 archive_limits: tuple = ()):
        from pipeline.core import tempdirs

        self.scratch = tempdirs.directory("batch-bundle")       # an extracted archive lives as long as the reader
        folder, self.cfg, manifest, self.signature = open_checked(bundle, Path(self.scratch.name), key, archive_limits)
        self.name = manifest.get("name") or folder.name
        self.max_pixels = max_pixels
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        if self.cfg.get("task") == "ocr_system":
            from pipeline.bundle.system import served_system

            self.det, self.rec, self.cls, self.spec = served_system(folder, threads)
            parts = {"detection": self.det, "recognition": self.rec, "classifier": self.cls}
            self.engines = {r: e for r, e in parts.items() if e is not None}
        else:
            from pipeline.bundle import layout
            from pipeline.bundle.serving_choice import load_engine
            from pipeline.tasks import get_task

            self.engines = {"model": load_engine(folder, self.cfg, threads=threads)}
            self.task = get_task(self.cfg["task"], self.cfg["postprocess"])
            layout.reference_of(self.cfg)       # an unknown reference engine is refused here, as `serve` refuses it
        self.served = {r: f"{e.serving['engine']} {e.serving['precision']}" if getattr(e, "serving", None)
                       else f"{e.kind} {e.effective_precision}" for r, e in self.engines.items()}
        self.choices = {r: getattr(e, "serving", None) or {} for r, e in self.engines.items()}

    # -------------------------------------------------------------------------------- one input

    def read(self, path: str, file: str | None = None, done: str | None = None) -> dict | None:
        """The row of one input (read from `file`, default `path`); None when `done` (the hash already in the output
        for this path) equals its hash."""
        t0 = time.perf_counter()
        row = {"path": path, "sha256": "", "bytes": None, "result": None, "prediction": None, "score": None,
               "served": json.dumps(self.served), "worker": self.worker}
        try:
            data = Path(file or path).read_bytes()
        except OSError as exc:
            why = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be read: {exc.strerror or exc}"
            return None if done == "" else self._finish(row, t0, error=f"{printable(path)} {why}")
        row.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        if done is not None and done == row["sha256"]:
            return None
        try:
            result, prediction, score = self._infer(data, f"image {printable(path)}")
        except DataError as exc:
            return self._finish(row, t0, error=exc.one_line())
        except PipelineError as exc:
            return self._finish(row, t0, error=f"engine failed on {printable(path)}: {exc.one_line()}")
        except Exception as exc:
            why = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            return self._finish(row, t0, error=f"engine failed on {printable(path)}: {type(exc).__name__}: {why}")
        row.update(result=json.dumps(result, ensure_ascii=False, default=_plain), prediction=prediction, score=score)
        return self._finish(row, t0)

    def _finish(self, row: dict, t0: float, error: str | None = None) -> dict:
        row.update(error=error, ms=round((time.perf_counter() - t0) * 1e3, 3), read_at=time.time(), rss_mb=rss_mb())
        return row

    def _infer(self, data: bytes, what: str) -> tuple[object, str | None, float | None]:
        """(result, prediction, score) of one image's bytes, as `serve` answers them."""
        if self.cfg.get("task") == "ocr_system":
            from pipeline.data.imagedecode import decode_page
            from pipeline.ocr.system import read_page

            page = decode_page(data, mode="BGR", max_pixels=self.max_pixels, what=what)
            lines, _ = read_page(page, self.det, self.rec, self.spec, self.cls, 0)
            scores = [float(ln["score"]) for ln in lines]
            return ({"width": int(page.shape[1]), "height": int(page.shape[0]), "lines": lines},
                    "\n".join(str(ln["text"]) for ln in lines), float(np.mean(scores)) if scores else None)
        x, sizes = self._model_input(data, what)
        out = self.engines["model"].run(x)
        post = self.cfg["postprocess"]
        preds = self.task.decode(out, post, sizes) if sizes else self.task.decode(out, post)
        first = preds[0] if preds else None
        if isinstance(first, str):                 # recognition: the line's text
            return preds, first, None
        top = first if isinstance(first, dict) else {}
        label = top.get("label")                   # classification; detection answers boxes and scores only
        return preds, None if label is None else str(label), _score(top)

    def _model_input(self, data: bytes, what: str) -> tuple[np.ndarray, list | None]:
        """/predict's input for one image (pipeline/serving/predict._decode_input without HTTP)."""
        from pipeline.data.preprocess import decode_image_bytes, to_tensor

        if self.cfg["task"] == "detection":
            from pipeline.ocr.pages import decode_page, detection_input

            page = decode_page(data, self.max_pixels)
            return detection_input(page, self.cfg["preprocess"]), [page.shape[:2]]
        img = decode_image_bytes(data, self.cfg["preprocess"], max_pixels=self.max_pixels, what=what)
        return to_tensor(img[None], self.cfg["preprocess"]), None

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        self.scratch.cleanup()


def _score(top: dict) -> float | None:
    s = top.get("score", top.get("confidence"))
    return float(s) if isinstance(s, (int, float, np.floating)) else None


def _plain(value):
    """JSON for numpy scalars and arrays in results."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def read_all(reader: BundleReader, paths: list[str], done: dict[str, str] | None = None) -> list[dict]:
    """The single-process reader: every path in order, in this process (rows skipped when done)."""
    done = done or {}
    rows = (reader.read(p, done=done.get(p)) for p in paths)
    return [r for r in rows if r is not None]

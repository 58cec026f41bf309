"""The systems and scoring `make bench-ocr` (scripts/bench_ocr.py) and `make bench-ocr-all`
(scripts/bench_ocr_all.py) share: the real pages, GT.tsv's known texts, our served system, the RapidOCR peers,
the interleaved timing and the line agreement.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np

from pipeline.core.errors import PipelineError
from pipeline.core.supervise import exit_status


def no_training() -> None:
    """This process reads pages and trains nothing: Paddle's OpenMP team waits PASSIVE (pipeline/core/env.py's rule
    for such processes; OMP_WAIT_POLICY set by the user wins), so an idle team of one system's Paddle engine cannot
    spin on the core the next system is timed on. Measured on the v5 bench (2026-12-07): no change outside one pass's
    noise (ours-v5 5.61 pages/s at the default, 5.62 and 5.63 with PASSIVE; one outlier pass at 6.47)."""
    from pipeline.core import env

    env.settle_wait_policy(trains=False)


def add_passes(ap) -> None:
    """--passes, shared by the OCR benches: every system reads the timed pages N times (one pass of 10 small v5 pages
    moved the same-model ratio by +-12 % from run to run, 2026-12-07)."""
    def integer(text: str) -> int:         # argparse names it in its error: "invalid integer value"
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError("one or more")
        return n

    ap.add_argument("--passes", type=integer, default=PASSES,
                    help=f"timed passes over the pages, every system alike (default {PASSES}); pages/s of the mean "
                         "pass, each pass's figures printed")


def set_threads(n: int | None = None) -> None:
    """OpenCV's pool at the engines' thread count (THREADS): resizing and contour search run in it, inside the timed
    calls."""
    from pipeline.ocr.system import set_opencv_threads

    set_opencv_threads(THREADS if n is None else n)        # 0: every core

IMAGES = ROOT / "tests" / "data" / "real_images"
# GT.tsv's "known text" column as checks (its prose: "first line X", "first 3 lines: a | b | c", "180 / X");
# latin.jpg's assertion in RapidOCR's tests is a prefix (its GT line has a typo), en_rec.jpg's spaces are
# not asserted there either: known texts are compared without spaces. A tuple is one known text with alternatives.
# return_word_debug.jpg's sign reads `3F】` (docs/pir_import.md's crop); RapidOCR's test asserts `3F1`, the v4
# recogniser's misreading of the bracket: `3F` followed by any glyph the bracket is read as counts.
SIGN_3F = ("3F1", "3FI", "3Fl", "3F]", "3F】")
KNOWN = {"black_font_color_transparent.png": ["我是中国人"], "ch_en_num.jpg": ["正品促销", "大桶装更划算", "强力去污符合国标"],
         "en_rec.jpg": ["To facilitate the shot type analysis in videos"], "issue_170.png": ["TEST"],
         "latin.jpg": ["Alphabetum in mundo hodie"], "return_word_debug.jpg": [SIGN_3F],
         "test_without_det.jpg": ["在中国作家协会第三届儿童文学"], "text_cls.jpg": ["怪我咯"], "text_rec.jpg": ["韩国小馆"]}
# README.md of the images: crops meant for recognition alone (RapidOCR's tests read them with use_det=False)
CROPS = ("en_rec.jpg", "test_without_det.jpg", "text_cls.jpg", "text_rec.jpg")
# The one warm-up page every system reads before timing (ours, RapidOCR 1.4.4, each RapidOCR 3.10 instance): real, with
# text (one word: detection, the classifier and recognition all run), never timed; its reading is still scored
WARMUP = "issue_170.png"
PASSES = 3              # timed passes over the pages (add_passes)
THREADS = 1             # every engine's threads, and OpenCV's (its own pool would otherwise use every core)
RAPID3_MODES = {"onnxruntime": "ONNX Runtime (as shipped)", "openvino-f32": "OpenVINO, f32 forced",
                "openvino": "OpenVINO as shipped"}


def pages(folder: Path) -> dict[str, np.ndarray]:
    from pipeline.ocr.pages import decode_page

    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not files:
        raise PipelineError(f"no .png/.jpg images in {folder}")
    return {p.name: decode_page(p.read_bytes()) for p in files}


def warmup_name(images: dict) -> str:
    """The warm-up page: WARMUP when the folder has it, else its first image; at least one other page is timed."""
    if len(images) < 2:
        raise PipelineError(f"{len(images)} image(s): one is the warm-up page (never timed), at least one more is "
                            "needed to time", hint="give --images a folder with two or more .png/.jpg pages")
    return WARMUP if WARMUP in images else next(iter(images))


class Ours:
    """The served system: read_pages on the configured engines, and the crop flow (cls + rec) for crops."""

    def __init__(self, args, threads: int = 1):
        from pipeline.tasks import ppocr_system

        if args.bundle:
            from pipeline.bundle.system import served_system
            if not Path(args.bundle).is_dir():
                raise PipelineError(f"no system bundle at {args.bundle}", hint="make real-ocr (or real-ocr-v5/-v6)")
            self.det, self.rec, self.cls, self.spec = served_system(Path(args.bundle), threads=threads,
                                                                    kind=args.engine)
            self._pin(Path(args.bundle), args.pin or [], threads)
        else:
            from pipeline.core.config import load_config
            from pipeline.ocr.ppocr_models import fetch

            sys_cfg = load_config([ROOT / args.config])
            det_cfg = load_config([ROOT / sys_cfg.system.detection])
            models = fetch()
            self.spec = ppocr_system.spec_from_configs(det_cfg, sys_cfg, models["keys"])
            self.det, self.rec, self.cls = ppocr_system.engines(models, args.engine or sys_cfg.system.engine, threads,
                                                                ROOT / ".cache" / "ppocr" / "onnx")
        self.engine = self.det.kind
        self.label = "ours, " + ", ".join(f"{r[:3]} {p['engine']} {p.get('effective_precision', p['precision'])}"
                                          for r, p in self.served().items())

    def _pin(self, bundle: Path, pins: list[str], threads: int = 1) -> None:
        """--pin part="engine precision": that part on a row chosen by hand (as system.pin would serve it)."""
        from pipeline.bundle.format import load_infer_config
        from pipeline.bundle.system import recheck_served, served_engine, sub_bundle

        attr = {"detection": "det", "recognition": "rec", "classifier": "cls"}
        for pin in pins:
            role, _, row = pin.partition("=")
            if role not in attr or len(row.split()) != 2:
                raise PipelineError(f"--pin {pin!r}: expected part=\"engine precision\", part one of {', '.join(attr)}")
            engine, prec = row.split()
            part = {"by": "pinned (--pin)", "engine": engine, "precision": prec, "why": f"--pin {pin}"}
            getattr(self, attr[role]).close()
            sub = sub_bundle(bundle, load_infer_config(bundle), role)
            eng = served_engine(sub, threads, "auto", part, role, self.spec.flow)
            setattr(self, attr[role], recheck_served(eng, sub, self.spec.flow, threads) if role == "recognition" else eng)

    def page(self, img: np.ndarray) -> tuple[list[tuple[list, str]], float]:
        from pipeline.ocr.system import read_pages

        t0 = time.perf_counter()
        lines = read_pages([img], self.det, self.rec, self.spec, cls=self.cls)[0]
        return [(ln["box"], ln["text"]) for ln in lines], time.perf_counter() - t0

    def served(self) -> dict:
        """Per part: the engine and precision that run, and why (the bundle's choice as this CPU runs it)."""
        parts = {"detection": self.det, "recognition": self.rec, "classifier": self.cls}
        return {r: getattr(e, "serving", None) or {"engine": e.kind, "precision": e.effective_precision,
                                                   "effective_precision": e.effective_precision, "why": "--engine"}
                for r, e in parts.items() if e is not None}

    def crop(self, img: np.ndarray) -> list[str]:
        from pipeline.ocr.system import read_crops

        return read_crops([img], self.rec, self.spec, self.cls)

    def close(self) -> None:
        for e in (self.det, self.rec, self.cls):
            if e is not None:
                e.close()


class Rapid:
    """RapidOCR 1.4.4 (ONNX Runtime, fp32): the fp32 reference whose lines every system is compared with."""

    label = "RapidOCR 1.4.4, ONNX Runtime fp32"

    def __init__(self):
        from rapidocr_onnxruntime import RapidOCR

        self.ocr = RapidOCR(intra_op_num_threads=THREADS, inter_op_num_threads=1)

    def page(self, img: np.ndarray) -> tuple[list, float]:
        t0 = time.perf_counter()
        res, _ = self.ocr(img)
        return [(r[0], r[1]) for r in (res or [])], time.perf_counter() - t0

    def crop(self, img: np.ndarray) -> list[str]:
        res, _ = self.ocr(img, use_det=False, use_cls=True, use_rec=True)
        return [r[0] for r in (res or [])]


def rapid_models() -> dict:
    """RapidOCR 1.4.4's own PP-OCRv4 det, mobile cls and v4 rec ONNX files: the models both RapidOCRs read."""
    import rapidocr_onnxruntime

    m = Path(rapidocr_onnxruntime.__file__).parent / "models"
    return {"det": m / "ch_PP-OCRv4_det_infer.onnx", "cls": m / "ch_ppocr_mobile_v2.0_cls_infer.onnx",
            "rec": m / "ch_PP-OCRv4_rec_infer.onnx", "keys": ROOT / ".cache" / "ppocr" / "ppocr_keys_v1.txt"}


# RapidOCR 3.10's OpenVINO reads bf16 from the CPU's flags while oneDNN is held below it: no kernel for a bf16 pooling
# (`Supported primitive descriptors list is empty`, seen on a Xeon with AMX under ONEDNN_MAX_CPU_ISA=AVX2)
_ISA_HINT = ("ONEDNN_MAX_CPU_ISA is set: where it holds oneDNN below this CPU's bf16, RapidOCR 3.10's OpenVINO fails; "
             "unset it for the peers")


class Rapid3Worker:
    """RapidOCR 3.10 in its own venv (scripts/rapidocr3_worker.py): pages go over a pipe, the worker times the OCR
    call alone, so the pipe is not in the figure. models: {det, cls, rec, keys} files, or None for RapidOCR 3.10's
    own (as shipped: PP-OCRv6 small det/rec, mobile v2 cls). det: {limit_type, limit_side_len} of the detector's
    resize, None: RapidOCR's own. warmup: the warm-up page each instance reads once as it loads its models (its
    only warm-up, as every other system's); the readings are in info["warmup"]. threads: each engine's and
    OpenCV's; 0: RapidOCR's own settings (every core)."""

    def __init__(self, python: str, modes: tuple[str, ...], models: dict | None = None, det: dict | None = None,
                 warmup: np.ndarray | None = None, threads: int = THREADS):
        import pickle
        import subprocess

        if not Path(python).is_file():
            raise PipelineError(f"no RapidOCR 3.10 venv at {python}", hint="make rapidocr3-venv")
        files = [a for k in ("det", "cls", "rec", "keys") for a in (f"--{k}", str(models[k]))] if models else []
        resize = [a for k in ("limit_type", "limit_side_len") for a in (f"--{k.replace('_', '-')}", str(det[k]))] \
            if det else []
        self._pickle = pickle
        self.proc = subprocess.Popen([python, str(ROOT / "scripts" / "rapidocr3_worker.py"), "--modes",
                                      ",".join(modes), "--threads", str(threads), *files, *resize],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._send(warmup if warmup is not None else np.full((64, 256, 3), 255, np.uint8))
        status, self.info = self._read()
        if status != "ready":
            raise PipelineError(f"RapidOCR 3.10 worker did not start: {self.info}")

    def _send(self, frame) -> None:
        try:
            self._pickle.dump(frame, self.proc.stdin)
            self.proc.stdin.flush()
        except BrokenPipeError:         # it died before reading the frame (one larger than the pipe's buffer)
            raise self._stopped() from None

    def _read(self):
        try:
            return self._pickle.load(self.proc.stdout)
        except EOFError:
            raise self._stopped() from None

    def _stopped(self) -> PipelineError:
        return PipelineError(f"RapidOCR 3.10 worker stopped ({exit_status(self.proc.wait())}); its messages, if any, "
                             "are above", hint=_ISA_HINT if os.environ.get("ONEDNN_MAX_CPU_ISA") else None)

    def call(self, what: str, mode: str, img: np.ndarray):
        self._send((what, mode, img))
        status, res = self._read()
        if status != "ok":
            raise PipelineError(f"RapidOCR 3.10 ({mode}) failed on a {what}: {res}")
        return res

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


class Rapid3:
    """One RapidOCR 3.10 instance of the worker (a mode of RAPID3_MODES); its label says what each part ran."""

    def __init__(self, worker: Rapid3Worker, mode: str):
        self.worker, self.mode = worker, mode
        ran = "/".join(sorted({p for part in worker.info["precision"][mode].values() for p in part}))
        self.label = f"RapidOCR 3.10, {RAPID3_MODES[mode]} (runs {ran})"

    def page(self, img: np.ndarray) -> tuple[list, float]:
        return self.worker.call("page", self.mode, img)

    def warm(self, img: np.ndarray) -> list:
        """Read once as the instance loaded its models (the worker's warm-up): not read again."""
        return self.worker.info["warmup"][self.mode]

    def crop(self, img: np.ndarray) -> list[str]:
        return self.worker.call("crop", self.mode, img)[0]


class OursLanes:
    """Ours at every core as `/ocr` serves it with serve.ocr_lanes: `lanes` engine sets (pipeline/ocr/lanes.PageLanes),
    each at `threads` (default: every core, serve's default: a page read while the other lane idles, e.g. the last of
    a batch, gets both cores), pages read side by side; each lane's lines are exactly read_page's on its engines."""

    def __init__(self, args, lanes: int, threads: int = 0):
        from pipeline.core.env import cpu_count
        from pipeline.ocr.lanes import PageLanes

        threads = self.threads = threads or cpu_count()

        def load():
            o = Ours(args, threads)
            self.label, self._served = o.label, o.served()
            return o.det, o.rec, o.cls, o.spec

        self.lanes = PageLanes(load, lanes)
        self.label = f"{self.label}; {lanes} lanes x {threads} threads"

    def warm(self, img: np.ndarray) -> list:
        """Every lane reads the warm-up page once (each engine set prepares its own kernels)."""
        lines = [self.lanes.read_one(img)[0] for _ in range(self.lanes.lanes)]
        return [(ln["box"], ln["text"]) for ln in lines[0]]

    def pages(self, imgs: list[np.ndarray]) -> tuple[list[list], float]:
        t0 = time.perf_counter()
        got = self.lanes.read(imgs)
        return [[(ln["box"], ln["text"]) for ln in lines] for lines, _ in got], time.perf_counter() - t0

    def served(self) -> dict:
        return self._served

    def close(self) -> None:
        self.lanes.close()


def pages_of(system, imgs: list[np.ndarray]) -> tuple[list[list], float]:
    """A block of pages: the system's own `pages` (lanes: side by side), else one after another."""
    if hasattr(system, "pages"):
        return system.pages(imgs)
    got = [system.page(img) for img in imgs]
    return [g[0] for g in got], sum(g[1] for g in got)


def interleaved_blocks(systems: dict, pages: dict, block: int, passes: int = 1,
                       spread: dict | None = None) -> tuple[dict, dict, list]:
    """After the one warm-up page (read once by every system, scored, never timed), the timed pages in blocks of
    `block`, each system reading a whole block (lanes read it side by side), the systems in a rotating order per
    block, `passes` times over; the results as interleaved() returns them (seconds: the mean of a pass; lines: the
    first pass's). `spread`, if given, receives {system: [seconds of each pass]}."""
    set_threads()           # OpenCV at the engines' one thread (our lanes each one thread; RapidOCR 3.10 has its own process)
    warm = warmup_name(pages)
    names = list(systems)
    got, t = {n: {} for n in names}, {n: [0.0] * max(1, passes) for n in names}
    for n, s in systems.items():
        got[n][warm] = s.warm(pages[warm]) if hasattr(s, "warm") else s.page(pages[warm])[0]
    timed = [i for i in pages if i != warm]
    chunks = [timed[k:k + block] for k in range(0, len(timed), block)]
    for p in range(max(1, passes)):
        for k, chunk in enumerate(chunks):
            i = p * len(chunks) + k
            for n in names[i % len(names):] + names[:i % len(names)]:
                lines, dt = pages_of(systems[n], [pages[c] for c in chunk])
                if p == 0:
                    got[n].update(zip(chunk, lines))
                t[n][p] += dt
    if spread is not None:
        spread.update(t)
    return {n: {i: got[n][i] for i in pages} for n in names}, {n: sum(v) / len(v) for n, v in t.items()}, timed


def interleaved(systems: dict, pages: dict, passes: int = 1, spread: dict | None = None) -> tuple[dict, dict, list]:
    """Every system reads the one warm-up page (warmup_name) once, then the other pages page by page in a rotating
    order (each goes first as often), `passes` times over, so a neighbour's load on a shared machine hits all alike:
    {system: {image: lines}} (the warm-up page's reading included: it is scored, not timed), {system: seconds of the
    timed pages, the mean of a pass}, the timed pages' names. interleaved_blocks with blocks of one page."""
    return interleaved_blocks(systems, pages, 1, passes, spread)


def agreement(a: list, b: list) -> int:
    """Lines of `a` identical to a line of `b` whose box it matches at IoU >= 0.5 (one to one)."""
    from pipeline.ocr.det_metric import match

    q = lambda lines: np.array([bx for bx, _ in lines], np.float32).reshape(-1, 4, 2)
    return sum(a[i][1] == b[j][1] for i, j in match(q(a), q(b), 0.5))


def known(name: str, lines: list[str]) -> bool:
    """Every known text of the image read (spaces ignored), in one line or across the joined lines; a tuple is read
    when any of its alternatives is."""
    flat = lambda s: "".join(s.split())
    texts = [flat(t) for t in lines + ["".join(lines)]]
    alternatives = lambda k: (k,) if isinstance(k, str) else k
    return all(any(flat(a) in t for a in alternatives(k) for t in texts) for k in KNOWN.get(name, []))


def texts_of(system, name: str, img: np.ndarray, lines: list) -> list[str]:
    """What a system's reading of one image is scored on: the crop images (CROPS) read with recognition alone, every
    other image's page lines."""
    return system.crop(img) if name in CROPS else [t for _, t in lines]


def cpu() -> dict:
    """The CPU facts the targets depend on (AVX-512, bf16, AMX), as this run saw them."""
    from pipeline.core import capabilities as caps

    flags = caps.cpu_flags()
    return {"avx512": "avx512f" in flags, "bf16": caps.has_bf16(), "amx": "amx_bf16" in flags}


def finish(json_path: str | None, payload: dict, ok: bool) -> int:
    """A bench script's end: the results as JSON when asked, exit 0 when every target held, else 1."""
    if json_path:
        import json
        Path(json_path).write_text(json.dumps(payload, indent=1, ensure_ascii=False, default=str))
    return 0 if ok else 1

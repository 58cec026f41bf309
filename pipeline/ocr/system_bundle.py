"""The OCR system bundle: two verified model bundles plus the system's own config, samples and gates.

    <name>/
      detection/   the detection run's bundle, unchanged (own manifest, infer_config with DB parameters)
      recognition/ the recognition run's bundle, unchanged (charset, CTC decoding)
      infer_config.yaml   task: ocr_system, sub-bundle folders, field keys, verify tolerance
      samples/page_NNN.png, samples/expected.json   sample pages and the fp32 chain's lines
      MODEL_CARD.md, manifest.json   (sha256 of every file, sub-bundles included; every gate)
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..bundle import load_infer_config, verify_hashes
from ..imagedecode import decode_file
from ..errors import IntegrityError, MissingArtifact
from ..gates import Check
from .system import SystemSpec, read_pages
from .system_metrics import agreement

VERIFY_MAX_DISAGREEMENT = 0.05     # share of sample lines an engine may read differently from the bundle's record


def sub_bundle(folder: Path, cfg: dict, role: str) -> Path:
    """The model bundle folder a system bundle names for `role`: a plain sub-folder, nothing else."""
    name = cfg.get(role)
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise IntegrityError(f"{folder}/infer_config.yaml: {role} must name a sub-folder of the bundle, got {name!r}",
                             hint="rebuild the bundle with `make deploy CONFIG=configs/ocr_system.yaml`")
    if not (Path(folder) / name / "infer_config.yaml").is_file():
        raise IntegrityError(f"{folder}/{name} is not a model bundle (no infer_config.yaml)")
    return Path(folder) / name


def spec_of(folder: Path) -> tuple[SystemSpec, dict, dict]:
    folder = Path(folder)
    cfg = load_infer_config(folder)
    det = load_infer_config(sub_bundle(folder, cfg, "detection"))
    rec = load_infer_config(sub_bundle(folder, cfg, "recognition"))
    return SystemSpec.from_infer_configs(det, rec), det, rec


def paddle_engine(prefix: Path, precision: str, threads: int):
    from ..engines.paddle_infer import InferenceEngine

    return InferenceEngine(prefix, precision, threads=threads)


def lite_engine(nb: Path, input_shape: list, timeout: float):
    from ..engines.lite import LiteEngine

    return LiteEngine(nb, input_shape, timeout=timeout)


LITE_BATCH = 4096      # one Lite subprocess per model per call, not one per 16 pages


def model_prefix(sub: Path, precision: str) -> Path | None:
    """Paddle Inference model of one precision inside a model bundle (None when it holds none)."""
    p = sub / "server" / precision / ("inference" if precision == "fp32" else "model")
    return p if p.with_suffix(".pdmodel").is_file() else None


def write_samples(folder: Path, pages: list[np.ndarray], lines: list[list[dict]]) -> list[str]:
    from ..artifacts import atomic_write_text
    from ..bundle import write_sample_pngs

    names = write_sample_pngs(folder, pages, "samples/page_{:03d}.png")
    atomic_write_text(folder / "samples" / "expected.json",
                      json.dumps({"pages": [{"file": n, "lines": ln} for n, ln in zip(names, lines)]}, indent=1))
    return names


def _sample_pages(folder: Path) -> tuple[list[np.ndarray], list[list[dict]]]:
    expected = json.loads((folder / "samples" / "expected.json").read_text())["pages"]
    if not expected:
        raise MissingArtifact(f"{folder}/samples/expected.json lists no sample pages")
    pages = []
    for item in expected:
        pages.append(decode_file(folder / item["file"]))
    return pages, [item["lines"] for item in expected]


def verify_system(folder: Path, timeout: float = 120, threads: int = 0) -> dict:
    """Hashes of everything, each model bundle's own sample checks, then the system on its sample pages."""
    from ..env import cpu_count
    from ..verify import verify_bundle

    folder = Path(folder)
    manifest = verify_hashes(folder)
    cfg = load_infer_config(folder)
    checks = [asdict(Check("sha256 of every file", 0.0, 0.0))]
    for role in ("detection", "recognition"):
        sub = verify_bundle(sub_bundle(folder, cfg, role), timeout=timeout, threads=threads)
        checks += [{**c, "name": f"{role}: {c['name']}"} for c in sub["checks"]]
    spec, det_cfg, rec_cfg = spec_of(folder)
    pages, expected = _sample_pages(folder)
    threads = threads or cpu_count()
    limit = float(cfg.get("verify", {}).get("max_disagreement", VERIFY_MAX_DISAGREEMENT))
    det_b, rec_b = sub_bundle(folder, cfg, "detection"), sub_bundle(folder, cfg, "recognition")
    runs = {"server fp32": (paddle_engine(det_b / "server/fp32/inference", "fp32", threads),
                            paddle_engine(rec_b / "server/fp32/inference", "fp32", threads))}
    det_nb, rec_nb = det_b / "mobile/x86_fp32.nb", rec_b / "mobile/x86_fp32.nb"
    if det_nb.is_file() and rec_nb.is_file():
        runs["lite x86 fp32"] = (lite_engine(det_nb, det_cfg["input"]["shape"], timeout),
                                 lite_engine(rec_nb, rec_cfg["input"]["shape"], timeout))
    for name, (det, rec) in runs.items():
        got = read_pages(pages, det, rec, spec, batch=LITE_BATCH if name.startswith("lite") else 16)
        miss = 1.0 - agreement(got, expected)
        checks.append(asdict(Check(f"system {name} lines differing on sample pages", miss, limit, "<=",
                                   miss <= limit)))
    return {"bundle": manifest.get("name"), "files": len(manifest["files"]), "checks": checks,
            "ok": all(c["passed"] for c in checks)}

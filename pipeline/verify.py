"""`python -m pipeline verify BUNDLE`: hashes first, then real runs on the bundled samples.

Parameter files are parsed by Paddle, so nothing is loaded before every hash matched.
"""
from __future__ import annotations

import zipfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from . import tempdirs
from .bundle import MAX_ARCHIVE_BYTES, MAX_MEMBERS, inside_bundle, load_infer_config, open_bundle, verify_hashes
from .errors import DataError, IntegrityError
from .gates import Check, parity_checks
from .preprocess import decode_image_bytes, to_tensor

# bundles written before bundle.sample_atol/rtol existed carry no sample_check: their tolerance was this
LEGACY_SAMPLE_CHECK = {"atol": 1e-4, "rtol": 0.0}


def _samples(folder: Path, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(folder / "samples" / "expected.npz", allow_pickle=False) as z:
            files, expected = [str(f) for f in z["files"]], z["outputs"]
        for f in files:                     # the sample list is data too: it must not point outside
            inside_bundle(folder, f, "samples/expected.npz")
        # the same decode → fit → normalise path `serve` uses for uploaded images
        images = np.stack([decode_image_bytes((folder / f).read_bytes(), cfg["preprocess"]) for f in files])
        return to_tensor(images, cfg["preprocess"]), expected
    except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile, DataError) as exc:
        msg = exc.one_line() if isinstance(exc, DataError) else f"{type(exc).__name__}: {exc}"
        raise IntegrityError(f"bundle samples are unreadable ({msg})", hint="rebuild the bundle with `make deploy`") from None


def _checks(engine: str, out: np.ndarray, expected: np.ndarray, cfg: dict) -> list[dict]:
    """The gates' own parity checks (NaN/Inf, shape, max abs diff), named for the engine, with the bundle's
    sample tolerance, in the task's comparison space (probabilities as log-probabilities); the limit-less
    max_rel_diff is left out of a pass/fail report."""
    from .tasks import get_task

    tol = cfg.get("sample_check") or LEGACY_SAMPLE_CHECK
    space = getattr(get_task(cfg["task"], cfg.get("postprocess")), "comparable", None) or (lambda a: a)
    if np.isfinite(out).all():
        out, expected = space(out), space(expected)
    return [{**asdict(c), "name": f"{engine} {c.name} on samples"}
            for c in parity_checks(out, expected, tol["atol"], tol.get("rtol", 0.0), key="bundle.sample")
            if c.limit is not None]


def check_signature(folder: Path, key: str | Path | None) -> str:
    """With a key: the signature must hold (raises otherwise). Without: say plainly what was not checked."""
    from . import signing

    if key:
        signing.verify(folder, key)
        return f"signature verified with {Path(key).name} ({signing.FORMAT})"
    if signing.is_signed(folder):
        return "signed, but the signature was NOT checked (no key: pass --key PUBLIC.pem or set verify.trust_key)"
    return "unsigned: authenticity NOT checked (sign with `python -m pipeline sign BUNDLE --key PRIVATE.pem`)"


def _engines(folder: Path, cfg: dict, timeout: float, threads: int) -> dict:
    """Every runnable model in the bundle, behind the one engine interface: name -> Engine factory."""
    from .engines import lite
    from .engines.paddle_infer import InferenceEngine
    from .env import cpu_count

    found = {"server fp32": lambda: InferenceEngine(folder / "server" / "fp32" / "inference", "fp32",
                                                    threads=threads or cpu_count())}
    nb = folder / "mobile" / "x86_fp32.nb"
    if nb.is_file() and lite.fp32_nb_runs_correctly_here("x86"):
        found["lite x86 fp32"] = lambda: lite.LiteEngine(nb, cfg["input"]["shape"], timeout=timeout)
    onnx = folder / "server" / "onnx" / "model.onnx"
    if onnx.is_file():
        from .engines.ort import OrtEngine

        found["onnxruntime fp32"] = lambda: OrtEngine(onnx, threads=threads or 1)
    return found


def verify_bundle(path: Path, timeout: float = 120, threads: int = 0, key: str | Path | None = None,
                  max_bytes: int = MAX_ARCHIVE_BYTES, max_members: int = MAX_MEMBERS) -> dict:
    with tempdirs.directory("bundle-verify") as scratch:
        folder = open_bundle(Path(path), Path(scratch), max_bytes, max_members)
        signature = check_signature(folder, key)     # before the manifest or any model file is read
        manifest = verify_hashes(folder)
        cfg = load_infer_config(folder)
        if cfg.get("task") == "ocr_system":      # both model bundles, then the system on its sample pages
            from .ocr.system_bundle import verify_system
            return {**verify_system(folder, timeout=timeout, threads=threads), "signature": signature}
        x, expected = _samples(folder, cfg)
        checks = [asdict(Check("sha256 of every file", 0.0, 0.0))]       # verify_hashes raised otherwise
        for name, make in _engines(folder, cfg, timeout, threads).items():
            checks += _checks(name, make().run(x), expected, cfg)
        failed = [c for c in checks if not c["passed"]]
        return {"bundle": manifest.get("name"), "files": len(manifest["files"]), "checks": checks,
                "ok": not failed, "signature": signature, "unverified": manifest.get("unverified", {})}


def verify_or_raise(path: Path, timeout: float = 120, **kw) -> dict:
    report = verify_bundle(path, timeout, **kw)
    bad = [c for c in report["checks"] if not c["passed"]]
    if bad:
        c = bad[0]
        raise IntegrityError(f"verify: {c['name']} = {c['observed']:.3g} > limit {c['limit']:g}",
                             hint="the bundle's models no longer reproduce their sample outputs")
    return report

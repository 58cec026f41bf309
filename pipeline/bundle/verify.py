"""`python -m pipeline verify BUNDLE`: open (folder or .tar.gz), signature, then the verifier of its kind.

A model bundle is verified by pipeline/bundle/verify_model.py (hashes, then real runs on the bundled samples); an OCR
system bundle by pipeline/bundle/system.py (both parts, then the system on its sample pages). This module
sits above both and only dispatches, so neither needs to import the other.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core import tempdirs
from pipeline.bundle.format import MAX_ARCHIVE_BYTES, MAX_MEMBERS, load_infer_config, open_bundle, verify_hashes
from pipeline.core.errors import IntegrityError
from pipeline.bundle.system import verify_system
from pipeline.bundle.verify_model import verify_model_folder

# bundle kind (infer_config.yaml `task`) -> verifier(folder, timeout=, threads=); model tasks use the default
VERIFIERS = {"ocr_system": verify_system}


def check_signature(folder: Path, key: str | Path | None) -> str:
    """With a key: the signature must hold (raises otherwise). Without: say plainly what was not checked."""
    from pipeline.bundle import signing

    if key:
        signing.verify(folder, key)
        return f"signature verified with {Path(key).name} ({signing.FORMAT})"
    if signing.is_signed(folder):
        return "signed, but the signature was NOT checked (no key: pass --key PUBLIC.pem or set verify.trust_key)"
    return "unsigned: authenticity NOT checked (sign with `python -m pipeline sign BUNDLE --key PRIVATE.pem`)"


def verify_bundle(path: Path, timeout: float = 120, threads: int = 0, key: str | Path | None = None,
                  max_bytes: int = MAX_ARCHIVE_BYTES, max_members: int = MAX_MEMBERS) -> dict:
    with tempdirs.directory("bundle-verify") as scratch:
        folder = open_bundle(Path(path), Path(scratch), max_bytes, max_members)
        signature = check_signature(folder, key)     # before the manifest or any model file is read
        manifest = verify_hashes(folder)             # then every hash, before any file is parsed
        kind = load_infer_config(folder).get("task")
        if kind in VERIFIERS:
            return {**VERIFIERS[kind](folder, timeout=timeout, threads=threads), "signature": signature}
        return {**verify_model_folder(folder, timeout=timeout, threads=threads, manifest=manifest),
                "signature": signature}


def verify_or_raise(path: Path, timeout: float = 120, **kw) -> dict:
    report = verify_bundle(path, timeout, **kw)
    bad = [c for c in report["checks"] if not c["passed"]]
    if bad:
        c = bad[0]
        raise IntegrityError(f"verify: {c['name']} = {c['observed']:.3g} > limit {c['limit']:g}",
                             hint="the bundle's models no longer reproduce their sample outputs")
    return report

"""The bundle format: what a deployable bundle holds and how to check it without the training config.

    <name>/
      server/fp32/inference.pdmodel|.pdiparams   Paddle Inference FP32 (the reference)
      server/int8/..., server/fp16/...           when made (fp16 only from a GPU build)
      mobile/<target>_<precision>.nb             Paddle Lite (arm fp32/int8, x86 fp32)
      infer_config.yaml                          input spec, preprocessing, labels/charset, post-processing
      samples/NNN.png + samples/expected.npz     sample inputs and the FP32 model's outputs for them
      MODEL_CARD.md, report.html
      manifest.json                              sha256/size of every file, versions, gates (written last)
"""
from __future__ import annotations

import os
import shutil
import stat
import tarfile
import tempfile
from pathlib import Path

import yaml

from .artifacts import MANIFEST, read_json, sha256_file
from .errors import IntegrityError, MissingArtifact

FORMAT_VERSION = 1


def verify_hashes(folder: Path) -> dict:
    """Check every file listed in manifest.json (and that nothing unlisted hides model code). Returns manifest."""
    folder = Path(folder)
    man_path = folder / MANIFEST
    if not man_path.is_file():
        raise MissingArtifact(f"{folder} is not a bundle: {MANIFEST} is missing")
    try:
        manifest = read_json(man_path)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise IntegrityError(f"{man_path} is not a valid bundle manifest") from None
    for rel, meta in files.items():
        p = folder / rel
        if not p.is_file():
            raise IntegrityError(f"bundle file missing: {rel}", hint="the bundle is incomplete; rebuild or re-copy it")
        if p.stat().st_size != meta["bytes"] or sha256_file(p) != meta["sha256"]:
            raise IntegrityError(f"bundle file modified: {rel} (sha256 mismatch)",
                                 hint="the bundle was tampered with or corrupted in transit")
    listed = set(files) | {MANIFEST}
    extra = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    unlisted = sorted(set(extra) - listed)
    if unlisted:
        raise IntegrityError(f"bundle holds files not in its manifest: {', '.join(unlisted[:5])}")
    return manifest


def load_infer_config(folder: Path) -> dict:
    return yaml.safe_load((Path(folder) / "infer_config.yaml").read_text())


def safe_extract(archive: Path, dest: Path) -> Path:
    """Extract a .tar.gz refusing absolute paths, '..', links and device files; returns the bundle root."""
    archive, dest = Path(archive), Path(dest)
    try:
        tf = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError) as exc:
        raise IntegrityError(f"{archive} is not a readable tar archive ({exc})") from None
    with tf:
        members = tf.getmembers()
        for m in members:
            name = m.name
            parts = Path(name).parts
            if name.startswith(("/", "\\")) or os.path.isabs(name) or ".." in parts:
                raise IntegrityError(f"unsafe archive member '{name}' in {archive}: path escapes the bundle")
            if m.issym() or m.islnk():
                raise IntegrityError(f"unsafe archive member '{name}' in {archive}: links are not allowed")
            if not (m.isfile() or m.isdir()):
                raise IntegrityError(f"unsafe archive member '{name}' in {archive}: device/special file")
        dest.mkdir(parents=True, exist_ok=True)
        for m in members:
            target = dest / m.name
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tf.extractfile(m)
            with open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            os.chmod(target, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    roots = {Path(m.name).parts[0] for m in members if Path(m.name).parts}
    if len(roots) == 1 and (dest / next(iter(roots))).is_dir():
        return dest / next(iter(roots))
    return dest


def write_archive(folder: Path, archive: Path) -> None:
    """tar.gz of folder under its own name; regular files and dirs only, written atomically."""
    fd, tmp = tempfile.mkstemp(dir=archive.parent, prefix=f".{archive.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz") as tf:
            tf.add(folder, arcname=folder.name, recursive=True)
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_bundle(path: Path, scratch: Path) -> Path:
    """A bundle folder, or a .tar.gz extracted safely into scratch."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.is_file():
        return safe_extract(path, scratch)
    raise MissingArtifact(f"bundle not found: {path}", hint="pass a bundle folder or .tar.gz (see bundles/)")

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

import json
import os
import shutil
import stat
import tarfile
import tempfile
import zlib
from pathlib import Path

import yaml

from pipeline.core.artifacts import ordinary_mode, sha256_file
from pipeline.bundle.layout import INFER_CONFIG, MANIFEST
from pipeline.core.errors import ConfigError, IntegrityError, MissingArtifact

FORMAT_VERSION = 1
PUBLISH_LOCK = ".publish.lock"      # in bundle.root: publishing takes it (hidden: never a bundle)



def write_sample_pngs(folder: Path, images, name_format: str) -> list[str]:
    """Each uint8 image as <folder>/<name_format.format(i)> (PNG, atomic) → the names written."""
    from pipeline.core.artifacts import atomic_write_bytes
    from pipeline.data.preprocess import png_bytes

    names = [name_format.format(i) for i in range(len(images))]
    for name, img in zip(names, images):
        atomic_write_bytes(folder / name, png_bytes(img))
    return names

def inside_bundle(folder: Path, rel, where: str) -> Path:
    """folder/rel, refusing any path a manifest could use to reach outside the bundle (absolute, '..',
    a symlink anywhere on the way): verify must never read, hash or load a file it does not ship."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or os.path.isabs(rel) \
            or ".." in Path(rel).parts or "\\" in rel or ":" in Path(rel).parts[0]:
        raise IntegrityError(f"{where} lists '{rel}', a path outside the bundle",
                             hint="bundle paths are relative and stay inside the bundle; rebuild it with `make deploy`")
    p = folder / rel
    cur = folder
    for part in Path(rel).parts:
        cur = cur / part
        if cur.is_symlink():
            raise IntegrityError(f"{where} lists '{rel}', which goes through a symlink ({cur.relative_to(folder)})",
                                 hint="bundles hold regular files only; re-copy it without links")
    return p


def verify_hashes(folder: Path) -> dict:
    """Check every file listed in manifest.json (and that nothing unlisted hides model code). Returns manifest."""
    from pipeline.bundle.signing import SIGNATURE

    folder = Path(folder)
    man_path = folder / MANIFEST
    if man_path.is_symlink() or not man_path.is_file():
        raise MissingArtifact(f"{folder} is not a bundle: {MANIFEST} is missing",
                              hint="pass a folder made by `make deploy` (see bundles/) or its .tar.gz")
    manifest = read_manifest(folder)
    try:
        files = manifest["files"]
        metas = [(rel, int(meta["bytes"]), str(meta["sha256"])) for rel, meta in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise IntegrityError(f"{man_path} is not a valid bundle manifest",
                             hint="it needs a 'files' mapping of path -> {sha256, bytes}; rebuild with `make deploy`") from None
    for rel, _size, _digest in metas:          # every path first: nothing outside is even stat'ed
        inside_bundle(folder, rel, MANIFEST)
    for rel, size, digest in metas:
        p = folder / rel
        if not p.is_file():
            raise IntegrityError(f"bundle file missing: {rel}", hint="the bundle is incomplete; rebuild or re-copy it")
        if p.stat().st_size != size or sha256_file(p) != digest:
            raise IntegrityError(f"bundle file modified: {rel} (sha256 mismatch)",
                                 hint="the bundle was tampered with or corrupted in transit")
    listed = set(files) | {MANIFEST, SIGNATURE}
    links = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_symlink()]
    if links:
        raise IntegrityError(f"bundle holds symlinks: {', '.join(sorted(links)[:5])}",
                             hint="bundles hold regular files only; re-copy it without links")
    extra = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    unlisted = sorted(set(extra) - listed)
    if unlisted:
        raise IntegrityError(f"bundle holds files not in its manifest: {', '.join(unlisted[:5])}",
                             hint="remove them, or rebuild the bundle with `make deploy`")
    return manifest


MAX_META_BYTES = 16 << 20          # manifest.json / infer_config.yaml: a few KB (a 18k-character charset: ~200 KB)
MAX_SIDE = 8192                    # any image size in infer_config (detection.limit_side_len's bound)
MAX_LABELS, MAX_LABEL_CHARS = 100_000, 256


def read_manifest(folder: Path) -> dict:
    """manifest.json as a mapping, within MAX_META_BYTES and without a RecursionError: else one IntegrityError."""
    path = Path(folder) / MANIFEST
    try:
        size = path.stat().st_size
        if size > MAX_META_BYTES:
            raise ValueError(f"{size} bytes, over the limit of {MAX_META_BYTES}")
        doc = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except RecursionError:
        raise IntegrityError(f"{path} is nested too deeply to be a bundle manifest",
                             hint="rebuild the bundle with `make deploy`") from None
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"{path} is not a valid bundle manifest ({str(exc)[:100]})",
                             hint="it needs a 'files' mapping of path -> {sha256, bytes}; rebuild with `make deploy`") \
            from None
    return doc


def load_infer_config(folder: Path) -> dict:
    """infer_config.yaml through the config reader (size, alias and depth limits), then the bounds of the values a
    reader allocates by (image sizes, input shape, labels): one IntegrityError line naming the key."""
    from pipeline.core import safe_yaml

    path = Path(folder) / INFER_CONFIG
    try:
        cfg = safe_yaml.read(path, "bundle file", max_bytes=MAX_META_BYTES)
    except ConfigError as exc:
        raise IntegrityError(exc.message, hint="rebuild the bundle with `make deploy`") from None
    except (OSError, yaml.YAMLError) as exc:
        raise IntegrityError(f"{path} is unreadable ({type(exc).__name__})", hint="rebuild the bundle with `make deploy`") from None
    # an OCR system bundle names its two model bundles instead (pipeline/bundle/system.py)
    required = ("task", "detection", "recognition") if isinstance(cfg, dict) and cfg.get("task") == "ocr_system" \
        else ("task", "input", "preprocess", "postprocess")
    missing = [k for k in required if not isinstance(cfg, dict) or k not in cfg]
    if missing:
        raise IntegrityError(f"{path} lacks {', '.join(missing)}", hint="rebuild the bundle with `make deploy`")
    bad = _out_of_bounds(cfg)
    if bad:
        raise IntegrityError(f"{path}: {bad}", hint="rebuild the bundle with `make deploy`")
    return cfg


def _out_of_bounds(cfg: dict) -> str | None:
    """What a bundle's infer_config may not hold: image sizes past MAX_SIDE (verify allocated 60000x60000 pages),
    an input shape past it, labels that are not a bounded list of short strings."""
    import math

    def side(v) -> bool:
        return v is None or (type(v) is int and 0 < v <= MAX_SIDE)

    pre, inp, post = cfg.get("preprocess"), cfg.get("input"), cfg.get("postprocess")
    if pre is not None and not isinstance(pre, dict) or post is not None and not isinstance(post, dict):
        return "preprocess/postprocess is not a mapping"
    for k in ("height", "width", "limit_side_len"):
        if pre and k in pre and not side(pre[k]):
            return f"preprocess.{k}={str(pre[k])[:40]} is not a size within 1..{MAX_SIDE}"
    for k in ("mean", "std"):
        vals = pre.get(k) if pre else None
        vals = vals if isinstance(vals, list) else [vals] if vals is not None else []
        if len(vals) > 4 or not all(type(v) in (int, float) and math.isfinite(v) for v in vals):
            return f"preprocess.{k} is not one to four finite numbers"
    shape = inp.get("shape") if isinstance(inp, dict) else None
    if shape is not None and (not isinstance(shape, list) or len(shape) > 8
                              or not all(d == -1 or side(d) for d in shape)):
        return f"input.shape {str(shape)[:60]} is not a list of sizes within 1..{MAX_SIDE} (or -1/null: any)"
    for k in ("labels", "charset"):
        v = post.get(k) if post else None
        if v is None:
            continue
        if isinstance(v, str):          # a recognition charset: one string, one character per class
            if len(v) > MAX_LABELS:
                return f"postprocess.{k} holds {len(v)} characters, over the limit of {MAX_LABELS}"
            continue
        if not isinstance(v, list) or len(v) > MAX_LABELS or sum(len(str(x)) for x in v) > 10 * MAX_LABELS or \
                not all(isinstance(x, str) and len(x) <= MAX_LABEL_CHARS for x in v):
            return (f"postprocess.{k} is not a list of at most {MAX_LABELS} strings of at most "
                    f"{MAX_LABEL_CHARS} characters ({10 * MAX_LABELS} in all)")
    return None


MAX_ARCHIVE_BYTES = 512 << 20     # defaults of verify.max_archive_bytes / verify.max_members
MAX_MEMBERS = 10_000


UNSAFE_HINT = "nothing was extracted; bundles made by `make deploy` hold plain files and folders only"


def _check_member(m: tarfile.TarInfo, archive: Path) -> None:
    name = m.name
    parts = Path(name).parts
    if name.startswith(("/", "\\")) or os.path.isabs(name) or ".." in parts:
        raise IntegrityError(f"unsafe archive member '{name}' in {archive}: path escapes the bundle", hint=UNSAFE_HINT)
    if m.issym() or m.islnk():
        raise IntegrityError(f"unsafe archive member '{name}' in {archive}: links are not allowed", hint=UNSAFE_HINT)
    if not (m.isfile() or m.isdir()):
        raise IntegrityError(f"unsafe archive member '{name}' in {archive}: device/special file", hint=UNSAFE_HINT)


def _headers(tf: tarfile.TarFile, archive: Path, max_bytes: int, max_members: int) -> list[tarfile.TarInfo]:
    """Every member header, checked one by one as it is read: an oversized member or a flood of members
    is refused at its header, before its data is decompressed or anything is written."""
    members, total = [], 0
    while True:
        try:
            m = tf.next()
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise IntegrityError(f"{archive} is damaged ({str(exc).splitlines()[0] if str(exc) else exc!r})",
                                 hint="re-copy the .tar.gz or rebuild the bundle") from None
        if m is None:
            return members
        _check_member(m, archive)
        members.append(m)
        total += m.size
        if len(members) > max_members:
            raise IntegrityError(f"{archive} has more than {max_members} members (limit verify.max_members)",
                                 hint="not a bundle made by this pipeline; raise verify.max_members only if you trust it")
        if total > max_bytes:
            raise IntegrityError(f"{archive} unpacks to more than {max_bytes:,} bytes ('{m.name}' alone is "
                                 f"{m.size:,}; limit verify.max_archive_bytes)",
                                 hint="not extracted; raise verify.max_archive_bytes only if you trust the archive")


def safe_extract(archive: Path, dest: Path, max_bytes: int = MAX_ARCHIVE_BYTES, max_members: int = MAX_MEMBERS) -> Path:
    """Extract a .tar.gz refusing absolute paths, '..', links, device files, and archives over the size or
    member-count limit (both read from the headers first); returns the bundle root."""
    archive, dest = Path(archive), Path(dest)
    try:
        tf = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise IntegrityError(f"{archive} is not a readable tar archive ({str(exc).splitlines()[0] if str(exc) else exc!r})",
                             hint="pass a bundle folder or the .tar.gz that `make deploy` wrote") from None
    with tf:
        members = _headers(tf, archive, max_bytes, max_members)
        dest.mkdir(parents=True, exist_ok=True)
        try:
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
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            raise IntegrityError(f"{archive} is damaged ({exc})", hint="re-copy the .tar.gz or rebuild the bundle") from None
    roots = {Path(m.name).parts[0] for m in members if Path(m.name).parts}
    if len(roots) == 1 and (dest / next(iter(roots))).is_dir():
        return dest / next(iter(roots))
    return dest


def write_archive(folder: Path, archive: Path) -> None:
    """tar.gz of folder under its own name; regular files and dirs only, written atomically."""
    fd, tmp = tempfile.mkstemp(dir=archive.parent, prefix=f".{archive.name}.", suffix=".tmp")
    ordinary_mode(fd)
    os.close(fd)
    try:
        # gzip level 6 (gzip's own default), not tarfile's 9: model weights barely compress, and 9 took 60 s for a
        # 333 MB resnet18 bundle (262 MB) where 6 takes 13 s (276 MB)
        with tarfile.open(tmp, "w:gz", compresslevel=6) as tf:
            tf.add(folder, arcname=folder.name, recursive=True)
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_bundle(path: Path, scratch: Path, max_bytes: int = MAX_ARCHIVE_BYTES, max_members: int = MAX_MEMBERS) -> Path:
    """A bundle folder, or a .tar.gz extracted safely into scratch."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.is_file():
        return safe_extract(path, scratch, max_bytes, max_members)
    raise MissingArtifact(f"bundle not found: {path}", hint="pass a bundle folder or .tar.gz (see bundles/)")


def check_name(name: str, what: str = "bundle name") -> str:
    """A bundle's name becomes a folder under bundle.root: one plain path component, never '..' or a path."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", name or "") or len(name) > 200:
        raise ConfigError(f"{what} {name!r} is not a plain name (letters, digits, '.', '_', '-'; not a path, "
                          "not starting with '.')", hint="set bundle.version (and run.name) to a plain name")
    return name


def publish(out_dir: Path, name: str, root: Path, archive: bool) -> None:
    """Copy the verified bundle to bundle.root atomically (temp copy + rename), under bundle.root's publish
    lock. Bundles are never overwritten: one of this name published by another run after this one started is
    refused, not replaced."""
    import fcntl

    check_name(name)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / PUBLISH_LOCK, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # two runs publishing at once: one after the other
        for final in [root / name] + ([root / f"{name}.tar.gz"] if archive else []):
            if os.path.lexists(final):
                raise ConfigError(f"bundle {final} was published by another run while this one ran; bundles "
                                  "are never overwritten", hint="run again with another bundle.version")
        tmp = root / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(out_dir / name, tmp)
        os.rename(tmp, root / name)
        if archive:
            tmp_tar = root / f".tmp-{name}.tar.gz"
            shutil.copy2(out_dir / f"{name}.tar.gz", tmp_tar)
            os.rename(tmp_tar, root / f"{name}.tar.gz")
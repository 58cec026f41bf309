"""The bad-input corpus as data: every case is an input a careless user or an attacker could give.

tests/test_bad_inputs.py runs them; scripts/bad_inputs_table.py renders docs/bad_inputs.md from them.
Each case names what it feeds (`what`), the words its one-line answer must contain (`expect`), and builds
its input from an Env (the session's smoke run and bundle, keys, a per-case temp folder).

Kinds: CliCase runs `python -m pipeline ...` in-process (cli.main: no new paddle import per case);
HttpCase sends one request to `serve`; ProcCase is a real subprocess (make, and the CLI entry itself).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Env:
    base: Path             # the smoke chain's root: runs/smoke, bundles/
    bundle: Path           # its bundle folder (unsigned)
    archive: Path          # its .tar.gz
    signed: Path           # a signed copy of the bundle
    priv: Path             # EC P-256 private key that signed it (generated at test time)
    pub: Path
    other_pub: Path        # a key that did not sign it
    tmp: Path = None       # per case, empty

    def smoke(self, *over: str, root: Path | None = None) -> list[str]:
        """The smoke chain's config (its stages stay cached), plus overrides."""
        args = ["-c", "configs/smoke.yaml", "-o", f"run.root={root or self.base / 'runs'}", "-o", "run.name=smoke",
                "-o", "train.min_metric=0.05", "-o", f"bundle.root={self.base / 'bundles'}",
                "-o", f"regression.history={self.tmp / 'history.sqlite'}"]      # never the repo's runs/
        return args + [x for o in over for x in ("-o", o)]

    def write(self, rel: str, data: bytes | str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return p


@dataclass
class CliCase:
    id: str
    category: str
    what: str
    argv: Callable[[Env], list[str]]
    expect: tuple[str, ...]
    hint: bool = True                   # the line must also say how to fix it ("hint: ...")
    absent: tuple[str, ...] = ()        # words that must not appear anywhere in the output
    kind: str = "cli"


@dataclass
class HttpCase:
    id: str
    what: str
    request: Callable[[Env], dict]      # {"method", "url", + httpx/TestClient kwargs}
    status: int
    expect: tuple[str, ...]
    category: str = "serve: HTTP"
    kind: str = "http"
    absent: tuple[str, ...] = ()        # words that must not appear in the answer


@dataclass
class ProcCase:
    id: str
    category: str
    what: str
    cmd: Callable[[Env], list[str]]
    expect: tuple[str, ...]
    hint: bool = True
    kind: str = "subprocess"
    env: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------ builders

def copy_bundle(e: Env, src: Path | None = None) -> Path:
    dst = e.tmp / (src or e.bundle).name
    shutil.copytree(src or e.bundle, dst, symlinks=True)
    return dst


def rehash(folder: Path, *rels: str, drop: tuple[str, ...] = ()) -> None:
    """Rewrite manifest.json so its hashes match the (tampered) files: what an attacker would do."""
    man = json.loads((folder / "manifest.json").read_text())
    for rel in rels:
        data = (folder / rel).read_bytes()
        man["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    for rel in drop:
        man["files"].pop(rel, None)
    (folder / "manifest.json").write_text(json.dumps(man))


def tamper(folder: Path, rel: str, data: bytes | None = None) -> Path:
    p = folder / rel
    if data is None:
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data = bytes(raw)
    p.write_bytes(data)
    return folder


def tampered_rehashed(e: Env, rel: str, data: bytes | None = None, src: Path | None = None) -> Path:
    b = copy_bundle(e, src)
    tamper(b, rel, data)
    rehash(b, rel)
    return b


def manifest_lists(e: Env, rel: str, data: bytes) -> Path:
    """A bundle whose manifest lists `rel` (outside the bundle) with the right hash of `data`."""
    b = copy_bundle(e)
    man = json.loads((b / "manifest.json").read_text())
    man["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (b / "manifest.json").write_text(json.dumps(man))
    return b


def tar(e: Env, members: list[tuple[tarfile.TarInfo, bytes | None]], name="evil.tar.gz") -> Path:
    path = e.tmp / name
    with tarfile.open(path, "w:gz") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def member(name: str, data: bytes | None = b"x", kind=tarfile.REGTYPE, link: str = ""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info, data


def giant_member_archive(e: Env) -> Path:
    """A .tar.gz whose first header announces a 1 GiB member (its data is not even there): refused from the
    header; the old code would have decompressed and written it all before looking."""
    info = tarfile.TarInfo("b/zeros.bin")
    info.size = 1 << 30
    path = e.tmp / "bomb.tar.gz"
    path.write_bytes(gzip.compress(info.tobuf(format=tarfile.GNU_FORMAT) + b"\0" * 4096))
    return path


def png_header(width: int, height: int, depth: int = 8) -> bytes:
    """A PNG whose IHDR announces width x height (a few hundred bytes; the pixels are never there)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, depth, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def damaged_run(e: Env, rel: str, data: bytes | None = None, delete: bool = False) -> Path:
    """A copy of the smoke run's stage outputs with runs/smoke/<rel> damaged; returns its run.root."""
    root = e.tmp / "runs"
    src = e.base / "runs" / "smoke"
    for stage in ("train", "export", "server", "lite"):
        shutil.copytree(src / stage, root / "smoke" / stage)
    if delete:
        (root / "smoke" / rel).unlink()
    else:
        tamper(root / "smoke", rel, data)
    return root


def image_folder(e: Env, bad: bytes | None = None, classes: str = "ab") -> Path:
    from PIL import Image

    root = e.tmp / "imgs"
    for cls in classes:
        (root / cls).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(np.full((8, 8), 60 * i, np.uint8)).save(root / cls / f"{i}.png")
    if bad is not None:
        (root / "b" / "broken.png").write_bytes(bad)
    return root


def port_in_use(e: Env) -> list[str]:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    _HELD.append(s)                             # held until the case ends
    return ["serve", str(e.bundle), "--port", str(s.getsockname()[1])]


_HELD: list = []


def release_held() -> None:
    while _HELD:
        _HELD.pop().close()


def key_file(e: Env, text: str) -> Path:
    return e.write("key.pem", text)


# ------------------------------------------------------------------------------------ the corpus

def _cfg(id, what, override, *expect, hint=True):
    return CliCase(id, "config (-o)", what, lambda e, o=override: ["run", "train", *e.smoke(o)], expect, hint)


CONFIG = [
    _cfg("unknown-key", "misspelled key", "train.epoch=3", "train.epoch", "did you mean"),
    _cfg("unknown-section", "misspelled section", "trian.epochs=3", "trian"),
    _cfg("lr-zero", "learning rate 0", "train.lr=0", "train.lr"),
    _cfg("amp-level", "AMP level that does not exist", "train.amp.level=O3", "train.amp.level"),
    _cfg("run-name-path", "run name that is a path", "run.name=../evil", "run.name"),
    _cfg("task", "unknown task", "task=detect", "task"),
    _cfg("channels", "2 input channels", "data.channels=2", "data.channels"),
    _cfg("precision", "unknown server precision", "server.precisions=[fp64]", "server.precisions"),
    _cfg("no-fp32", "server rows without the fp32 reference", "server.precisions=[int8]", "fp32"),
    _cfg("lite-arm", "unknown Lite precision", "lite.arm=[mips]", "lite.arm"),
    _cfg("samples-zero", "bundle with 0 samples", "bundle.samples=0", "bundle.samples"),
    _cfg("metric-drop", "negative regression threshold", "regression.metric_drop=-1", "regression.metric_drop"),
    _cfg("max-members", "archive member limit 0", "verify.max_members=0", "verify.max_members"),
    _cfg("max-pixels", "negative pixel limit", "serve.max_pixels=-5", "serve.max_pixels"),
    _cfg("seed", "negative seed", "seed=-1", "seed"),
    _cfg("val-fraction", "validation fraction 1.5", "data.val_fraction=1.5", "data.val_fraction"),
    _cfg("precheck", "unknown AMP pre-check action", "train.amp.precheck.on_fail=ignore", "train.amp.precheck.on_fail"),
    _cfg("atol-zero", "export tolerance 0", "export.gate.atol=0", "export.gate.atol"),
    _cfg("threads", "negative thread count", "run.threads=-1", "run.threads"),
    _cfg("epochs-text", "epochs given as text", "train.epochs=abc", "train.epochs"),
    _cfg("args-list", "model.args given as a list", "model.args=[1, 2]", "model.args"),
    _cfg("colon-no-space", "README's old `model.args={scale:0.5}` (no space after ':')",
         "model.args={scale:0.5}", "{scale: 0.5}"),
    _cfg("no-equals", "override without '='", "train.epochs", "not key=value"),
    _cfg("empty-key", "override with an empty key", "=3", "empty key"),
    _cfg("bad-yaml-value", "mapping value that is not YAML", "model.args={a: [1}", "not valid YAML"),
    CliCase("config-missing", "config file", "config file that does not exist",
            lambda e: ["run", "train", "-c", str(e.tmp / "nope.yaml")], ("config file not found",)),
    CliCase("config-bad-yaml", "config file", "config file that is not YAML",
            lambda e: ["run", "train", "-c", str(e.write("c.yaml", "train: [1"))], ("not valid YAML", "c.yaml")),
    CliCase("config-list", "config file", "config file holding a list",
            lambda e: ["run", "train", "-c", str(e.write("c.yaml", "- a\n- b\n"))], ("must hold a mapping",)),
    CliCase("config-unknown-key", "config file", "config file with a misspelled key",
            lambda e: ["run", "train", "-c", str(e.write("c.yaml", "train:\n  epoch: 3\n"))],
            ("train.epoch", "did you mean")),
    CliCase("O-bracket", "O= string", "unbalanced bracket in O",
            lambda e: ["run", "train", *e.smoke(), "-O", "model.args={a: 1"], ("unbalanced bracket",)),
    CliCase("O-quote", "O= string", "unbalanced quote in O",
            lambda e: ["run", "train", *e.smoke(), "-O", 'data.path="/x'], ("unbalanced", "quote")),
    CliCase("O-colon", "O= string", "{k:v} inside O",
            lambda e: ["run", "train", *e.smoke(), "-O", "train.epochs=2 model.args={hidden:16}"], ("{hidden: 16}",)),
]

STAGES = [
    CliCase("unknown-stage", "run: stages", "stage name typo", lambda e: ["run", "trian", *e.smoke()],
            ("unknown stage 'trian'", "train")),
    CliCase("export-before-train", "run: stages", "export in a run that has no training",
            lambda e: ["run", "export", *e.smoke(root=e.tmp)], ("train", "make train")),
    CliCase("train-pdparams-changed", "run: artifacts read", "train/model.pdparams modified, then export",
            lambda e: ["run", "export", *e.smoke(root=damaged_run(e, "train/model.pdparams"))],
            ("model.pdparams", "changed")),
    CliCase("train-info-missing", "run: artifacts read", "train/info.json deleted, then export",
            lambda e: ["run", "export", *e.smoke(root=damaged_run(e, "train/info.json", delete=True))],
            ("info.json", "missing")),
    CliCase("train-manifest-garbage", "run: artifacts read", "train/manifest.json not JSON, then export",
            lambda e: ["run", "export", *e.smoke(root=damaged_run(e, "train/manifest.json", b"{not json"))],
            ("train", "make train")),
    CliCase("export-pdmodel-changed", "run: artifacts read", "export/inference.pdmodel modified, then server",
            lambda e: ["run", "server", *e.smoke(root=damaged_run(e, "export/inference.pdmodel"))],
            ("inference.pdmodel", "changed")),
    CliCase("val-slice-changed", "run: artifacts read", "train/val_slice.npz (the reference outputs) modified, then export",
            lambda e: ["run", "export", *e.smoke(root=damaged_run(e, "train/val_slice.npz"))],
            ("val_slice.npz", "changed")),
    CliCase("calib-deleted", "run: artifacts read", "train/calib.npz (INT8 calibration) deleted, then server",
            lambda e: ["run", "server", *e.smoke(root=damaged_run(e, "train/calib.npz", delete=True))],
            ("calib.npz", "missing")),
    CliCase("lite-nb-changed", "run: artifacts read", "lite/x86_fp32.nb modified, then bundle",
            lambda e: ["run", "bundle", *e.smoke(root=damaged_run(e, "lite/x86_fp32.nb"))],
            ("x86_fp32.nb", "changed")),
    CliCase("summary-no-run", "run: stages", "summary of a run that does not exist",
            lambda e: ["summary", *e.smoke(root=e.tmp)], ("no run folder",)),
    CliCase("launch-nproc-0", "run: stages", "launch with 0 processes",
            lambda e: ["launch", "--nproc", "0", *e.smoke(root=e.tmp)], (">= 1",)),
]

MODEL = [
    CliCase("no-parameters", "model", "a model with no parameters (paddle.nn:Flatten)",
            lambda e: ["run", "train", *e.smoke("model.name=paddle.nn:Flatten")],
            ("paddle.nn:Flatten", "no trainable parameters")),
    CliCase("output-rank", "model", "output rank that does not fit the task (paddle.nn:Linear on images)",
            lambda e: ["run", "train", *e.smoke("model.name=paddle.nn:Linear", "model.args={in_features: 32, out_features: 36}")],
            ("paddle.nn:Linear", "rank 4", "rank 2")),
    CliCase("forward-fails", "model", "a model whose forward fails on the input",
            lambda e: ["run", "train", *e.smoke("model.name=paddle.nn:Linear", "model.args={in_features: 5, out_features: 36}")],
            ("paddle.nn:Linear", "fails on one input")),
    CliCase("module-missing", "model", "model from a module that does not exist",
            lambda e: ["run", "train", *e.smoke("model.name=no_such_pkg_xyz:build")], ("cannot import",)),
    CliCase("not-a-layer", "model", "builder that returns no Layer (os:getcwd)",
            lambda e: ["run", "train", *e.smoke("model.name=os:getcwd")], ("not a paddle.nn.Layer",)),
    CliCase("builder-raises", "model", "builder that raises (paddle.nn:Conv2D with a bad kernel size)",
            lambda e: ["run", "train", *e.smoke("model.name=paddle.nn:Conv2D",
                                                  "model.args={in_channels: 1, out_channels: 4, kernel_size: -3}")],
            ("paddle.nn:Conv2D",)),
    CliCase("no-colon", "model", "model name that is neither built-in nor module:callable",
            lambda e: ["run", "train", *e.smoke("model.name=resnet_tiny")], ("neither a built-in",)),
    CliCase("bad-builtin-args", "model", "unknown argument for the built-in model",
            lambda e: ["run", "train", *e.smoke("model.args={bogus: 1}")], ("model.args", "bogus")),
    CliCase("recognition-bad-model", "model", "classification model for the recognition task",
            lambda e: ["run", "train", *e.smoke("task=recognition", "model.name=small_cnn", "data.width=128", "data.num_train=64", "data.num_val=16")],
            ("not a recognition model",)),
]

DATA = [
    CliCase("folder-missing", "data", "image folder that does not exist",
            lambda e: ["run", "train", *e.smoke("data.source=folder", f"data.path={e.tmp / 'none'}")], ("none",)),
    CliCase("folder-empty", "data", "empty image folder",
            lambda e: ["run", "train", *e.smoke("data.source=folder", f"data.path={e.tmp}")], ("no class subfolders",)),
    CliCase("folder-no-path", "data", "data.source=folder without data.path",
            lambda e: ["run", "train", *e.smoke("data.source=folder")], ("data.path",)),
    CliCase("folder-one-class", "data", "image folder with one class",
            lambda e: ["run", "train", *e.smoke("data.source=folder", f"data.path={image_folder(e, classes='a')}")],
            ("only one class",)),
    CliCase("folder-broken-image", "data", "a broken PNG among the images",
            lambda e: ["run", "train", *e.smoke("data.source=folder", f"data.path={image_folder(e, b'not a png')}")],
            ("broken.png",)),
    CliCase("batch-too-big", "data", "batch larger than the data set",
            lambda e: ["run", "train", *e.smoke("train.batch_size=100000")], ("train.batch_size",)),
    CliCase("not-square", "data", "non-square synthetic characters",
            lambda e: ["run", "train", *e.smoke("data.width=48")], ("square",)),
    CliCase("font-missing", "data", "a font file that does not exist",
            lambda e: ["run", "train", *e.smoke(f"data.fonts=[{e.tmp / 'nope.ttf'}]")], ("nope.ttf",)),
    CliCase("charset-missing", "data", "recognition charset file that does not exist",
            lambda e: ["run", "train", *e.smoke("task=recognition", "model.name=crnn", "data.width=128", "data.num_train=64", "data.num_val=16", f"data.charset={e.tmp / 'dict.txt'}")],
            ("dict.txt",)),
    CliCase("charset-duplicate", "data", "charset file with a duplicate character",
            lambda e: ["run", "train", *e.smoke("task=recognition", "model.name=crnn", "data.width=128", "data.num_train=64", "data.num_val=16",
                                                 f"data.charset={e.write('dict.txt', 'A' + chr(10) + 'A' + chr(10))}")],
            ("duplicate",)),
    CliCase("labelfile-no-tab", "data", "recognition label line without a TAB",
            lambda e: ["run", "train", *e.smoke("task=recognition", "model.name=crnn", "data.width=128", "data.num_train=64", "data.num_val=16", "data.source=folder",
                                                 f"data.path={e.write('gt.txt', 'img.png ABC' + chr(10))}")],
            ("gt.txt:1",)),
    CliCase("labelfile-not-utf8", "data", "recognition label file that is not UTF-8",
            lambda e: ["run", "train", *e.smoke("task=recognition", "model.name=crnn", "data.width=128", "data.num_train=64", "data.num_val=16", "data.source=folder",
                                                 f"data.path={e.write('gt.txt', bytes([0xff, 0xfe, 0x00, 0x41]))}")],
            ("UTF-8",)),
    CliCase("no-gpu", "data", "train.device=gpu on a machine without one",
            lambda e: ["run", "train", *e.smoke("train.device=gpu")], ("train.device",)),
]

VERIFY = [
    CliCase("verify-missing", "verify: bundle", "bundle path that does not exist",
            lambda e: ["verify", str(e.tmp / "nope")], ("bundle not found",)),
    CliCase("verify-empty-folder", "verify: bundle", "a folder that is not a bundle",
            lambda e: ["verify", str(e.tmp)], ("not a bundle",)),
    CliCase("verify-text-file", "verify: archive", "a text file given as the archive",
            lambda e: ["verify", str(e.write("b.tar.gz", "hello"))], ("not a readable tar",)),
    CliCase("verify-truncated", "verify: archive", "the bundle's .tar.gz cut in half",
            lambda e: ["verify", str(e.write("b.tar.gz", e.archive.read_bytes()[: e.archive.stat().st_size // 2]))],
            ("damaged",)),
    CliCase("tar-dotdot", "verify: archive", "archive member ../evil.txt",
            lambda e: ["verify", str(tar(e, [member("b/manifest.json"), member("b/../../evil.txt")]))], ("escapes",)),
    CliCase("tar-absolute", "verify: archive", "archive member /tmp/evil.txt",
            lambda e: ["verify", str(tar(e, [member("/tmp/evil-absolute.txt")]))], ("escapes",)),
    CliCase("tar-symlink", "verify: archive", "archive member that is a symlink to /etc/passwd",
            lambda e: ["verify", str(tar(e, [member("b/manifest.json"), member("b/l", None, tarfile.SYMTYPE, "/etc/passwd")]))],
            ("links",)),
    CliCase("tar-device", "verify: archive", "archive member that is a device file",
            lambda e: ["verify", str(tar(e, [member("b/manifest.json"), member("b/dev", None, tarfile.CHRTYPE)]))],
            ("special",)),
    CliCase("tar-1gib", "verify: archive", "archive announcing a 1 GiB member (a zip bomb)",
            lambda e: ["verify", str(giant_member_archive(e))], ("verify.max_archive_bytes", "1,073,741,824")),
    CliCase("tar-members", "verify: archive", "archive with more members than verify.max_members",
            lambda e: ["verify", str(e.archive), "-o", "verify.max_members=3"], ("verify.max_members",)),
    CliCase("tar-bytes", "verify: archive", "archive larger than verify.max_archive_bytes",
            lambda e: ["verify", str(e.archive), "-o", "verify.max_archive_bytes=1000"], ("verify.max_archive_bytes",)),
    CliCase("manifest-dotdot", "verify: manifest", "manifest listing ../outside.txt (with its right hash)",
            lambda e: ["verify", str(manifest_lists(e, "../outside.txt", e.write("outside.txt", "secret").read_bytes()))],
            ("../outside.txt", "outside the bundle")),
    CliCase("manifest-absolute", "verify: manifest", "manifest listing /etc/hostname",
            lambda e: ["verify", str(manifest_lists(e, "/etc/hostname", b""))], ("/etc/hostname", "outside the bundle")),
    CliCase("manifest-symlink-dir", "verify: manifest", "manifest path through a symlinked folder leading outside",
            lambda e: ["verify", str(_symlinked_dir(e))], ("symlink",)),
    CliCase("bundle-symlink-file", "verify: manifest", "a model file replaced by a symlink to a copy elsewhere",
            lambda e: ["verify", str(_symlinked_file(e))], ("symlink",)),
    CliCase("file-modified", "verify: manifest", "model parameters modified",
            lambda e: ["verify", str(tamper(copy_bundle(e), "server/fp32/inference.pdiparams"))],
            ("inference.pdiparams", "modified")),
    CliCase("file-missing", "verify: manifest", "a listed file deleted",
            lambda e: ["verify", str(_without(e, "mobile/x86_fp32.nb"))], ("x86_fp32.nb", "missing")),
    CliCase("file-unlisted", "verify: manifest", "an extra file not in the manifest",
            lambda e: ["verify", str(_with_extra(e))], ("not in its manifest",)),
    CliCase("manifest-not-json", "verify: manifest", "manifest.json that is not JSON",
            lambda e: ["verify", str(tamper(copy_bundle(e), "manifest.json", b"{oops"))], ("not a valid bundle manifest",)),
    CliCase("manifest-files-list", "verify: manifest", "manifest whose 'files' is a list",
            lambda e: ["verify", str(tamper(copy_bundle(e), "manifest.json", b'{"files": ["a"]}'))],
            ("not a valid bundle manifest",)),
    CliCase("manifest-missing", "verify: manifest", "manifest.json deleted",
            lambda e: ["verify", str(_without(e, "manifest.json"))], ("not a bundle",)),
    CliCase("infer-config-rehashed", "verify: content", "infer_config.yaml broken, manifest rehashed (unsigned)",
            lambda e: ["verify", str(tampered_rehashed(e, "infer_config.yaml", b"task: [oops"))], ("infer_config.yaml",)),
    CliCase("samples-rehashed", "verify: content", "samples/expected.npz garbage, manifest rehashed",
            lambda e: ["verify", str(tampered_rehashed(e, "samples/expected.npz", b"garbage"))], ("samples",)),
    CliCase("samples-outside", "verify: content", "sample list pointing outside the bundle, rehashed",
            lambda e: ["verify", str(tampered_rehashed(e, "samples/expected.npz", _npz_outside(e)))],
            ("outside the bundle",)),
    CliCase("pdmodel-rehashed", "verify: content", "program file garbage, manifest rehashed (unsigned)",
            lambda e: ["verify", str(tampered_rehashed(e, "server/fp32/inference.pdmodel", b"garbage"))],
            ("inference",)),
    CliCase("expected-rehashed", "verify: content", "expected outputs altered, manifest rehashed",
            lambda e: ["verify", str(tampered_rehashed(e, "samples/expected.npz", _npz_shifted(e)))], ("limit",)),
]

SIGNATURE = [
    CliCase("signed-tampered-rehashed", "verify: signature", "signed bundle: file + manifest rewritten, verify --key",
            lambda e: ["verify", str(tampered_rehashed(e, "server/fp32/inference.pdiparams", src=e.signed)), "--key", str(e.pub)],
            ("signature check failed", "inference.pdiparams", "manifest.json")),
    CliCase("signed-file-added", "verify: signature", "signed bundle: file added and listed, verify --key",
            lambda e: ["verify", str(_added_and_listed(e)), "--key", str(e.pub)], ("added since signing", "extra.txt")),
    CliCase("unsigned-with-key", "verify: signature", "unsigned bundle, verify --key",
            lambda e: ["verify", str(e.bundle), "--key", str(e.pub)], ("unsigned",)),
    CliCase("unsigned-trust-root", "verify: signature", "unsigned bundle, verify.trust_key configured",
            lambda e: ["verify", str(e.bundle), "-o", f"verify.trust_key={e.pub}"], ("unsigned",)),
    CliCase("wrong-key", "verify: signature", "signed bundle checked with another key",
            lambda e: ["verify", str(e.signed), "--key", str(e.other_pub)], ("signature check failed", "public key")),
    CliCase("key-missing", "verify: signature", "--key file that does not exist",
            lambda e: ["verify", str(e.signed), "--key", str(e.tmp / "nope.pem")], ("public key not found",)),
    CliCase("key-not-pem", "verify: signature", "--key file that is not a PEM key",
            lambda e: ["verify", str(e.signed), "--key", str(key_file(e, "hello"))], ("cannot use",)),
    CliCase("sig-garbage", "verify: signature", "model.sig replaced by garbage",
            lambda e: ["verify", str(tamper(copy_bundle(e, e.signed), "model.sig", b"garbage")), "--key", str(e.pub)],
            ("signature check failed",)),
    CliCase("sign-key-missing", "sign", "sign with a key file that does not exist",
            lambda e: ["sign", str(copy_bundle(e)), "--key", str(e.tmp / "nope.pem")], ("signing key not found",)),
    CliCase("sign-public-key", "sign", "sign with the public key",
            lambda e: ["sign", str(copy_bundle(e)), "--key", str(e.pub)], ("cannot use", "signing key")),
    CliCase("sign-tampered", "sign", "sign a bundle whose files no longer match its manifest",
            lambda e: ["sign", str(tamper(copy_bundle(e), "infer_config.yaml")), "--key", str(e.priv)],
            ("infer_config.yaml", "modified")),
    CliCase("sign-missing", "sign", "sign a bundle that does not exist",
            lambda e: ["sign", str(e.tmp / "nope"), "--key", str(e.priv)], ("bundle not found",)),
    CliCase("bundle-sign-key-missing", "sign", "bundle.sign_key that does not exist (bundle stage)",
            lambda e: ["run", "bundle", *e.smoke(f"bundle.sign_key={e.tmp / 'nope.pem'}")], ("bundle.sign_key",)),
]

SERVE = [
    CliCase("port-70000", "serve: CLI", "serve --port 70000",
            lambda e: ["serve", str(e.bundle), "--port", "70000"], ("--port 70000", "out of range"), absent=("serving",)),
    CliCase("port-0", "serve: CLI", "serve --port 0", lambda e: ["serve", str(e.bundle), "--port", "0"],
            ("out of range",), absent=("serving",)),
    CliCase("port-in-use", "serve: CLI", "serve on a port that is in use", port_in_use, ("already in use",),
            absent=("serving",)),
    CliCase("host-foreign", "serve: CLI", "serve --host with an address this machine does not have",
            lambda e: ["serve", str(e.bundle), "--host", "192.0.2.1", "--port", "8000"], ("cannot listen",),
            absent=("serving",)),
    CliCase("port-text", "serve: CLI", "serve --port abc", lambda e: ["serve", str(e.bundle), "--port", "abc"],
            ("invalid int value",), hint=False),
    CliCase("serve-missing", "serve: CLI", "serve a bundle that does not exist",
            lambda e: ["serve", str(e.tmp / "nope"), "--port", _free_port()], ("bundle not found",), absent=("serving",)),
    CliCase("serve-tampered", "serve: CLI", "serve a tampered bundle",
            lambda e: ["serve", str(tamper(copy_bundle(e), "server/fp32/inference.pdiparams")), "--port", _free_port()],
            ("modified",), absent=("serving",)),
    CliCase("serve-precision-unservable", "serve: CLI", "serve --engine onnxruntime --precision bf16",
            lambda e: ["serve", str(e.bundle), "--engine", "onnxruntime", "--precision", "bf16", "--port",
                       _free_port()], ("onnxruntime does not serve 'bf16'", "--precision fp32 | int8"),
            absent=("serving",)),
    CliCase("serve-unsigned-key", "serve: CLI", "serve --key on an unsigned bundle",
            lambda e: ["serve", str(e.bundle), "--key", str(e.pub), "--port", _free_port()], ("unsigned",),
            absent=("serving",)),
]

REGRESSION = [
    CliCase("compare-not-run", "nightly", "compare a folder that is not a run",
            lambda e: ["compare", str(e.tmp), *e.smoke(root=e.tmp)], ("not a run folder",)),
    CliCase("accept-not-run", "nightly", "accept a run folder that does not exist",
            lambda e: ["accept", str(e.tmp / "nope"), *e.smoke(root=e.tmp)], ("refusing to accept",)),
    CliCase("history-not-sqlite", "nightly", "history database that is not SQLite",
            lambda e: ["history", *e.smoke(f"regression.history={e.write('h.sqlite', 'garbage')}")], ("not a database",)),
    CliCase("nightly-ocr-system", "nightly", "nightly on an OCR system config (two runs joined, not one chain)",
            lambda e: ["nightly", "-c", "configs/smoke_ocr_system.yaml", "-o", f"run.root={e.tmp / 'runs'}",
                       "-o", f"regression.history={e.tmp / 'history.sqlite'}"], ("one model's chain",)),
    CliCase("stage-not-of-task", "run", "a stage of another task (the OCR system stage in a classification run)",
            lambda e: ["run", "system", *e.smoke()], ("does not apply to task: classification",)),
]


def _img(e: Env) -> bytes:
    with np.load(e.bundle / "samples" / "expected.npz") as z:
        return (e.bundle / str(z["files"][0])).read_bytes()


HTTP = [
    HttpCase("get-predict", "GET /predict", lambda e: {"method": "GET", "url": "/predict"}, 405, ("Method Not Allowed",)),
    HttpCase("unknown-path", "POST /nope", lambda e: {"method": "POST", "url": "/nope"}, 404, ("Not Found",)),
    HttpCase("empty-body", "empty body", lambda e: {"method": "POST", "url": "/predict", "content": b"",
                                                    "headers": {"content-type": "image/png"}}, 400, ("empty",)),
    HttpCase("text-plain", "text/plain body", lambda e: {"method": "POST", "url": "/predict", "content": b"hi",
                                                         "headers": {"content-type": "text/plain"}}, 415, ("content-type",)),
    HttpCase("garbage-png", "garbage bytes as image/png", lambda e: {"method": "POST", "url": "/predict",
             "content": b"\x89PNG garbage", "headers": {"content-type": "image/png"}}, 400, ("not a readable",)),
    HttpCase("huge-image", "10000x10000 PNG (a few hundred bytes): refused from its header",
             lambda e: {"method": "POST", "url": "/predict", "content": png_header(10000, 10000),
                        "headers": {"content-type": "image/png"}}, 413, ("10000x10000", "serve.max_pixels")),
    HttpCase("body-too-big", "body over serve.max_body_bytes", lambda e: {"method": "POST", "url": "/predict",
             "content": b"\x89PNG" + b"0" * (5 << 20), "headers": {"content-type": "image/png"}}, 413, ("limit",)),
    HttpCase("json-invalid", "invalid JSON", lambda e: {"method": "POST", "url": "/predict", "content": b"{oops",
             "headers": {"content-type": "application/json"}}, 400, ("not valid JSON",)),
    HttpCase("json-no-inputs", "JSON without 'inputs'", lambda e: {"method": "POST", "url": "/predict",
             "json": {"x": 1}}, 400, ("'inputs'",)),
    HttpCase("json-shape", "tensor of the wrong shape", lambda e: {"method": "POST", "url": "/predict",
             "json": {"inputs": [[1.0, 2.0]]}}, 400, ("shape",)),
    HttpCase("json-nan", "tensor with NaN", lambda e: {"method": "POST", "url": "/predict",
             "content": json.dumps({"inputs": np.full((1, 32, 32), np.nan).tolist()}).encode(),
             "headers": {"content-type": "application/json"}}, 400, ("NaN",)),
    HttpCase("json-strings", "tensor of strings", lambda e: {"method": "POST", "url": "/predict",
             "json": {"inputs": [["a", "b"]]}}, 400, ("numbers",)),
    HttpCase("multipart-no-file", "multipart form without a file", lambda e: {"method": "POST", "url": "/predict",
             "content": b'--X\r\nContent-Disposition: form-data; name="a"\r\n\r\nb\r\n--X--\r\n',
             "headers": {"content-type": "multipart/form-data; boundary=X"}}, 400, ("no file part",)),
    HttpCase("multipart-empty-file", "multipart upload of an empty file", lambda e: {"method": "POST", "url": "/predict",
             "files": {"file": ("a.png", b"", "image/png")}}, 400, ("empty",)),
    HttpCase("jpeg-truncated", "a JPEG cut short", lambda e: {"method": "POST", "url": "/predict",
             "content": _jpeg()[:60], "headers": {"content-type": "image/jpeg"}}, 400, ("not a readable",)),
]

def _v2(e: Env, doc=None, content: bytes | None = None, model: str | None = None) -> dict:
    req = {"method": "POST", "url": f"/v2/models/{model or e.bundle.name}/infer"}
    if content is not None:
        return {**req, "content": content, "headers": {"content-type": "application/json"}}
    return {**req, "json": doc}


def _v2_input(shape, data=None, datatype="FP32") -> dict:
    n = int(np.prod(shape))
    return {"inputs": [{"name": "x", "datatype": datatype, "shape": shape,
                        "data": data if data is not None else [0.0] * n}]}


HTTP += [
    HttpCase("v2-unknown-model", "KServe v2 infer on a model that is not served",
             lambda e: _v2(e, _v2_input([1, 1, 32, 32]), model="nope"), 404, ("nope",), category="serve: KServe v2"),
    HttpCase("v2-not-json", "KServe v2 infer body that is not JSON", lambda e: _v2(e, content=b"{oops"), 400,
             ("not valid JSON",), category="serve: KServe v2"),
    HttpCase("v2-datatype", "KServe v2 tensor of datatype INT64", lambda e: _v2(e, _v2_input([1, 1, 32, 32], datatype="INT64")),
             400, ("FP32",), category="serve: KServe v2"),
    HttpCase("v2-shape", "KServe v2 tensor of the wrong shape", lambda e: _v2(e, _v2_input([1, 3, 8, 8])), 400,
             ("shape",), category="serve: KServe v2"),
    HttpCase("v2-count", "KServe v2 shape and data that disagree", lambda e: _v2(e, _v2_input([1, 1, 32, 32], [0.0])),
             400, ("values",), category="serve: KServe v2"),
    HttpCase("v2-nan", "KServe v2 tensor with NaN", lambda e: _v2(e, content=json.dumps(
             _v2_input([1, 1, 32, 32], [float("nan")] * 1024)).encode()), 400, ("NaN",), category="serve: KServe v2"),
    HttpCase("v2-too-big", "KServe v2 body over serve.max_body_bytes", lambda e: _v2(e, content=b"{" + b" " * (5 << 20)),
             413, ("serve.max_body_bytes",), category="serve: KServe v2"),
]

PROC = [
    ProcCase("make-colon", "make O=", "make train O='model.args={scale:0.5}' (the README's old example)",
             lambda e: ["make", "--no-print-directory", "train", "O=model.args={scale:0.5}"], ("{scale: 0.5}",)),
    ProcCase("make-space-path", "make O=", "make summary O='run.root=\"/tmp/my set\" model.args={a: 1, b: 2}' "
             "(a space in a path and in a mapping reach the CLI intact)",
             lambda e: ["make", "--no-print-directory", "summary",
                        f"O=run.root=\"{e.tmp}/my set\" model.args={{a: 1, b: 2}} run.name=r"], ("my set/r",)),
    ProcCase("make-quote", "make O=", "make train O='data.path=\"/x' (unbalanced quote)",
             lambda e: ["make", "--no-print-directory", "train", 'O=data.path="/x'], ("unbalanced",)),
    ProcCase("cli-port", "serve: CLI", "python -m pipeline serve --port 70000 (a real process: no uvicorn traceback)",
             lambda e: [sys.executable, "-m", "pipeline", "serve", str(e.bundle), "--port", "70000"], ("out of range",)),
]


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _symlinked_dir(e: Env) -> Path:
    outside = e.tmp / "outside"
    outside.mkdir()
    data = b"not shipped"
    (outside / "x.bin").write_bytes(data)
    b = manifest_lists(e, "data/x.bin", data)
    os.symlink(outside, b / "data")
    return b


def _symlinked_file(e: Env) -> Path:
    b = copy_bundle(e)
    real = e.tmp / "elsewhere.pdiparams"
    shutil.move(b / "server/fp32/inference.pdiparams", real)
    os.symlink(real, b / "server/fp32/inference.pdiparams")
    return b


def _without(e: Env, rel: str) -> Path:
    b = copy_bundle(e)
    (b / rel).unlink()
    return b


def _with_extra(e: Env) -> Path:
    b = copy_bundle(e)
    (b / "server" / "evil.py").write_text("import os\n")
    return b


def _added_and_listed(e: Env) -> Path:
    b = copy_bundle(e, e.signed)
    (b / "extra.txt").write_text("added later")
    rehash(b, "extra.txt")
    return b


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _npz_outside(e: Env) -> bytes:
    with np.load(e.bundle / "samples" / "expected.npz") as z:
        files = np.array(["../../outside.png"] + [str(f) for f in z["files"][1:]])
        return _npz(outputs=z["outputs"], labels=z["labels"], files=files)


def _npz_shifted(e: Env) -> bytes:
    with np.load(e.bundle / "samples" / "expected.npz") as z:
        return _npz(outputs=z["outputs"] + 1.0, labels=z["labels"], files=z["files"])



# ------------------------------------------------------------------------------------ issue 21: hostile, third round

def _bytes_of(fmt: str, mode: str = "L", size=(32, 32), **save) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, format=fmt, **save)
    return buf.getvalue()


def dds_malformed() -> bytes:
    """A 384-byte DDS whose pixel format flags Pillow does not know (NotImplementedError in its decoder)."""
    head = bytearray(128)
    head[0:4] = b"DDS "
    struct.pack_into("<IIII", head, 4, 124, 0x1007, 32, 32)
    struct.pack_into("<II", head, 76, 32, 0x80000)        # pixel format size, unknown flags
    return bytes(head) + b"\0" * 256


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\nnewpath 0 0 moveto 32 32 lineto stroke\nshowpage\n"


def bmp_bad_depth() -> bytes:
    raw = bytearray(_bytes_of("BMP"))
    struct.pack_into("<H", raw, 28, 7)                     # 7 bits per pixel: no decoder for it
    return bytes(raw)


def gif_header(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00" + b"\x2c" + b"\0" * 9 + b"\x02\x02\x44\x01\x00\x3b"


def jpeg_header(width: int, height: int) -> bytes:
    """A small real JPEG whose SOF0 is rewritten to announce width x height."""
    raw = bytearray(_jpeg())
    at = raw.index(b"\xff\xc0")
    struct.pack_into(">HH", raw, at + 5, height, width)
    return bytes(raw)


def _img_post(data: bytes, ctype: str = "image/png", url: str = "/predict") -> dict:
    return {"method": "POST", "url": url, "content": data, "headers": {"content-type": ctype}}


HTTP += [
    HttpCase("dds-malformed", "384-byte malformed DDS sent as image/png (its decoder raised NotImplementedError: 500)",
             lambda e: _img_post(dds_malformed()), 400, ("not a readable image", "PNG, JPEG"), category="serve: image decoding"),
    HttpCase("eps-as-png", "an EPS sent as image/png (Pillow went looking for Ghostscript)",
             lambda e: _img_post(EPS), 400, ("not a readable image",), category="serve: image decoding"),
    HttpCase("jpeg-as-png", "JPEG bytes sent as image/png", lambda e: _img_post(_jpeg()), 400,
             ("image/png", "JPEG"), category="serve: image decoding"),
    HttpCase("multipart-mismatch", "multipart file part typed image/png holding a GIF",
             lambda e: {"method": "POST", "url": "/predict", "files": {"file": ("a.png", _bytes_of("GIF"), "image/png")}},
             400, ("image/png", "GIF"), category="serve: image decoding"),
    HttpCase("bmp-bad-depth", "a BMP announcing 7 bits per pixel", lambda e: _img_post(bmp_bad_depth(), "image/bmp"),
             400, ("not a readable BMP",), category="serve: image decoding"),
    HttpCase("tiff-truncated", "a TIFF cut after its header", lambda e: _img_post(_bytes_of("TIFF")[:40], "image/tiff"),
             400, ("TIFF",), category="serve: image decoding"),
    HttpCase("gif-truncated", "a GIF cut short", lambda e: _img_post(_bytes_of("GIF")[:20], "image/gif"), 400,
             ("GIF",), category="serve: image decoding"),
    HttpCase("webp-garbage", "RIFF/WEBP magic followed by garbage", lambda e: _img_post(b"RIFF\x20\0\0\0WEBPVP8 " + b"\x07" * 40,
             "image/webp"), 400, ("WEBP",), category="serve: image decoding"),
    HttpCase("png-idat-garbage", "a PNG whose pixel data is not zlib", lambda e: _img_post(
             _bytes_of("PNG").replace(b"IDAT", b"IDAT\x00\x00", 1)), 400, ("not a readable PNG",), category="serve: image decoding"),
    HttpCase("svg", "an SVG (image/svg+xml)", lambda e: _img_post(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"),
             415, ("content-type",), category="serve: image decoding"),
    HttpCase("garbage-message", "garbage bytes: the answer names no Python object",
             lambda e: _img_post(b"\x00\x01garbage" * 10), 400, ("not a readable image",),
             category="serve: image decoding", absent=("BytesIO", "0x")),
    HttpCase("png16-huge", "16-bit PNG header announcing 10000x10000", lambda e: _img_post(
             png_header(10000, 10000, depth=16)), 413,
             ("serve.max_pixels",), category="serve: image decoding"),
    HttpCase("jpeg-huge", "JPEG header announcing 60000x60000", lambda e: _img_post(jpeg_header(60000, 60000), "image/jpeg"),
             413, ("3,600,000,000 pixels", "serve.max_pixels"), category="serve: image decoding"),
    HttpCase("gif-huge", "GIF header announcing 65535x65535", lambda e: _img_post(gif_header(65535, 65535), "image/gif"),
             413, ("pixels",), category="serve: image decoding"),
]


def _v2_doc(**changes) -> dict:
    doc = _v2_input([1, 1, 32, 32])
    tensor = {**doc["inputs"][0], **changes.pop("tensor", {})}
    return {**doc, "inputs": [tensor], **changes}


def _v2_binary(e: Env, shape, size: int, blob: bytes = b"") -> dict:
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": shape,
                                   "parameters": {"binary_data_size": size}}]}).encode()
    return {"method": "POST", "url": f"/v2/models/{e.bundle.name}/infer", "content": head + blob,
            "headers": {"content-type": "application/octet-stream", "inference-header-content-length": str(len(head))}}


_V2 = "serve: KServe v2"
HTTP += [
    HttpCase("v2-shape-overflow", "shape [2^32, 2^32, 32, 32] (element count overflows int64 to 0) with empty data",
             lambda e: _v2(e, _v2_doc(tensor={"shape": [1 << 32, 1 << 32, 32, 32], "data": []})), 400, ("shape",), category=_V2),
    HttpCase("v2-shape-overflow-binary", "the same overflowing shape in the binary-data form",
             lambda e: _v2_binary(e, [1 << 32, 1 << 32, 32, 32], 0), 400, ("shape",), category=_V2),
    HttpCase("v2-bool-dims", "boolean dimensions", lambda e: _v2(e, _v2_doc(tensor={"shape": [True, True, 32, 32]})),
             400, ("inputs[0].shape[0]",), category=_V2),
    HttpCase("v2-input-params-list", "an input's parameters given as a list",
             lambda e: _v2(e, _v2_doc(tensor={"parameters": []})), 400, ("inputs[0].parameters",), category=_V2),
    HttpCase("v2-request-params-list", "the request's parameters given as a list",
             lambda e: _v2(e, _v2_doc(parameters=[1])), 400, ("'parameters'",), category=_V2),
    HttpCase("v2-outputs-string", "outputs given as a string", lambda e: _v2(e, _v2_doc(outputs="output")), 400,
             ("'outputs'",), category=_V2),
    HttpCase("v2-output-params-number", "an output's parameters given as a number",
             lambda e: _v2(e, _v2_doc(outputs=[{"name": "output", "parameters": 5}])), 400,
             ("outputs[0].parameters",), category=_V2),
    HttpCase("v2-negative-dim", "a negative dimension", lambda e: _v2(e, _v2_doc(tensor={"shape": [1, 1, -32, 32]})),
             400, ("inputs[0].shape[2]",), category=_V2),
    HttpCase("v2-float-dim", "a fractional dimension", lambda e: _v2(e, _v2_doc(tensor={"shape": [1.5, 1, 32, 32]})),
             400, ("inputs[0].shape[0]",), category=_V2),
    HttpCase("v2-name-number", "an input name that is a number", lambda e: _v2(e, _v2_doc(tensor={"name": 5})), 400,
             ("inputs[0].name",), category=_V2),
    HttpCase("v2-no-inputs", "a request without inputs", lambda e: _v2(e, {"id": "a"}), 400, ("'inputs'",), category=_V2),
    HttpCase("v2-size-string", "binary_data_size given as text", lambda e: _v2(e, _v2_doc(
             tensor={"parameters": {"binary_data_size": "4096"}})), 400, ("binary_data_size",), category=_V2),
    HttpCase("v2-id-object", "an id that is an object", lambda e: _v2(e, _v2_doc(id={"a": 1})), 400, ("'id'",), category=_V2),
    HttpCase("v2-batch-huge", "batch dimension 10^12 with one value", lambda e: _v2(e, _v2_doc(
             tensor={"shape": [10 ** 12, 1, 32, 32], "data": [0.0]})), 400, ("limit",), category=_V2),
]



# ------------------------------------------------------------------------------------ serving hardening (issue 30)
# (owned by the serving work: docs/serving_hardening.md; kept in its own block so other corpus edits merge cleanly)

def _v2_raw(e: Env, first: str, headers: dict | None = None) -> dict:
    """A KServe v2 infer body whose first data value is the raw JSON text `first` (numbers json.dumps cannot write)."""
    body = json.dumps(_v2_doc()).replace("0.0", first, 1).encode()
    return {"method": "POST", "url": f"/v2/models/{e.bundle.name}/infer", "content": body,
            "headers": {"content-type": "application/json", **(headers or {})}}


def _v2_header_len(e: Env, value: bytes) -> dict:
    return _v2_raw(e, "0.0", {"inference-header-content-length": value})


_HARDENING = "serve: hardening"
HTTP += [
    HttpCase("v2-int-400-digits", "KServe v2 data holding a 400-digit integer (was 500: OverflowError)",
             lambda e: _v2_raw(e, "1" + "0" * 400), 400, ("outside the FP32 range",), category=_HARDENING),
    HttpCase("v2-beyond-fp32", "KServe v2 data holding 1e39 (silently Inf as FP32)", lambda e: _v2_raw(e, "1e39"),
             400, ("outside the FP32 range",), category=_HARDENING),
    HttpCase("v2-header-len-superscript", "Inference-Header-Content-Length '\u00b2' (str.isdigit() says yes, int() "
             "refuses: was 500)", lambda e: _v2_header_len(e, "\u00b2".encode("latin-1")), 400,
             ("Inference-Header-Content-Length",), category=_HARDENING),
    HttpCase("v2-header-len-arabic", "Inference-Header-Content-Length in Arabic-Indic digits",
             lambda e: _v2_header_len(e, "\u0661\u0662".encode()), 400, ("Inference-Header-Content-Length",),
             category=_HARDENING),
    HttpCase("v2-header-len-5000-digits", "Inference-Header-Content-Length of 5000 digits (past int()'s digit limit)",
             lambda e: _v2_header_len(e, b"9" * 5000), 400, ("Inference-Header-Content-Length",), category=_HARDENING),
    HttpCase("predict-beyond-float32", "/predict JSON tensor holding 1e39 (silently Inf as float32)",
             lambda e: {"method": "POST", "url": "/predict", "content": json.dumps(
                 {"inputs": np.full((1, 32, 32), 1e39).tolist()}).encode(),
                 "headers": {"content-type": "application/json"}}, 400, ("outside the float32 range",),
             category=_HARDENING),
    HttpCase("predict-json-deep", "/predict JSON body of 60000 nested '[' (was 500: RecursionError)",
             lambda e: {"method": "POST", "url": "/predict", "content": b"[" * 60_000,
                        "headers": {"content-type": "application/json"}}, 400, ("not valid JSON",), category=_HARDENING),
]
# the rest of issue 30's serving cases need a real socket, a broken engine or an OCR bundle, so they are tested in
# tests/test_http_limits.py (30 big pages: /health answers, 429 past the slots; 503/408 past serve.request_timeout_s;
# HEAD) and tests/test_serve.py (engine faults 500 in one line; /ocr box cap): see docs/serving_hardening.md

def _folder_with(e: Env, name: str, data: bytes) -> Path:
    root = image_folder(e)
    (root / "b" / name).write_bytes(data)
    return root


def _folder_case(id: str, what: str, name: str, data: Callable[[], bytes], *expect: str) -> CliCase:
    return CliCase(id, "data: images", what, lambda e: ["run", "train", *e.smoke(
        "data.source=folder", f"data.path={_folder_with(e, name, data())}")], (name, *expect))


def _non_utf8_class(e: Env) -> Path:
    root = image_folder(e)
    os.rename(root / "b", os.path.join(os.fsencode(root), b"caf\xe9"))
    return root


def _labelfile_with(e: Env, data: bytes) -> Path:
    (e.tmp / "crops").mkdir(parents=True, exist_ok=True)
    (e.tmp / "crops" / "a.png").write_bytes(data)
    return e.write("gt.txt", "crops/a.png\tABC\n")


DATA += [
    _folder_case("folder-dds", "a malformed DDS named .png among the images (its decoder raised NotImplementedError)",
                 "x.png", dds_malformed, "not a readable image"),
    _folder_case("folder-eps", "an EPS named .png among the images", "x.png", lambda: EPS, "not a readable image"),
    _folder_case("folder-jpeg-cut", "a JPEG cut short among the images", "x.jpg", lambda: _jpeg()[:80], "not a readable JPEG"),
    _folder_case("folder-bmp-depth", "a BMP announcing 7 bits per pixel", "x.bmp", bmp_bad_depth, "not a readable BMP"),
    _folder_case("folder-empty-file", "a 0-byte .png among the images", "x.png", lambda: b"", "not a readable image"),
    _folder_case("folder-gif-huge", "a GIF announcing 65535x65535 (a decompression bomb)", "x.gif",
                 lambda: gif_header(65535, 65535), "x.gif"),
    CliCase("folder-non-utf8-class", "data: images", "a class folder whose name is not UTF-8 (was served as lone surrogates)",
            lambda e: ["run", "train", *e.smoke("data.source=folder", f"data.path={_non_utf8_class(e)}")],
            ("caf\\xe9", "not valid UTF-8")),
    CliCase("labelfile-dds", "data: images", "a recognition label line pointing at a malformed DDS",
            lambda e: ["run", "train", *e.smoke("task=recognition", "model.name=crnn", "data.width=128", "data.num_train=64",
                                                 "data.num_val=16", "data.source=folder",
                                                 f"data.path={_labelfile_with(e, dds_malformed())}")],
            ("gt.txt:1", "not a readable image")),
]


def _serve_cfg(id, what, override, *expect):
    return CliCase(id, "config (-o)", what, lambda e, o=override: ["serve", str(e.bundle), "--port", _free_port(),
                                                                     *e.smoke(o)], expect, absent=("serving",))


CONFIG += [
    _serve_cfg("header-bytes-tiny", "serve.max_header_bytes=10 (no client fits)", "serve.max_header_bytes=10",
               "serve.max_header_bytes"),
    _serve_cfg("body-timeout-zero", "serve.body_timeout_s=0", "serve.body_timeout_s=0", "serve.body_timeout_s"),
    _serve_cfg("header-timeout-text", "serve.header_timeout_s=soon", "serve.header_timeout_s=soon", "serve.header_timeout_s"),
    _serve_cfg("grace-negative", "serve.grace_s=-1", "serve.grace_s=-1", "serve.grace_s"),
    _serve_cfg("keepalive-zero", "serve.keepalive_s=0", "serve.keepalive_s=0", "serve.keepalive_s"),
]
CONFIG += [      # serving hardening (issue 30): the two new serve.* keys
    _serve_cfg("request-timeout-negative", "serve.request_timeout_s=-1", "serve.request_timeout_s=-1",
               "serve.request_timeout_s"),
    _serve_cfg("max-boxes-text", "serve.max_boxes_per_page=many", "serve.max_boxes_per_page=many",
               "serve.max_boxes_per_page"),
]


class _Held:
    """Something a case holds until it ends (a mount, a process): release_held() closes it."""

    def __init__(self, close: Callable[[], None]):
        self.close = close


def mount_tmpfs(e: Env, name: str, *, readonly: bool = False, size: str = "64m", fill_from: Path | None = None) -> Path:
    """A real tmpfs at e.tmp/name (read-only, or small for ENOSPC), unmounted when the case ends.
    Skips where mounting is not allowed (tests run as root here; chmod alone cannot deny root)."""
    import subprocess

    import pytest

    point = e.tmp / name
    point.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    _HELD.append(_Held(lambda: subprocess.run(["umount", "-l", str(point)], capture_output=True)))
    if fill_from is not None:
        shutil.copytree(fill_from, point, dirs_exist_ok=True)
    if readonly:
        subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True, capture_output=True)
    return point


def _ro_copy_of_run(e: Env) -> Path:
    src = damaged_run(e, "train/info.json", (e.base / "runs" / "smoke" / "train" / "info.json").read_bytes())
    return mount_tmpfs(e, "ro-runs", readonly=True, size="256m", fill_from=src)


def _stages_copy(e: Env) -> Path:
    return damaged_run(e, "train/info.json", (e.base / "runs" / "smoke" / "train" / "info.json").read_bytes())


def hold_run_lock(e: Env) -> Path:
    """Another process holding the run folder's lock (pipeline/core/runlock.py); returns its run.root."""
    import subprocess

    root = e.tmp / "locked"
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from pipeline.core import runlock; "
            f"runlock.acquire({str(root / 'smoke')!r}); print('locked', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    _HELD.append(_Held(lambda: (proc.kill(), proc.wait())))
    assert proc.stdout.readline().strip() == "locked"
    return root


STORAGE = [
    CliCase("run-locked", "run: storage", "a second run into a run folder another process is writing",
            lambda e: ["run", "train", *e.smoke(root=hold_run_lock(e))], ("in use by pid", "since", "run.name")),
    CliCase("run-root-readonly", "run: storage", "run.root on a read-only file system (a real read-only tmpfs)",
            lambda e: ["run", "train", *e.smoke(root=mount_tmpfs(e, "ro", readonly=True))], ("read-only", "ro")),
    CliCase("run-uptodate-readonly", "run: storage", "an up-to-date run on a read-only mount",
            lambda e: ["run", "train", *e.smoke(root=_ro_copy_of_run(e))], ("read-only",)),
    CliCase("bundle-root-readonly", "run: storage", "bundle.root on a read-only file system",
            lambda e: ["run", "bundle", *e.smoke(f"bundle.root={mount_tmpfs(e, 'ro-b', readonly=True)}", root=_stages_copy(e))],
            ("bundle: cannot write", "read-only")),
    CliCase("bundle-root-full", "run: storage", "bundle.root on a full file system (a 64 KiB tmpfs)",
            lambda e: ["run", "bundle", *e.smoke(f"bundle.root={mount_tmpfs(e, 'full', size='64k')}", root=_stages_copy(e))],
            ("bundle: cannot write", "no space left")),
    CliCase("run-root-is-file", "run: storage", "run.root that is a regular file",
            lambda e: ["run", "train", *e.smoke(root=e.write("afile", "x"))], ("cannot", "afile")),
    CliCase("bundle-root-is-file", "run: storage", "bundle.root that is a regular file",
            lambda e: ["run", "bundle", *e.smoke(f"bundle.root={e.write('bfile', 'x')}", root=_stages_copy(e))],
            ("bundle:", "bfile")),
]


def _sample_replaced(e: Env, data: bytes) -> Path:
    with np.load(e.bundle / "samples" / "expected.npz") as z:
        rel = str(z["files"][0])
    return tampered_rehashed(e, rel, data)


VERIFY += [
    CliCase("verify-sample-dds", "verify: content", "a bundle sample replaced by a malformed DDS, manifest rehashed",
            lambda e: ["verify", str(_sample_replaced(e, dds_malformed()))], ("samples", "not a readable image")),
]




def table() -> str:
    """Markdown table of every case (docs/bad_inputs.md), with the count per category."""
    from collections import Counter

    counts = Counter(c.category for c in ALL)
    lines = ["# The bad-input corpus", "",
             "Generated from `tests/bad_inputs_cases.py` by `python scripts/bad_inputs_table.py`; run by",
             "`tests/test_bad_inputs.py` (part of `make test`). Every case must answer with a non-zero exit (CLI) or",
             "a 4xx status (HTTP), one line naming what is wrong and how to fix it, no traceback, and leave the",
             "hashes of every artifact that already existed (the run's stage outputs, the bundles) unchanged.", "",
             f"**{len(ALL)} cases**: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + ".", "",
             "| # | category | case | input | the answer names |", "|---|---|---|---|---|"]
    for i, c in enumerate(ALL, 1):
        answer = (f"HTTP {c.status}: " if c.kind == "http" else "") + ", ".join(f"`{x}`" for x in c.expect)
        what, answer = c.what.replace("|", "\\|"), answer.replace("|", "\\|")
        lines.append(f"| {i} | {c.category} | `{c.id}` | {what} | {answer} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ untrusted model files
# Each malicious file runs `touch <marker>` if anything unpickles it the way paddle.load does (pickle.load);
# the marker must never appear. Built at run time: no payload is committed.

MARKER = "PWNED"


class _Call:
    """An object whose pickle is a call of fn(*args): the classic __reduce__ payload."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _touch(marker: Path) -> _Call:
    return _Call(os.system, f"touch {marker}")


def small_state() -> dict:
    """What paddle.save(layer.state_dict()) holds: names -> float32 arrays (+ Paddle's name table)."""
    rng = np.random.default_rng(0)
    return {"fc.weight": rng.standard_normal((4, 3)).astype(np.float32), "fc.bias": np.zeros(3, np.float32),
            "StructuredToParameterName@@": {"fc.weight": "linear_0.w_0", "fc.bias": "linear_0.b_0"}}


def evil_pdparams(kind: str, marker: Path) -> bytes:
    """A .pdparams whose unpickling runs the payload: at the top, inside a dict value, inside a list, as an
    object-dtype array, or stealthily (runs, then yields the real weights: paddle.load returns them)."""
    import pickle

    state = small_state()
    if kind == "reduce":
        return pickle.dumps(_touch(marker), protocol=2)
    if kind == "nested-dict":
        return pickle.dumps({**state, "fc.weight": _touch(marker)}, protocol=4)
    if kind == "nested-list":
        return pickle.dumps({**state, "extra": [1, (2, [_touch(marker)])]}, protocol=4)
    if kind == "object-array":
        return pickle.dumps({**state, "fc.bias": np.array([_touch(marker)], dtype=object)}, protocol=4)
    if kind == "eval":
        return pickle.dumps(_Call(eval, f"__import__('os').system('touch {marker}')"), protocol=2)
    if kind == "stealthy":      # GLOBAL posix.system, call it, POP the result, then the genuine state dict
        call = b"c" + os.system.__module__.encode() + b"\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR0"
        return b"\x80\x02" + call + pickle.dumps(state, protocol=2)[2:]
    raise ValueError(kind)


EVIL_KINDS = ("reduce", "nested-dict", "nested-list", "object-array", "eval", "stealthy")


def pickle_bomb(kind: str) -> bytes:
    """A small .pdparams that runs nothing but costs time or memory (issue 47): a DAG of shared lists (2^61
    paths for a walk that does not remember), numpy.ndarray(shape) (1.6 GB of uninitialised "weights" from 40
    bytes), a zero-stride view (a 3.2 GB array over 8 bytes), one 64 KB string encoded 2000 times (128 MB)."""
    import codecs
    import pickle

    if kind == "dag":
        x: list = []
        for _ in range(60):
            x = [x, x]
        return pickle.dumps({"fc.weight": x}, protocol=2)
    if kind == "ndarray-alloc":
        return pickle.dumps({"fc.weight": _Call(np.ndarray, (200_000_000,))}, protocol=2)
    if kind == "zero-stride":
        return pickle.dumps({"fc.weight": _Call(np.ndarray, (400_000_000,), "f8", b"\0" * 8, 0, (0,))}, protocol=2)
    if kind == "memo-encode":
        text = "w" * (64 << 10)
        return pickle.dumps({"fc.weight": [_Call(codecs.encode, text, "latin1") for _ in range(2000)]}, protocol=2)
    raise ValueError(kind)


BOMB_KINDS = ("dag", "ndarray-alloc", "zero-stride", "memo-encode")


def _evil_pretrained(e: Env, kind: str) -> list[str]:
    path = e.write(f"{kind}.pdparams", evil_pdparams(kind, e.tmp / MARKER))
    return ["run", "train", *e.smoke(f"model.pretrained={path}", root=e.tmp / "runs")]


def tiny_program(folder: Path) -> Path:
    """A small exported classifier ([N, 1, 32, 32] -> [N, 36], the smoke data) -> its folder."""
    import paddle
    from paddle.static import InputSpec

    folder.mkdir(parents=True, exist_ok=True)
    layer = paddle.nn.Sequential(paddle.nn.Conv2D(1, 4, 3, padding=1), paddle.nn.AdaptiveAvgPool2D(1),
                                 paddle.nn.Flatten(), paddle.nn.Linear(4, 36))
    layer.eval()
    paddle.jit.save(layer, str(folder / "inference"), input_spec=[InputSpec([None, 1, 32, 32], "float32", "x")])
    return folder


def _varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def damaged_params(e: Env, how: str) -> Path:
    """A tiny export whose .pdiparams is truncated, declares a huge tensor, or has a broken header."""
    folder = tiny_program(e.tmp / "model")
    p = folder / "inference.pdiparams"
    raw = bytearray(p.read_bytes())
    if how == "truncated":
        raw = raw[:len(raw) - 7]
    elif how == "huge":          # first tensor's first dim -> 2^40 (protobuf varint), the file stays small
        desc_len = struct.unpack("<i", raw[16:20])[0]
        dims = _varint(1 << 40) + _varint(3)
        new = b"\x08\x05" + b"\x12" + bytes([len(dims)]) + dims      # float32, packed dims [2^40, 3]
        raw[16:20 + desc_len] = struct.pack("<i", len(new)) + new
    elif how == "garbage":
        raw[0:4] = b"\xde\xad\xbe\xef"
    p.write_bytes(bytes(raw))
    return folder


def _import(e: Env, folder: Path) -> list[str]:
    return ["run", "train", *e.smoke("model.source=inference", f"model.path={folder}", root=e.tmp / "runs")]


def _yml_not_mapping(e: Env) -> Path:
    folder = tiny_program(e.tmp / "model")
    (folder / "inference.yml").write_text("- PreProcess\n- PostProcess\n")
    return folder


def fifo(e: Env, name: str) -> Path:
    p = e.tmp / name
    os.mkfifo(p)
    return p


def alias_bomb() -> str:
    """718 bytes in the issue; this one is ~340: nine levels of nine aliases = 9^9 leaves when walked."""
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        text += f"{cur}: &{cur} [{', '.join(['*' + prev] * 9)}]\n"
    return text


def _rec(e: Env, *over: str, root: Path | None = None) -> list[str]:
    return ["run", "train", *e.smoke("task=recognition", "model.name=crnn", "data.width=128", "data.num_train=64",
                                     "data.num_val=16", *over, root=root or e.tmp / "runs")]


def _other_run(e: Env) -> Path:
    """A run.root holding another run ('train', with a stage output) that run.name=. would have replaced."""
    root = e.tmp / "runs"
    shutil.copytree(e.base / "runs" / "smoke" / "train", root / "train" / "train")
    return root


UNTRUSTED = [
    *[CliCase(f"pdparams-{k}", "untrusted model files", f"model.pretrained .pdparams with a pickle payload ({k})",
              lambda e, k=k: _evil_pretrained(e, k), ("refused", f"{k}.pdparams", "was not run"), absent=(MARKER,))
      for k in EVIL_KINDS],
    *[CliCase(f"pdparams-bomb-{k}", "untrusted model files", f"model.pretrained .pdparams costing time or memory ({k})",
              lambda e, k=k: ["run", "train", *e.smoke(f"model.pretrained={e.write(k + '.pdparams', pickle_bomb(k))}",
                                                       root=e.tmp / "runs")], ("refused", f"{k}.pdparams"))
      for k in BOMB_KINDS],
    CliCase("pdparams-not-pickle", "untrusted model files", "model.pretrained .pdparams that is random bytes",
            lambda e: ["run", "train", *e.smoke(f"model.pretrained={e.write('w.pdparams', os.urandom(256))}",
                                                root=e.tmp / "runs")], ("w.pdparams", "not a Paddle parameter file")),
    CliCase("pdparams-list", "untrusted model files", "model.pretrained .pdparams holding a list, not a state dict",
            lambda e: ["run", "train", *e.smoke(f"model.pretrained={e.write('l.pdparams', __import__('pickle').dumps([1, 2]))}",
                                                root=e.tmp / "runs")], ("l.pdparams", "not a state dict")),
    CliCase("pdparams-fifo", "untrusted model files", "model.pretrained that is a FIFO (hung before)",
            lambda e: ["run", "train", *e.smoke(f"model.pretrained={fifo(e, 'w.pdparams')}", root=e.tmp / "runs")],
            ("w.pdparams", "not a regular file")),
    CliCase("pdiparams-truncated", "untrusted model files", "imported program whose .pdiparams is cut short",
            lambda e: _import(e, damaged_params(e, "truncated")), ("inference.pdiparams", "truncated")),
    CliCase("pdiparams-huge", "untrusted model files", "imported .pdiparams declaring a 2^40-element tensor",
            lambda e: _import(e, damaged_params(e, "huge")), ("inference.pdiparams", "tensor #0", "remain")),
    CliCase("pdiparams-garbage", "untrusted model files", "imported .pdiparams with a damaged tensor header",
            lambda e: _import(e, damaged_params(e, "garbage")), ("inference.pdiparams", "not a Paddle tensor")),
    CliCase("inference-yml-list", "untrusted model files", "imported model whose inference.yml is a list",
            lambda e: _import(e, _yml_not_mapping(e)), ("inference.yml", "must hold a mapping")),
    CliCase("model-max-bytes", "untrusted model files", "imported program over model.max_file_bytes",
            lambda e: [*_import(e, tiny_program(e.tmp / "model")), "-o", "model.max_file_bytes=100"],
            ("over the limit of 100", "model.max_file_bytes")),
    CliCase("charset-fifo", "data", "charset file that is a FIFO (hung silently)",
            lambda e: _rec(e, f"data.charset={fifo(e, 'dict.txt')}"), ("dict.txt", "not a regular file")),
    CliCase("charset-device", "data", "charset file /dev/zero (grew past 1.5 GB)",
            lambda e: _rec(e, "data.charset=/dev/zero"), ("/dev/zero", "not a regular file")),
    CliCase("charset-huge", "data", "charset file over data.max_text_bytes",
            lambda e: _rec(e, f"data.charset={e.write('dict.txt', 'A' * 5000)}", "data.max_text_bytes=1000"),
            ("dict.txt", "data.max_text_bytes=1000")),
    CliCase("labelfile-fifo", "data", "recognition label file that is a FIFO",
            lambda e: _rec(e, "data.source=folder", f"data.path={fifo(e, 'gt.txt')}"), ("gt.txt", "not a regular file")),
    CliCase("labelfile-lines", "data", "recognition label file over data.max_text_lines",
            lambda e: _rec(e, "data.source=folder", f"data.path={e.write('gt.txt', 'a.png' + chr(9) + 'A' + chr(10) * 50)}",
                           "data.max_text_lines=10"), ("gt.txt", "data.max_text_lines=10")),
]

CONFIG += [
    CliCase("config-alias-bomb", "config file", "a YAML alias bomb (passed 2 GB in 31 s)",
            lambda e: ["run", "train", "-c", str(e.write("c.yaml", alias_bomb()))], ("c.yaml", "alias bomb")),
    CliCase("config-deep", "config file", "a 5000-deep nested list (RecursionError traceback)",
            lambda e: ["run", "train", "-c", str(e.write("c.yaml", "x: " + "[" * 5000 + "]" * 5000))],
            ("c.yaml", "nesting deeper than")),
    CliCase("config-duplicate-key", "config file", "a duplicate train: block (the first was silently dropped)",
            lambda e: ["run", "train", "-c", str(e.write("c.yaml", "train:\n  epochs: 3\nseed: 1\ntrain:\n  lr: 0.1\n"))],
            ("'train' appears twice", "lines 1 and 4")),
    CliCase("config-not-utf8", "config file", "a Latin-1 config (UnicodeDecodeError traceback)",
            lambda e: ["run", "train", "-c", str(e.write("c.yaml", "run:\n  name: caf\xe9\n".encode("latin-1")))],
            ("c.yaml", "not UTF-8", "line 2")),
    CliCase("config-fifo", "config file", "a config that is a FIFO", lambda e: ["run", "train", "-c", str(fifo(e, "c.yaml"))],
            ("c.yaml", "not a regular file")),
    CliCase("override-alias-bomb", "O= string", "an alias bomb inside -o model.args={...}",
            lambda e: ["run", "train", *e.smoke("model.args={a: &a [1,1,1,1,1,1,1,1,1,1], b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], "
                                                "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], "
                                                "e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], f: [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]}")],
            ("alias bomb",)),
    _cfg("run-name-dot", "run.name=. (made run.root the run folder: replaced another run's runs/train)", "run.name=.",
         "run.name", "run.root"),
    _cfg("run-name-dotdot", "run.name=.. (wrote .lock, .work/ and train.failed/ into the checkout)", "run.name=..",
         "run.name"),
    _cfg("run-name-hidden", "run.name=.work (the runner's own folder names)", "run.name=.work", "run.name"),
    _cfg("run-name-empty", "run.name empty", "run.name=''", "run.name"),
    _cfg("run-name-slashes", "run.name=a/../..", "run.name=a/../..", "run.name"),
    _cfg("run-root-checkout", "run.root=. (the checkout itself)", "run.root=.", "run.root", "a folder of its own"),
    _cfg("run-root-slash", "run.root=/", "run.root=/", "run.root"),
    _cfg("bundle-root-parent", "bundle.root=.. (the checkout's parent)", "bundle.root=..", "bundle.root"),
    _cfg("seed-over-32-bits", "seed=4294967296 (a traceback in numpy's seeding)", "seed=4294967296", "seed",
         "less than 4294967296"),
    _cfg("num-train-huge", "data.num_train=10^20 (a traceback)", "data.num_train=100000000000000000000",
         "data.num_train", "10000000"),
    _cfg("max-len-huge", "data.max_len=10^20 (a traceback)", "data.max_len=100000000000000000000", "data.max_len"),
    _cfg("threads-huge", "run.threads=10^20 (ended in SIGSEGV)", "run.threads=100000000000000000000", "run.threads",
         "over the limit"),
    _cfg("threads-per-core", "run.threads=100000 (far more threads than cores)", "run.threads=100000", "run.threads",
         "threads per core"),
    _cfg("tolerance-inf", "server.gates.fp32.atol=.inf (a gate that can never fail)", "server.gates.fp32.atol=.inf",
         "server.gates.fp32.atol", "finite"),
    _cfg("bundle-version-path", "bundle.version=x/../../victim (a second run deleted a folder outside bundle.root)",
         "bundle.version=x/../../victim", "bundle.version", "pattern"),
    CliCase("run-into-bundle", "config (-o)", "run.root=<bundle.root> run.name=<a published bundle> (wrote into it)",
            lambda e: ["run", "train", *e.smoke(f"run.name={e.bundle.name}", root=e.bundle.parent)],
            ("run folder", "bundle.root", "overlap")),
    _cfg("cache-home", "data.cache_dir=$HOME (the home folder)", f"data.cache_dir={Path.home()}", "data.cache_dir",
         "a folder of its own"),
]

STAGES += [
    CliCase("run-inside-input", "run: stages", "model.pretrained inside this run's own folder (its stages replace it)",
            lambda e: ["run", "train", *e.smoke(f"model.pretrained={e.tmp / 'runs' / 'smoke' / 'train' / 'model.pdparams'}",
                                                root=e.tmp / "runs")], ("model.pretrained", "this run's own folder")),
    CliCase("stage-folder-foreign", "run: stages", "a run whose stage folder exists but was not made by the pipeline",
            lambda e: ["run", "train", *e.smoke(root=_foreign_stage_folder(e))], ("train", "not made by this pipeline")),
]


def _foreign_stage_folder(e: Env) -> Path:
    root = e.tmp / "runs"
    (root / "smoke" / "train").mkdir(parents=True)
    (root / "smoke" / "train" / "notes.txt").write_text("mine")
    return root


def swapped_int8(e: Env, rel: str) -> Path:
    """A bundle whose int8 model (ONNX, or OpenVINO's weights) was replaced and the manifest rehashed: `serve
    --precision int8` would serve it, and verify never ran it before."""
    b = copy_bundle(e)
    p = b / rel
    if p.suffix == ".onnx":
        import onnx
        from onnx import numpy_helper

        m = onnx.load(str(p))
        for init in m.graph.initializer:          # the first int8 weight tensor, negated
            arr = numpy_helper.to_array(init)
            if arr.dtype == np.int8 and arr.size > 16:
                init.CopyFrom(numpy_helper.from_array((-arr.astype(np.int16)).clip(-127, 127).astype(np.int8), init.name))
                break
        onnx.save(m, str(p))
    else:                                        # every int8 weight constant of the IR negated, in place
        import xml.etree.ElementTree as ET

        raw = np.frombuffer(p.read_bytes(), np.int8).copy()
        for layer in ET.parse(p.with_suffix(".xml")).getroot().iter("layer"):
            data = layer.find("data")
            if layer.get("type") == "Const" and data is not None and data.get("element_type") == "i8":
                at, n = int(data.get("offset")), int(data.get("size"))
                raw[at:at + n] = (-raw[at:at + n].astype(np.int16)).clip(-127, 127).astype(np.int8)
        p.write_bytes(raw.tobytes())
    rehash(b, rel)
    return b


def _ro_bundle(e: Env) -> Path:
    return mount_tmpfs(e, "ro-sign", readonly=True, size="256m", fill_from=e.bundle)


VERIFY += [
    CliCase("verify-int8-onnx-swapped", "verify: content", "int8 ONNX model replaced, manifest rehashed (was never run)",
            lambda e: ["verify", str(swapped_int8(e, "server/onnx/model_int8.onnx"))], ("onnxruntime", "on samples")),
    CliCase("verify-int8-openvino-swapped", "verify: content", "OpenVINO int8 weights scrambled, manifest rehashed",
            lambda e: ["verify", str(swapped_int8(e, "server/openvino/model_int8.bin"))], ("openvino", "on samples")),
]

SIGNATURE += [
    CliCase("sign-readonly", "sign", "sign a bundle on read-only storage (OSError traceback)",
            lambda e: ["sign", str(_ro_bundle(e)), "--key", str(e.priv)], ("sign: cannot write", "read-only")),
]




# ------------------------------------------------------------------------------------ PIR programs (issue 47)

def _pir_at(kind: str, value) -> dict:
    return {"#": kind, "D": value}


def _pir_ints(*v) -> dict:
    return _pir_at("0.a_array", [_pir_at("0.a_i32", x) for x in v])


def _pir_tt(shape, dtype="0.t_f32") -> dict:
    return {"#": "0.t_dtensor", "D": [{"#": dtype}, list(shape), "NCHW", [], 0]}


def pir_doc(relus: int = 1) -> dict:
    """A genuine PIR program: x[-1,3,8,8] -> conv2d (one [4,3,3,3] parameter) -> relu (x relus) -> fetch."""
    conv_attrs = [("strides", _pir_ints(1, 1)), ("paddings", _pir_ints(1, 1)),
                  ("padding_algorithm", _pir_at("0.a_str", "EXPLICIT")), ("dilations", _pir_ints(1, 1)),
                  ("groups", _pir_at("0.a_i32", 1)), ("data_format", _pir_at("0.a_str", "NCHW"))]
    ops = [{"#": "p", "A": [0, 1, 1, "conv2d_0.w_0"], "O": {"%": 1, "TT": _pir_tt([4, 3, 3, 3])}},
           {"#": "1.data", "A": [{"AT": _pir_at("0.a_str", "x"), "N": "name"},
                                 {"AT": _pir_at("1.a_intarray", [-1, 3, 8, 8]), "N": "shape"},
                                 {"AT": _pir_at("1.a_dtype", "float32"), "N": "dtype"}],
            "I": [], "O": [{"%": 2, "TT": _pir_tt([-1, 3, 8, 8])}]},
           {"#": "1.conv2d", "A": [{"AT": a, "N": n} for n, a in conv_attrs], "I": [{"%": 2}, {"%": 1}],
            "O": [{"%": 3, "TT": _pir_tt([-1, 4, 8, 8])}]}]
    for k in range(relus):
        ops.append({"#": "1.relu", "A": [], "I": [{"%": 3 + k}], "O": [{"%": 4 + k, "TT": _pir_tt([-1, 4, 8, 8])}]})
    ops.append({"#": "1.fetch", "A": [{"AT": _pir_at("0.a_str", "out"), "N": "name"}, {"AT": _pir_at("0.a_i32", 0), "N": "col"}],
                "I": [{"%": 3 + relus}], "O": [{"%": 100 + relus, "TT": _pir_tt([-1, 4, 8, 8])}]})
    return {"base_code": {"magic": "pir", "trainable": True, "version": 1},
            "program": {"regions": [{"#": "region_0", "blocks": [{"#": "block_0", "args": [], "ops": ops}]}]}}


def pdiparams_tensor(shape, dtype_code: int = 5, data: bytes | None = None, desc: bytes | None = None) -> bytes:
    """One LoDTensor record as save_combine writes it (pipeline/engines/params_file.py has the layout)."""
    dims = b"".join(_varint(d) for d in shape)
    desc = desc if desc is not None else b"\x08" + _varint(dtype_code) + b"\x12" + _varint(len(dims)) + dims
    n = int(np.prod(shape)) * 4
    return struct.pack("<IQ", 0, 0) + struct.pack("<Ii", 0, len(desc)) + desc + (data if data is not None else b"\0" * n)


def _pir_ops(doc: dict) -> list:
    return doc["program"]["regions"][0]["blocks"][0]["ops"]


def _pir_mutate(how: str, doc: dict) -> tuple[dict | str, bytes]:
    """(inference.json document or raw text, .pdiparams bytes) for a malformed variant of pir_doc()."""
    ops, params = _pir_ops(doc), pdiparams_tensor([4, 3, 3, 3])
    conv = ops[2]
    if how == "op-without-#":
        del ops[3]["#"]
    elif how == "no-regions":
        del doc["program"]["regions"]
    elif how == "ops-not-a-list":
        doc["program"]["regions"][0]["blocks"][0]["ops"] = {"0": ops[0]}
    elif how == "attrs-not-a-list":
        conv["A"] = "strides"
    elif how == "attr-without-value":
        del conv["A"][0]["AT"]
    elif how == "param-unknown-dtype":
        ops[0]["O"]["TT"]["D"][0]["#"] = "0.t_quaternion"
    elif how == "param-name-not-a-string":
        ops[0]["A"][3] = 7
    elif how == "conv-missing-input":
        conv["I"] = [{"%": 2}]
    elif how == "conv-strides-a-string":
        conv["A"][0]["AT"] = _pir_at("0.a_str", "two")
    elif how == "undefined-value":
        ops[3]["I"] = [{"%": 999}]
    elif how == "params-garbage":
        params = b"\xde\xad\xbe\xef" * 40
    elif how == "params-bad-desc":
        params = pdiparams_tensor([4, 3, 3, 3], desc=b"\xff\xff\xff")
    elif how == "params-unknown-dtype":
        params = pdiparams_tensor([4, 3, 3, 3], dtype_code=22)          # bfloat16: no numpy type to read it as
    elif how == "params-extra-tensor":
        params += pdiparams_tensor([4])
    elif how == "not-json":
        return "{\"base_code\": [1, 2", params
    elif how == "deep-json":
        return "[" * 100_000 + "]" * 100_000, params
    elif how == "many-ops":                                # 3,500 ops: over model.pir_max_ops (Paddle builds ops superlinearly)
        doc = pir_doc(relus=3_500)
    elif how == "many-params":                             # 6,000 parameters: hung in create_parameter at 50,000
        ops[1:1] = [{"#": "p", "A": [0, 1, 1, f"extra_{k}.w_0"], "O": {"%": 10_000 + k, "TT": _pir_tt([1])}}
                    for k in range(6_000)]
    else:
        raise ValueError(how)
    return doc, params


PIR_MALFORMED = ("op-without-#", "no-regions", "ops-not-a-list", "attrs-not-a-list", "attr-without-value",
                 "param-unknown-dtype", "param-name-not-a-string", "conv-missing-input", "conv-strides-a-string",
                 "undefined-value", "params-garbage", "params-bad-desc", "params-unknown-dtype",
                 "params-extra-tensor", "not-json")
PIR_TOO_BIG = ("deep-json", "many-ops", "many-params")


def pir_model(folder: Path, how: str | None = None) -> Path:
    """A tiny PIR export (inference.json + .pdiparams): genuine when how is None, else that malformed variant."""
    doc, params = _pir_mutate(how, pir_doc()) if how else (pir_doc(), pdiparams_tensor([4, 3, 3, 3]))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "inference.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
    (folder / "inference.pdiparams").write_bytes(params)
    return folder


def _pir_import(e: Env, how: str) -> list[str]:
    return ["run", "train", "-c", "configs/ppocr_v5_det.yaml", "-o", f"model.path={pir_model(e.tmp / 'm', how)}",
            "-o", f"run.root={e.tmp / 'runs'}", "-o", f"bundle.root={e.tmp / 'bundles'}",
            "-o", f"regression.history={e.tmp / 'history.sqlite'}"]


UNTRUSTED += [
    CliCase(f"pir-{how}", "untrusted model files", f"model.source=pir program: {how.replace('-', ' ')}",
            lambda e, how=how: _pir_import(e, how), words, hint=True)
    for how, words in [("op-without-#", ("inference.json", "op #3", "malformed")),
                       ("conv-missing-input", ("inference.json", "conv2d", "malformed")),
                       ("params-unknown-dtype", ("inference.pdiparams", "data type 22")),
                       ("deep-json", ("inference.json", "model.pir_max_depth")),
                       ("many-ops", ("inference.json", "over the limit of 3000", "model.pir_max_ops")),
                       ("many-params", ("inference.json", "model.pir_max_params"))]
]


# ------------------------------------------------------------------------------------ inference.yml values (issue 47)

_DET_YML = """PreProcess:
  transform_ops:
  - DetResizeForTest:
      resize_long: {side}
  - NormalizeImage:
      {mean}std: [0.229, 0.224, 0.225]
PostProcess:
  name: DBPostProcess
  thresh: {thresh}
  box_thresh: {box_thresh}
  max_candidates: 1000
  unclip_ratio: {unclip}
"""
_REC_YML = "PreProcess:\n  transform_ops:\n  - RecResizeImg:\n      image_shape: {shape}\n"

# case -> (yml text, words of the answer); each was a traceback (hints, db_post) or got into the config silently
YML_CASES = {
    "pre-a-list": ("PreProcess: [1, 2]\n", ("PreProcess", "inference.yml")),
    "shape-2-values": (_REC_YML.format(shape="[48, 320]"), ("image_shape", "[channels, height, width]")),
    "side-inf": (None, ("inference.yml", "OverflowError")),
    "no-mean": (None, ("inference.yml", "KeyError")),
    "thresh-high": (None, ("detection.thresh='high'",)),
    "unclip-1e300": (None, ("detection.unclip_ratio=1e+300",)),
    "box-thresh-negative": (None, ("detection.box_thresh=-3",)),
    "channels-7": (_REC_YML.format(shape="[7, 48, 320]"), ("data.channels=7",)),
}


def inference_yml(case: str) -> str:
    text = YML_CASES[case][0]
    if text is not None:
        return text
    det = {"side": 960, "mean": "mean: [0.485, 0.456, 0.406]\n      ", "thresh": 0.3, "box_thresh": 0.6,
           "unclip": 1.5}
    det.update({"side-inf": {"side": ".inf"}, "no-mean": {"mean": ""}, "thresh-high": {"thresh": "high"},
                "unclip-1e300": {"unclip": "1.0e+300"}, "box-thresh-negative": {"box_thresh": -3}}[case])
    return _DET_YML.format(**det)


def _pir_with_yml(e: Env, case: str) -> list[str]:
    """The smallest config an import needs (task, model.source, model.path): every other key comes from the yml."""
    folder = pir_model(e.tmp / "m")
    (folder / "inference.yml").write_text(inference_yml(case))
    task = "recognition" if "shape" in case or "channels" in case else "detection"
    conf = e.write("import.yaml", f"task: {task}\nmodel:\n  source: pir\n  path: {folder}\ntrain:\n  nproc: 1\n")
    return ["run", "train", "-c", str(conf), "-o", f"run.root={e.tmp / 'runs'}", "-o", f"bundle.root={e.tmp / 'bundles'}",
            "-o", f"regression.history={e.tmp / 'history.sqlite'}"]


UNTRUSTED += [
    CliCase(f"inference-yml-{case}", "untrusted model files", f"model.source=pir inference.yml: {case.replace('-', ' ')}",
            lambda e, case=case: _pir_with_yml(e, case), words)
    for case, (_, words) in YML_CASES.items()
]


# ------------------------------------------------------------------------------------ ONNX external data (issue 47)

def _external_tensor(name: str, location: str, n: int = 4):
    """A float32 [n] tensor whose bytes ONNX Runtime reads from `location` (relative to the model's folder)."""
    import onnx

    t = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=[n])
    t.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(4 * n))):
        t.external_data.add(key=k, value=v)
    return t


def onnx_reading(folder: Path, location: str, where: str = "constant") -> Path:
    """folder/model.onnx: y = x + c, c a [4] float tensor kept in `location`: a Constant node's value, an
    initializer, or a Constant inside an If subgraph. Harmless only if `location` is the model's own file."""
    import onnx
    from onnx import TensorProto, helper

    folder.mkdir(parents=True, exist_ok=True)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    inits, nodes = [], []
    if where == "initializer":
        inits.append(_external_tensor("c", location))
    elif where == "constant":
        nodes.append(helper.make_node("Constant", [], ["c"], value=_external_tensor("cv", location)))
    else:                                       # inside an If's branch: only a walk into subgraphs finds it
        branch = helper.make_graph([helper.make_node("Constant", [], ["cb"], value=_external_tensor("cv", location))],
                                   "then", [], [helper.make_tensor_value_info("cb", TensorProto.FLOAT, [4])])
        nodes += [helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
                  helper.make_node("If", ["cond"], ["c"], then_branch=branch, else_branch=branch)]
    nodes.append(helper.make_node("Add", ["x", "c"], ["y"]))
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], initializer=inits),
                              opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def _bundle_onnx_reading_outside(e: Env) -> Path:
    """The smoke bundle with an unused Constant added to server/onnx/model.onnx whose bytes come from a file
    outside the bundle (../../../secret.bin); manifest rehashed (an unsigned bundle: what an attacker does). A
    symlink inside the bundle is refused by the hash check already."""
    import onnx

    b = copy_bundle(e)
    e.write("secret.bin", b"\x00\x00\x80?" * 4)             # beside the bundle: <tmp>/secret.bin
    m = onnx.load(str(b / "server" / "onnx" / "model.onnx"))
    from onnx import helper
    m.graph.node.append(helper.make_node("Constant", [], ["evil_c"],
                                         value=_external_tensor("cv", "../../../secret.bin")))
    onnx.save(m, str(b / "server" / "onnx" / "model.onnx"))
    rehash(b, "server/onnx/model.onnx")
    return b


VERIFY += [
    CliCase("verify-onnx-external-outside", "verify: content",
            "bundle ONNX with a Constant read through a symlink to a file outside the bundle, manifest rehashed",
            lambda e: ["verify", str(_bundle_onnx_reading_outside(e))], ("model.onnx", "outside the model's folder")),
]
UNTRUSTED += [
    CliCase("onnx-import-external-constant", "untrusted model files",
            "model.source=onnx whose Constant node reads `Makefile` as external data (passed onnx.checker)",
            lambda e: ["run", "train", *e.smoke("model.source=onnx", f"model.path={onnx_reading(e.tmp / 'm', 'Makefile')}",
                                                root=e.tmp / "runs")], ("model.onnx", "external files", "Constant")),
]


CLI_CASES = CONFIG + STAGES + MODEL + DATA + VERIFY + SIGNATURE + SERVE + REGRESSION + STORAGE + UNTRUSTED
ALL = CLI_CASES + HTTP + PROC

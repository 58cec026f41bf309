"""The bad-input corpus (tests/bad_inputs_cases.py, listed in docs/bad_inputs.md), plus the fixes it checks
that need more than one input: signed bundles end to end, the concurrency limit, temp folders after kill -9.

Every case: non-zero exit or 4xx; exactly one error line naming what is wrong (and, for our own errors, a
hint saying how to fix it); no traceback; the hashes of every artifact that existed before are unchanged.
CLI cases run in-process through cli.main (a subprocess per case would re-import paddle: seconds each);
the make/O= path and the CLI entry itself run as real subprocesses.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bad_inputs_cases as corpus

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------ fixtures

def _keys(folder: Path) -> tuple[Path, Path, Path]:
    """A fresh EC P-256 key pair (+ an unrelated public key), generated now: no private key is ever committed."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("signer", "other"):
        key = ec.generate_private_key(ec.SECP256R1())
        priv, pub = folder / f"{name}.pem", folder / f"{name}.pub.pem"
        priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
        paths += [priv, pub]
    return paths[0], paths[1], paths[3]


@pytest.fixture(scope="module")
def env(smoke_chain, smoke_bundle, tmp_path_factory):
    from pipeline.bundle import signing

    keys = tmp_path_factory.mktemp("keys")
    priv, pub, other = _keys(keys)
    signed = tmp_path_factory.mktemp("signed") / smoke_bundle[0].name
    shutil.copytree(smoke_bundle[0], signed)
    signing.sign(signed, priv)
    return corpus.Env(base=smoke_chain.parent.parent, bundle=smoke_bundle[0], archive=smoke_bundle[1],
                      signed=signed, priv=priv, pub=pub, other_pub=other)


@pytest.fixture
def case_env(env, tmp_path):
    e = corpus.Env(**{**env.__dict__, "tmp": tmp_path})
    yield e
    corpus.release_held()


_HASHES: dict[tuple, str] = {}


def snapshot(e: corpus.Env) -> dict[str, str]:
    """sha256 of every artifact that exists before a case: stage outputs, bundles, the signed copy.
    (config.resolved.yaml records the latest invocation, .lock the latest writer, .work/ is scratch, log/ holds the
    runs' logs (native.log is appended by every run): not artifacts.)
    A file whose inode, size and mtime are unchanged is not re-read: any rewrite changes them."""
    out = {}
    for top in (e.base / "runs" / "smoke", e.base / "bundles", e.signed):
        for p in sorted(top.rglob("*")):
            rel = p.relative_to(e.base if top != e.signed else top.parent)
            if p.is_file() and rel.name not in ("config.resolved.yaml", ".lock") and ".work" not in rel.parts \
                    and rel.parts[:3] != ("runs", "smoke", "log"):
                st = p.stat()
                key = (str(p), st.st_ino, st.st_size, st.st_mtime_ns)
                if key not in _HASHES:
                    _HASHES[key] = hashlib.sha256(p.read_bytes()).hexdigest()
                out[str(rel)] = _HASHES[key]
    return out


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """cli.main in this process, stdout/stderr captured (the pipeline logger writes to the capture too)."""
    import paddle

    from pipeline import cli

    cli.setup_logging()
    handler = logging.getLogger("pipeline").handlers[0]
    out, err = io.StringIO(), io.StringIO()
    old = handler.setStream(err)
    try:
        # a fresh layer-name scope: models built here must not shift the names later tests see
        with redirect_stdout(out), redirect_stderr(err), paddle.utils.unique_name.guard():
            try:
                code = cli.main([str(a) for a in argv])
            except SystemExit as exc:            # argparse
                code = exc.code
    finally:
        handler.setStream(old)
    return code, out.getvalue(), err.getvalue()


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ") or ": error: " in line]


def assert_one_line(code, out: str, err: str, case) -> str:
    text = out + err
    assert code not in (0, None), f"exit {code}\n{text[-2000:]}"
    assert "Traceback" not in text, text[-3000:]
    errors = error_lines(err)
    assert len(errors) == 1, f"expected one error line, got {len(errors)}:\n{err[-2000:]}"
    line = errors[0]
    for word in case.expect:
        assert word in line, f"{word!r} not in: {line}"
    if case.hint:
        assert "(hint: " in line, f"no hint on how to fix it: {line}"
    for word in getattr(case, "absent", ()):
        assert word not in text, f"{word!r} printed:\n{text[-2000:]}"
    return line


# ------------------------------------------------------------------------------------ the corpus

@pytest.mark.parametrize("case", corpus.CLI_CASES, ids=[c.id for c in corpus.CLI_CASES])
def test_cli_case(case, case_env):
    if case.id == "no-gpu":
        from pipeline.core import env as penv
        if penv.capabilities()["gpu"]:
            pytest.skip("this machine has a GPU")
    if "openvino" in case.id:       # a case that tampers with the bundle's OpenVINO files needs them built
        from pipeline.engines import registry
        ok, why = registry.available("openvino")
        if not ok:
            pytest.skip(f"no OpenVINO rows here, none bundled: {why}")
    before = snapshot(case_env)
    argv = case.argv(case_env)
    code, out, err = run_cli(argv)
    assert_one_line(code, out, err, case)
    assert snapshot(case_env) == before, "an existing artifact changed"


@pytest.fixture(scope="module")
def http(env):
    from fastapi.testclient import TestClient

    from pipeline.serving.app import create_app

    with TestClient(create_app(env.bundle), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("case", corpus.HTTP, ids=[c.id for c in corpus.HTTP])
def test_http_case(case, http, case_env):
    req = case.request(case_env)
    r = http.request(req.pop("method"), req.pop("url"), **req)
    assert r.status_code == case.status, r.text[:500]
    body = r.json()
    message = body.get("error") or str(body.get("detail"))
    assert "\n" not in message and "Traceback" not in r.text
    for word in case.expect:
        assert word in message, f"{word!r} not in: {message}"
    for word in case.absent:
        assert word not in message, f"{word!r} in: {message}"


@pytest.mark.parametrize("case", corpus.PROC, ids=[c.id for c in corpus.PROC])
def test_subprocess_case(case, case_env):
    before = snapshot(case_env)
    cmd = case.cmd(case_env)
    if cmd[0] == "make":
        if shutil.which("make") is None:
            pytest.skip("make is not installed")
        # -o: never (re)build the venv from inside a test; O must come from the case alone
        cmd = [cmd[0], "-o", ".venv/.installed-cpu", "-o", ".venv/.installed-gpu", *cmd[1:]]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k not in ("O", "CONFIG", "MAKEFLAGS")})
    assert_one_line(res.returncode, res.stdout, res.stderr, case)
    assert snapshot(case_env) == before, "an existing artifact changed"


def test_docs_table_is_current():
    doc = ROOT / "docs" / "bad_inputs.md"
    assert doc.read_text() == corpus.table(), "regenerate it: .venv/bin/python scripts/bad_inputs_table.py"
    assert len(corpus.ALL) >= 180


def test_16bit_copies_of_the_bundle_samples_are_classified_like_the_originals(env, http):
    """16-bit PNGs used to be clipped to all-white by convert('L'): every one answered like a blank image."""
    import numpy as np
    from PIL import Image

    with np.load(env.bundle / "samples" / "expected.npz") as z:
        files = [str(f) for f in z["files"]]
    for rel in files:
        original = (env.bundle / rel).read_bytes()
        pixels = np.asarray(Image.open(io.BytesIO(original)).convert("L"), dtype=np.uint16)
        buf = io.BytesIO()
        Image.fromarray(pixels * 257).save(buf, format="PNG")           # 16-bit, same picture
        assert Image.open(io.BytesIO(buf.getvalue())).mode == "I;16"
        answers = [http.post("/predict", content=body, headers={"content-type": "image/png"}).json()["predictions"]
                   for body in (original, buf.getvalue())]
        assert answers[0] == answers[1], rel


# ------------------------------------------------------------------------------------ signatures

def test_unsigned_bundle_verifies_and_says_unsigned(env):
    code, out, err = run_cli(["verify", env.bundle])
    assert code == 0, err[-2000:]
    assert "unsigned" in out.splitlines()[-1] and "NOT checked" in out


def test_signed_bundle_verifies_with_its_key_and_says_unchecked_without(env):
    code, out, err = run_cli(["verify", env.signed, "--key", env.pub])
    assert code == 0, err[-2000:]
    assert "signature verified" in out.splitlines()[-1]
    code, out, _ = run_cli(["verify", env.signed])
    assert code == 0 and "signature was NOT checked" in out


def test_tampered_signed_bundle_fails_before_any_file_is_parsed(env, tmp_path, monkeypatch):
    import pipeline.bundle.format
    import pipeline.engines.paddle_infer
    import pipeline.bundle.verify

    parsed = []
    monkeypatch.setattr(pipeline.engines.paddle_infer.InferenceEngine, "__init__",
                        lambda *a, **k: parsed.append("paddle") or (_ for _ in ()).throw(AssertionError("parsed")))
    monkeypatch.setattr(pipeline.bundle.verify, "load_infer_config", lambda *a: parsed.append("infer_config"))
    monkeypatch.setattr(pipeline.bundle.verify, "verify_hashes", lambda *a: parsed.append("manifest"))
    e = corpus.Env(**{**env.__dict__, "tmp": tmp_path})
    bad = corpus.tampered_rehashed(e, "server/fp32/inference.pdiparams", src=env.signed)
    code, out, err = run_cli(["verify", bad, "--key", env.pub])
    assert code != 0 and "signature check failed" in err and "inference.pdiparams" in err
    assert parsed == []
    # without the key the same bundle passes the hash check: only the signature tells
    monkeypatch.undo()
    from pipeline.bundle.format import verify_hashes
    verify_hashes(bad)


def test_sign_an_archive_then_verify_it(env, tmp_path):
    archive = tmp_path / env.archive.name
    shutil.copy2(env.archive, archive)
    code, out, err = run_cli(["sign", archive, "--key", env.priv])
    assert code == 0, err[-2000:]
    code, out, err = run_cli(["verify", archive, "--key", env.pub])
    assert code == 0, err[-2000:]
    assert "signature verified" in out


def test_bundle_stage_signs_when_a_key_is_configured(env, tmp_path):
    root = tmp_path / "runs"
    for stage in ("train", "export", "server", "lite"):
        shutil.copytree(env.base / "runs" / "smoke" / stage, root / "smoke" / stage)
    e = corpus.Env(**{**env.__dict__, "tmp": tmp_path})
    args = e.smoke(f"bundle.sign_key={env.priv}", f"bundle.root={tmp_path / 'bundles'}", root=root)
    code, out, err = run_cli(["run", "bundle", *args])
    assert code == 0, err[-3000:]
    folder = next(p for p in (tmp_path / "bundles").iterdir() if p.is_dir())
    assert (folder / "model.sig").is_file()
    code, out, err = run_cli(["verify", folder.with_name(folder.name + ".tar.gz"), "--key", env.pub])
    assert code == 0 and "signature verified" in out, err[-2000:]


# ------------------------------------------------------------------------------------ serve limits

def test_pixel_limit_is_read_from_the_header_not_the_pixels():
    from pipeline.data.preprocess import ImageTooLarge, decode_image_bytes

    spec = {"height": 32, "width": 32, "mean": 0.5, "std": 0.5}
    with pytest.raises(ImageTooLarge, match="10000x10000"):      # the PNG holds no pixel data at all
        decode_image_bytes(corpus.png_header(10000, 10000), spec, max_pixels=4096 * 4096)


# ------------------------------------------------------------------------------------ temp folders, O=

def test_temp_folders_of_a_killed_process_are_removed_by_the_next(tmp_path):
    code = ("import os, signal, sys; sys.path.insert(0, %r); from pipeline.core import tempdirs; "
            "print(tempdirs.make('lite-fp16-probe'), flush=True); os.kill(os.getpid(), signal.SIGKILL)" % str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == -signal.SIGKILL
    leaked = Path(res.stdout.strip())
    assert leaked.is_dir()                           # kill -9: no atexit ran
    from pipeline.core import tempdirs

    mine = tempdirs.make("lite-fp16-probe")
    try:
        assert not leaked.exists() and mine.is_dir()     # the next user of the kind reaped it, not its own
    finally:
        shutil.rmtree(mine, ignore_errors=True)


@pytest.mark.parametrize("text, items", [
    ('data.path="/data/my set" model.args={a: 1, b: 2}', ["data.path=/data/my set", "model.args={a: 1, b: 2}"]),
    ("train.epochs=3  train.amp.level=O2", ["train.epochs=3", "train.amp.level=O2"]),
    ("model.args={name: \"a b\", l: [1, 2]} x='it s'", ['model.args={name: "a b", l: [1, 2]}', "x=it s"]),
    ("", []),
])
def test_overrides_string_is_split_like_a_user_reads_it(text, items):
    from pipeline.core.config import load_config, split_overrides

    assert split_overrides(text) == items
    if text.startswith("data.path"):
        cfg = load_config([], split_overrides(text))
        assert cfg.data.path == "/data/my set" and cfg.model.args == {"a": 1, "b": 2}


def test_every_O_example_in_the_readme_parses():
    import re

    from pipeline.core.config import load_config, split_overrides

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(p.read_text() for p in pages if p.name != "bad_inputs.md")     # that one lists bad examples
    examples = [" ".join(m.group(2).split()) for m in re.finditer(r"\bO=([\"'])(.*?)\1", text, re.S)]
    assert len(examples) >= 3
    for ex in examples:
        load_config([], split_overrides(ex))            # raises ConfigError on a bad example

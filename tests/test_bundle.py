"""Bundles check themselves: hashes before loading, safe extraction, sample outputs reproduced.

Unsafe-archive tests craft tars with tarfile (fast, no chain). The rest share the session's
smoke-chain bundle (tests/conftest.py).
"""
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from pipeline.core.capabilities import host_arch

from pipeline.bundle.format import open_bundle, safe_extract, verify_hashes, write_archive
from pipeline.core.errors import IntegrityError, MissingArtifact
from tests.clirun import pipeline_cli as cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bundle(smoke_bundle):
    return smoke_bundle


@pytest.fixture
def bundle_copy(bundle, tmp_path):
    dst = tmp_path / bundle[0].name
    shutil.copytree(bundle[0], dst)
    return dst


# ------------------------------------------------------------------ crafted archives (fast)

def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes = b"x"):
    return tarfile.TarInfo(name), data


def _link(name: str, target: str, kind=tarfile.SYMTYPE):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


@pytest.mark.parametrize("members,words", [
    ([_file("b/manifest.json"), _file("b/../../evil.txt")], "escapes"),
    ([_file("../evil.txt")], "escapes"),
    ([_file("/tmp/evil-absolute.txt")], "escapes"),
    ([_file("b/manifest.json"), _link("b/link", "/etc/passwd")], "links"),
    ([_file("b/manifest.json"), _link("b/rel", "../../outside")], "links"),
    ([_file("b/manifest.json"), _link("b/hard", "b/manifest.json", tarfile.LNKTYPE)], "links"),
    ([_file("b/manifest.json"), _link("b/dev", "", tarfile.CHRTYPE)], "special"),
    ([_file("b/manifest.json"), _link("b/fifo", "", tarfile.FIFOTYPE)], "special"),
])
def test_unsafe_archive_members_are_refused(tmp_path, members, words):
    archive = _tar(tmp_path / "bad.tar.gz", members)
    dest = tmp_path / "out"
    with pytest.raises(IntegrityError, match=words) as err:
        safe_extract(archive, dest)
    assert "bad.tar.gz" in str(err.value)
    assert not dest.exists()                                 # checked before anything is written
    assert not (tmp_path / "evil.txt").exists()


def test_not_a_tar_and_missing_path(tmp_path):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tar at all")
    with pytest.raises(IntegrityError, match="not a readable tar"):
        open_bundle(junk, tmp_path / "x")
    with pytest.raises(MissingArtifact):
        open_bundle(tmp_path / "nope", tmp_path / "x")


def test_verify_cli_fails_with_one_line_on_a_bad_archive(tmp_path):
    archive = _tar(tmp_path / "evil.tar.gz", [_file("../evil.txt")])
    res = cli("verify", archive)
    assert res.returncode == IntegrityError.exit_code
    assert res.stderr.strip().count("\n") == 0 and res.stderr.startswith("error: ")
    assert "evil.txt" in res.stderr and "Traceback" not in res.stderr


# ------------------------------------------------------------------ a real bundle (slow)

@pytest.mark.slow
def test_fresh_bundle_verifies_folder_and_archive(bundle):
    from pipeline.bundle.verify import verify_or_raise

    for path in bundle:
        report = verify_or_raise(path)
        names = [c["name"] for c in report["checks"]]
        assert report["ok"] and any("server fp32" in n for n in names) and any("lite x86" in n for n in names)
    for expected in ("infer_config.yaml", "MODEL_CARD.md", "samples/expected.npz", "server/fp32/inference.pdiparams"):
        assert (bundle[0] / expected).is_file(), expected


@pytest.mark.slow
def test_verify_cli_passes_on_a_fresh_bundle(bundle):
    res = cli("verify", bundle[1])
    assert res.returncode == 0, res.stderr
    assert "verified:" in res.stdout
    if host_arch() != "arm":      # arm .nb files were converted, not executed: said so, never "ok"
        assert "not executed  mobile/arm_fp32.nb: converted, not executed" in res.stdout
        assert "  ok  " not in "\n".join(l for l in res.stdout.splitlines() if "arm" in l)


@pytest.mark.slow
def test_model_card_and_manifest_say_what_was_not_executed(bundle):
    card = (bundle[0] / "MODEL_CARD.md").read_text()
    man = json.loads((bundle[0] / "manifest.json").read_text())
    assert "every artifact in this bundle passed" not in card
    rows = [l for l in card.splitlines() if "lite arm fp32" in l]
    if host_arch() != "arm":
        assert rows and "UNVERIFIED: converted, not executed" in rows[0] and "vouched for by" in rows[0]
        assert "vouched for by" in man["unverified"]["mobile/arm_fp32.nb"]
        assert all(g["status"] != "OK" for g in man["gates"] if g["subject"].startswith("lite arm"))


@pytest.mark.slow
@pytest.mark.parametrize("rel", ["server/fp32/inference.pdiparams", "infer_config.yaml", "samples/000.png"])
def test_tampered_file_is_named(bundle_copy, rel):
    with open(bundle_copy / rel, "r+b") as f:
        f.seek(min(40, os.path.getsize(bundle_copy / rel) - 1))
        f.write(b"\xff")
    with pytest.raises(IntegrityError, match=f"modified: {rel}"):
        verify_hashes(bundle_copy)


@pytest.mark.slow
def test_missing_and_unlisted_files(bundle_copy):
    (bundle_copy / "mobile" / "x86_fp32.nb").rename(bundle_copy / "x86_fp32.nb.bak")
    with pytest.raises(IntegrityError, match="missing: mobile/x86_fp32.nb"):
        verify_hashes(bundle_copy)
    (bundle_copy / "x86_fp32.nb.bak").rename(bundle_copy / "mobile" / "x86_fp32.nb")
    verify_hashes(bundle_copy)                                   # restored: fine again
    (bundle_copy / "server" / "fp32" / "patch.py").write_text("import os\n")
    with pytest.raises(IntegrityError, match="server/fp32/patch.py"):
        verify_hashes(bundle_copy)


@pytest.mark.slow
def test_broken_manifest(bundle_copy):
    (bundle_copy / "manifest.json").write_text("{ not json")
    with pytest.raises(IntegrityError, match="not a valid bundle manifest"):
        verify_hashes(bundle_copy)
    (bundle_copy / "manifest.json").unlink()
    with pytest.raises(MissingArtifact, match="manifest.json"):
        verify_hashes(bundle_copy)


@pytest.mark.slow
def test_tampered_archive_fails_verify_cli_naming_the_file(bundle_copy, tmp_path):
    with open(bundle_copy / "server" / "fp32" / "inference.pdmodel", "ab") as f:
        f.write(b"\x00")
    archive = tmp_path / f"{bundle_copy.name}.tar.gz"
    write_archive(bundle_copy, archive)
    res = cli("verify", archive)
    assert res.returncode == IntegrityError.exit_code
    line = res.stderr.strip()
    assert "\n" not in line and "server/fp32/inference.pdmodel" in line and "Traceback" not in line

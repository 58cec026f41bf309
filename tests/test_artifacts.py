import pytest

from pipeline.core.artifacts import describe_files, staged_dir, verify_outputs, atomic_write_text
from pipeline.core.errors import IntegrityError


def test_staged_dir_keeps_old_output_on_failure(tmp_path):
    final = tmp_path / "stage"
    with staged_dir(final) as tmp:
        (tmp / "a.txt").write_text("good")
    with pytest.raises(RuntimeError):
        with staged_dir(final) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("crash mid-stage")
    assert (final / "a.txt").read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["stage"]      # no temp litter


def test_staged_dir_replaces_on_success(tmp_path):
    final = tmp_path / "stage"
    for text in ("one", "two"):
        with staged_dir(final) as tmp:
            (tmp / "a.txt").write_text(text)
    assert (final / "a.txt").read_text() == "two"


def test_verify_outputs_detects_tamper_and_missing(tmp_path):
    atomic_write_text(tmp_path / "m.bin", "x" * 10)
    (tmp_path / "sub").mkdir()
    atomic_write_text(tmp_path / "sub" / "n.bin", "y")
    man = {"outputs": describe_files(tmp_path)}
    assert set(man["outputs"]) == {"m.bin", "sub/n.bin"}
    verify_outputs(tmp_path, man)
    (tmp_path / "m.bin").write_text("x" * 9 + "z")
    with pytest.raises(IntegrityError, match="m.bin"):
        verify_outputs(tmp_path, man)
    (tmp_path / "sub" / "n.bin").unlink()
    man2 = {"outputs": {"sub/n.bin": {"sha256": "0", "bytes": 1}}}
    with pytest.raises(IntegrityError, match="missing"):
        verify_outputs(tmp_path, man2)

"""Users' data: PaddleOCR label files, charset files, image folders (tiny PNGs in tmp_path)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.data.imagefolder import load_image_folder
from pipeline.data.labelfile import load_charset, load_label_file
from pipeline.data.textlines import DEFAULT_CHARSET
from pipeline.core.errors import ConfigError, DataError


def _png(path: Path, size: tuple[int, int] = (60, 20), value: int = 200) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", size, value).save(path)
    return path


# ---------------------------------------------------------------- label files
@pytest.fixture
def label_dir(tmp_path: Path) -> Path:
    _png(tmp_path / "crops" / "a.png", (64, 16))
    _png(tmp_path / "crops" / "b.png", (200, 40))
    _png(tmp_path / "abs.png", (30, 30))
    (tmp_path / "crops" / "broken.png").write_bytes(b"\x89PNG not really")
    return tmp_path


def test_label_file_happy_path(label_dir: Path):
    lf = label_dir / "train.txt"
    lf.write_text(f"crops/a.png\tINV-2024-001\ncrops/b.png\t12/03/2024\r\n\n{label_dir / 'abs.png'}\t1,234.56\n",
                  encoding="utf-8")
    images, labels, skipped = load_label_file(lf, DEFAULT_CHARSET, 32, 128)
    assert images.dtype == np.uint8 and images.shape == (3, 32, 128)
    assert labels == ["INV-2024-001", "12/03/2024", "1,234.56"] and skipped == 0
    # pad_right: a 64x16 crop scaled to height 32 is 128 wide, a wide one is squeezed to 128
    assert (images[0] == 200).all()


def test_label_file_relative_to_file_not_cwd(label_dir: Path, monkeypatch, tmp_path_factory):
    lf = label_dir / "train.txt"
    lf.write_text("crops/a.png\tAB\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    assert load_label_file(lf, DEFAULT_CHARSET, 32, 64)[1] == ["AB"]


@pytest.mark.parametrize("line, needle", [
    ("crops/a.png INV-1", "no TAB"),
    ("crops/a.png\t", "empty label"),
    ("crops/a.png\tinv-1?", "not in the charset: ['?', 'i', 'n', 'v']"),
    ("crops/missing.png\tAB", "does not exist"),
    ("crops/broken.png\tAB", "not a readable image"),
    ("crops/a.png\tABCDEFGHIJ", "max_len"),
])
def test_label_file_bad_line_names_file_and_line(label_dir: Path, line: str, needle: str):
    lf = label_dir / "train.txt"
    lf.write_text(f"crops/a.png\tOK\n{line}\ncrops/b.png\tOK2\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        load_label_file(lf, DEFAULT_CHARSET, 32, 64, max_len=8)
    msg = err.value.message
    assert f"{lf}:2:" in msg and needle in msg
    assert err.value.hint                                      # every error says how to fix it


def test_label_file_skip_mode_counts(label_dir: Path):
    lf = label_dir / "train.txt"
    lf.write_text("crops/a.png\tOK\nno-tab-here\ncrops/a.png\t\ncrops/a.png\tbad?\n"
                  "crops/missing.png\tAB\ncrops/broken.png\tAB\ncrops/b.png\tOK2\n", encoding="utf-8")
    images, labels, skipped = load_label_file(lf, DEFAULT_CHARSET, 32, 64, on_bad="skip")
    assert labels == ["OK", "OK2"] and skipped == 5 and len(images) == 2


def test_label_file_missing_empty_and_bad_option(tmp_path: Path):
    with pytest.raises(DataError, match="does not exist"):
        load_label_file(tmp_path / "nope.txt", DEFAULT_CHARSET, 32, 64)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="no usable samples"):
        load_label_file(empty, DEFAULT_CHARSET, 32, 64)
    with pytest.raises(ConfigError):
        load_label_file(empty, DEFAULT_CHARSET, 32, 64, on_bad="ignore")


# ---------------------------------------------------------------- charset files
def test_load_charset(tmp_path: Path):
    f = tmp_path / "dict.txt"
    f.write_text("0\n1\nA\n \n€\n", encoding="utf-8")
    assert load_charset(f) == "01A €"                         # a space line is the space character
    f.write_text("0\r\n1\r\n", encoding="utf-8")
    assert load_charset(f) == "01"


@pytest.mark.parametrize("text, needle", [
    ("0\n1\n0\n", "duplicate"),
    ("0\n\n1\n", "empty line"),
    ("0\nAB\n", "exactly one"),
    ("", "empty"),
])
def test_load_charset_errors(tmp_path: Path, text: str, needle: str):
    f = tmp_path / "dict.txt"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(DataError, match=needle):
        load_charset(f)
    with pytest.raises(DataError, match="does not exist"):
        load_charset(tmp_path / "nope.txt")


# ---------------------------------------------------------------- image folders
def test_image_folder_happy_path(tmp_path: Path):
    for i in range(3):
        _png(tmp_path / "dog" / f"{i}.png", (40, 20), 10)
    for i in range(2):
        _png(tmp_path / "cat" / f"{i}.jpg", (20, 40), 250)
    (tmp_path / "cat" / "README.txt").write_text("not an image")
    (tmp_path / ".hidden").mkdir()
    images, labels, names, skipped = load_image_folder(tmp_path, 16, 16)
    assert names == ["cat", "dog"]                            # sorted, hidden folder ignored
    assert images.shape == (5, 16, 16) and images.dtype == np.uint8
    assert labels.dtype == np.int64 and labels.tolist() == [0, 0, 1, 1, 1]
    assert skipped == 0 and images[0].mean() > 200 and images[-1].mean() < 50


def test_image_folder_errors(tmp_path: Path):
    with pytest.raises(DataError, match="does not exist"):
        load_image_folder(tmp_path / "nope", 16, 16)
    with pytest.raises(DataError, match="no class subfolders"):
        load_image_folder(tmp_path, 16, 16)
    _png(tmp_path / "only" / "a.png")
    with pytest.raises(DataError, match="at least 2"):
        load_image_folder(tmp_path, 16, 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no readable images"):
        load_image_folder(tmp_path, 16, 16)


def test_image_folder_unreadable_image(tmp_path: Path):
    _png(tmp_path / "a" / "ok.png")
    _png(tmp_path / "b" / "ok.png")
    bad = tmp_path / "b" / "bad.png"
    bad.write_bytes(b"garbage")
    with pytest.raises(DataError, match="bad.png"):
        load_image_folder(tmp_path, 16, 16)
    images, labels, names, skipped = load_image_folder(tmp_path, 16, 16, on_bad="skip")
    assert skipped == 1 and labels.tolist() == [0, 1]


# ---------------------------------------------------------------- recognition task on a label file
def test_recognition_task_reads_label_file(tmp_path: Path):
    from pipeline.tasks.recognition import RecognitionTask

    lines = []
    for i in range(10):
        _png(tmp_path / "crops" / f"{i}.png", (80, 20))
        lines.append(f"crops/{i}.png\tINV-{i}")
    lines.append("crops/0.png\tbad label")                  # lowercase and a space: not in the charset
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "dict.txt").write_text("\n".join("INV-0123456789") + "\n", encoding="utf-8")
    cfg = dict(source="folder", path=str(tmp_path / "train.txt"), val_path=None,
               charset=str(tmp_path / "dict.txt"), num_train=0, num_val=0, height=32, width=64,
               max_len=8, fonts=[], on_bad_sample="skip", cache_dir=None, val_fraction=0.2)
    task = RecognitionTask()
    ds = task.load_data(cfg, seed=0)
    assert len(ds.train.images) == 8 and len(ds.val.images) == 2 and ds.train.skipped == 1
    assert ds.info["charset"] == "INV-0123456789" and ds.train.labels.shape == (8, 8)
    assert task.load_data(cfg, seed=0).val.images.tobytes() == ds.val.images.tobytes()   # seeded split
    with pytest.raises(DataError, match=r"train.txt:11:"):
        task.load_data({**cfg, "on_bad_sample": "error"}, seed=0)
    ds2 = task.load_data({**cfg, "val_path": str(tmp_path / "train.txt")}, seed=0)
    assert len(ds2.train.images) == 10 and len(ds2.val.images) == 10 and ds2.val.skipped == 1

"""Users' classification data: one subfolder per class (torchvision ImageFolder layout).

    my_data/
      cat/  a.png b.jpg ...
      dog/  c.png ...

Class names are the sorted subfolder names, so class indices do not depend on the order
the file system lists folders in. Every image goes through `preprocess.fit_image` with the
"stretch" rule, the same call inference makes.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from pipeline.data import imagedecode
from pipeline.data.imagedecode import printable
from pipeline.core.errors import ConfigError, DataError
from pipeline.data.preprocess import fit_image

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})
ON_BAD_CHOICES = ("error", "skip")


def check_on_bad(on_bad: str) -> None:
    if on_bad not in ON_BAD_CHOICES:
        raise ConfigError(f"data.on_bad_sample must be one of {ON_BAD_CHOICES}, got {on_bad!r}")


def read_image(path: str | os.PathLike, spec: dict) -> np.ndarray:
    """Image file → uint8 [H, W] fitted to `spec`; DataError naming the file if unreadable."""
    try:
        return fit_image(imagedecode.load_file(path), spec)     # any decoder error: one DataError
    except imagedecode.UnreadableImage as exc:
        raise DataError(exc.message, hint="re-save it as PNG/JPEG, delete it, or set data.on_bad_sample: skip") from None


def _check_class_name(d: Path) -> None:
    """Class names become the bundle's labels (JSON, YAML, HTTP answers): they must be real text."""
    try:
        d.name.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"class folder {printable(d)} has a name that is not valid UTF-8",
                        hint="rename it in UTF-8 (e.g. `convmv -f latin1 -t utf8`): class names become the labels") from None


def _is_image(p: Path, root: Path) -> bool:
    hidden = any(part.startswith(".") for part in p.relative_to(root).parts)
    return not hidden and p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()


def load_image_folder(path: str | os.PathLike, height: int, width: int,
                      on_bad: str = "error") -> tuple[np.ndarray, np.ndarray, list[str], int]:
    """Read a class-per-subfolder tree → (uint8 [N, H, W], int64 [N], class_names, skipped).

    Files without an image extension and hidden files/folders are ignored (README.txt,
    .DS_Store); an image file that cannot be decoded is an error, or skipped and counted
    with on_bad="skip".
    """
    check_on_bad(on_bad)
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist or is not a folder",
                        hint="data.path must point at a folder with one subfolder per class")
    class_dirs = sorted((d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")),
                        key=lambda d: d.name)
    if not class_dirs:
        raise DataError(f"image folder {root} has no class subfolders",
                        hint="put each class's images in its own subfolder, e.g. cat/ and dog/")
    if len(class_dirs) < 2:
        raise DataError(f"image folder {root} has only one class ({class_dirs[0].name}); "
                        "classification needs at least 2", hint="add a subfolder per class")
    for d in class_dirs:
        _check_class_name(d)
    spec = {"height": height, "width": width, "resize": "stretch"}
    images: list[np.ndarray] = []
    labels: list[int] = []
    skipped = 0
    for cls, d in enumerate(class_dirs):
        files = sorted((p for p in d.rglob("*") if _is_image(p, d)), key=lambda p: str(p))
        read, bad = _read_all(files, spec, on_bad)
        images += read
        labels += [cls] * len(read)
        skipped += bad
        count = len(read)
        if count == 0:
            # a class with no usable images would be a label the model can never learn
            raise DataError(f"class folder {d} has no readable images "
                            f"({len(files)} image files, extensions {sorted(IMAGE_EXTENSIONS)})",
                            hint="add images or remove the folder")
    return (np.stack(images).astype(np.uint8), np.asarray(labels, dtype=np.int64),
            [d.name for d in class_dirs], skipped)


def _read_all(files: list[Path], spec: dict, on_bad: str) -> tuple[list[np.ndarray], int]:
    """Each file fitted to spec → (images, skipped); a bad file raises, or with on_bad="skip" is counted."""
    images, skipped = [], 0
    for f in files:
        try:
            images.append(read_image(f, spec))
        except DataError:
            if on_bad == "error":
                raise
            skipped += 1
    return images, skipped


def load_unlabelled(path: str | os.PathLike, spec: dict, on_bad: str = "error") -> tuple[np.ndarray, int]:
    """Every image under a folder (sorted, recursively; hidden files ignored) fitted to `spec`, without
    labels → (uint8 images, skipped). For validating an imported model on a user's own images."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"data.path {root} is not a folder of images", hint="point data.path at a folder")
    images, skipped = _read_all(sorted(p for p in root.rglob("*") if _is_image(p, root)), spec, on_bad)
    if not images:
        raise DataError(f"no readable images in {root}", hint=f"extensions: {', '.join(sorted(IMAGE_EXTENSIONS))}")
    return np.stack(images), skipped

"""What `batch` reads and writes: the input list (a folder, a glob, or a JSONL/Parquet manifest of paths) and the
output folder of part files (Parquet, or JSONL), each written whole or not at all.

An input is done when the output holds a row for its path with the same content hash (sha256 of its bytes): a re-run
skips it, a file whose bytes changed is read again (its new row stands beside the old one, each with its hash).
Rows of a run are committed in parts as they arrive, so a run stopped anywhere keeps every committed row and the next
run reads only the rest. Every row, good or not, has the same columns (ROW_SCHEMA); a row that could not be read
has its one-line reason in `error`.
"""
from __future__ import annotations

import glob as globmod
import json
import os
import uuid
from pathlib import Path

from pipeline.core.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
FORMATS = ("parquet", "jsonl")
SUMMARY = "_batch.json"
# column -> (arrow type name, what it holds): docs/scale.md lists the same
COLUMNS = {
    "path": ("string", "the input as listed"),
    "sha256": ("string", "sha256 of its bytes (empty when it could not be read)"),
    "bytes": ("int64", "its size"),
    "result": ("string", "JSON: {lines: [{box, text, score}]} for an OCR system, the /predict predictions otherwise"),
    "prediction": ("string", "a model's top label; an OCR page's text, its lines joined by newlines"),
    "score": ("float64", "the top label's score; an OCR page's mean line score (null without lines)"),
    "served": ("string", "JSON: per part, the engine and precision that ran"),
    "ms": ("float64", "decode + inference time of this input in its worker"),
    "read_at": ("float64", "when its worker finished it (Unix seconds)"),
    "worker": ("string", "host:pid of the worker that read it"),
    "rss_mb": ("float64", "that worker's resident memory after it (MB)"),
    "error": ("string", "why it could not be read (one line); null for a good row"),
}


def arrow_schema():
    import pyarrow as pa

    return pa.schema([(name, getattr(pa, kind)()) for name, (kind, _) in COLUMNS.items()])


# ------------------------------------------------------------------------------------ inputs

def list_inputs(spec: str, exclude: Path | None = None) -> list[str]:
    """Paths to read, sorted: every image file under a folder (recursive; hidden ones and `exclude` left out), every
    file a glob matches, or the `path` of every row of a .jsonl/.parquet manifest (relative to the manifest)."""
    p = Path(spec)
    if p.is_dir():
        return _walk(p, exclude)
    if p.is_file() and p.suffix.lower() in (".jsonl", ".parquet"):
        return _manifest(p)
    if any(c in spec for c in "*?["):
        found = sorted(f for f in globmod.glob(spec, recursive=True) if os.path.isfile(f))
        if not found:
            raise DataError(f"input glob {spec!r} matches no file", hint="check the pattern (** for sub-folders)")
        return found
    raise DataError(f"input {spec} is not a folder, a glob or a .jsonl/.parquet manifest"
                    + ("" if p.exists() else " (it does not exist)"),
                    hint="pass a folder of images, a quoted glob like 'scans/**/*.png', or a manifest with a path column")


def _walk(root: Path, exclude: Path | None) -> list[str]:
    skip = exclude.resolve() if exclude else None
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and (here / d).resolve() != skip)
        out += [str(here / f) for f in filenames if not f.startswith(".") and Path(f).suffix.lower() in IMAGE_SUFFIXES]
    if not out:
        raise DataError(f"input folder {root} holds no image ({', '.join(IMAGE_SUFFIXES)})",
                        hint="point at the folder with the images, or list them in a manifest")
    return sorted(out)


def _manifest(path: Path) -> list[str]:
    """A manifest's paths: JSONL lines {"path": ...} (or a bare JSON string), or a Parquet `path` column."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path, columns=["path"])
        except Exception as exc:
            raise DataError(f"manifest {path} is not a Parquet file with a 'path' column ({str(exc)[:160]})") from None
        paths = [str(v) for v in table.column("path").to_pylist() if v]
    else:
        paths = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                paths.append(doc if isinstance(doc, str) else str(doc["path"]))
            except (ValueError, KeyError, TypeError):
                raise DataError(f"manifest {path} line {n} is not a JSON object with a 'path' (or a JSON string)",
                                hint='one input per line: {"path": "scans/0001.png"}') from None
    if not paths:
        raise DataError(f"manifest {path} lists no path")
    return [p if os.path.isabs(p) else str(path.parent / p) for p in paths]


# ------------------------------------------------------------------------------------ output

class OutputStore:
    """The output folder: part files of one format, each written to a temporary name and renamed when complete."""

    def __init__(self, folder: Path, fmt: str = "parquet"):
        if fmt not in FORMATS:
            raise ConfigError(f"output format {fmt!r} is not one of {', '.join(FORMATS)}")
        self.folder, self.fmt, self.run = Path(folder), fmt, uuid.uuid4().hex[:8]
        if self.folder.exists() and not self.folder.is_dir():
            raise DataError(f"output {self.folder} exists and is not a folder",
                            hint="batch writes a folder of part files: give a folder path")
        other = [p.name for p in self.parts() if not p.name.endswith("." + fmt)]
        if other:
            raise DataError(f"output {self.folder} already holds {other[0]} (another format than {fmt})",
                            hint="resume with the same --format, or write to another folder")
        self.seq = 0
        for stale in self.folder.glob(".part-*.tmp") if self.folder.is_dir() else ():
            stale.unlink()          # a part a stopped run did not finish: its rows are read again

    def parts(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if p.name.startswith("part-") and p.suffix in (".parquet", ".jsonl"))

    def rows(self, columns: list[str] | None = None) -> list[dict]:
        """Every committed row (of the given columns)."""
        out = []
        for part in self.parts():
            if part.suffix == ".parquet":
                import pyarrow.parquet as pq

                out += pq.read_table(part, columns=columns).to_pylist()
            else:
                for line in part.read_text(encoding="utf-8").splitlines():
                    row = json.loads(line)
                    out.append({k: row.get(k) for k in columns} if columns else row)
        return out

    def done(self) -> dict[str, str]:
        """path -> content hash of every committed row (what a re-run skips)."""
        return {r["path"]: r["sha256"] or "" for r in self.rows(["path", "sha256"])}

    def write(self, rows: list[dict]) -> Path | None:
        """Commit rows as one part file; nothing is visible under its final name until it is complete."""
        if not rows:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        self.seq += 1
        final = self.folder / f"part-{self.run}-{self.seq:05d}.{self.fmt}"
        tmp = self.folder / f".{final.name}.tmp"
        rows = [{k: r.get(k) for k in COLUMNS} for r in rows]
        if self.fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema()), tmp)
        else:
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return final

    def write_summary(self, summary: dict) -> None:
        """Append this run's summary to SUMMARY (every run that wrote to the folder, oldest first)."""
        from pipeline.core.artifacts import atomic_write_text

        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            runs = json.loads((self.folder / SUMMARY).read_text())["runs"]
        except (OSError, ValueError, KeyError, TypeError):
            runs = []
        atomic_write_text(self.folder / SUMMARY, json.dumps({"runs": runs + [{"run": self.run, **summary}]}, indent=1))

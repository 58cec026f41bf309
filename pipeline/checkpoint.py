"""Atomic training checkpoints for resume: model, optimizer, scaler, scheduler, epoch, best metric."""
from __future__ import annotations

import io
import json
from pathlib import Path

from .artifacts import atomic_write_bytes, atomic_write_text


def _to_bytes(obj) -> bytes:
    import paddle

    buf = io.BytesIO()
    paddle.save(obj, buf)
    return buf.getvalue()


def save(folder: Path, key: str, state: dict, meta: dict) -> None:
    """state: name → state_dict; written file by file, then meta.json last (the commit point)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, sd in state.items():
        atomic_write_bytes(folder / f"{name}.pdparams", _to_bytes(sd))
    atomic_write_text(folder / "meta.json", json.dumps({**meta, "key": key}))


def load(folder: Path, key: str) -> tuple[dict, dict] | None:
    """Return (states, meta) when a complete checkpoint for this exact config exists."""
    import paddle

    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("key") != key:
        return None
    states = {}
    for name in meta.get("parts", []):
        states[name] = paddle.load(str(folder / f"{name}.pdparams"))
    return states, meta

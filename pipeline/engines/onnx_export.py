"""Paddle inference program -> ONNX with paddle2onnx, in a child process.

paddle2onnx is C++ underneath: a program it cannot handle may abort the process, so (like Lite opt)
the conversion runs in `python -m pipeline.engines.onnx_export` and a crash becomes an EngineCrash.
Written atomically: nothing appears at the final path on failure.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.core.errors import EngineCrash, MissingArtifact

OPSET = 13          # the lowest opset asked for; converts both built-in models (ORT/OpenVINO agree to ~1e-5)
REPO_ROOT = Path(__file__).resolve().parents[2]


def paddle2onnx_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("paddle2onnx")
    except metadata.PackageNotFoundError:
        return None


def export_onnx(model_prefix: str | os.PathLike, out_file: str | os.PathLike, *, opset: int = OPSET,
                timeout: float = 300) -> Path:
    """Convert `<prefix>.pdmodel/.pdiparams` to `out_file` (model.onnx); returns its path."""
    model, params = f"{model_prefix}.pdmodel", f"{model_prefix}.pdiparams"
    for f in (model, params):
        if not os.path.isfile(f):
            raise MissingArtifact(f"ONNX export input not found: {f}")
    if paddle2onnx_version() is None:
        raise MissingArtifact("paddle2onnx is not installed", hint="pip install -r requirements.txt")
    final = Path(out_file)
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".onnx-", dir=final.parent) as tmp:
        out = Path(tmp) / final.name
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "pipeline.engines.onnx_export", model, params, str(out), str(opset)]
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, errors="replace",
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EngineCrash(f"paddle2onnx timed out after {timeout:g}s on {model}") from None
        if proc.returncode != 0 or not out.is_file() or out.stat().st_size == 0:
            lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("[ERROR]")]      # paddle2onnx's own reason, if any
            tail = " | ".join(errors[:3] or lines[-3:])
            raise EngineCrash(f"paddle2onnx failed on {model} (exit {proc.returncode}): {tail or 'no output'}",
                              hint="an op without an ONNX mapping? see paddle2onnx's op list")
        os.replace(out, final)
    return final


def onnx_opset(onnx_file: str | os.PathLike) -> int:
    import onnx

    m = onnx.load(str(onnx_file), load_external_data=False)
    return max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=0)


if __name__ == "__main__":    # the child: model params out opset
    import paddle2onnx

    m, p, o, opset_ = sys.argv[1:5]
    # auto_upgrade_opset: ops such as hardswish (MobileNetV3) exist only from opset 14; the opset really
    # written is read back from the file by the caller
    paddle2onnx.export(m, p, o, opset_version=int(opset_), auto_upgrade_opset=True, verbose=False,
                       enable_onnx_checker=True)

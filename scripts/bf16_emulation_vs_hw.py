"""Does the bf16-emulated row change about as many lines as real bf16 kernels did? (../shared/hw_truth/)

Runs the run folder's exported recognizer emulated in bf16 (pipeline/engines/amp_emulation.py: weights and every
op's output rounded to bf16, fp32 math) on its validation slice, checks the slice is the one the hardware truth was
captured on (sha256 of the inputs), and prints how many of the lines each row reads differently from fp32.

  .venv/bin/python scripts/bf16_emulation_vs_hw.py --run runs/ppocr_v4_rec --truth ../shared/hw_truth/amd_zen_avx512_bf16
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
import numpy as np


def collapse(path) -> tuple:
    seq, prev = [], 0
    for c in path:
        if c != prev and c != 0:
            seq.append(int(c))
        prev = c
    return tuple(seq)


def main() -> int:
    from pipeline.engines.paddle_infer import InferenceEngine, make_fp16_emulated

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True)
    p.add_argument("--truth", required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    run, truth = Path(args.run), Path(args.truth)
    with np.load(run / "train" / "val_slice.npz") as z:
        x, ref = z["inputs"], z["outputs"]
    meta = json.loads((truth / "v4_rec_hw_truth.json").read_text())
    sha = hashlib.sha256(x.tobytes()).hexdigest()
    if sha != meta["inputs_sha256"]:
        print(f"validation slice differs from the hardware truth's: sha256 {sha} != {meta['inputs_sha256']}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        info = make_fp16_emulated(run / "export" / "inference", Path(tmp) / "model", "bf16")
        out = InferenceEngine(Path(tmp) / "model", threads=args.threads).run_batched(x, 8)
    paths = dict(np.load(truth / "v4_rec_argmax_paths.npz"))
    paths["bf16_emulated_here"] = out.argmax(-1).astype(np.int16)
    refs = [collapse(r) for r in ref.argmax(-1)]
    print(f"slice sha256 {sha[:16]}... matches; emulation rounded {info['params_rounded']} weights, "
          f"{info['casts_inserted']} casts")
    for name, pth in paths.items():
        changed = [i for i, (a, r) in enumerate(zip(pth, refs)) if collapse(a) != r]
        print(f"{name:24s} {len(changed):3d} of {len(refs)} lines differ from fp32; timesteps equal "
              f"{float((pth == ref.argmax(-1)).mean()):.4f}; lines {changed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reference outputs of a Paddle 3 inference model, run by Paddle 3 itself (the isolated .venv-paddle3 of
`make pir-reference`, never the pipeline's .venv): the evidence that pipeline/models/pir.py translates right.

  .venv-paddle3/bin/python scripts/pir_reference.py --models DIR --inputs tests/data/pir/inputs.npz --out OUT.npz

DIR holds det/ and rec/ (inference.json + .pdiparams). Inputs are the uint8 BGR images of inputs.npz, normalised
here with the constants stored beside them (the test normalises the same way). oneDNN is off: Paddle 3.3.1 crashes
on the PP-OCRv5 json with it on (Paddle #79749). Only a slice of each output is kept (pipeline/models/pir_slices.py).
"""
import os

os.environ.setdefault("FLAGS_use_mkldnn", "0")

import argparse
import importlib.util

import numpy as np

_spec = importlib.util.spec_from_file_location(     # by path: the pipeline package needs the pipeline's .venv
    "pir_slices", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pipeline", "models", "pir_slices.py"))
_slices = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_slices)
normalise, slices, input_keys = _slices.normalise, _slices.slices, _slices.input_keys


def predictor(folder):
    import paddle.inference as pi

    cfg = pi.Config(os.path.join(folder, "inference.json"), os.path.join(folder, "inference.pdiparams"))
    cfg.disable_mkldnn()
    cfg.switch_ir_optim(False)          # the program as written: no fusion passes
    cfg.set_cpu_math_library_num_threads(1)
    cfg.disable_glog_info()
    return pi.create_predictor(cfg)


def run(pred, x):
    h = pred.get_input_handle(pred.get_input_names()[0])
    h.reshape(list(x.shape))
    h.copy_from_cpu(np.ascontiguousarray(x))
    pred.run()
    return pred.get_output_handle(pred.get_output_names()[0]).copy_to_cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import paddle

    z = dict(np.load(args.inputs))
    out = {"paddle_version": np.array(paddle.__version__)}
    for role in ("det", "rec"):
        pred = predictor(os.path.join(args.models, role))
        for key in input_keys(z, role):
            out.update(slices(key, run(pred, normalise(role, z[key], z))))
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out}: {len(out) - 1} arrays, paddle {paddle.__version__}, oneDNN off")


if __name__ == "__main__":
    main()

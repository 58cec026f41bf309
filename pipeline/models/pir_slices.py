"""How an input image of the PIR reference data is normalised and which slice of an output is kept: shared by the
reference makers (scripts/pir_reference.py under Paddle 3, scripts/pir_onnx_reference.py) and the check
(pipeline/models/pir_check.py). numpy only and no pipeline import: .venv-paddle3 loads this file by its path."""
import numpy as np

TOP = 5            # per CTC step: the reference's top-5 classes ...
COLS = 64          # ... plus 64 fixed classes spread over the dictionary


def normalise(role, img, z):
    """uint8 BGR HWC -> float32 NCHW with the model's own constants (stored in inputs.npz from its .yml)."""
    x = img.astype(np.float32) * np.float32(1 / 255.0)
    x = (x - z[f"{role}_mean"]) / z[f"{role}_std"]
    return x.transpose(2, 0, 1)[None].astype(np.float32)


def input_keys(z, role):
    """det_0, det_1, ... (the images; det_mean/det_std are the constants)."""
    return sorted(k for k in z if k.startswith(role + "_") and k.split("_", 1)[1].isdigit())


def columns(classes):
    return np.linspace(0, classes - 1, COLS).astype(np.int64)


def slices(key, y):
    """{name: array} kept of output y: a det map whole (small inputs), a rec output as top-k + fixed columns."""
    if key.startswith("det_"):
        return {key: y.astype(np.float32)}
    top = np.argsort(-y, axis=-1)[..., :TOP]
    cols = columns(y.shape[-1])
    return {f"{key}.top_idx": top.astype(np.int32), f"{key}.top_val": np.take_along_axis(y, top, -1),
            f"{key}.cols": y[..., cols].astype(np.float32), f"{key}.shape": np.array(y.shape)}

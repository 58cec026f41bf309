"""Models that arrive as files: an exported inference program (model.source=inference, or model.pretrained
pointing at one) and pretrained .pdparams (model.pretrained, PaddleOCR's Global.pretrained_model).

Two Paddle 2.6 traps of `paddle.jit.load` are handled here, not by callers: a TranslatedLayer's outputs
come back with stop_gradient=True (backward reaches no parameter), and a parent's .train() does not
reach its `_is_test`, so it keeps running the inference program (BatchNorm statistics, no dropout).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.core import safe_pickle, safe_yaml, tempdirs
from pipeline.core.artifacts import sha256_file
from pipeline.core.errors import ConfigError, IntegrityError

SUFFIXES = (".pdmodel", ".pdiparams")


def resolve_prefix(path: str | Path, key: str = "model.path", max_bytes: int | None = None) -> Path:
    """A folder holding inference.pdmodel/.pdiparams, their path prefix, or either file → the prefix, its files
    checked (check_files) before Paddle reads them."""
    p = Path(path)
    if p.suffix in SUFFIXES:
        p = p.with_suffix("")
    prefix = p / "inference" if p.is_dir() else p
    missing = [str(prefix) + s for s in SUFFIXES if not Path(str(prefix) + s).is_file()]
    if missing:
        raise ConfigError(f"{key} {path}: no exported model there ({missing[0]} not found)",
                          hint=f"set {key} to the folder of inference.pdmodel/.pdiparams or their path prefix")
    check_files(prefix, max_bytes)
    return prefix


def check_files(prefix: Path, max_bytes: int | None) -> None:
    """Sizes within model.max_file_bytes, a parseable program, and a parameter stream whose every declared
    tensor fits in the file and whose count is the program's: Paddle itself trusts all of these."""
    from pipeline.engines import params_file, program

    model = Path(str(prefix) + ".pdmodel")
    if max_bytes is not None and model.stat().st_size > max_bytes:
        raise IntegrityError(f"{model} is {model.stat().st_size} bytes, over the limit of {max_bytes}",
                             hint="raise model.max_file_bytes if the file is genuine")
    block = program.parse(model).blocks[0]
    params = sum(1 for v in block.vars if v.persistable and v.name not in program.FEED_FETCH)
    params_file.check(str(prefix) + ".pdiparams", max_bytes, expect=params)


def is_inference_model(path: str | Path) -> bool:
    p = Path(path)
    if p.suffix == ".pdparams":
        return False
    return any(Path(str(q) + ".pdmodel").is_file() for q in (p / "inference", p.with_suffix("")))


def file_hashes(prefix: Path) -> dict[str, str]:
    return {Path(str(prefix) + s).name: sha256_file(Path(str(prefix) + s)) for s in SUFFIXES}


def inference_yml(prefix: Path) -> dict | None:
    """PaddleOCR writes inference.yml beside its export (PreProcess / PostProcess); read it as hints."""
    f = prefix.parent / "inference.yml"
    if not f.is_file():
        return None
    doc = safe_yaml.read(f, "model file") or {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{f} must hold a mapping (PreProcess:, PostProcess:), got a {type(doc).__name__}",
                          hint="fix or remove it (it is read as hints only)")
    post = doc.get("PostProcess") or {}
    post = post if isinstance(post, dict) else {}
    chars = post.get("character_dict") or []
    return {"file": f.name, "preprocess": doc.get("PreProcess"), "postprocess_name": post.get("name"),
            "dictionary_size": len(chars) if isinstance(chars, list) else None}


def translate_pir(path: str | Path, out_dir: Path, sections: dict, model_cfg=None) -> tuple[Path, dict]:
    """model.source=pir: the Paddle 3 export at `path` translated into out_dir/translated/inference.pdmodel/
    .pdiparams (pipeline/models/pir.py), its inference.yml copied beside; the configured pre/post-processing
    (`sections`: {'data': ..., 'detection': ...}) must agree with that yml -> (prefix, record)."""
    import shutil

    from pipeline.models import pir, pir_yml

    folder = pir.resolve_dir(path)
    yml = folder / "inference.yml"
    bad = pir_yml.mismatches(folder, sections) + _dictionary_mismatch(folder, sections) if yml.is_file() else []
    if bad:
        raise ConfigError(f"model.path {path}: the config contradicts its inference.yml: {'; '.join(bad)}",
                          hint=f"set those keys as `python -m pipeline.models.pir_yml {folder}` prints them")
    prefix = out_dir / "translated" / "inference"
    record = pir.translate(folder, prefix, pir.Limits.of(model_cfg or {}))
    if yml.is_file():
        shutil.copy2(yml, prefix.parent / yml.name)
    record["sha256"] = {f.name: sha256_file(f)
                        for f in (folder / n for n in (*pir.FILES, "inference.yml")) if f.is_file()}
    return prefix, record


def fill_from_yml(path: str | Path, sections: dict, user_keys, out_dir: Path) -> dict:
    """model.source=pir: the pre/post-processing keys the user did not set, from the export's inference.yml
    (pir_yml.fill), the dictionary written as out_dir/charset_from_yml.txt when data.charset is unset
    -> {dotted key: value filled} (the dictionary as its size)."""
    from pipeline.models import pir, pir_yml

    folder = pir.resolve_dir(path)
    if not (folder / "inference.yml").is_file():
        return {}
    filled = pir_yml.fill(folder, sections, user_keys)
    chars = pir_yml.hints(folder).get("dictionary")
    if chars and user_keys is not None and "data.charset" not in user_keys:
        f = Path(out_dir) / "charset_from_yml.txt"
        f.write_text("\n".join(pir_yml.charset_lines(chars)[0]) + "\n", encoding="utf-8")
        sections["data"]["charset"] = str(f)
        filled["data.charset"] = f"{f.name} ({len(chars)} characters)"
    return filled


def _dictionary_mismatch(folder: Path, sections: dict) -> list[str]:
    """The configured charset must be the yml's dictionary, class for class (pir_yml.charset_lines' placeholders)."""
    from pipeline.data.labelfile import load_charset
    from pipeline.models.pir_yml import charset_lines, hints

    chars, path = hints(folder).get("dictionary"), (sections.get("data") or {}).get("charset")
    if not chars or not path:
        return []
    want, have = charset_lines(chars)[0], list(load_charset(path))
    if want == have:
        return []
    first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
    return [f"data.charset {path} has {len(have)} characters, the yml's dictionary {len(want)} (first difference "
            f"at class {first + 1})"]


def check_input(prefix: Path, spec: dict, task: str) -> list[int]:
    """The program's one feed must be [N, C, H, W] with the configured channels (and H, W where fixed)."""
    from pipeline.engines.paddle_infer import program_input_shape, program_io

    feeds, fetches = program_io(prefix)
    if len(feeds) != 1 or len(fetches) != 1:
        raise ConfigError(f"model.path {prefix}: the program has inputs {feeds} and outputs {fetches}; the "
                          f"{task} task needs exactly one of each", hint="export a single-input/single-output model")
    shape = program_input_shape(prefix)
    want = [spec.get("channels", 1), spec["height"], spec["width"]]
    names = ("channels", "height", "width")
    bad = [(n, d, w) for n, d, w in zip(names, shape[1:], want) if d > 0 and d != w]
    if len(shape) != 4 or bad:
        what = f"rank {len(shape)}" if len(shape) != 4 else ", ".join(f"{n} {d} (data.{n}={w})" for n, d, w in bad)
        raise ConfigError(f"model.path {prefix}: input {feeds[0]} is {shape}, which does not fit the {task} data: "
                          f"{what}", hint="set data.channels / data.height / data.width to the model's input")
    return shape


class Trainable:
    """Marker base for layers wrapping a jit.load-ed program (export re-saves the inner program)."""


def trainable(prefix: Path):
    """paddle.jit.load(prefix) made fine-tunable: outputs join the autograd graph, and the wrapped program
    follows the wrapper's train()/eval() (its `_is_test` is set on every call)."""
    import paddle

    class TrainableProgram(paddle.nn.Layer, Trainable):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            self.inner._is_test = not self.training      # a parent's .train() never reaches it
            out = self.inner(x)
            if self.training:
                out.stop_gradient = False                # else backward stops here: no weight moves
            return out

    return TrainableProgram(load_program(prefix))


def load_program(prefix: Path):
    """paddle.jit.load of the program and its parameters only. jit.load also unpickles `<prefix>.pdiparams.info`
    when one lies beside them (code, if crafted): the two files it needs are copied into a scratch folder first,
    so a user's .info is never read. Without it the loaded layer names its parameters by program variable names."""
    import paddle

    with tempdirs.directory("jit-load") as scratch:
        copy = Path(scratch) / "inference"
        for s in SUFFIXES:
            shutil.copyfile(str(prefix) + s, str(copy) + s)
        return paddle.jit.load(str(copy))


def load_params(model, path: str | Path, allow_partial: bool, max_bytes: int | None = None) -> dict:
    """Load a .pdparams by parameter name; report missing, unexpected and shape-mismatched keys and
    refuse a partial load unless model.allow_partial (PaddleOCR's load_pretrained_params does the same)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"model.pretrained {p} does not exist", hint="a .pdparams file or an inference model folder")
    state = safe_pickle.load_state(p, "model.pretrained", max_bytes)     # data only: a pickle runs no code here
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise IntegrityError(f"model.pretrained {p} holds a {type(state).__name__}, not a state dict of named "
                             "parameters", hint="save it with paddle.save(layer.state_dict(), path)")
    own = model.state_dict()
    report = {"missing": sorted(set(own) - set(state)), "unexpected": sorted(set(state) - set(own)),
              "shape_mismatch": sorted(k for k in set(own) & set(state)
                                       if list(own[k].shape) != list(state[k].shape))}
    bad = {k: v for k, v in report.items() if v}
    if bad and not allow_partial:
        what = "; ".join(f"{len(v)} {k.replace('_', ' ')} (e.g. {v[0]})" for k, v in bad.items())
        raise ConfigError(f"model.pretrained {p.name}: partial load refused: {what}",
                          hint="fix model.name/model.args to match the checkpoint, or set model.allow_partial=true")
    model.set_state_dict({k: v for k, v in state.items() if k in own and k not in report["shape_mismatch"]})
    report["loaded"] = len(own) - len(report["missing"]) - len(report["shape_mismatch"])
    return report


def _is_pir(path) -> bool:
    from pipeline.models.pir import is_pir_model
    return is_pir_model(path) and not is_inference_model(path)


def _trainable_pir(path, model_cfg=None):
    """trainable() of a PIR export translated into a scratch folder (jit.load reads it whole; removed after)."""
    import shutil
    import tempfile

    from pipeline.models.pir import Limits, resolve_dir, translate

    scratch = Path(tempfile.mkdtemp(prefix="pir-"))
    try:
        translate(resolve_dir(path, "model.pretrained"), scratch / "inference", Limits.of(model_cfg or {}))
        return trainable(scratch / "inference")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def build(task, model_cfg: dict, info: dict, load_pretrained: bool = True):
    """The model `train` trains and `export` saves: model.pretrained as an inference program (made trainable),
    or the builder's Layer with model.pretrained .pdparams loaded by name → (layer, report or None)."""
    pre = model_cfg.get("pretrained")
    if pre and _is_pir(pre):                      # a Paddle 3 export (e.g. PP-OCRv5): translated, then as below
        return _trainable_pir(pre, model_cfg), {"kind": "inference program (Paddle 3 PIR, translated)", "path": str(pre)}
    if pre and is_inference_model(pre):
        prefix = resolve_prefix(pre, "model.pretrained", model_cfg.get("max_file_bytes"))
        return trainable(prefix), {"kind": "inference program", "path": str(pre)}
    model = task.build_model(model_cfg, info)
    if pre and load_pretrained:
        return model, {"kind": "pdparams", "path": str(pre), **load_params(model, pre, model_cfg["allow_partial"],
                                                                            model_cfg.get("max_file_bytes"))}
    return model, None


def moved(before, after, fallback_scale: float = 0.0) -> bool:
    """A tensor moved when its largest change exceeds float32 rounding at its own scale (max|d| > eps x max|w|;
    an all-zero tensor, e.g. a fresh bias, is measured at `fallback_scale`). Bit equality is not enough:
    train.lr=1e-30 nudges exact zeros to 1e-30 (8 of v4 rec's 234 tensors) and moves nothing else, a change that
    every sum with values of the tensor's scale rounds away."""
    import numpy as np

    a, b = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if a.shape != b.shape:
        return True
    if a.size == 0:
        return False
    scale = float(np.abs(a).max()) or fallback_scale
    return float(np.abs(b - a).max()) > float(np.finfo(np.float32).eps) * scale


def changed_tensors(before: dict, after: dict) -> tuple[int, int]:
    """(tensors that moved beyond float32 rounding, tensors compared) between two state dicts of numpy arrays;
    all-zero tensors are measured at the median scale of the others."""
    import numpy as np

    keys = [k for k in before if k in after]
    scales = [float(np.abs(before[k]).max()) for k in keys if np.size(before[k])]
    fallback = float(np.median([v for v in scales if v > 0])) if any(v > 0 for v in scales) else 0.0
    return sum(moved(before[k], after[k], fallback) for k in keys), len(keys)


def rounding_only(before: dict, after: dict) -> int:
    """Tensors whose bits changed although none moved beyond float32 rounding (a vanishing learning rate)."""
    import numpy as np

    return sum(not np.array_equal(before[k], np.asarray(after[k])) for k in before if k in after)


def unchanged_cause(model, lr: float, rounding: int = 0) -> str:
    """Why a training run moved no weight: the likeliest cause first (`rounding`: tensors whose bits changed
    only below float32 resolution, which only a vanishing learning rate does)."""
    from paddle.jit.translated_layer import TranslatedLayer

    loaded = [n for n, m in model.named_sublayers(include_self=True) if isinstance(m, TranslatedLayer)]
    if loaded and not isinstance(model, Trainable):
        return (f"the model holds a paddle.jit.load-ed program ({loaded[0] or 'the model itself'}): its outputs come "
                "back with stop_gradient=True and a parent's train() does not reach it; give its folder as "
                "model.pretrained instead, which handles both")
    if rounding:
        return (f"train.lr={lr:g} is too small: the updates changed {rounding} tensors only below float32 resolution "
                "(each by less than one rounding step of its largest value); raise train.lr")
    params = model.parameters()
    if params and all(p.stop_gradient for p in params):
        return "every parameter has stop_gradient=True (frozen): unfreeze the layers to fine-tune"
    return f"no gradient reached the weights, or train.lr={lr:g} is too small to change a float32 value"

"""One validated config tree: configs/defaults.yaml ← config file ← `-o key=value` overrides.

Every key lives in defaults.yaml (with a comment); the schema below only types and bounds them,
so an unknown or misspelled key is an error with a "did you mean" suggestion.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from pipeline.core import safe_yaml
from pipeline.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = ROOT / "configs" / "defaults.yaml"

PosInt = Field(gt=0)
NonNegFloat = Field(ge=0)
MAX_INT = 1 << 40              # any integer key: past this it is a typo (and range()/allocations would die on it)
MAX_FLOAT = 1e12               # any float key: finite and within this (a tolerance of .inf could never fail)
MAX_COUNT = 10_000_000         # sample counts (data.num_train, ...): ~10x the largest real data set
THREADS_PER_CORE = 4           # thread keys: at most this many per core (1e20 threads ended in SIGSEGV)


def _max_threads() -> int:
    return THREADS_PER_CORE * (os.cpu_count() or 1)


def bounded_number(name: str, value) -> None:
    """Raises ValueError naming `name` if a number in `value` (a list included) is out of every key's bounds."""
    for v in (value if isinstance(value, (list, tuple)) else [value]):
        if isinstance(v, bool):
            continue
        if isinstance(v, int) and abs(v) > MAX_INT:
            raise ValueError(f"{name}={v} is over the limit of {MAX_INT} for any integer key")
        if isinstance(v, float) and (not math.isfinite(v) or abs(v) > MAX_FLOAT):
            raise ValueError(f"{name}={v} is not a finite number within +-{MAX_FLOAT:g}")
        if "threads" in name and isinstance(v, int) and v > _max_threads():
            raise ValueError(f"{name}={v} is more than {THREADS_PER_CORE} threads per core "
                             f"({_max_threads()} on this machine)")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _numbers_bounded(self):
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for key, v in items:
                if not isinstance(v, BaseModel):
                    bounded_number(name if key is None else f"{name}.{key}", v)
        return self


class RunCfg(Section):
    root: str
    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    quiet: bool
    threads: int = Field(ge=0)

    @field_validator("name")
    @classmethod
    def _a_folder_of_its_own(cls, v: str) -> str:
        # "." is run.root itself (its train stage replaced another run's runs/train), ".." the checkout;
        # names starting with "." are the runner's own (.work, .lock, .tmp-*)
        if v.startswith("."):
            raise ValueError(f"run.name {v!r} would not be a folder of its own under run.root (it names run.root, "
                             "its parent, or a hidden folder): use letters, digits, '_', '-' and '.' not first")
        return v


class DataCfg(Section):
    source: Literal["synthetic", "folder", "pages", "images"]
    path: Optional[str]
    val_path: Optional[str]
    val_fraction: float = Field(gt=0, lt=1)
    charset: Optional[str]
    use_space_char: bool
    preprocess: Literal["default", "ppocr"]
    num_train: int = Field(gt=0, le=MAX_COUNT)
    num_val: int = Field(gt=0, le=MAX_COUNT)
    height: int = Field(ge=8, le=1024)
    width: int = Field(ge=8, le=4096)
    channels: Literal[1, 3]
    max_len: int = Field(gt=0, le=1024)            # characters in one text line
    max_boxes: int = Field(gt=0, le=10_000)        # text boxes on one page
    page_size: int = Field(ge=64, le=4096)
    fonts: list[str]
    train_drawable_only: bool
    val_drawable_only: bool
    on_bad_sample: Literal["error", "skip"]
    cache_dir: str
    max_text_bytes: int = PosInt
    max_text_lines: int = PosInt


class ModelCfg(Section):
    name: str
    args: dict[str, Any]
    source: Literal["builder", "inference", "pir", "onnx"]   # pir: a Paddle 3 inference.json export (pipeline/models/pir.py); onnx: an .onnx file (pipeline/models/onnx_import.py)
    path: Optional[str]
    pretrained: Optional[str]
    allow_partial: bool
    max_file_bytes: int = PosInt
    pir_max_json_bytes: int = PosInt
    pir_max_depth: int = Field(gt=0, le=10_000)
    pir_max_ops: int = PosInt
    pir_max_params: int = PosInt

    @model_validator(mode="after")
    def _inference_needs_a_path(self):
        if self.source in ("inference", "pir", "onnx") and not self.path:
            raise ValueError(f"model.source is '{self.source}' but model.path is empty: set it to the folder (or prefix) "
                             "of inference.pdmodel/.pdiparams (pir: the folder of inference.json/.pdiparams/.yml)")
        return self


class PrecheckCfg(Section):
    enable: bool
    atol: float = Field(gt=0)
    bf16_atol: float = Field(gt=0)
    on_fail: Literal["fallback", "fail"]


class AmpCfg(Section):
    enable: bool
    level: Literal["O1", "O2"]
    dtype: Literal["float16", "bfloat16"]
    custom_white_list: list[str]
    custom_black_list: list[str]
    init_loss_scaling: float = Field(gt=0)
    incr_ratio: float = Field(gt=1)
    decr_ratio: float = Field(gt=0, lt=1)
    incr_every_n_steps: int = PosInt
    decr_every_n_nan_or_inf: int = PosInt
    use_dynamic_loss_scaling: bool
    master_grad: bool
    bf16_min_mac_share: float = Field(ge=0, le=1)
    precheck: PrecheckCfg


class TrainCfg(Section):
    device: Literal["auto", "cpu", "gpu"]
    epochs: int = PosInt
    nproc: Union[Literal["auto"], int]
    batch_size: int = PosInt
    lr: float = Field(gt=0)
    lr_scaling: Literal["none", "linear", "sqrt"]
    lr_base_batch: int = PosInt
    optimizer: Literal["adam", "momentum"]
    weight_decay: float = NonNegFloat
    scheduler: Literal["cosine", "constant"]
    warmup_epochs: int = Field(ge=0)
    amp: AmpCfg
    max_nonfinite_steps: int = PosInt
    min_metric: float = Field(ge=0, le=1)
    bn_recalibrate: bool
    val_slice: int = PosInt
    resume: bool
    visualdl: bool

    @field_validator("nproc", mode="before")
    @classmethod
    def _auto_or_count(cls, v):
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError("must be auto or a process count >= 1")


class Tolerance(Section):
    atol: Optional[float] = Field(default=None, gt=0)        # None: outputs not compared elementwise
    rtol: float = Field(default=0.0, ge=0)                   # + rtol x max|reference| (np.allclose-like)
    metric_delta: float = NonNegFloat                        # allowed drop of the primary metric
    min_agreement: Optional[float] = Field(default=None, ge=0, le=1)   # argmax / decoded-text agreement
    # outputs that are probabilities (softmax / sigmoid) are compared as probabilities: max|p - p_ref| <=
    # prob_atol (atol/rtol are for logits). Below 1: a probability cannot move by more than 1
    prob_atol: Optional[float] = Field(default=None, gt=0, lt=1)
    # tasks that read text (recognition): the share of lines the reference reads correctly that the row reads
    # wrongly (docs/low_precision.md); None: not gated
    max_correct_lost: Optional[float] = Field(default=None, ge=0, le=1)

    @model_validator(mode="after")
    def _can_fail(self):
        # metrics live in [0, 1]: a drop of 1 is always allowed, so with no elementwise bound and no agreement floor
        # the gate would pass any output, a broken model's included. One bound per output kind: the kind is known
        # only with the model, so gates.evaluate_tol refuses the case where only the other kind's bound is set
        if self.atol is None and self.prob_atol is None and self.metric_delta >= 1.0 and not self.min_agreement:
            raise ValueError("this gate cannot fail (atol and prob_atol null, metric_delta >= 1 and no min_agreement): "
                             "set an atol, a metric_delta below 1 or a min_agreement above 0")
        return self


class ExportCfg(Section):
    gate: Tolerance


class QuantCfg(Section):
    algo: Literal["hist", "avg", "mse", "abs_max", "KL"]
    batch_size: int = PosInt
    batch_nums: int = PosInt
    onnx_format: bool
    skip: list[str]
    op_types: list[Literal["conv2d", "depthwise_conv2d", "conv2d_transpose", "mul", "matmul", "matmul_v2"]]
    sensitivity_on_fail: bool
    sensitivity_budget_s: float = Field(gt=0)
    nncf_preset: Literal["performance", "mixed"]
    nncf_activation_range: Literal["mean_minmax", "minmax"]


class PerfCfg(Section):
    warmup: int = Field(ge=0)
    repeats: int = PosInt
    batch_size: int = PosInt


class HttpCfg(Section):
    enable: bool
    max_requests: int = PosInt


class OnnxCfg(Section):
    opset: int = Field(ge=7, le=19)
    required: bool
    gpu_providers: list[Literal["cuda", "tensorrt"]]


class TuningCfg(Section):
    threads: list[int] = Field(min_length=1)
    paddle_ir_optim: list[bool | Literal["plain"]] = Field(min_length=1)
    rounds: int = PosInt


class RecommendCfg(Section):
    by: Literal["latency", "throughput"]
    precisions: list[Literal["fp32", "bf16", "fp16", "int8"]] = Field(min_length=1)
    max_metric_drop: float = Field(ge=0, le=1)
    min_agreement: float = Field(ge=0, le=1)
    min_speedup: float = Field(ge=1.0)

    @model_validator(mode="after")
    def _fp32_servable(self):
        # fp32 is what every low-precision row must beat; without it nothing could be compared
        if "fp32" not in self.precisions:
            raise ValueError("server.recommend.precisions must include fp32 (low-precision rows are served only "
                             "when faster than the fastest fp32 row)")
        return self


class Fp16Cfg(Section):
    # op types added to Paddle Inference's mixed-precision black list: convert_to_mixed_precision(black_list=) and
    # Config.exp_disable_mixed_precision_ops() on a GPU, the emulation's black list on CPU (the same set for both)
    keep_fp32_ops: list[str]

    @field_validator("keep_fp32_ops")
    @classmethod
    def _op_type_names(cls, v: list[str]) -> list[str]:
        bad = [o for o in v if not re.fullmatch(r"[a-z][a-z0-9_]*", o)]
        if bad:
            raise ValueError(f"not Paddle op type names: {bad} (e.g. softmax, matmul_v2, layer_norm)")
        return sorted(set(v))


class Bf16Cfg(Section):
    emulated: bool                          # the paddle-inference bf16-emulated row (every CPU, never served)
    paddle_ops: list[str]                   # Paddle Inference set_bfloat16_op op types; [] = every op
    openvino_keep_fp32: list[str]           # OpenVINO compute layers kept f32 with their tails (IR `precise`)
    chosen_on: Optional[str] = None         # the data split the lists were chosen on (never the gate's)

    @field_validator("paddle_ops")
    @classmethod
    def _op_type_names(cls, v: list[str]) -> list[str]:
        return Fp16Cfg._op_type_names(v)


class ServerCfg(Section):
    precisions: list[Literal["fp32", "fp16", "bf16", "int8"]]
    device: Literal["auto", "cpu", "gpu"]
    threads: int = Field(ge=0)
    mkldnn: bool
    ir_optim: bool
    tensorrt: bool
    fp16: Fp16Cfg
    bf16: Bf16Cfg
    gates: dict[Literal["fp32", "fp16", "bf16", "int8"], Tolerance]
    # row subject ("onnxruntime int8") or precision ("int8") -> required (a failure fails the run) | candidate
    # (gated and reported; a failure excludes the row from serving); unnamed rows are required
    roles: dict[str, Literal["required", "candidate"]]
    quant: QuantCfg
    perf: PerfCfg
    http: HttpCfg
    engines: list[Literal["paddle-inference", "onnxruntime", "openvino"]]
    onnx: OnnxCfg
    tuning: TuningCfg
    recommend: RecommendCfg
    batch_memory_mb: int = PosInt       # bound on one batch's activations (batch sizes)
    memory_budget_mb: int = PosInt      # the stage's peak RSS (pipeline/evaluation/rows.py MemoryBudget)

    @model_validator(mode="after")
    def _every_precision_has_a_gate(self):
        missing = [p for p in self.precisions if p not in self.gates]
        if missing:
            raise ValueError(f"server.gates has no tolerance for {missing}")
        if "fp32" not in self.precisions:
            raise ValueError("server.precisions must include fp32 (the reference every other row is gated against)")
        return self


class LiteCfg(Section):
    arm: list[Literal["fp32", "fp16", "int8", "int8_weight", "int16_weight"]]
    verify_x86: bool
    gate: Tolerance
    timeout: int = PosInt


class BundleCfg(Section):
    root: str
    version: Optional[str] = Field(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$", max_length=100)   # a name, not a path
    archive: bool
    samples: int = PosInt
    sample_atol: float = Field(gt=0)
    sample_rtol: float = NonNegFloat
    sample_prob_atol: float = Field(gt=0, lt=1)
    sign_key: Optional[str]


class VerifyCfg(Section):
    trust_key: Optional[str]
    max_archive_bytes: int = PosInt
    max_members: int = PosInt


class BatchingCfg(Section):
    mode: Literal["auto", "on", "off"] | bool       # YAML reads a bare on/off as true/false
    max_batch: int = Field(ge=1, le=64)
    max_wait_ms: float = Field(ge=0, le=1000)
    min_saving_ms: float = Field(ge=0)
    min_saving_ratio: float = Field(ge=0, lt=1)


class ServeCfg(Section):
    max_body_bytes: int = PosInt
    max_pixels: int = PosInt
    max_concurrency: int = PosInt
    access_log: bool
    max_header_bytes: int = Field(ge=1024)      # below 1 KiB ordinary clients' headers would be refused
    header_timeout_s: float = Field(gt=0)
    body_timeout_s: float = Field(gt=0)
    keepalive_s: float = Field(gt=0)
    grace_s: float = Field(ge=0)
    request_timeout_s: float = Field(ge=0)      # 0: no budget
    max_boxes_per_page: int = Field(ge=0)       # 0: no cap
    ocr_lanes: int = Field(ge=1, le=64)         # /ocr engine sets reading pages side by side
    batching: BatchingCfg


class DetectionCfg(Section):
    resize: Literal["stretch", "limit"]
    limit_side_len: int = Field(ge=32, le=8192)
    limit_type: Literal["max", "min", "resize_long"]
    mean: list[float] = Field(min_length=3, max_length=3)
    std: list[float] = Field(min_length=3, max_length=3)
    use_dilation: bool
    thresh: float = Field(gt=0, lt=1)
    box_thresh: float = Field(gt=0, lt=1)
    unclip_ratio: float = Field(gt=0, le=100)       # PaddleOCR uses 1.5-2; 1e300 overflowed db_post
    max_candidates: int = PosInt
    min_size: float = NonNegFloat
    iou: float = Field(gt=0, le=1)
    shrink_ratio: float = Field(gt=0, lt=1)


class SystemCfg(Section):
    detection: Optional[str]
    recognition: Optional[str]
    detection_overrides: list[str]
    recognition_overrides: list[str]
    pages: int = PosInt
    samples: int = PosInt
    http_pages: int = Field(ge=0)
    min_line_accuracy: float = Field(ge=0, le=1)
    min_field_accuracy: float = Field(ge=0, le=1)
    gates: dict[Literal["fp16", "bf16", "int8", "lite", "engines", "http"], float]
    classifier: Optional[str]
    classifier_overrides: list[str]
    engine: Literal["auto", "paddle-inference", "onnxruntime", "openvino"]
    pin: dict[Literal["detection", "recognition", "classifier"], str] = {}
    rec_batch_num: int = PosInt
    cls_batch_num: int = PosInt
    max_side_len: int = Field(ge=0)
    min_side_len: int = Field(ge=0)
    min_height: int = Field(ge=0)
    width_height_ratio: float = NonNegFloat
    cls_thresh: float = Field(ge=0, le=1)
    drop_score: float = Field(ge=0, le=1)
    retry_scale: float = Field(ge=0, lt=1)
    turn_check: bool
    det_bucket: int = Field(ge=0)
    rec_bucket: int = Field(ge=0)
    rec_recheck_margin: float = Field(ge=0, le=1)
    det_static_shapes: int = Field(ge=0, le=64)
    edge_pages: int = Field(ge=0, le=256)
    edge_lines_kept: float = Field(ge=0, le=1)

    @field_validator("pin")
    @classmethod
    def _pin_rows(cls, v: dict) -> dict:
        # "engine precision", as the server rows are named (pipeline/bundle/recommend.SERVABLE checks the pair)
        for role, row in v.items():
            parts = str(row).split()
            if len(parts) != 2 or parts[0] not in ("paddle-inference", "onnxruntime", "openvino") \
                    or parts[1] not in ("fp32", "bf16", "int8", "fp16"):
                raise ValueError(f"system.pin.{role}={row!r}: expected '<engine> <precision>', e.g. 'openvino fp32'")
        return v


class RegressionCfg(Section):
    baseline: Optional[str]
    history: str
    metric_drop: float = NonNegFloat
    size_growth: float = NonNegFloat
    latency_growth: float = NonNegFloat
    ab_rounds: int = PosInt
    ab_runs: int = PosInt
    ab_threads: int = Field(ge=0)


class ConformanceCfg(Section):
    """`make conformance`'s own settings (pipeline/nightly/conformance.py): read by the driver, never by a stage."""
    max_marked_share: float = Field(ge=0.0, le=1.0)
    jobs: int = Field(ge=1, le=64)      # architectures run side by side
    zoo: dict[str, dict[str, Any]]
    fast: list[str]


class Config(Section):
    task: Literal["classification", "recognition", "detection", "text_direction", "ocr_system"]
    seed: int = Field(ge=0, lt=1 << 32)            # numpy's and Paddle's seeds are 32-bit
    run: RunCfg
    data: DataCfg
    model: ModelCfg
    train: TrainCfg
    export: ExportCfg
    server: ServerCfg
    lite: LiteCfg
    bundle: BundleCfg
    verify: VerifyCfg
    serve: ServeCfg
    regression: RegressionCfg
    detection: DetectionCfg
    system: SystemCfg
    conformance: ConformanceCfg
    # dotted keys the config files and overrides set (not defaults.yaml): an import fills the others from its
    # model's own description (model.source=pir: inference.yml). None (a config rebuilt from a dump): all set.
    _user_keys: frozenset | None = PrivateAttr(default=None)

    @property
    def user_keys(self) -> frozenset | None:
        return self._user_keys

    @property
    def run_dir(self) -> Path:
        return (ROOT / self.run.root / self.run.name) if not Path(self.run.root).is_absolute() \
            else Path(self.run.root) / self.run.name

    def section(self, *keys: str) -> dict:
        out = {k: _plain(getattr(self, k)) for k in keys}
        if "model" in out:      # what the model loads is part of every fingerprint made from this section
            out["model"] = {**out["model"], "loads": model_sources(self.model)}
        return out

    def hash_of(self, *keys: str) -> str:
        blob = json.dumps(self.section(*keys), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


OUTPUT_ROOTS = ("run.root", "bundle.root", "data.cache_dir")
INPUT_PATHS = ("data.path", "data.val_path", "data.charset", "model.path", "model.pretrained", "regression.baseline",
               "verify.trust_key", "bundle.sign_key")


def _abs(path: str) -> Path:
    p = Path(path).expanduser()
    return Path(os.path.abspath(p if p.is_absolute() else ROOT / p))


def _get(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


BUNDLE_MARKERS = ("manifest.json", "infer_config.yaml")     # what a published bundle folder holds (bundle/layout)


def _run_outside_bundles(cfg, run_dir: Path) -> None:
    """A run writes .lock, .work and its stage folders: never inside bundle.root or a published bundle (verify
    would then fail it), and bundle.root never inside the run folder (its stages replace it)."""
    bundle_root = _abs(cfg.bundle.root)
    if run_dir.is_relative_to(bundle_root) or bundle_root.is_relative_to(run_dir):
        raise ConfigError(f"run folder {run_dir} (run.root/run.name) and bundle.root {bundle_root} overlap: the run "
                          "would write into the published bundles", hint="keep run.root and bundle.root apart")
    for folder in (run_dir, *run_dir.parents):
        if all((folder / m).is_file() for m in BUNDLE_MARKERS):
            raise ConfigError(f"run folder {run_dir} lies inside the bundle {folder}",
                              hint="set run.root to a folder of its own, outside every bundle")


def confine_paths(cfg) -> None:
    """Folders a run writes (and replaces stage folders in) hold nothing else: an output root that is the file
    system root, the home folder, the checkout or one of its parents is refused, and so is an input that lies
    inside this run's own folder (its stages replace it) or that contains it."""
    home = Path(os.path.abspath(Path.home()))
    for key in OUTPUT_ROOTS:
        p = _abs(_get(cfg, key))
        if p == Path(p.anchor) or p == home or ROOT.is_relative_to(p):
            raise ConfigError(f"{key}={_get(cfg, key)!r} is {p}, a folder that holds more than this pipeline's "
                              "outputs: runs write (and replace stage folders) there",
                              hint=f"set {key} to a folder of its own, such as the default in configs/defaults.yaml")
    run_dir = _abs(str(cfg.run_dir))
    _run_outside_bundles(cfg, run_dir)
    for key in INPUT_PATHS:
        value = _get(cfg, key)
        if not value:
            continue
        p = _abs(value)
        if p.is_relative_to(run_dir) or run_dir.is_relative_to(p):
            raise ConfigError(f"{key}={value!r} {'lies inside' if p.is_relative_to(run_dir) else 'contains'} "
                              f"this run's own folder {run_dir}, which its stages replace",
                              hint="copy it elsewhere, or give this run another run.name")


_HASHED: dict[tuple, str] = {}


def _file_digest(path: Path) -> str:
    """sha256 of a file, cached per (path, size, mtime): sections are built many times per run."""
    from pipeline.core.artifacts import sha256_file

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = sha256_file(path)
    return _HASHED[key]


def _files_of(path: str) -> list[Path]:
    p = ROOT / path if not Path(path).is_absolute() else Path(path)
    if p.is_dir():
        return sorted(f for f in p.iterdir() if f.is_file() and f.suffix in (".pdmodel", ".pdiparams", ".yml", ".json"))
    cands = [p] + [Path(str(p) + s) for s in (".pdmodel", ".pdiparams")]
    return [f for f in cands if f.is_file()]


def _builder_source(name: str) -> list[Path]:
    """The module file of a user's "package.module:callable" (built-ins are covered by the stage's code deps)."""
    import importlib.util

    if ":" not in name:
        return []
    try:
        spec = importlib.util.find_spec(name.partition(":")[0])
    except (ImportError, ValueError):
        return []
    return [Path(spec.origin)] if spec and spec.origin and Path(spec.origin).is_file() else []


def model_sources(model: "ModelCfg") -> dict[str, str]:
    """File name → sha256 of everything the model section makes the train stage read: the imported program
    (model.path), pretrained weights (model.pretrained) and a user builder's module source."""
    files = _builder_source(model.name)
    for path in (model.path if model.source in ("inference", "pir", "onnx") else None, model.pretrained):
        files += _files_of(path) if path else []
    return {(str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f)): _file_digest(f) for f in files}


def _plain(value):
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


# ---------------------------------------------------------------- loading

def _read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}", hint="pass an existing file with CONFIG=... or -c")
    try:
        data = safe_yaml.read(path) or {}       # UTF-8 whatever the locale; alias bombs, depth, duplicate keys
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"config file is not valid YAML at {where}: {getattr(exc, 'problem', exc)}",
                          hint="check brackets, quotes and indentation on that line (configs/defaults.yaml "
                               "shows the layout)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}",
                          hint="write 'section:' lines with indented 'key: value' lines, as in configs/defaults.yaml")
    return data


def _merge(base: dict, extra: dict, origin: str, prefix: str = "") -> dict:
    out = dict(base)
    for key, value in extra.items():
        dotted = f"{prefix}{key}"
        if key not in base:
            close = difflib.get_close_matches(str(key), [str(k) for k in base], n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else \
                f"valid keys here: {', '.join(sorted(map(str, base)))}"
            if not (isinstance(base, dict) and _is_free_mapping(prefix)):
                raise ConfigError(f"unknown config key '{dotted}' in {origin}", hint=hint)
        if isinstance(value, dict) and isinstance(base.get(key), dict) and not _is_free_mapping(dotted + "."):
            out[key] = _merge(base[key], value, origin, dotted + ".")
        else:
            out[key] = value
    return out


def _is_free_mapping(prefix: str) -> bool:
    """Mappings whose keys are user-defined (model constructor args; system.pin's parts, checked by its validator;
    server.roles' row names)."""
    return prefix in ("model.args.", "system.pin.", "server.roles.", "conformance.zoo.")


def split_overrides(text: str) -> list[str]:
    """`make O="..."` as one string → key=value items, the way a user reads it.

    Shell-like: whitespace separates items, '...' and "..." quote (and are removed), backslash escapes.
    Unlike a shell, whitespace inside {...} or [...] does not split, and a value that starts with a
    bracket is kept verbatim (its quotes belong to YAML): `model.args={a: 1, b: "x y"}` is one item."""
    items, cur, quote, depth, has_item = [], [], None, 0, False
    it = iter(text)
    for ch in it:
        if quote:
            if ch == quote:
                quote = None
                if depth:
                    cur.append(ch)
            else:
                cur.append(ch)
            continue
        if ch == "\\" and not depth:
            cur.append(next(it, ""))
            has_item = True
        elif ch in "'\"":
            quote, has_item = ch, True
            if depth:
                cur.append(ch)
        elif ch in "{[":
            depth += 1
            cur.append(ch)
        elif ch in "}]":
            depth = max(depth - 1, 0)
            cur.append(ch)
        elif ch.isspace() and not depth:
            if cur or has_item:
                items.append("".join(cur))
            cur, has_item = [], False
        else:
            cur.append(ch)
    if quote:
        raise ConfigError(f"unbalanced {quote} quote in overrides: {text!r}",
                          hint="close the quote, e.g. O='data.path=\"/data/my set\"'")
    if depth:
        raise ConfigError(f"unbalanced bracket in overrides: {text!r}", hint="e.g. O='model.args={a: 1, b: 2}'")
    if cur or has_item:
        items.append("".join(cur))
    return items


def _colon_without_space(value, where: str) -> None:
    """YAML reads {scale:0.5} as a key 'scale:0.5' with no value: almost always a typo for {scale: 0.5}."""
    if isinstance(value, dict):
        for k, v in value.items():
            if v is None and isinstance(k, str) and ":" in k:
                a, b = k.split(":", 1)
                raise ConfigError(f"{where}: '{k}' reads as a key with no value (YAML needs a space after ':')",
                                  hint=f"write {{{a}: {b}}}")
            _colon_without_space(v, where)
    elif isinstance(value, list):
        for v in value:
            _colon_without_space(v, where)


def parse_override(item: str) -> dict:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not key=value", hint="e.g. -o train.epochs=3")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override '{item}' has an empty key", hint="e.g. -o train.epochs=3")
    try:
        value = safe_yaml.loads(raw, f"override '{item}'") if raw != "" else None
    except yaml.YAMLError:
        if raw.lstrip().startswith(("{", "[")):
            raise ConfigError(f"override '{item}': the value is not valid YAML",
                              hint="mappings look like {a: 1, b: 2} and lists like [1, 2]") from None
        value = raw
    _colon_without_space(value, f"override '{item}'")
    node: dict = {}
    cur = node
    parts = key.split(".")
    for part in parts[:-1]:
        cur[part] = {}
        cur = cur[part]
    cur[parts[-1]] = value
    return node


def _dotted(tree: dict, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in tree.items():
        out |= _dotted(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}"}
    return out


def load_config(paths: list[str | Path] | None = None, overrides: list[str] | None = None) -> Config:
    tree = _read_yaml(DEFAULTS)
    user: set[str] = set()
    for path in paths or []:
        layer = _read_yaml(Path(path))
        tree, user = _merge(tree, layer, str(path)), user | _dotted(layer)
    for item in overrides or []:
        layer = parse_override(item)
        tree, user = _merge(tree, layer, f"-o {item}"), user | _dotted(layer)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        got = err.get("input")
        got_s = "" if isinstance(got, dict) else f" (got {got!r})"
        named = re.match(r"Value error, ([\w.]+)=", err["msg"])
        if named:                   # a section's own check names its key: section.key, not only the section
            where, err = f"{where}.{named[1]}", {**err, "msg": err["msg"][len("Value error, "):]}
        more = f" [+{len(exc.errors()) - 1} more]" if len(exc.errors()) > 1 else ""
        raise ConfigError(f"config key '{where}': {err['msg']}{got_s}{more}",
                          hint="see configs/defaults.yaml for the allowed values") from None
    confine_paths(cfg)
    cfg._user_keys = frozenset(user)
    return cfg


def save_resolved(cfg: Config, path: Path) -> None:
    from pipeline.core.artifacts import atomic_write_text
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))

"""docs/extending.md walked through: a toy engine and a toy task added through the declared extension points
(pipeline.engines.registry.register_engine, pipeline.tasks.register_task) and run through the rows the way the
server stage runs the built-in ones (make -> run_batched -> evaluate_tol inside run_row -> apply_role; rank).
Fast: numpy only, no Paddle."""
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.core.gates import EXCLUDED, FAIL, OK, Gate, apply_role, evaluate_tol, run_row
from pipeline.engines import evidence, registry
from pipeline.engines.base import Engine
from pipeline.tasks.base import Datasets, Split, Task, provides

ROOT = Path(__file__).resolve().parent.parent
SHAPE = (1, 4, 4)


class NumpyLinear(Engine):
    """A runtime in numpy for a linear model stored as .npz (w, b): out = flat(x) @ w + b. At fp16 the matmul runs
    in float16 (a real precision change the gate must measure); `flip` plants a defect (negated outputs)."""
    kind = "numpy"

    def __init__(self, model, precision: str = "fp32", threads: int = 1, flip: bool = False):
        super().__init__()
        with np.load(model) as z:
            self.w, self.b = z["w"], z["b"]
        self.input_shape = [-1, *SHAPE]
        self.dtype = np.float16 if precision == "fp16" else np.float32
        self.effective_precision = "fp16" if precision == "fp16" else "fp32"
        self.evidence = {"matmul_dtype": np.dtype(self.dtype).name}
        self.settings = {"threads": threads}
        self.flip = flip

    def _run(self, x: np.ndarray) -> np.ndarray:
        out = (x.reshape(len(x), -1).astype(self.dtype) @ self.w.astype(self.dtype) + self.b.astype(self.dtype))
        return (-out if self.flip else out).astype(np.float32)


class ToySign(Task):
    """Two classes: which of two fixed linear read-outs of a 4x4 image is larger (labels from the true model)."""
    name = "toy_sign"
    primary_metric = "accuracy"
    output_layout = "[N, 2]"

    def load_data(self, data_cfg: dict, seed: int) -> Datasets:
        rng = np.random.default_rng(seed)
        w = rng.normal(size=(int(np.prod(SHAPE)), 2)).astype(np.float32)
        make = lambda n: rng.normal(size=(n, *SHAPE)).astype(np.float32)
        tr, va = make(64), make(64)
        label = lambda x: np.argmax(x.reshape(len(x), -1) @ w, axis=1).astype(np.int64)
        return Datasets(Split(tr, label(tr)), Split(va, label(va)), {"labels": ["first", "second"], "w": w})

    def build_model(self, model_cfg: dict, info: dict):
        import paddle
        return paddle.nn.Sequential(paddle.nn.Flatten(), paddle.nn.Linear(int(np.prod(SHAPE)), 2))

    def loss(self, logits, labels):
        import paddle.nn.functional as F
        return F.cross_entropy(logits, labels)

    def metrics(self, outputs, labels):
        return {"accuracy": float(np.mean(np.argmax(outputs, axis=1) == labels))}

    def agreement(self, candidate, reference, band=None):
        share = float(np.mean(np.argmax(candidate, axis=1) == np.argmax(reference, axis=1)))
        return "argmax", share, share

    def decode(self, outputs, info):
        return [info["labels"][i] for i in np.argmax(outputs, axis=1)]

    def preprocess_spec(self, data_cfg, info):
        return {"input_shape": [-1, *SHAPE], "normalize": None}

    def postprocess_spec(self, info):
        return {"labels": info["labels"], "decoder": "argmax"}


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy engine and task registered (for this test only), a model file, data and the smoke config's gates."""
    from pipeline import tasks

    monkeypatch.setattr(registry, "_ENGINES", dict(registry._ENGINES))
    monkeypatch.setattr(tasks, "_REGISTERED", dict(tasks._REGISTERED))
    registry.register_engine("numpy", lambda model, precision, *, threads, batch, spin, **opts:
                             NumpyLinear(model, precision, threads, **opts), requires="numpy")
    tasks.register_task("toy_sign", lambda post: ToySign())
    task = tasks.get_task("toy_sign")
    ds = task.load_data({}, seed=0)
    model = tmp_path / "linear.npz"
    np.savez(model, w=ds.info["w"], b=np.zeros(2, np.float32))
    gates = load_config([ROOT / "configs" / "smoke.yaml"]).server.gates
    return task, ds, model, gates


def _row(task, engine, x, ref_out, labels, ref_metric, tol, requested, role="required") -> Gate:
    """One engine row, as the server stage builds it from the library pieces."""
    def judge() -> Gate:
        out = engine.run_batched(x, 16)
        value = task.metrics(out, labels)[task.primary_metric]
        label = engine.effective_precision
        if requested != "fp32":
            label, _ = evidence.check_outputs(label, requested, out, ref_out)
        gate = Gate("server", f"{engine.kind} {requested}", requested, label, task.primary_metric, reference=ref_metric)
        return evaluate_tol(gate, out, ref_out, tol, value, task, key=f"server.gates.{requested}", labels=labels)
    return apply_role(run_row("server", f"{engine.kind} {requested}", requested, task.primary_metric, judge), role)


def test_a_toy_engine_and_task_run_through_the_rows(toy):
    task, ds, model, gates = toy
    assert "numpy" in registry.kinds() and registry.available("numpy") == (True, "ok")
    x, labels = ds.val.images, ds.val.labels
    ref = registry.make("numpy", model, "fp32")
    ref_out = ref.run(x)
    ref_metric = task.metrics(ref_out, labels)["accuracy"]
    assert ref_metric == 1.0                               # the model is the one the labels came from

    fp32 = _row(task, registry.make("numpy", model, "fp32"), x, ref_out, labels, ref_metric, gates["fp32"], "fp32")
    assert fp32.status == OK and fp32.precision_effective == "fp32", fp32.failure_line()
    fp16 = _row(task, registry.make("numpy", model, "fp16"), x, ref_out, labels, ref_metric, gates["fp16"], "fp16")
    assert fp16.status == OK and fp16.precision_effective == "fp16", fp16.failure_line()
    diff = next(c for c in fp16.checks if c.name == "max_abs_diff")
    assert diff.observed > 0 and diff.passed            # fp16 really ran: its outputs differ, within the fp16 limit

    flipped = registry.make("numpy", model, "fp32", flip=True)     # a planted defect fails its gate
    bad = _row(task, flipped, x, ref_out, labels, ref_metric, gates["fp32"], "fp32")
    assert bad.status == FAIL and "max_abs_diff" in bad.failure_line(), bad.failure_line()
    assert _row(task, flipped, x, ref_out, labels, ref_metric, gates["fp32"], "fp32", "candidate").status == EXCLUDED

    crashed = _row(task, registry.make("numpy", model, "fp32"), x[:, :, :2], ref_out, labels, ref_metric,
                   gates["fp32"], "fp32")       # wrong input shape: the engine refuses, the row says why
    assert crashed.status == FAIL and "does not match model input" in crashed.reason

    rows = registry.rank({"numpy fp32": registry.make("numpy", model, "fp32"),
                          "numpy fp16": registry.make("numpy", model, "fp16")}, x, batch_size=8, warmup=1,
                         repeats=4, rounds=2)
    assert {r["engine"] for r in rows} == {"numpy fp32", "numpy fp16"}
    assert all(r["latency_ms"]["p50"] > 0 and r["throughput_sps"] > 0 for r in rows)
    assert task.decode(ref_out[:2], ds.info)[0] in ("first", "second")


def test_the_declared_hooks_have_their_defaults(toy):
    task = toy[0]
    assert (task.outputs, task.labels_are_classes) == ("logits", True)
    assert task.check_output_shape([1, 2], {}) is None
    assert not provides(task, "correct_lost")
    with pytest.raises(KeyError, match="not an optional task hook"):
        provides(task, "corect_lost")


def test_extension_points_refuse_what_does_not_implement_them(toy, monkeypatch):
    from pipeline import tasks

    registry.register_engine("not-an-engine", lambda model, precision, **kw: object())
    with pytest.raises(TypeError, match="pipeline.engines.base.Engine"):
        registry.make("not-an-engine", "m")
    with pytest.raises(ConfigError, match="numpy"):          # the unknown-engine line lists registered ones
        registry.make("numpyy", "m")
    with pytest.raises(ValueError, match="built in"):
        registry.register_engine("openvino", lambda *a, **k: None)

    class Half(Task):           # forgets agreement: cannot even be built
        name = "half"

    tasks.register_task("half", lambda post: Half())
    with pytest.raises(TypeError, match="agreement"):
        tasks.get_task("half")
    with pytest.raises(ConfigError, match="toy_sign"):
        tasks.get_task("toy")


def test_every_task_probe_names_a_declared_hook():
    """Call sites that still ask `hasattr(task, ...)` / `getattr(task, ..., default)` ask only for declared hooks
    (base.Task attributes or OPTIONAL_HOOKS): a new hook is declared in pipeline/tasks/base.py first."""
    import ast

    from pipeline.tasks.base import OPTIONAL_HOOKS

    declared = set(dir(Task)) | set(OPTIONAL_HOOKS)
    probes = []
    for path in [*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "stages").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                    and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "task"
                    and isinstance(node.args[1], ast.Constant)):
                probes.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.args[1].value))
    assert probes, "the reader found no probe at all: it is broken"
    assert not [p for p in probes if p[1] not in declared], probes


def test_gates_evaluation_and_stages_ask_declared_hooks_without_probing():
    """Issue 46: where rows are gated (pipeline/core/gates.py, pipeline/evaluation/, stages/), a task's hooks are
    called as declared (required ones directly, optional ones through `provides`): no hasattr(task, ...) probe."""
    import ast

    files = [ROOT / "pipeline" / "core" / "gates.py", *(ROOT / "pipeline" / "evaluation").glob("*.py"),
             *(ROOT / "stages").glob("*.py")]
    probes = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"
                    and node.args and isinstance(node.args[0], (ast.Name, ast.Attribute))
                    and (getattr(node.args[0], "id", None) == "task" or getattr(node.args[0], "attr", None) == "task")):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(files) > 10 and not probes, probes

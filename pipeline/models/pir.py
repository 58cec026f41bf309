"""model.source=pir: a Paddle 3 inference model (PaddleOCR 3.x exports `inference.json` + `inference.pdiparams` +
`inference.yml`) translated into the Paddle 2.6 program format (`.pdmodel` + `.pdiparams`), which every later stage
(Paddle Inference, paddle2onnx, OpenVINO's paddle frontend, Lite `opt`) reads as it reads any 2.6 export.

The PIR program (JSON) is rebuilt op by op into a Paddle 2.6 static Program (pipeline/models/pir_ops.py) and saved
with `paddle.static.save_inference_model`. Parameters keep their PIR names; the `.pdiparams` stream is bound to them
in Paddle 3's sorted-name order with every shape checked (pipeline/models/pir_params.py), never by the position a
parameter happens to take in the program. A program holding an op type the translator does not know is refused with
one line naming those ops. Paddle 3 itself is not needed.
"""
from __future__ import annotations


import collections
import json
from dataclasses import dataclass, fields
from pathlib import Path

from pipeline.core.errors import ConfigError, DataError, PipelineError
from pipeline.models.pir_ops import DTYPE, HANDLERS, Ctx, Untranslatable
from pipeline.models.pir_params import bind

FILES = ("inference.json", "inference.pdiparams")


@dataclass(frozen=True)
class Limits:
    """What an inference.json may cost before it is read (config keys model.pir_*; the defaults are those of
    configs/defaults.yaml: PP-OCRv5 mobile det is 230 KB, depth 16, 668 ops, 234 parameters; Paddle builds a
    program superlinearly in its ops: 2000 took 2.2 s, 8000 took 20 s)."""
    max_json_bytes: int = 16 << 20
    max_depth: int = 40
    max_ops: int = 3_000
    max_params: int = 5_000
    max_file_bytes: int = 2 << 30             # the .pdiparams (model.max_file_bytes)

    @classmethod
    def of(cls, model_cfg) -> "Limits":
        """From the model section (a dict or the config object); keys it lacks keep their defaults."""
        get = model_cfg.get if isinstance(model_cfg, dict) else lambda k, d=None: getattr(model_cfg, k, d)
        found = {f.name: get("pir_" + f.name) for f in fields(cls) if f.name != "max_file_bytes"}
        found["max_file_bytes"] = get("max_file_bytes")
        return cls(**{k: v for k, v in found.items() if v is not None})


def _refuse(json_path: Path, what: str, limit: str) -> DataError:
    return DataError(f"{json_path}: {what}", hint=f"raise {limit} if the model is genuine" if limit else
                     "pass the inference.json a Paddle 3 export (paddle.jit.save / PaddleOCR 3) wrote")


def resolve_dir(path: str | Path, key: str = "model.path") -> Path:
    """The folder holding inference.json + inference.pdiparams (given the folder or the .json)."""
    p = Path(path)
    folder = p.parent if p.suffix == ".json" else p
    missing = [f for f in FILES if not (folder / f).is_file()]
    if missing:
        raise ConfigError(f"{key} {path}: no Paddle 3 inference model there ({folder / missing[0]} not found)",
                          hint=f"set {key} to the folder of inference.json/.pdiparams/.yml (a PaddleOCR 3 export)")
    return folder


def is_pir_model(path: str | Path) -> bool:
    p = Path(path)
    return (p / "inference.json").is_file() or (p.suffix == ".json" and p.is_file())


def _value(at: dict):
    """A typed PIR attribute ({'#': '0.a_i32', 'D': 2}, arrays nested) -> Python value."""
    if at["#"] == "0.a_array":
        return [_value(x) for x in at["D"]]
    return at["D"]


def _tensor_type(tt: dict) -> tuple[str, list[int]]:
    if tt.get("#") != "0.t_dtensor":
        return "vec", []
    code = tt["D"][0]["#"]
    if code not in DTYPE:
        raise ValueError(f"unknown data type {str(code)[:40]!r}")
    return DTYPE[code], [int(d) for d in tt["D"][1]]


def _depth(doc) -> int:
    """Nesting depth of a parsed JSON document (iterative: no recursion limit)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node)
    return deepest


def _load_json(json_path: Path, limits: Limits):
    """The parsed document, within model.pir_max_json_bytes and model.pir_max_depth."""
    size = json_path.stat().st_size if json_path.is_file() else -1
    if size < 0:
        raise _refuse(json_path, "not a regular file", "")
    if size > limits.max_json_bytes:
        raise _refuse(json_path, f"{size} bytes, over the limit of {limits.max_json_bytes}",
                      "model.pir_max_json_bytes")
    try:
        doc = json.loads(json_path.read_bytes().decode("utf-8"))
    except RecursionError:
        doc = None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _refuse(json_path, f"not a Paddle 3 PIR program ({type(exc).__name__}: {str(exc)[:120]})", "") from None
    depth = _depth(doc) if doc is not None else None
    if depth is None or depth > limits.max_depth:
        deep = "too deep for the JSON parser" if depth is None else f"{depth} levels deep"
        raise _refuse(json_path, f"nesting {deep}, over the limit of {limits.max_depth}", "model.pir_max_depth")
    return doc


def read_program(json_path: Path, limits: Limits = Limits()) -> tuple[dict[int, dict], list[dict]]:
    """({value id: parameter {name, shape, dtype}}, [ops as {type, attrs, in, out}]) of a PIR program file;
    anything malformed is one DataError line naming the op."""
    doc = _load_json(json_path, limits)
    try:
        if doc["base_code"]["magic"] != "pir":
            raise ValueError(f"magic {str(doc['base_code']['magic'])[:40]!r}")
        raw = doc["program"]["regions"][0]["blocks"][0]["ops"]
        if not isinstance(raw, list):
            raise TypeError("ops is not a list")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise _refuse(json_path, f"not a Paddle 3 PIR program ({type(exc).__name__}: {str(exc)[:120]})", "") from None
    n_params = sum(1 for o in raw if isinstance(o, dict) and o.get("#") == "p")      # counted before any is read
    if n_params > limits.max_params:
        raise _refuse(json_path, f"{n_params} parameters, over the limit of {limits.max_params}", "model.pir_max_params")
    if len(raw) - n_params > limits.max_ops:
        raise _refuse(json_path, f"{len(raw) - n_params} ops, over the limit of {limits.max_ops}", "model.pir_max_ops")
    params, ops = {}, []
    for k, o in enumerate(raw):
        try:
            _read_op(o, params, ops, k)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as exc:
            kind = o.get("#") if isinstance(o, dict) else None
            raise _refuse(json_path, f"op #{k} ({str(kind)[:40]}) is malformed ({type(exc).__name__}: "
                          f"{str(exc)[:80]})", "") from None
    return params, ops


def _read_op(o: dict, params: dict, ops: list, at: int) -> None:
    if o["#"] == "p":                                   # a parameter: A = [.., .., .., name]
        dtype, shape = _tensor_type(o["O"]["TT"])
        name = o["A"][3]
        if not isinstance(name, str) or not name:
            raise TypeError("a parameter without a name")
        params[o["O"]["%"]] = {"name": name, "shape": shape, "dtype": dtype}
        return
    outs = [{"id": x["%"], **dict(zip(("dtype", "shape"), _tensor_type(x["TT"])))} for x in o.get("O", [])]
    ops.append({"type": str(o["#"]), "attrs": {str(a["N"]): _value(a["AT"]) for a in o.get("A", [])},
                "in": [i["%"] for i in o.get("I", [])], "out": outs, "at": at})


def untranslated(ops: list[dict]) -> list[str]:
    return sorted({op["type"].split(".", 1)[-1] for op in ops if op["type"] not in HANDLERS})


def use_order(params: dict[int, dict], ops: list[dict]) -> list[str]:
    """Parameter names in the order the program first reads them (the record lists it; unused ones last)."""
    seen = dict.fromkeys(params[v]["name"] for op in ops for v in op["in"] if v in params)
    return list(seen) + [p["name"] for p in params.values() if p["name"] not in seen]


def _refuse_unknown(json_path: Path, ops: list[dict]) -> None:
    missing = untranslated(ops)
    if missing:
        known = sorted({k.split(".", 1)[-1] for k in HANDLERS})
        raise ConfigError(f"{json_path}: {len(missing)} op type(s) the PIR importer does not translate: "
                          f"{', '.join(missing)}",
                          hint=f"export the model with Paddle 2.6 (.pdmodel) and use model.source=inference, or add "
                               f"a handler in pipeline/models/pir_ops.py (translated: {', '.join(known)})")


def _build(params: dict[int, dict], ops: list[dict], json_path: Path):
    """A Paddle 2.6 static Program equivalent to the PIR ops -> (program, feed vars, fetch vars)."""
    import paddle

    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        block = main.global_block()
        ctx = Ctx(block)
        for vid, p in params.items():
            try:
                # the block's own create_parameter: paddle.static.create_parameter also writes an initializer
                # op into the startup program, quadratic in the count (1000 parameters: 3 s; 5000: 77 s)
                ctx.values[vid] = block.create_parameter(name=p["name"], shape=p["shape"], dtype=p["dtype"])
            except (ValueError, TypeError, RuntimeError) as exc:
                raise _refuse(json_path, f"parameter {p['name'][:60]} {p['dtype']}{p['shape'][:8]} is malformed "
                              f"({type(exc).__name__})", "") from None
        for k, op in enumerate(ops):
            try:
                HANDLERS[op["type"]](ctx, op)
            except Untranslatable as exc:
                raise ConfigError(f"{json_path}: op {op['type'].split('.', 1)[-1]} cannot be translated ({exc})",
                                  hint="export the model with Paddle 2.6 (.pdmodel) and use model.source=inference") \
                    from None
            except PipelineError:
                raise
            except Exception as exc:       # a malformed op (missing input, wrong attribute type): Paddle's own checks
                raise _refuse(json_path, f"op #{op.get('at', k)} ({op['type']}) is malformed "
                              f"({type(exc).__name__}: {str(exc).strip().splitlines()[0][:100] if str(exc).strip() else ''})",
                              "") from None
    if not ctx.feeds or not ctx.fetch:
        raise DataError(f"{json_path}: the program has {len(ctx.feeds)} inputs and {len(ctx.fetch)} outputs",
                        hint="an inference program needs data and fetch ops")
    return main, ctx.feeds, ctx.fetch


def translate(src: str | Path, dest_prefix: str | Path, limits: Limits = Limits()) -> dict:
    """Write `<dest_prefix>.pdmodel/.pdiparams` from the Paddle 3 model in `src` -> a record of what was done."""
    import paddle

    folder = resolve_dir(src)
    json_path = folder / "inference.json"
    params, ops = read_program(json_path, limits)
    _refuse_unknown(json_path, ops)
    declared = {p["name"]: (p["shape"], p["dtype"]) for p in params.values()}
    if len(declared) != len(params):
        raise _refuse(json_path, f"{len(params) - len(declared)} parameter names given twice", "")
    weights = bind(folder / "inference.pdiparams", declared, sorted(declared),       # Paddle 3 writes sorted names
                   max_bytes=limits.max_file_bytes)
    was_static = not paddle.in_dynamic_mode()
    paddle.enable_static()
    try:
        main, feeds, fetches = _build(params, ops, json_path)
        scope, place = paddle.static.Scope(), paddle.CPUPlace()
        with paddle.static.scope_guard(scope):
            for name, arr in weights.items():
                scope.var(name).get_tensor().set(arr, place)
            Path(dest_prefix).parent.mkdir(parents=True, exist_ok=True)
            paddle.static.save_inference_model(str(dest_prefix), feeds, fetches, paddle.static.Executor(place),
                                               program=main)
    finally:
        if not was_static:
            paddle.disable_static()
    counts = collections.Counter(op["type"].split(".", 1)[-1] for op in ops)
    return {"source": str(json_path), "pir_ops": dict(sorted(counts.items())), "parameters": len(params),
            "first_used": use_order(params, ops)[:3], "inputs": [v.name for v in feeds],
            "outputs": len(fetches)}

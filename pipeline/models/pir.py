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

import zlib  # noqa: F401  (must precede paddle: libpaddle exports its own zlib symbols)

import collections
import json
from pathlib import Path

from pipeline.core.errors import ConfigError, DataError
from pipeline.models.pir_ops import DTYPE, HANDLERS, Ctx, Untranslatable
from pipeline.models.pir_params import bind

FILES = ("inference.json", "inference.pdiparams")


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
    return DTYPE.get(tt["D"][0]["#"], tt["D"][0]["#"]), [int(d) for d in tt["D"][1]]


def read_program(json_path: Path) -> tuple[dict[int, dict], list[dict]]:
    """({value id: parameter {name, shape, dtype}}, [ops as {type, attrs, in, out}]) of a PIR program file."""
    try:
        doc = json.loads(json_path.read_text(encoding="utf-8"))
        if doc["base_code"]["magic"] != "pir":
            raise ValueError(f"magic {doc['base_code']['magic']!r}")
        raw = doc["program"]["regions"][0]["blocks"][0]["ops"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise DataError(f"{json_path}: not a Paddle 3 PIR program ({type(exc).__name__}: {exc})",
                        hint="pass the inference.json a Paddle 3 export (paddle.jit.save / PaddleOCR 3) wrote") from None
    params, ops = {}, []
    for o in raw:
        if o["#"] == "p":                                   # a parameter: A = [.., .., .., name]
            dtype, shape = _tensor_type(o["O"]["TT"])
            params[o["O"]["%"]] = {"name": o["A"][3], "shape": shape, "dtype": dtype}
            continue
        outs = [{"id": x["%"], **dict(zip(("dtype", "shape"), _tensor_type(x["TT"])))} for x in o.get("O", [])]
        ops.append({"type": o["#"], "attrs": {a["N"]: _value(a["AT"]) for a in o.get("A", [])},
                    "in": [i["%"] for i in o.get("I", [])], "out": outs})
    return params, ops


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
            ctx.values[vid] = paddle.static.create_parameter(p["shape"], p["dtype"], name=p["name"])
        for op in ops:
            try:
                HANDLERS[op["type"]](ctx, op)
            except Untranslatable as exc:
                raise ConfigError(f"{json_path}: op {op['type'].split('.', 1)[-1]} cannot be translated ({exc})",
                                  hint="export the model with Paddle 2.6 (.pdmodel) and use model.source=inference") \
                    from None
    if not ctx.feeds or not ctx.fetch:
        raise DataError(f"{json_path}: the program has {len(ctx.feeds)} inputs and {len(ctx.fetch)} outputs",
                        hint="an inference program needs data and fetch ops")
    return main, ctx.feeds, ctx.fetch


def translate(src: str | Path, dest_prefix: str | Path) -> dict:
    """Write `<dest_prefix>.pdmodel/.pdiparams` from the Paddle 3 model in `src` -> a record of what was done."""
    import paddle

    folder = resolve_dir(src)
    json_path = folder / "inference.json"
    params, ops = read_program(json_path)
    _refuse_unknown(json_path, ops)
    declared = {p["name"]: (p["shape"], p["dtype"]) for p in params.values()}
    weights = bind(folder / "inference.pdiparams", declared, sorted(declared))   # Paddle 3 writes sorted names
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

"""KServe v2 / Open Inference Protocol (REST) routes for `serve`, so existing clients and gateways
(tritonclient, KServe, Seldon) talk to the bundle unchanged.

GET  /v2                              server metadata
GET  /v2/health/live, /v2/health/ready
GET  /v2/models/{name}[/versions/{v}]            model metadata (typed input/output tensors)
GET  /v2/models/{name}[/versions/{v}]/ready
POST /v2/models/{name}[/versions/{v}]/infer      typed tensors as JSON `data`, or binary (the
                                                 binary tensor data extension tritonclient uses by default)
Errors are {"error": "<message>"} with 400 (bad request) or 404 (unknown model/version), as the
protocol specifies, and 500 (one line) when the engine itself fails; the input goes through the same engine,
validated, as /predict. Large bodies are parsed on the prep pool, off the event loop.
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any, Optional

import numpy as np
from fastapi import Request   # module level: FastAPI resolves the (string) annotations from globals
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

MODEL_VERSION = "1"
_DTYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT8": np.int8, "INT16": np.int16,
           "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
           "UINT64": np.uint64, "BOOL": np.bool_}
HEADER_LEN = "inference-header-content-length"
MAX_BATCH = 64


Annotated_dim = Annotated[StrictInt, Field(ge=0)]        # StrictInt: JSON true is not a dimension
Annotated_size = Annotated[StrictInt, Field(ge=0)]


class _Params(BaseModel):
    """`parameters` objects: the keys this server reads are typed, others are kept and ignored."""
    model_config = ConfigDict(extra="allow")
    binary_data_size: Optional[Annotated_size] = None
    binary_data: Optional[StrictBool] = None
    binary_data_output: Optional[StrictBool] = None


class _Input(BaseModel):
    name: StrictStr
    shape: list[Annotated_dim]
    datatype: StrictStr
    parameters: Optional[_Params] = None
    data: Any = None


class _Output(BaseModel):
    name: StrictStr
    parameters: Optional[_Params] = None


class V2Request(BaseModel):
    """The Open Inference Protocol inference request (REST), validated before anything is allocated:
    booleans are not dimensions, `parameters` are objects, `outputs` a list of objects."""
    id: Optional[StrictStr] = None
    parameters: Optional[_Params] = None
    inputs: list[_Input]
    outputs: Optional[list[_Output]] = None


def parse_request(doc) -> V2Request:
    """V2Request, or V2Error(400) naming the first malformed field, e.g. `inputs[0].shape[1]`."""
    try:
        return V2Request.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".") or "request"
        raise V2Error(400, f"inference request field '{where}': {err['msg']}") from None


class V2Error(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def add_v2_routes(app, *, name: str, runner, input_shape: list, output_name: str, versions: dict,
                  input_name: str = "x", max_body: int = 16 * 1024 * 1024) -> None:
    """Attach the v2 routes. runner: async callable float32 [N, ...] -> np.ndarray (output 0);
    input_shape: model input with None for free dims."""
    from fastapi.responses import Response

    shape_meta = [-1 if d is None else int(d) for d in input_shape]

    def check_model(model: str, version: str | None) -> None:
        if model != name:
            raise V2Error(404, f"unknown model '{model}'; this server serves '{name}'")
        if version not in (None, "", MODEL_VERSION):
            raise V2Error(404, f"unknown version '{version}' of model '{name}'; available: {MODEL_VERSION}")

    # routes that do not depend on the model; registered first so the route order is unchanged
    _add_server_routes(app, versions)

    async def metadata(model: str, version: str | None = None):
        check_model(model, version)
        return {"name": name, "versions": [MODEL_VERSION], "platform": runner.engine.kind,
                "inputs": [{"name": input_name, "datatype": "FP32", "shape": shape_meta}],
                "outputs": [{"name": output_name, "datatype": "FP32", "shape": [-1, -1]}]}

    async def model_ready(model: str, version: str | None = None):
        check_model(model, version)
        return {"name": name, "ready": True}

    def parse(body: bytes, header_len: str | None) -> tuple[V2Request, np.ndarray]:
        req, binary = _split_body(body, header_len)
        return req, _input_tensor(req, binary, input_name, shape_meta)

    async def infer(model: str, request: Request, version: str | None = None):
        check_model(model, version)
        from pipeline.core.errors import DataError
        from pipeline.serving.http_common import INLINE_BYTES, _BadRequest, off_loop, read_body

        try:                      # streamed and capped: an oversized body is refused before it is all in memory
            body = await read_body(request, max_body)
        except _BadRequest as exc:
            raise V2Error(exc.status, exc.message) from None
        header_len = request.headers.get(HEADER_LEN)
        req, x = parse(body, header_len) if len(body) <= INLINE_BYTES else \
            await off_loop(app.state.prep, parse, body, header_len)
        try:
            out = await runner(x)
        except DataError as exc:  # the engine refused the input; anything else is the server's: 500 (http_common.fault)
            raise V2Error(400, f"inference failed: {exc.one_line()}") from None
        return _response(req, out, name, output_name, Response)

    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.add_api_route(base, metadata, methods=["GET"])
        app.add_api_route(base + "/ready", model_ready, methods=["GET"])
        app.add_api_route(base + "/infer", infer, methods=["POST"])


def add_health_routes(app, versions: dict) -> None:
    """The v2 health and server-metadata routes alone, for an app without a v2 model (/ocr): KServe's probes."""
    _add_server_routes(app, versions)


def _add_server_routes(app, versions: dict) -> None:
    """The v2 error handler, server metadata and health routes (the same whatever model is served)."""
    from fastapi.responses import JSONResponse

    @app.exception_handler(V2Error)
    async def _v2_error(_request, exc: V2Error):
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    @app.get("/v2")
    async def server_metadata():
        return {"name": "pipeline-serve", "version": versions.get("pipeline", ""),
                "extensions": ["binary_tensor_data"]}

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        return {"ready": True}


def _split_body(body: bytes, header_len: str | None) -> tuple[V2Request, bytes]:
    """JSON header (+ binary tensor bytes after it when Inference-Header-Content-Length is given)."""
    from pipeline.serving.limits import parse_length

    n = len(body)
    if header_len is not None:
        n = parse_length(header_len)
        if n is None or n > len(body):
            raise V2Error(400, f"Inference-Header-Content-Length {header_len[:40]!r} is not a length within the "
                               f"{len(body)}-byte body (ASCII digits: the byte length of the JSON header)")
    try:
        doc = json.loads(body[:n])
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise V2Error(400, f"inference request is not valid JSON: {str(exc)[:200]}") from None
    return parse_request(doc), body[n:]


def _check_shape(name: str, shape: list[int], shape_meta: list[int]) -> int:
    """The element count of a shape that fits the model input, in Python ints (no int64 overflow),
    checked before any array exists."""
    ok = len(shape) == len(shape_meta) and all(m < 0 or g == m for g, m in zip(shape, shape_meta))
    if not ok or shape[0] == 0:
        raise V2Error(400, f"input '{name}': shape {shape} does not match the model input {shape_meta}")
    if shape[0] > MAX_BATCH:
        raise V2Error(400, f"input '{name}': batch of {shape[0]} exceeds the limit of {MAX_BATCH}")
    return math.prod(shape)


def _input_tensor(req: V2Request, binary: bytes, input_name: str, shape_meta: list[int]) -> np.ndarray:
    if len(req.inputs) != 1:
        raise V2Error(400, f"expected exactly one input tensor '{input_name}', got {len(req.inputs)}")
    t = req.inputs[0]
    if t.name != input_name:
        raise V2Error(400, f"unexpected input '{t.name}'; the model input is '{input_name}'")
    if t.datatype != "FP32":   # typed tensors: the model input is FP32, nothing is cast silently
        known = "a known" if t.datatype in _DTYPES else "an unknown"
        raise V2Error(400, f"input '{input_name}': datatype {t.datatype!r} ({known} type) does not match "
                           "the model input datatype FP32")
    count = _check_shape(input_name, t.shape, shape_meta)
    size = t.parameters.binary_data_size if t.parameters else None
    if size is not None:
        if size != len(binary) or size != count * 4:
            raise V2Error(400, f"input '{input_name}': binary_data_size {size} does not match shape {t.shape} "
                               f"of FP32 ({len(binary)} bytes sent)")
        arr = np.frombuffer(binary, dtype=np.float32)
    else:
        arr = _json_data(t.data, input_name)
        if arr.size != count:
            raise V2Error(400, f"input '{input_name}': {arr.size} values for shape {t.shape} ({count} expected)")
    arr = arr.reshape(t.shape)
    if not np.isfinite(arr).all():
        raise V2Error(400, f"input '{input_name}' contains NaN or Inf")
    return arr


_FP32_MAX = float(np.finfo(np.float32).max)


def _json_data(data, input_name: str) -> np.ndarray:
    """`data` as float32, every value checked against the FP32 range first: float64 holds any JSON number
    Python's float() can (a 400-digit integer does not fit even that: OverflowError), and a value beyond
    FP32's range would otherwise become Inf silently."""
    try:
        wide = np.asarray(data, dtype=np.float64).reshape(-1)
    except OverflowError:
        raise V2Error(400, f"input '{input_name}': a value in 'data' is outside the FP32 range "
                           f"(|x| <= {_FP32_MAX:.4g})") from None
    except (TypeError, ValueError, RecursionError):
        raise V2Error(400, f"input '{input_name}': 'data' must be a flat or nested list of numbers") from None
    with np.errstate(invalid="ignore"):
        over = np.abs(wide) > _FP32_MAX           # NaN compares False: the NaN/Inf check below names it
    if over.any():
        i = int(np.argmax(over))
        raise V2Error(400, f"input '{input_name}': data[{i}] = {wide[i]:.4g} is outside the FP32 range "
                           f"(|x| <= {_FP32_MAX:.4g})" if np.isfinite(wide[i]) else
                           f"input '{input_name}' contains NaN or Inf")
    return wide.astype(np.float32)


def _binary_output(req: V2Request, output_name: str) -> bool:
    """binary_data of the requested output, else the request's binary_data_output, else JSON."""
    default = bool(req.parameters and req.parameters.binary_data_output)
    if req.outputs is None:
        return default
    unknown = [o.name for o in req.outputs if o.name != output_name]
    if unknown:
        raise V2Error(400, f"unknown output(s) {unknown}; the model output is '{output_name}'")
    params = next((o.parameters for o in req.outputs if o.parameters is not None), None)
    return default if params is None or params.binary_data is None else params.binary_data


def _response(req: V2Request, out: np.ndarray, name: str, output_name: str, response_cls):
    binary = _binary_output(req, output_name)
    out = np.ascontiguousarray(out, dtype=np.float32)
    tensor = {"name": output_name, "datatype": "FP32", "shape": list(out.shape)}
    head = {"model_name": name, "model_version": MODEL_VERSION, "outputs": [tensor]}
    if req.id is not None:
        head["id"] = req.id
    if not binary:
        tensor["data"] = out.reshape(-1).tolist()
        return response_cls(json.dumps(head, separators=(",", ":")), media_type="application/json")
    raw = out.tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    js = json.dumps(head, separators=(",", ":")).encode()
    return response_cls(js + raw, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(js))})

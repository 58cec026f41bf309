"""KServe v2 / Open Inference Protocol (REST) routes for `serve`, so existing clients and gateways
(tritonclient, KServe, Seldon) talk to the bundle unchanged.

GET  /v2                              server metadata
GET  /v2/health/live, /v2/health/ready
GET  /v2/models/{name}[/versions/{v}]            model metadata (typed input/output tensors)
GET  /v2/models/{name}[/versions/{v}]/ready
POST /v2/models/{name}[/versions/{v}]/infer      typed tensors as JSON `data`, or binary (the
                                                 binary tensor data extension tritonclient uses by default)
Errors are {"error": "<message>"} with 400 (bad request) or 404 (unknown model/version), as the
protocol specifies; the input goes through the same engine, validated, as /predict.
"""
from __future__ import annotations

import json

import numpy as np
from fastapi import Request   # module level: FastAPI resolves the (string) annotations from globals

MODEL_VERSION = "1"
_DTYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT8": np.int8, "INT16": np.int16,
           "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
           "UINT64": np.uint64, "BOOL": np.bool_}
HEADER_LEN = "inference-header-content-length"
MAX_BATCH = 64


class V2Error(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def add_v2_routes(app, *, name: str, runner, input_shape: list, output_name: str, versions: dict,
                  input_name: str = "x", max_body: int = 16 * 1024 * 1024) -> None:
    """Attach the v2 routes. runner: async callable float32 [N, ...] -> np.ndarray (output 0);
    input_shape: model input with None for free dims."""
    from fastapi.responses import JSONResponse, Response

    shape_meta = [-1 if d is None else int(d) for d in input_shape]

    def check_model(model: str, version: str | None) -> None:
        if model != name:
            raise V2Error(404, f"unknown model '{model}'; this server serves '{name}'")
        if version not in (None, "", MODEL_VERSION):
            raise V2Error(404, f"unknown version '{version}' of model '{name}'; available: {MODEL_VERSION}")

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

    async def metadata(model: str, version: str | None = None):
        check_model(model, version)
        return {"name": name, "versions": [MODEL_VERSION], "platform": runner.engine.kind,
                "inputs": [{"name": input_name, "datatype": "FP32", "shape": shape_meta}],
                "outputs": [{"name": output_name, "datatype": "FP32", "shape": [-1, -1]}]}

    async def model_ready(model: str, version: str | None = None):
        check_model(model, version)
        return {"name": name, "ready": True}

    async def infer(model: str, request: Request, version: str | None = None):
        check_model(model, version)
        from .serve import _BadRequest, read_body

        try:                      # streamed and capped: an oversized body is refused before it is all in memory
            body = await read_body(request, max_body)
        except _BadRequest as exc:
            raise V2Error(exc.status, exc.message) from None
        doc, binary = _split_body(body, request.headers.get(HEADER_LEN))
        x = _input_tensor(doc, binary, input_name, shape_meta)
        try:
            out = await runner(x)
        except Exception as exc:  # engine refusal (DataError) and runtime errors alike: the client's input
            raise V2Error(400, f"inference failed: {getattr(exc, 'message', exc)}") from None
        return _response(doc, out, name, output_name, Response)

    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.add_api_route(base, metadata, methods=["GET"])
        app.add_api_route(base + "/ready", model_ready, methods=["GET"])
        app.add_api_route(base + "/infer", infer, methods=["POST"])


def _split_body(body: bytes, header_len: str | None) -> tuple[dict, bytes]:
    """JSON header (+ binary tensor bytes after it when Inference-Header-Content-Length is given)."""
    n = len(body)
    if header_len is not None:
        if not header_len.isdigit() or int(header_len) > len(body):
            raise V2Error(400, f"Inference-Header-Content-Length {header_len!r} is not a length within the body")
        n = int(header_len)
    try:
        doc = json.loads(body[:n])
    except (ValueError, UnicodeDecodeError) as exc:
        raise V2Error(400, f"inference request is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise V2Error(400, "inference request must be a JSON object with an 'inputs' list")
    return doc, body[n:]


def _input_tensor(doc: dict, binary: bytes, input_name: str, shape_meta: list[int]) -> np.ndarray:
    inputs = doc["inputs"]
    if len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise V2Error(400, f"expected exactly one input tensor '{input_name}', got {len(inputs)}")
    t = inputs[0]
    if t.get("name") != input_name:
        raise V2Error(400, f"unexpected input '{t.get('name')}'; the model input is '{input_name}'")
    if t.get("datatype") != "FP32":   # typed tensors: the model input is FP32, nothing is cast silently
        known = "a known" if t.get("datatype") in _DTYPES else "an unknown"
        raise V2Error(400, f"input '{input_name}': datatype {t.get('datatype')!r} ({known} type) does not match "
                           "the model input datatype FP32")
    dtype = np.float32
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise V2Error(400, f"input '{input_name}': 'shape' must be a list of non-negative integers")
    count = int(np.prod(shape)) if shape else 1
    size = (t.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if size != len(binary) or size != count * np.dtype(dtype).itemsize:
            raise V2Error(400, f"input '{input_name}': binary_data_size {size} does not match shape {shape} "
                               f"of {t['datatype']} ({len(binary)} bytes sent)")
        arr = np.frombuffer(binary, dtype=dtype)
    else:
        try:
            arr = np.asarray(t.get("data"), dtype=dtype).reshape(-1)
        except (TypeError, ValueError):
            raise V2Error(400, f"input '{input_name}': 'data' must be a flat or nested list of numbers") from None
        if arr.size != count:
            raise V2Error(400, f"input '{input_name}': {arr.size} values for shape {shape} ({count} expected)")
    arr = arr.reshape(shape)
    ok = arr.ndim == len(shape_meta) and all(m < 0 or g == m for g, m in zip(arr.shape, shape_meta))
    if not ok or arr.shape[0] == 0:
        raise V2Error(400, f"input '{input_name}': shape {shape} does not match the model input {shape_meta}")
    if arr.shape[0] > MAX_BATCH:
        raise V2Error(400, f"input '{input_name}': batch of {arr.shape[0]} exceeds the limit of {MAX_BATCH}")
    arr = arr.astype(np.float32, copy=False)
    if not np.isfinite(arr).all():
        raise V2Error(400, f"input '{input_name}' contains NaN or Inf")
    return arr


def _response(doc: dict, out: np.ndarray, name: str, output_name: str, response_cls):
    wanted = doc.get("outputs")
    if wanted is not None:
        names = [o.get("name") for o in wanted if isinstance(o, dict)]
        unknown = [n for n in names if n != output_name]
        if unknown:
            raise V2Error(400, f"unknown output(s) {unknown}; the model output is '{output_name}'")
        params = next((o.get("parameters") or {} for o in wanted if o.get("name") == output_name), {})
        binary = bool(params.get("binary_data", (doc.get("parameters") or {}).get("binary_data_output", False)))
    else:
        binary = bool((doc.get("parameters") or {}).get("binary_data_output", False))
    out = np.ascontiguousarray(out, dtype=np.float32)
    tensor = {"name": output_name, "datatype": "FP32", "shape": list(out.shape)}
    head = {"model_name": name, "model_version": MODEL_VERSION, "outputs": [tensor]}
    if "id" in doc:
        head["id"] = doc["id"]
    if not binary:
        tensor["data"] = out.reshape(-1).tolist()
        return response_cls(json.dumps(head, separators=(",", ":")), media_type="application/json")
    raw = out.tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    js = json.dumps(head, separators=(",", ":")).encode()
    return response_cls(js + raw, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(js))})

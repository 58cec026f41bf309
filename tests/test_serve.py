"""HTTP service: health, predictions that match the model, and 4xx (never 500) for bad requests.

Fast tests use a tiny randomly initialised CNN exported with jit.save (seconds, no training);
the slow ones serve a real smoke bundle and run http_gate against it.
"""
import contextlib
import io
import json

import numpy as np
import pytest
from PIL import Image

H = W = 16
LABELS = list("0123456789")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import paddle
    from paddle.static import InputSpec

    from pipeline.models.small_cnn import SmallCNN

    paddle.seed(0)
    model = SmallCNN(len(LABELS), height=H, width=W, channels=(4, 8, 8), hidden=16)
    model.eval()
    prefix = tmp_path_factory.mktemp("tiny") / "inference"
    spec = [InputSpec([None, 1, H, W], "float32", "x")]
    paddle.jit.save(paddle.jit.to_static(model, input_spec=spec), str(prefix), input_spec=spec)
    infer_cfg = {"task": "classification", "input": {"name": "x", "dtype": "float32", "shape": [None, 1, H, W]},
                 "preprocess": {"height": H, "width": W, "channels": 1, "mean": 0.5, "std": 0.5, "resize": "stretch"},
                 "postprocess": {"type": "softmax_argmax", "labels": LABELS}}
    return str(prefix), infer_cfg


@pytest.fixture(scope="module")
def client(tiny_model):
    from fastapi.testclient import TestClient

    from pipeline.serving.predict import create_app_from_model

    app = create_app_from_model(*tiny_model, max_body=64 * 1024)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _png(img: np.ndarray, fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt)
    return buf.getvalue()


def _images(n=3):
    return np.random.default_rng(1).integers(0, 256, size=(n, H, W), dtype=np.uint8)


def test_health(client):
    r = client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["task"] == "classification"
    assert "paddlepaddle" in body["versions"]


def test_png_prediction_matches_the_model(client, tiny_model):
    from pipeline.serving.predict import outputs_of
    from pipeline.engines.paddle_infer import InferenceEngine
    from pipeline.data.preprocess import to_tensor

    img = _images(1)
    want = InferenceEngine(tiny_model[0], "fp32", threads=1).run(to_tensor(img, tiny_model[1]["preprocess"]))
    for kwargs in ({"content": _png(img[0]), "headers": {"content-type": "image/png"}},
                   {"files": {"file": ("x.png", _png(img[0]), "image/png")}}):
        r = client.post("/predict?outputs=1", **kwargs)
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["outputs"], dtype=np.float32)
        assert np.abs(got - want).max() < 1e-4
        assert r.json()["predictions"][0]["label"] == LABELS[int(want.argmax())]
        assert "x-latency-ms" in r.headers
    b64 = client.post("/predict?outputs=b64", content=_png(img[0]), headers={"content-type": "image/png"}).json()
    assert np.array_equal(outputs_of(b64), got) and "outputs" not in b64      # the same float32 bits, no list


def test_jpeg_and_json_inputs(client, tiny_model):
    from pipeline.data.preprocess import to_tensor

    r = client.post("/predict", content=_png(_images(1)[0], "JPEG"), headers={"content-type": "image/jpeg"})
    assert r.status_code == 200 and len(r.json()["predictions"]) == 1
    x = to_tensor(_images(2), tiny_model[1]["preprocess"])
    r = client.post("/predict", json={"inputs": x.tolist()})
    assert r.status_code == 200 and len(r.json()["predictions"]) == 2
    r = client.post("/predict", json={"inputs": x[0].tolist()})         # one sample [C, H, W]
    assert r.status_code == 200 and len(r.json()["predictions"]) == 1


@pytest.mark.parametrize("kwargs,status,words", [
    ({"content": b"definitely not a png", "headers": {"content-type": "image/png"}}, 400, "image"),
    ({"files": {"file": ("x.png", b"GIF89a nonsense", "image/png")}}, 400, "image"),
    ({"files": {"other": (None, "text field only")}}, 400, "file"),
    ({"content": b"", "headers": {"content-type": "image/png"}}, 400, "empty"),
    ({"content": b"hello", "headers": {"content-type": "text/plain"}}, 415, "content-type"),
    ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "JSON"),
    ({"json": {"x": 1}}, 400, "inputs"),
    ({"json": {"inputs": [[1.0, 2.0], [3.0]]}}, 400, "rectangular"),
    ({"json": {"inputs": np.zeros((1, 3, H, W)).tolist()}}, 400, "shape"),
    ({"json": {"inputs": np.zeros((H, W)).tolist()}}, 400, "shape"),
    ({"json": {"inputs": [[["a"] * W] * H]}}, 400, "numbers"),
    ({"json": {"inputs": [[[True] * W] * H]}}, 400, "numbers"),
    ({"json": {"inputs": []}}, 400, "numbers"),
    ({"json": {"inputs": np.zeros((65, 1, H, W)).tolist()}}, 413, "limit"),   # > 64 KiB test limit
    ({"content": b"\x89PNG" + b"0" * (70 * 1024), "headers": {"content-type": "image/png"}}, 413, "limit"),
])
def test_bad_requests_get_4xx_with_a_message(client, kwargs, status, words):
    r = client.post("/predict", **kwargs)
    assert r.status_code == status, r.text
    assert words.lower() in r.json()["error"].lower()


def test_hot_route_keeps_the_app_contract(client):
    """POST /predict is answered ahead of FastAPI's router (serve._HotRoutes): other methods still get the
    router's 405, responses still carry the request timing, and an engine crash is still answered 500."""
    assert client.get("/predict").status_code == 405
    r = client.post("/predict", content=_png(_images(1)[0]), headers={"content-type": "image/png"})
    assert r.status_code == 200 and float(r.headers["x-latency-ms"]) > 0
    runner = client.app.state.runner
    engine_run = runner.engine.run
    runner.engine.run = lambda x: (_ for _ in ()).throw(RuntimeError("engine exploded"))
    try:
        r = client.post("/predict", content=_png(_images(1)[0]), headers={"content-type": "image/png"})
    finally:
        runner.engine.run = engine_run
    assert r.status_code == 500


def test_chunked_oversized_body_is_413(client):
    def gen():                                           # no content-length: the stream itself is capped
        for _ in range(20):
            yield b"0" * 8192
    r = client.post("/predict", content=gen(), headers={"content-type": "image/png"})
    assert r.status_code == 413


def test_nan_and_batch_limit(client, tiny_model):
    from fastapi.testclient import TestClient

    from pipeline.serving.predict import MAX_BATCH, create_app_from_model

    r = client.post("/predict", content=json.dumps({"inputs": [[[float("nan")] * W] * H]}),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "NaN" in r.json()["error"]
    big = TestClient(create_app_from_model(*tiny_model, max_body=64 << 20))
    r = big.post("/predict", json={"inputs": np.zeros((MAX_BATCH + 1, 1, H, W)).tolist()})
    assert r.status_code == 400 and "batch" in r.json()["error"]


def test_http_gate_real_uvicorn(tiny_model):
    from pipeline.engines.paddle_infer import InferenceEngine
    from pipeline.data.preprocess import to_tensor
    from pipeline.serving.predict import http_gate
    from pipeline.tasks import get_task

    imgs = _images(6)
    labels = np.arange(6) % len(LABELS)
    res = http_gate(tiny_model[0], tiny_model[1], imgs, labels, "classification", max_requests=5, threads=1)
    ref = InferenceEngine(tiny_model[0], "fp32", threads=1).run(to_tensor(imgs[:5], tiny_model[1]["preprocess"]))
    assert res["n"] == 5 and res["outputs"].shape == ref.shape
    assert np.abs(res["outputs"] - ref).max() < 1e-4
    assert res["metric"] == get_task("classification").metrics(ref, labels[:5])["accuracy"]
    lat = res["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] and res["metric_name"] == "accuracy"


@pytest.mark.slow
def test_serve_a_real_bundle_folder_and_archive(smoke_bundle):
    from fastapi.testclient import TestClient

    from pipeline.serving.app import create_app
    from tests.conftest import served_limit

    folder, archive = smoke_bundle
    with np.load(folder / "samples" / "expected.npz") as z:
        files, expected = list(z["files"]), z["outputs"]
    for path in (folder, archive):
        with TestClient(create_app(path)) as c:
            assert c.get("/health").json()["model"] == folder.name
            r = c.post("/predict?outputs=1", content=(folder / files[0]).read_bytes(),
                       headers={"content-type": "image/png"})
            assert r.status_code == 200
            assert np.abs(np.asarray(r.json()["outputs"]) - expected[:1]).max() < served_limit(folder, expected)


@pytest.mark.slow
def test_create_app_refuses_a_tampered_bundle(smoke_bundle, tmp_path):
    import shutil

    from pipeline.core.errors import IntegrityError
    from pipeline.serving.app import create_app

    copy = tmp_path / smoke_bundle[0].name
    shutil.copytree(smoke_bundle[0], copy)
    with open(copy / "server" / "fp32" / "inference.pdiparams", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(IntegrityError, match="inference.pdiparams"):
        create_app(copy)


# the concurrency limit (429) and slow clients: tests/test_http_limits.py (a trickling body holds no slot now)


def test_request_log_summary_by_default_and_per_request_when_asked(tiny_model):
    """Default: no line per request, one summary line (count per status, p50/p99) per interval and at
    shutdown; log_requests=True (serve.access_log): one line per request. X-Latency-ms either way."""
    img = _png(_images(1)[0])
    with _serve_log() as seen:       # its own handler: earlier tests leave pytest's capture handlers on
        _check_request_log(tiny_model, seen, img)     # the "pipeline" logger, which caplog would count twice


@contextlib.contextmanager
def _serve_log():
    import logging

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    log = logging.getLogger("pipeline.serving.app")
    old = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def _check_request_log(tiny_model, seen, img):
    from fastapi.testclient import TestClient

    from pipeline.serving.predict import create_app_from_model

    app = create_app_from_model(*tiny_model)
    with TestClient(app, raise_server_exceptions=False) as c:
        for _ in range(3):
            assert "x-latency-ms" in c.post("/predict", content=img, headers={"content-type": "image/png"}).headers
        assert c.post("/predict", content=b"", headers={"content-type": "image/png"}).status_code == 400
        assert not [m for m in seen if "->" in m]
    summary = [m for m in seen if "requests in" in m]
    assert len(summary) == 1 and summary[0].startswith("4 requests in") and "200×3, 400×1" in summary[0], summary

    seen.clear()
    app = create_app_from_model(*tiny_model, log_requests=True)
    with TestClient(app, raise_server_exceptions=False) as c:
        assert "x-latency-ms" in c.post("/predict", content=img, headers={"content-type": "image/png"}).headers
    assert any(m.startswith("POST /predict -> 200 in") for m in seen), seen
    assert not [m for m in seen if "requests in" in m]


def test_traffic_summary_every_interval():
    from pipeline.serving.http_common import _Traffic

    with _serve_log() as seen:
        t = _Traffic(every_s=0.0)          # every request closes an interval
        t.add(200, 1.0)
        t.add(429, 2.0)
        t.flush()                          # nothing left: no empty line
    assert len(seen) == 2 and "1 requests" in seen[0] and "200×1" in seen[0] and "429×1" in seen[1], seen


# ------------------------------------------------------------------------------------ issues 30/31: faults, KServe, /ocr

def test_engine_faults_are_500_in_one_line_and_engine_refusals_400(client):
    """An engine that crashes or raises is the server's fault: 500 with one line, no traceback, on /predict and
    KServe v2 alike (KServe used to answer 400); a DataError from the engine is the input's: 400."""
    from pipeline.core.errors import DataError, EngineCrash

    runner = client.app.state.runner
    name = client.get("/health").json()["model"]
    x = np.zeros((1, 1, H, W)).tolist()
    v2 = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1, H, W], "data": np.zeros(H * W).tolist()}]}
    engine_run, inline = runner.engine.run, runner.inline
    runner.inline = False
    try:
        for exc, status, words in ((EngineCrash("paddle lite predictor died (SIGSEGV)"), 500, "SIGSEGV"),
                                   (RuntimeError("oneDNN primitive failed\n  at line 2"), 500, "RuntimeError"),
                                   (DataError("engine input shape [1, 1, 16, 16] refused"), 400, "refused")):
            def broken(_x, exc=exc):
                raise exc
            runner.engine.run = broken
            for r in (client.post("/predict", content=_png(_images(1)[0]), headers={"content-type": "image/png"}),
                      client.post("/predict", json={"inputs": x}),
                      client.post(f"/v2/models/{name}/infer", json=v2)):
                assert r.status_code == status, r.text
                message = r.json()["error"]
                assert words in message and "\n" not in message and "Traceback" not in r.text, message
    finally:
        runner.engine.run, runner.inline = engine_run, inline


def _v2_json(data: str) -> bytes:
    """A KServe v2 body whose first data value is written as the raw JSON text `data`."""
    rest = ",".join(["0.0"] * (H * W - 1))
    return (f'{{"inputs":[{{"name":"x","datatype":"FP32","shape":[1,1,{H},{W}],"data":[{data},{rest}]}}]}}').encode()


@pytest.mark.parametrize("data,words", [("1" + "0" * 400, "outside the FP32 range"),
                                        ("1e39", "outside the FP32 range"),
                                        ("-4e38", "outside the FP32 range"),
                                        ("1e400", "NaN or Inf")])
def test_kserve_numbers_outside_fp32_are_400(client, data, words):
    name = client.get("/health").json()["model"]
    r = client.post(f"/v2/models/{name}/infer", content=_v2_json(data), headers={"content-type": "application/json"})
    assert r.status_code == 400 and words in r.json()["error"], r.text


@pytest.mark.parametrize("value", ["\u00b2".encode("latin-1"), "\u0661\u0662".encode(), b"12x", b"-5", b"9" * 5000,
                                   b"99999999999999999999", b""])
def test_kserve_malformed_header_length_is_400(client, value):
    name = client.get("/health").json()["model"]
    r = client.post(f"/v2/models/{name}/infer", content=_v2_json("0.0"),
                    headers={"content-type": "application/json", "inference-header-content-length": value})
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"], r.text


def test_predict_json_outside_float32_and_too_deep_are_400(client):
    r = client.post("/predict", json={"inputs": (np.ones((1, 1, H, W)) * 1e39).tolist()})
    assert r.status_code == 400 and "outside the float32 range" in r.json()["error"]
    r = client.post("/predict", content=b"[" * 60_000, headers={"content-type": "application/json"})   # < 64 KiB
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]


class _StubDet:
    """A 'detector' whose map has `n` separate word-sized blobs (a dense page): the real DB post-processing,
    crops and reading order run on it. Engine-shaped: kind, input_shape, run."""
    kind, effective_precision, input_shape = "stub", "fp32", [-1, 3, -1, -1]

    def __init__(self, n: int, fail: Exception | None = None):
        self.n, self.fail = n, fail

    def run(self, x):
        if self.fail is not None:
            raise self.fail
        out = np.zeros((len(x), 1, *x.shape[2:]), np.float32)
        rows, cols = (x.shape[2] - 8) // 16, (x.shape[3] - 8) // 40
        for k in range(min(self.n, rows * cols)):
            r, c = divmod(k, cols)
            out[:, 0, 8 + 16 * r:16 + 16 * r, 8 + 40 * c:38 + 40 * c] = 0.9
        return out


class _StubRec:
    """A 'recogniser' reading every crop as "a" with probability 1 (its softmax output over 3 classes)."""
    kind, effective_precision, input_shape = "stub", "fp32", [-1, 3, 48, -1]

    def run(self, x):
        out = np.zeros((len(x), max(1, x.shape[3] // 8), 3), np.float32)
        out[:, :, 0] = 1.0
        out[:, 0, :] = [0.0, 1.0, 0.0]
        return out


def _ocr_client(det, max_boxes: int):
    from fastapi.testclient import TestClient

    from pipeline.ocr.system import SystemSpec
    from pipeline.serving.ocr_routes import create_ocr_app

    spec = SystemSpec({"resize": "limit", "limit_side_len": 640, "limit_type": "max", "mean": [0.5] * 3,
                       "std": [0.5] * 3}, {"thresh": 0.3, "box_thresh": 0.5, "unclip_ratio": 1.5,
                                           "max_candidates": 1000},
                      {"height": 48, "width": 320}, {"charset": ["a", "b"]})
    app = create_ocr_app((det, _StubRec(), None, spec), {}, log_requests=False, batching={"mode": "off"},
                         max_boxes=max_boxes)
    return TestClient(app, raise_server_exceptions=False)


def _page_png() -> bytes:
    return _png(np.full((640, 640, 3), 255, np.uint8))


def test_ocr_caps_boxes_per_page_and_says_so():
    """serve.max_boxes_per_page: a dense page is read up to the cap, in reading order, and the answer says
    how many boxes there were; under the cap nothing changes."""
    with _ocr_client(_StubDet(120), max_boxes=50) as client:
        capped = client.post("/ocr", content=_page_png(), headers={"content-type": "image/png"}).json()
    with _ocr_client(_StubDet(120), max_boxes=0) as client:
        full = client.post("/ocr", content=_page_png(), headers={"content-type": "image/png"}).json()
    assert full["boxes_found"] == capped["boxes_found"] == 120 and len(full["lines"]) == 120
    assert not full["truncated"] and "note" not in full
    assert capped["truncated"] and len(capped["lines"]) == 50 and "serve.max_boxes_per_page" in capped["note"]
    assert capped["lines"] == full["lines"][:50]                  # the first 50 in reading order
    assert {ln["text"] for ln in full["lines"]} == {"a"}


def test_ocr_engine_fault_is_500_in_one_line_and_head_health_is_200():
    from pipeline.core.errors import EngineCrash

    with _ocr_client(_StubDet(3, fail=EngineCrash("det predictor died (exit -11)")), max_boxes=10) as client:
        r = client.post("/ocr", content=_page_png(), headers={"content-type": "image/png"})
        head = client.head("/health")
    assert r.status_code == 500 and "exit -11" in r.json()["error"] and "\n" not in r.json()["error"], r.text
    assert head.status_code == 200 and head.content == b""


def test_ocr_lanes_read_concurrent_pages_side_by_side_as_one_lane_does():
    """serve.ocr_lanes=2: two requests in flight run on two engine sets at once (each on its own thread), and every
    answer is what one lane gives; /health says batching is off because of the lanes; shutdown closes the lanes."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from pipeline.ocr.lanes import PageLanes
    from pipeline.ocr.system import SystemSpec
    from pipeline.serving.ocr_routes import create_ocr_app

    running, most, lock = [0], [0], threading.Lock()

    class SlowDet(_StubDet):             # holds its lane long enough for the second request to need the other
        def run(self, x):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            try:
                threading.Event().wait(0.3)
                return super().run(x)
            finally:
                with lock:
                    running[0] -= 1

    spec = SystemSpec({"resize": "limit", "limit_side_len": 640, "limit_type": "max", "mean": [0.5] * 3,
                       "std": [0.5] * 3}, {"thresh": 0.3, "box_thresh": 0.5, "unclip_ratio": 1.5,
                                           "max_candidates": 1000},
                      {"height": 48, "width": 320}, {"charset": ["a", "b"]})
    closed = []

    class ClosedRec(_StubRec):
        def close(self):
            closed.append(self)

    lanes = PageLanes(lambda: (SlowDet(7), ClosedRec(), None, spec), 2)
    app = create_ocr_app(lanes.sets[0], {}, log_requests=False, max_boxes=0, lanes=lanes)
    with TestClient(app) as client:
        post = lambda _: client.post("/ocr", content=_page_png(), headers={"content-type": "image/png"}).json()
        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(post, range(4)))
        health = client.get("/health").json()
        assert not closed
    assert len(closed) == 2                                       # the app's shutdown closed both lanes' engines
    assert most[0] == 2                                           # side by side, never more than the lanes
    assert all(a["lines"] == answers[0]["lines"] and len(a["lines"]) == 7 for a in answers)
    assert health["batching"]["enabled"] is False and "2 lanes" in health["batching"]["reason"]

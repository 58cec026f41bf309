"""Integration: the tiny OCR system through the CLI — detection chain, recognition-on-page-crops chain,
the system stage, its bundle's verify and the /ocr service. Minutes on two cores, so opt-in:
`make test-ocr` (PIPELINE_OCR_E2E=1); `make test` covers the detection chain (tests/test_det_chain.py)."""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from tests.clirun import pipeline_cli as cli

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("PIPELINE_OCR_E2E") != "1",
                                 reason="OCR system end to end takes minutes: run `make test-ocr`")]


@pytest.fixture(scope="module")
def system_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    # the smoke parts run Paddle Inference only (fast `make test`); here they also bundle model.onnx, so the
    # system runs its ONNX Runtime and OpenVINO rows (both read server/onnx/model.onnx)
    onnx = '["server.engines=[paddle-inference,onnxruntime]"]'
    args = ["-c", "configs/smoke_ocr_system.yaml", "-o", f"run.root={root}", "-o", f"bundle.root={root}/bundles",
            "-o", f"system.detection_overrides={onnx}", "-o", f"system.recognition_overrides={onnx}"]
    res = cli("run", "train", "export", "deploy", *args, check=True)
    return root, args, res


def _manifest(root, run, stage):
    return json.loads((root / run / stage / "manifest.json").read_text())


def test_parts_passed_their_gates(system_run):
    root = system_run[0]
    for run in ("smoke_ocr_det", "smoke_ocr_rec"):
        for stage in ("train", "export", "server", "lite", "bundle"):
            assert _manifest(root, run, stage)["status"] == "OK", (run, stage)


def test_system_rows_and_bundle(system_run):
    root = system_run[0]
    man = _manifest(root, "smoke_ocr_system", "system")
    gates = {g["subject"]: g for g in man["gates"]}
    assert gates["paddle-inference fp32"]["status"] == "OK"
    assert {"line_accuracy", "field_accuracy"} <= set(gates["paddle-inference fp32"]["extra"])
    assert gates["paddle-inference int8"]["status"] == "OK"
    assert gates["lite x86 fp32"]["status"] == "OK" and "agreement_with_fp32" in gates["lite x86 fp32"]["extra"]
    for kind in ("onnxruntime", "openvino"):                 # the same flow on the other runtimes' model.onnx pair
        assert gates[f"{kind} fp32"]["status"] == "OK", gates[f"{kind} fp32"]
        assert gates[f"{kind} fp32"]["extra"]["agreement_with_fp32"] >= 0.99
        assert gates[f"{kind} fp32"]["precision_effective"] == "fp32"
    assert gates["paddle-inference fp16"]["status"] == "SKIPPED" and gates["paddle-inference fp16"]["reason"]
    # system.engine: auto (default): each part on its own recommendation, gated, and /ocr reads exactly as that set
    served = gates["as served (system.engine=auto)"]
    assert served["status"] == "OK" and set(served["extra"]["served"]) == {"detection", "recognition"}
    for role, part in served["extra"]["served"].items():
        rec = yaml.safe_load((Path(man["info"]["bundle"]) / role / "infer_config.yaml").read_text())
        if part["by"] == "recommendation":      # the part bundle's own choice
            assert part["engine"] == rec["serving"]["engine"] and part["precision"] == rec["serving"]["precision"]
        else:                                   # timed on system pages (fresh engines, same warm-up)
            assert part["by"] == "system pages" and part["recommended"]["engine"] == rec["serving"]["engine"], part
            row = next(c for c in part["candidates"]
                       if (c["engine"], c["precision"]) == (part["engine"], part["precision"]))
            assert row["verdict"] == "chosen", row
            assert part["precision"] == "fp32" or part["speedup_vs_fastest_fp32"] >= part["min_speedup"], part
    assert gates["http /ocr as served"]["status"] == "OK" and gates["http /ocr as served"]["value"] == 0.0
    verified = gates["bundle self-verification"]
    assert verified["status"] == "OK"
    sets = verified["extra"]["sets"]                  # the precisions come from the engines that ran each set
    assert sets["as served"].keys() == served["extra"]["served"].keys()
    ran = {p["effective"] for parts in sets.values() for p in parts.values()}
    assert set(verified["precision_effective"].split("+")) == ran and "fp32" in ran
    bundle = Path(man["info"]["bundle"])
    files = json.loads((bundle / "manifest.json").read_text())["files"]
    for required in ("detection/server/fp32/inference.pdmodel", "recognition/mobile/x86_fp32.nb",
                     "detection/manifest.json", "infer_config.yaml", "samples/page_000.png", "samples/expected.json"):
        assert required in files, required
    assert Path(str(bundle) + ".tar.gz").is_file()


def test_verify_system_archive_and_tamper(system_run, tmp_path):
    root = system_run[0]
    bundle = Path(_manifest(root, "smoke_ocr_system", "system")["info"]["bundle"])
    res = cli("verify", str(bundle) + ".tar.gz", check=True)
    assert "system server fp32 lines differing" in res.stdout and "system lite x86 fp32" in res.stdout
    assert "system as served lines differing" in res.stdout
    import shutil

    from pipeline.core.errors import IntegrityError
    from pipeline.bundle.verify import verify_or_raise
    copy = tmp_path / bundle.name
    shutil.copytree(bundle, copy)
    with open(copy / "recognition" / "infer_config.yaml", "a") as f:
        f.write("\n# edited\n")
    with pytest.raises(IntegrityError, match="recognition/infer_config.yaml"):      # before any model is parsed
        verify_or_raise(copy)


def test_serve_ocr_answers_lines_with_boxes(system_run):
    from fastapi.testclient import TestClient

    from pipeline.serving.app import create_app

    root = system_run[0]
    bundle = Path(_manifest(root, "smoke_ocr_system", "system")["info"]["bundle"])
    expected = json.loads((bundle / "samples" / "expected.json").read_text())["pages"][0]
    body = (bundle / expected["file"]).read_bytes()
    with TestClient(create_app(bundle), raise_server_exceptions=False) as client:
        assert client.get("/health").json()["task"] == "ocr_system"
        r = client.post("/ocr", content=body, headers={"content-type": "image/png"})
        assert r.status_code == 200, r.text
        lines = r.json()["lines"]
        assert [ln["text"] for ln in lines] == [ln["text"] for ln in expected["lines"]]
        for ln in lines:
            assert np.asarray(ln["box"]).shape == (4, 2) and 0.0 <= ln["score"] <= 1.0
        bad = client.post("/ocr", content=b"not an image", headers={"content-type": "image/png"})
        assert bad.status_code == 400 and "error" in bad.json()
        assert client.post("/ocr", content=body, headers={"content-type": "text/plain"}).status_code == 415
        # a page of another size goes through the same resize rule
        big = Image.open(io.BytesIO(body)).resize((400, 300))
        buf = io.BytesIO()
        big.save(buf, format="PNG")
        assert client.post("/ocr", content=buf.getvalue(), headers={"content-type": "image/png"}).status_code == 200


def test_serve_cli_answers_ocr_on_the_system_bundle(system_run):
    """`python -m pipeline serve <system bundle>` as a user starts it (its startup log names the engine)."""
    import socket
    import time
    import urllib.request

    bundle = Path(_manifest(system_run[0], "smoke_ocr_system", "system")["info"]["bundle"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(bundle), "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert json.loads(r.read())["task"] == "ocr_system"
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
        page = sorted((bundle / "samples").glob("page_*.png"))[0].read_bytes()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/ocr", data=page, headers={"content-type": "image/png"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert isinstance(json.loads(r.read())["lines"], list)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "Traceback" not in out and "POST /ocr" in out, out


def test_batch_rows_are_what_ocr_answers(system_run, tmp_path):
    """`pipeline batch` on the system bundle (pipeline/scale): each row's lines are /ocr's answer for that page, on
    a Ray worker as in this process; the /ocr app answers KServe's probes (/v2/health/ready, /v2/health/live)."""
    import httpx

    from pipeline.scale.batch import BatchOptions, run_batch
    from pipeline.scale.reader import BundleReader, read_all
    from pipeline.scale.store import OutputStore
    from pipeline.serving.app import create_app
    from pipeline.serving.http_common import BackgroundServer

    bundle = Path(_manifest(system_run[0], "smoke_ocr_system", "system")["info"]["bundle"])
    pages = sorted(str(p) for p in (bundle / "samples").glob("page_*.png"))
    reader = BundleReader(bundle, threads=1)
    try:
        single = {r["path"]: r for r in read_all(reader, pages)}
    finally:
        reader.close()
    with BackgroundServer(create_app(bundle, threads=1, log_requests=False)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        for path in ("/v2/health/ready", "/v2/health/live"):
            assert client.get(path).status_code == 200, path
        for p in pages:
            answer = client.post("/ocr", content=Path(p).read_bytes(), headers={"content-type": "image/png"}).json()
            assert json.loads(single[p]["result"])["lines"] == json.loads(json.dumps(answer["lines"])), p
    s = run_batch(bundle, str(bundle / "samples"), tmp_path / "out", BatchOptions(workers=1, progress=False))
    rows = OutputStore(tmp_path / "out").rows()
    assert s["written"] == len(pages) == len(rows) and s["errors"] == 0
    for r in rows:
        assert (r["result"], r["prediction"], r["score"]) == (single[r["path"]]["result"],
                                                             single[r["path"]]["prediction"], single[r["path"]]["score"])

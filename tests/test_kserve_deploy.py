"""`pipeline kserve BUNDLE`: the ServingRuntime and InferenceService validate against the pinned kserve SDK's models
(in .venv-kserve, `make kserve-venv`; `make test` builds it), the routes the runtime declares are answered by the app
`serve` runs, and the Dockerfile installs the pinned stack and runs `pipeline serve`.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
KSERVE_PY = ROOT / ".venv-kserve" / "bin" / "python"


@pytest.fixture(scope="module")
def rendered(smoke_bundle, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kserve")
    res = subprocess.run([sys.executable, "-m", "pipeline", "kserve", str(smoke_bundle[1]), "--out", str(out),
                          "--storage-uri", "s3://models/smoke", "--namespace", "ocr"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("wrote ") == 4
    return out


def _validate(*files: Path) -> tuple[int, dict]:
    if not KSERVE_PY.is_file():
        if os.environ.get("CI"):
            pytest.fail(".venv-kserve is missing: `make test` builds it (make kserve-venv)")
        pytest.skip("the kserve SDK venv is not built: make kserve-venv")
    res = subprocess.run([str(KSERVE_PY), str(ROOT / "scripts" / "kserve_validate.py"), *map(str, files)],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    return res.returncode, json.loads(res.stdout)


def test_manifests_validate_against_the_pinned_kserve_sdk(rendered):
    code, report = _validate(rendered / "servingruntime.yaml", rendered / "inferenceservice.yaml")
    assert code == 0, report
    pinned = re.search(r"^kserve==(\S+)", (ROOT / "requirements-kserve.txt").read_text(), re.M).group(1)
    assert {r["model"] for r in report.values()} == {"V1alpha1ServingRuntime", "V1beta1InferenceService"}
    assert all(r["problems"] == [] and r["kserve"] == pinned for r in report.values()), report


def test_the_validator_refuses_what_the_sdk_does_not_know(rendered, tmp_path):
    rt = yaml.safe_load((rendered / "servingruntime.yaml").read_text())
    rt["spec"]["containers"][0]["readynessProbe"] = rt["spec"]["containers"][0].pop("readinessProbe")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(rt))
    del rt["spec"]["containers"][0]["name"]
    (tmp_path / "no-name.yaml").write_text(yaml.safe_dump(rt))
    code, report = _validate(tmp_path / "typo.yaml", tmp_path / "no-name.yaml")
    assert code == 1
    assert report[str(tmp_path / "typo.yaml")]["problems"] == [
        ".spec.containers[0].readynessProbe: not a field of the SDK model (dropped)"]
    assert "the SDK refused it" in report[str(tmp_path / "no-name.yaml")]["problems"][0]


def test_runtime_service_and_image_say_what_serve_needs(rendered, smoke_bundle):
    rt = yaml.safe_load((rendered / "servingruntime.yaml").read_text())
    isvc = yaml.safe_load((rendered / "inferenceservice.yaml").read_text())
    (c,) = rt["spec"]["containers"]
    assert c["name"] == "kserve-container" and c["ports"] == [{"containerPort": 8080, "protocol": "TCP"}]
    assert c["command"] == ["python", "-m", "pipeline", "serve"] and c["args"][:5] == [
        "/mnt/models", "--host", "0.0.0.0", "--port", "8080"]
    assert rt["spec"]["protocolVersions"] == ["v2"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["storageUri"] == "s3://models/smoke" and model["runtime"] == rt["metadata"]["name"]
    assert model["modelFormat"]["name"] == rt["spec"]["supportedModelFormats"][0]["name"]
    assert isvc["metadata"] == {"name": smoke_bundle[0].name.lower(), "namespace": "ocr"}
    mem = int(model["resources"]["requests"]["memory"].removesuffix("Mi"))
    peak = float(re.search(r"peak RSS (\d+) MB", (rendered / "inferenceservice.yaml").read_text()).group(1))
    assert mem % 64 == 0 and peak * 1.5 <= mem < peak * 1.5 + 65
    assert model["resources"]["limits"]["memory"] == f"{2 * mem}Mi"
    docker = (rendered / "Dockerfile").read_text()
    paddle = re.search(r"^PADDLE_cpu := (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"pip install {paddle} -r requirements.txt" in docker and "FROM python:3.10" in docker
    assert '"pipeline", "serve"' in docker and "EXPOSE 8080" in docker and "USER 1000" in docker
    assert {".venv*", "runs", "bundles"} <= set((rendered / "Dockerfile.dockerignore").read_text().split())


def test_the_app_serve_runs_answers_the_declared_routes(rendered, smoke_bundle):
    import httpx

    from pipeline.serving.app import create_app
    from pipeline.serving.http_common import BackgroundServer

    (c,) = yaml.safe_load((rendered / "servingruntime.yaml").read_text())["spec"]["containers"]
    paths = [c[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")]
    assert paths == ["/v2/health/ready", "/v2/health/live"]
    app = create_app(smoke_bundle[0], log_requests=False)
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        for path in paths:
            assert client.get(path).status_code == 200, path
        name = client.get("/health").json()["model"]
        assert client.get(f"/v2/models/{name}/ready").status_code == 200      # protocol v2, as the runtime says


def test_a_bundle_that_is_not_one_is_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pipeline", "kserve", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 3 and "is not a bundle" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (ROOT / "kserve" / tmp_path.name).exists()

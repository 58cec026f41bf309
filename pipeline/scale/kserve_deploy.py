"""`python -m pipeline kserve BUNDLE`: what a KServe cluster needs to serve a bundle with `pipeline serve`.

Writes, into one folder:
  servingruntime.yaml     a ServingRuntime (serving.kserve.io/v1alpha1): container `kserve-container` running
                          `python -m pipeline serve /mnt/models` on port 8080, Open Inference Protocol v2, readiness on
                          /v2/health/ready and liveness on /v2/health/live;
  inferenceservice.yaml   an InferenceService (serving.kserve.io/v1beta1) whose predictor names that runtime, the
                          bundle's storage URI (KServe's storage initializer puts it at /mnt/models) and resources from
                          the memory measured here while the real app served the bundle's samples;
  Dockerfile              the server image: Python 3.10, the pinned stack (requirements.txt + paddlepaddle), the project,
                          a non-root user, `pipeline serve` as entry point (build from the project root), and its
                          Dockerfile.dockerignore (venvs, caches, runs and bundles stay out of the build context).
Before anything is written, the app `serve` would run for the bundle is started on a local port: every route the
runtime declares must answer 200 and the bundle's samples must be answered, or nothing is written.
The files are plain YAML and text; tests validate them against the pinned `kserve` SDK's models
(requirements-kserve.txt, its own venv: scripts/kserve_validate.py).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import yaml

from pipeline.bundle.format import load_infer_config, read_manifest
from pipeline.core.errors import PipelineError
from pipeline.serving.http_common import MAX_PIXELS

PORT = 8080
CONTAINER = "kserve-container"
MODEL_FORMAT = "pipeline-bundle"
PROBES = {"readinessProbe": "/v2/health/ready", "livenessProbe": "/v2/health/live"}
MODEL_DIR = "/mnt/models"              # where KServe's storage initializer puts storageUri
PADDLE = "paddlepaddle==2.6.2"         # as the Makefile installs it (PADDLE_cpu)
DOCKER_IGNORE = (".git", ".venv*", ".cache", "runs", "bundles", "kserve", "log", "**/__pycache__", "tests")


def k8s_name(text: str) -> str:
    """A DNS-1035 label (what Kubernetes accepts as a resource name) from a bundle name."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    name = name if name[:1].isalpha() else f"b-{name}"
    return name[:63].rstrip("-") or "bundle"


def measure(bundle: Path, max_pixels: int = MAX_PIXELS, archive_limits: tuple = ()) -> dict:
    """Start the app `serve` runs for the bundle, GET every probe path, answer the bundle's samples; → {"routes":
    {path: status}, "samples": n answered, "peak_rss_mb", "threads", "task", "name"}. A route or sample not answered
    200 raises PipelineError (nothing is deployed that does not answer here)."""
    from pipeline.bundle.format import open_bundle
    from pipeline.core import tempdirs

    with tempdirs.directory("kserve") as scratch:
        folder = open_bundle(Path(bundle), Path(scratch), *archive_limits)
        return _measure_folder(folder, max_pixels)


def _measure_folder(folder: Path, max_pixels: int) -> dict:
    import httpx

    from pipeline.core import resources
    from pipeline.serving.app import create_app
    from pipeline.serving.http_common import BackgroundServer

    app = create_app(folder, max_pixels=max_pixels, log_requests=False)
    task, routes, answered = _task(folder), {}, 0
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        for path in PROBES.values():
            routes[path] = client.get(path).status_code
        for png in _samples(folder, task):
            r = client.post("/ocr" if task == "ocr_system" else "/predict", content=png.read_bytes(),
                            headers={"content-type": "image/png"})
            if r.status_code != 200:
                raise PipelineError(f"kserve: the app answered {r.status_code} to the bundle's sample {png.name}: "
                                    f"{r.text[:200]}")
            answered += 1
    bad = {p: s for p, s in routes.items() if s != 200}
    if bad:
        raise PipelineError(f"kserve: the app does not answer the routes the runtime would declare: {bad}",
                            hint="the probes must answer 200; see pipeline/serving/kserve.py")
    return {"routes": routes, "samples": answered, "peak_rss_mb": resources.peak_record(False)["peak_rss_mb"],
            "task": task, "name": read_manifest(folder).get("name") or folder.name}


def _task(folder: Path) -> str:
    return str(load_infer_config(folder).get("task", ""))   # the bundle reader's limits (issue 47)


def _samples(folder: Path, task: str, most: int = 4) -> list[Path]:
    pattern = "page_*.png" if task == "ocr_system" else "[0-9]*.png"
    return sorted((folder / "samples").glob(pattern))[:most]


def resources_for(peak_rss_mb: float, threads: int = 1) -> dict:
    """Requests = the measured peak x 1.5 (pages larger than the samples, the allocator's slack), rounded up to
    64 Mi; the memory limit twice that. CPU: the engine threads a request runs on."""
    req = int(math.ceil(peak_rss_mb * 1.5 / 64.0) * 64)
    return {"requests": {"cpu": str(threads), "memory": f"{req}Mi"},
            "limits": {"cpu": str(threads), "memory": f"{2 * req}Mi"}}


def serving_runtime(name: str, image: str, res: dict) -> dict:
    probes = {k: {"httpGet": {"path": p, "port": PORT}, "initialDelaySeconds": 5, "periodSeconds": 10,
                  "timeoutSeconds": 5, "failureThreshold": 30 if k == "readinessProbe" else 3}
              for k, p in PROBES.items()}
    container = {"name": CONTAINER, "image": image,
                 "command": ["python", "-m", "pipeline", "serve"],
                 "args": [MODEL_DIR, "--host", "0.0.0.0", "--port", str(PORT), "-o", "serve.access_log=false"],
                 "ports": [{"containerPort": PORT, "protocol": "TCP"}],
                 "resources": res, **probes}
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "ServingRuntime",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "pipeline"}},
            "spec": {"supportedModelFormats": [{"name": MODEL_FORMAT, "version": "1", "autoSelect": True}],
                     "protocolVersions": ["v2"], "multiModel": False,
                     "annotations": {"prometheus.kserve.io/port": str(PORT)},
                     "containers": [container]}}


def inference_service(name: str, runtime: str, storage_uri: str, res: dict, namespace: str | None) -> dict:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": meta,
            "spec": {"predictor": {"minReplicas": 1, "model": {
                "modelFormat": {"name": MODEL_FORMAT, "version": "1"}, "runtime": runtime,
                "protocolVersion": "v2", "storageUri": storage_uri, "resources": res}}}}


def dockerfile(version: str) -> str:
    """The server image recipe (build context: the project root)."""
    return f"""# The `pipeline serve` image for KServe (written by `python -m pipeline kserve`, project {version}).
# Build from the project root:  docker build -f <this file> -t <image> .
FROM python:3.10-slim
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 libgl1 libglib2.0-0 \\
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt .
RUN python -m pip install --upgrade pip && python -m pip install {PADDLE} -r requirements.txt
COPY pipeline/ pipeline/
COPY configs/ configs/
COPY stages/ stages/
RUN useradd --uid 1000 --create-home serve && chown -R serve /app
USER 1000
EXPOSE {PORT}
# KServe's storage initializer puts the InferenceService's storageUri (the bundle folder) at {MODEL_DIR}
ENTRYPOINT ["python", "-m", "pipeline", "serve"]
CMD ["{MODEL_DIR}", "--host", "0.0.0.0", "--port", "{PORT}"]
"""


def write_manifests(bundle: Path, out: Path | None = None, *, image: str | None = None, storage_uri: str | None = None,
                    namespace: str | None = None, max_pixels: int = MAX_PIXELS, archive_limits: tuple = ()) -> list[Path]:
    """Measure the bundle as served here, then write the three files; → their paths."""
    from pipeline.core.artifacts import atomic_write_text
    from pipeline.core.version import __version__

    m = measure(Path(bundle), max_pixels, archive_limits)
    name = k8s_name(m["name"])
    out = Path(out) if out else Path("kserve") / name
    res = resources_for(m["peak_rss_mb"])
    runtime = "pipeline-serve"
    docs = {"servingruntime.yaml": serving_runtime(runtime, image or f"pipeline-serve:{__version__}", res),
            "inferenceservice.yaml": inference_service(name, runtime, storage_uri or f"pvc://bundles/{m['name']}",
                                                       res, namespace)}
    note = (f"# written by `python -m pipeline kserve {bundle}`: the app answered {', '.join(m['routes'])} with 200 and "
            f"{m['samples']} sample(s); peak RSS {m['peak_rss_mb']:.0f} MB\n")
    files = []
    for fname, doc in docs.items():
        atomic_write_text(out / fname, note + yaml.safe_dump(doc, sort_keys=False))
        files.append(out / fname)
    atomic_write_text(out / "Dockerfile", dockerfile(__version__))
    # BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile: the context is the project root, whose venvs,
    # caches, runs and bundles (gigabytes) the image does not need
    atomic_write_text(out / "Dockerfile.dockerignore", "\n".join(DOCKER_IGNORE) + "\n")
    return files + [out / "Dockerfile", out / "Dockerfile.dockerignore"]

"""Validate `python -m pipeline kserve` output with the pinned `kserve` SDK's own models (run by .venv-kserve's python,
`make kserve-venv`: the SDK pins protobuf<7 and python-dateutil<3, which the pipeline's .venv has newer).

Each YAML document is built into the SDK model of its kind (V1alpha1ServingRuntime, V1beta1InferenceService) field by
field as the SDK's ApiClient deserializes (its nested Kubernetes types from the kubernetes client the SDK pins), whose
generated setters refuse missing required fields and wrong enums; the model is then
serialized back, and every key of the file must come back with the same value: a key the SDK's model does not know
(a typo, a field of another API version) would be dropped, and is reported by its path.
Prints one JSON object {file: {"kind", "model", "problems"}}; exit 1 when any file has a problem.
"""
from __future__ import annotations

import importlib.metadata
import json
import sys

import yaml

import kserve
from kserve import ApiClient

MODELS = {("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
          ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService"}


def differences(want, got, path: str = "") -> list[str]:
    """Where `got` (the SDK's round trip) lost or changed something of `want` (the file)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path or '.'}: became {type(got).__name__}"]
        out = []
        for k, v in want.items():
            if k not in got:
                out.append(f"{path}.{k}: not a field of the SDK model (dropped)")
            else:
                out += differences(v, got[k], f"{path}.{k}")
        return out
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: list changed"]
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in differences(w, g, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: {want!r} came back as {got!r}"]


NATIVE = {"str": str, "int": int, "float": float, "bool": bool, "object": object, "datetime": str, "date": str}


def build(data, klass: str):
    """data as the SDK model named klass, the way kserve.ApiClient deserializes (list[...], dict(str, ...), models),
    models looked up in kserve.models, then kubernetes.client.models (V1ObjectMeta, V1Container, ...): each model's
    generated constructor and setters run their own checks (required fields, enums)."""
    import re

    from kubernetes.client import models as k8s

    if data is None:
        return None
    listed = re.fullmatch(r"[lL]ist\[(.*)\]", klass)          # kserve writes list[X], kubernetes 37 List[X]
    if listed:
        if not isinstance(data, list):
            raise ValueError(f"expected a list for {klass}, got {type(data).__name__}")
        return [build(d, listed.group(1)) for d in data]
    mapped = re.fullmatch(r"dict\([^,]*, (.*)\)|Dict\[[^,]*, (.*)\]", klass)
    if mapped:
        if not isinstance(data, dict):
            raise ValueError(f"expected a mapping for {klass}, got {type(data).__name__}")
        return {k: build(v, mapped.group(1) or mapped.group(2)) for k, v in data.items()}
    if klass in NATIVE:
        want = NATIVE[klass]
        if want is not object and not isinstance(data, want) and not (want is float and isinstance(data, int)):
            raise ValueError(f"expected {klass}, got {type(data).__name__} {data!r}")
        return data
    cls = getattr(kserve.models, klass, None) or getattr(k8s, klass)
    if not isinstance(data, dict):
        raise ValueError(f"expected an object for {klass}, got {type(data).__name__}")
    kwargs = {a: build(data[cls.attribute_map[a]], t) for a, t in cls.openapi_types.items()
              if cls.attribute_map[a] in data}
    return cls(**kwargs)


def validate(doc: dict) -> tuple[str, list[str]]:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in MODELS:
        return "", [f"apiVersion/kind {key} is none of {sorted(MODELS)}"]
    try:
        obj = build(doc, MODELS[key])
    except (ValueError, TypeError, AttributeError) as exc:
        return MODELS[key], [f"the SDK refused it: {' '.join(str(exc).splitlines()[:3])}"]
    return MODELS[key], differences(doc, ApiClient().sanitize_for_serialization(obj))


def main(paths: list[str]) -> int:
    report, bad = {}, False
    for p in paths:
        with open(p) as f:
            doc = yaml.safe_load(f)
        model, problems = validate(doc)
        report[p] = {"kind": doc.get("kind"), "model": model, "problems": problems,
                     "kserve": importlib.metadata.version("kserve")}
        bad |= bool(problems)
    print(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Model builders chosen by name: a built-in name, or "package.module:callable" for users' own Layers.

Built-ins are the conformance zoo (`make conformance`): the project's own small_cnn/crnn, models
written here to cover the op families of Paddle's OCR and classification nets (lcnet, svtr_lcnet,
vit), and paddle.vision architectures (no weight downloads: pretrained=False).
"""
from __future__ import annotations

import importlib
import inspect

from pipeline.core.errors import ConfigError


def _vision(name: str):
    def build(num_classes: int, **kwargs):
        import paddle.vision.models as pvm
        return getattr(pvm, name)(pretrained=False, num_classes=num_classes, **kwargs)
    build.__name__ = name
    build.accepts = ("num_classes",)      # RGB only; their **kwargs would swallow anything else
    return build


def _local(module: str, cls: str):
    def build(num_classes: int, **kwargs):
        mod = importlib.import_module(f"pipeline.models.{module}")
        return getattr(mod, cls)(num_classes=num_classes, **kwargs)
    build.__name__ = cls
    build.target = f"pipeline.models.{module}:{cls}"     # for the signature of accepted arguments
    return build


# task → name → builder(num_classes=..., **args)
BUILTIN = {
    "classification": {
        "small_cnn": _local("small_cnn", "SmallCNN"),
        "lcnet": _local("lcnet", "LCNet"),
        "vit": _local("vit", "ViT"),
        **{n: _vision(n) for n in ("resnet18", "mobilenet_v2", "mobilenet_v3_small", "shufflenet_v2_x0_25",
                                    "squeezenet1_1")},
    },
    "recognition": {
        "crnn": _local("crnn", "CRNN"),
        "svtr_lcnet": _local("svtr", "SVTRRecognizer"),
    },
}


def builtin_names(task: str) -> list[str]:
    return sorted(BUILTIN.get(task, {}))


def import_callable(spec: str):
    if ":" not in spec:
        raise ConfigError(f"model.name '{spec}' is neither a built-in model nor 'package.module:callable'",
                          hint="e.g. paddle.vision.models:mobilenet_v3_small")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:            # ImportError, or any error the module raises while importing
        raise ConfigError(f"model.name '{spec}': cannot import module '{module_name}' ({type(exc).__name__}: {exc})",
                          hint="check the module path and that its package is installed in .venv") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"model.name '{spec}': '{attr}' is not a callable in {module_name}",
                          hint="name a class or function returning a paddle.nn.Layer")
    return fn


def _accepted(fn, defaults: dict, args: dict) -> dict:
    """The defaults (num_classes, in_channels, ...) fn accepts and the user did not set."""
    if hasattr(fn, "accepts"):
        return {k: v for k, v in defaults.items() if k in fn.accepts and k not in args}
    target = import_callable(fn.target) if hasattr(fn, "target") else fn
    try:
        params = inspect.signature(target).parameters
        accepts_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        params, accepts_kwargs = {}, True
    return {k: v for k, v in defaults.items() if (k in params or accepts_kwargs) and k not in args}


def _call(fn, spec: str, args: dict, defaults: dict):
    import paddle

    try:
        layer = fn(**_accepted(fn, defaults, args), **args)
    except Exception as exc:            # the user's builder: TypeError for wrong args, anything else from its code
        raise ConfigError(f"model.args do not fit {spec}: {type(exc).__name__}: {exc}",
                          hint="check model.args in your config") from None
    if not isinstance(layer, paddle.nn.Layer):
        raise ConfigError(f"model.name '{spec}' returned {type(layer).__name__}, not a paddle.nn.Layer",
                          hint="model.name must name a builder of a paddle.nn.Layer")
    return layer


def build_model(task: str, name: str, args: dict, defaults: dict):
    """A built-in model of `task` by name, or a user's builder by import path.

    defaults (num_classes first) are passed only where the builder accepts them; for
    user builders only num_classes is offered (their own signature decides the rest)."""
    if isinstance(name, str) and name in BUILTIN.get(task, {}):
        return _call(BUILTIN[task][name], name, args, defaults)
    if isinstance(name, str) and ":" in name:
        return _call(import_callable(name), name, args, {"num_classes": defaults["num_classes"]})
    raise ConfigError(f"model.name {name!r} is not a {task} model: neither a built-in one "
                      f"({', '.join(builtin_names(task))}) nor 'package.module:callable'",
                      hint="e.g. paddle.vision.models:mobilenet_v3_small (a builder returning a paddle.nn.Layer)")


def build_user_model(spec: str, args: dict, defaults: dict):
    """Call the user's builder with their args; fill `defaults` (e.g. num_classes) it accepts but they omitted."""
    return _call(import_callable(spec), spec, args, defaults)

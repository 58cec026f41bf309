"""Model builders chosen by name: a built-in name, or "package.module:callable" for users' own Layers."""
from __future__ import annotations

import importlib
import inspect

from ..errors import ConfigError


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


def build_user_model(spec: str, args: dict, defaults: dict):
    """Call the user's builder with their args; fill `defaults` (e.g. num_classes) it accepts but they omitted."""
    import paddle

    fn = import_callable(spec)
    try:
        params = inspect.signature(fn).parameters
        accepts_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        params, accepts_kwargs = {}, True
    kwargs = {k: v for k, v in defaults.items() if (k in params or accepts_kwargs) and k not in args}
    try:
        layer = fn(**kwargs, **args)
    except Exception as exc:            # the user's builder: TypeError for wrong args, anything else from its code
        raise ConfigError(f"model.args do not fit {spec}: {type(exc).__name__}: {exc}",
                          hint="check model.args in your config") from None
    if not isinstance(layer, paddle.nn.Layer):
        raise ConfigError(f"model.name '{spec}' returned {type(layer).__name__}, not a paddle.nn.Layer",
                          hint="model.name must name a builder of a paddle.nn.Layer")
    return layer

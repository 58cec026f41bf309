"""Training-to-deployment pipeline for PaddlePaddle models.

Import-order guards live here because every entry point (CLI, tests, Lite child processes)
imports this package before anything touches paddle.
"""
import zlib

from pipeline.core.env import apply_cpu_tuning as _apply_cpu_tuning
from pipeline.core.version import __version__ as __version__

_apply_cpu_tuning()
# Paddle's C++ INFO/WARNING chatter (executor banners, deprecations) drowns the summary; errors stay visible
__import__("os").environ.setdefault("GLOG_minloglevel", "2")

"""What a person reads on the console: the `pipeline` logger's handler (one place, used by every entry point)."""
from __future__ import annotations

import logging
import sys


def setup_logging() -> None:
    # our own handler: paddle reconfigures the root logger on import
    log = logging.getLogger("pipeline")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

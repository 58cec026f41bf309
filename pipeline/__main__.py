import os
import sys

from pipeline.core import supervise

# the supervisor decides before the CLI is imported: the watching parent needs none of it (~0.7 s of imports)
if supervise.wanted(sys.argv[1:]):          # a kernel-killed stage then gets a clear line
    sys.exit(supervise.run_supervised(sys.argv[1:]))

from pipeline.cli import INTERRUPTED, main

code = main()
if code == INTERRUPTED:
    # Ctrl-C may have landed inside a native engine call (Paddle predictors, OpenVINO and ONNX Runtime thread
    # pools, after server and lite ran in this process): tearing them down at interpreter exit crashed with
    # SIGSEGV. The answer is printed and nothing is left to write: leave without the teardown (temp folders
    # are named by pid and reaped by the next run, pipeline/core/tempdirs.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)

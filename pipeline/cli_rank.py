"""The script paddle.distributed.launch starts for each rank of a launched training (pipeline/training/distributed.py).

It sits at the top of the package order, like `python -m pipeline`: it registers the stages (importing the `stages`
package), then hands over to the rank worker (pipeline/training/rank_worker.py), which runs the train stage.
"""
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # started as a script: import the package from the repo root, never from this folder (pipeline/ on sys.path
    # would shadow nothing useful and break the package's own imports)
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pipeline  # noqa: F401  (side effect: zlib before paddle, CPU tuning)
    import stages
    from pipeline.training.rank_worker import _worker

    sys.exit(_worker(sys.argv[1:]))

"""The process layout of training: processes per node × nodes × math threads per process, and why.

`train.nproc: auto` runs one process per core with one thread each on a multi-core CPU (one per
GPU on a GPU machine): Paddle's CPU kernels on small models scale poorly with threads, while
data-parallel processes share nothing but one gradient all-reduce per step (processes won 3.0x on
a quiet 2-core box and ~1.9x in full trainings on the same box under heavy load; `make
bench-train` measures the layouts side by side). `train.batch_size` is the
global batch, so the layout changes speed, not the training recipe.

The layout is part of the train fingerprint (BatchNorm batch statistics and float reduction order
differ between layouts, within noise), so a 1-process output is not "up to date" for 2 processes;
downstream stages accept whatever layout the train manifest records.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field

from pipeline.core import env
from pipeline.core.errors import ConfigError

MIN_RANK_BATCH = 16     # auto never shards a global batch into smaller per-process pieces


@dataclass(frozen=True)
class Layout:
    nproc: int = 1                  # processes per node
    nnodes: int = 1
    threads: int | None = None      # math threads per process (OMP/MKL); None: Paddle's default
    device: str = "cpu"
    reason: str = ""
    # how to reach the other nodes (not part of the fingerprint)
    master: str | None = field(default=None, compare=False)
    node_rank: int | None = field(default=None, compare=False)
    inside: bool = field(default=False, compare=False)     # this process is one of the ranks

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes

    @property
    def needs_launch(self) -> bool:
        """A parent that must start the ranks through paddle.distributed.launch."""
        return self.world > 1 and not self.inside

    def key(self) -> dict:
        """What enters the fingerprint."""
        return {"nproc": self.nproc, "nnodes": self.nnodes, "threads": self.threads}

    def record(self) -> dict:
        d = asdict(self)
        d.pop("inside")
        return {**d, "world_size": self.world}

    def describe(self) -> str:
        t = "default threads" if self.threads is None else f"{self.threads} thread{'s' * (self.threads != 1)}"
        nodes = f" × {self.nnodes} nodes" if self.nnodes > 1 else ""
        return f"{self.nproc} process{'es' * (self.nproc != 1)} × {t}{nodes}"


def split_batch(batch: int, world: int) -> int:
    """The per-process share of the global batch; an uneven split is a config error."""
    if batch % world:
        lo, hi = batch // world * world, (batch // world + 1) * world
        raise ConfigError(f"train.batch_size {batch} (the global batch) does not split evenly across {world} processes",
                          hint=f"use a multiple of {world} (e.g. {lo or hi} or {hi}) or another process count (NPROC=...)")
    return batch // world


def _user_threads(cfg) -> int | None:
    """Threads the user chose (run.threads, or OMP_NUM_THREADS set outside the pipeline)."""
    if cfg.run.threads:
        return cfg.run.threads
    if "OMP_NUM_THREADS" in os.environ and "OMP_NUM_THREADS" not in env.APPLIED_TUNING:
        try:
            return max(1, int(os.environ["OMP_NUM_THREADS"]))
        except ValueError:
            return None
    return None


def gpu_count() -> int:
    """Visible GPUs; imports paddle only when a CUDA build is installed (a CPU parent stays light)."""
    from importlib import metadata

    try:
        metadata.version("paddlepaddle-gpu")
    except metadata.PackageNotFoundError:
        return 0
    caps = env.capabilities()
    if not caps["gpu"]:
        return 0
    import paddle
    return int(paddle.device.cuda.device_count())


def _auto(batch: int, cores: int, gpus: int, nnodes: int) -> tuple[int, str]:
    """Processes where they beat threads: one process per core with one thread each on a multi-core CPU
    (3.0x over 1 process x 2 threads on a quiet 2-core box; ~1.9x in full trainings on the same box
    under heavy load, there partly because every launched rank is its own session and so its own
    autogroup share of the CPU - see docs/training.md), one per GPU; never shares of the global batch smaller
    than MIN_RANK_BATCH."""
    if gpus:
        return gpus, f"train.nproc=auto: one process per GPU ({gpus} visible)"
    if cores < 2:
        return 1, "train.nproc=auto: one CPU core"
    fits = [k for k in range(cores, 0, -1) if batch % (k * nnodes) == 0 and batch // (k * nnodes) >= MIN_RANK_BATCH]
    if not fits or fits[0] == 1:
        return 1, (f"train.nproc=auto: train.batch_size {batch} does not split into >= {MIN_RANK_BATCH}-sample shares "
                   f"over {cores} processes per node; threads instead")
    return fits[0], (f"train.nproc=auto: {cores}-core CPU, data-parallel processes beat threads for Paddle CPU "
                     f"training (measured on quiet and busy machines, see docs/training.md)")


def _cpu_bf16(cfg) -> bool:
    """bf16 AMP that will run on this CPU (pipeline/training/amp.py routes it through one static program)."""
    from pipeline.core import capabilities

    amp = cfg.train.amp
    return amp.enable and amp.dtype == "bfloat16" and capabilities.has_bf16() and not capabilities.isa_cap_without_bf16()


def is_auto(layout_record: dict | None) -> bool:
    return bool(layout_record) and str(layout_record.get("reason", "")).startswith("train.nproc=auto")


def _check_nodes(nnodes: int, master: str | None, node_rank: int | None) -> None:
    how = "make train NNODES=2 MASTER=<node 0 host>:<free port> NODE_RANK=<0 or 1> (on every node)"
    if nnodes < 1:
        raise ConfigError(f"the node count must be >= 1, got {nnodes}", hint=how)
    if nnodes == 1:
        return
    if not master or not re.fullmatch(r"[A-Za-z0-9._-]+:\d{1,5}", master):
        raise ConfigError(f"{nnodes} nodes need MASTER=host:port (the rendezvous on node 0), got {master!r}", hint=how)
    if node_rank is None or not 0 <= node_rank < nnodes:
        raise ConfigError(f"{nnodes} nodes need NODE_RANK between 0 and {nnodes - 1}, got {node_rank!r}", hint=how)


def plan(cfg, nproc: int | str | None = None, nnodes: int = 1, master: str | None = None,
         node_rank: int | None = None) -> Layout:
    """The layout a run will use: `nproc` (CLI) over train.nproc; auto resolved here, checked before any
    process starts (an uneven batch split is one line, not two crashed ranks)."""
    _check_nodes(nnodes, master, node_rank)
    requested = cfg.train.nproc if nproc is None else nproc
    cores = env.cpu_count()
    gpus = 0 if cfg.train.device == "cpu" else gpu_count()
    if requested == "auto" and not gpus and _cpu_bf16(cfg):
        n, why = 1, "train.nproc=auto: bf16 AMP on a CPU trains in one process (static-graph route, no data-parallel path)"
    elif requested == "auto":
        n, why = _auto(cfg.train.batch_size, cores, gpus, nnodes)
    else:
        n = int(requested)
        if n < 1:
            raise ConfigError(f"the process count must be >= 1 or auto, got {n}", hint="NPROC=2 or train.nproc=auto")
        why = f"train.nproc={n}" if nproc is None else f"NPROC={n}"
        if n > cores and not gpus:
            why += f" (more processes than the {cores} CPU cores: they compete for them)"
    split_batch(cfg.train.batch_size, n * nnodes)
    threads = _user_threads(cfg)
    if threads is None:
        env_threads = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(env_threads) if n * nnodes == 1 and env_threads.isdigit() else max(1, cores // n)
    elif n > 1:
        why += f"; threads per process from {'run.threads' if cfg.run.threads else 'OMP_NUM_THREADS'}"
    return Layout(nproc=n, nnodes=nnodes, threads=threads, device="gpu" if gpus else "cpu", reason=why,
                  master=master, node_rank=node_rank if nnodes > 1 else None)


def world() -> tuple[int, int]:
    """(rank, number of processes); (0, 1) unless init_parallel_env() has run in this process."""
    import paddle.distributed as dist

    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def current() -> Layout:
    """The layout this very process runs in (inside a launched rank, or a plain single process)."""
    _, size = world()
    nnodes = int(os.environ.get("PADDLE_NNODES", "1")) if size > 1 else 1
    nproc = int(os.environ.get("PADDLE_LOCAL_SIZE", size)) if size > 1 else 1
    raw = os.environ.get("OMP_NUM_THREADS")
    threads = int(raw) if raw and raw.isdigit() else None
    reason = os.environ.get("PIPELINE_LAYOUT_REASON", "one process (in-process run)" if size == 1 else "launched")
    return Layout(nproc=nproc, nnodes=nnodes, threads=threads, device=env_device(), reason=reason, inside=True)


def env_device() -> str:
    try:
        import paddle
        return "gpu" if paddle.device.get_device().startswith("gpu") else "cpu"
    except Exception:
        return "cpu"

"""Paddle Lite, parent side: conversion (opt), running, op support, FP16 detection.

Paddle Lite is never imported here: it aborts the whole process on bad input, so every call
goes through `python -m pipeline.engines.lite_child` and a crash becomes an EngineCrash.
Facts this module relies on (measured with paddlelite 2.13rc0, see /work/shared/STACK.md):
  * only an x86 FP32 .nb gives correct numbers on x86; ARM and quantized .nb run but output garbage;
  * Lite checks neither input shape nor dtype, so run() validates before spawning;
  * a PaddleSlim PTQ (fake-quant) model needs no extra opt flag: opt detects the quant ops;
  * the .nb stores kernel keys "op/alias/target/precision/layout", which tells what opt really did;
  * enable_fp16() only works when called before set_valid_places (after it: no effect, which is
    what STACK.md observed); then ARM gets FP16 kernels, x86 none.
"""

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core import resources, tempdirs
from pipeline.engines.base import Engine, validate_input
from pipeline.core.errors import ConfigError, DataError, EngineCrash, MissingArtifact, PipelineError
from pipeline.core.supervise import exit_status

REPO_ROOT = Path(__file__).resolve().parents[2]  # parent of the `pipeline` package
RESULT_PREFIX = "LITE_CHILD_RESULT "
TARGETS = ("arm", "x86")
PRECISIONS = ("fp32", "fp16", "int8_weight", "int16_weight", "int8")
_QUANT_TYPE = {"int8_weight": "QUANT_INT8", "int16_weight": "QUANT_INT16"}
# paddlelite PrecisionType values as written in .nb kernel keys.
_PREC_NAMES = {1: "fp32", 2: "int8", 3: "int32", 4: "any", 5: "fp16", 7: "int64", 8: "int16"}
_QUANT_OP_PREFIXES = ("fake_quantize", "fake_channel_wise", "fake_dequantize", "quantize_linear",
                      "dequantize_linear")
_KERNEL_KEY = re.compile(rb"([A-Za-z0-9_]+/[A-Za-z0-9_]+/\d+/\d+/\d+)\x00")


class Unsupported(PipelineError):
    """The installed Lite cannot produce what was asked (e.g. FP16 kernels); callers mark SKIPPED."""


@dataclass
class ConvertResult:
    path: Path
    size_bytes: int
    target: str
    precision_requested: str
    precision_effective: str
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _tail(text: str, n: int = 5) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-n:]) or "(no output)"


def _child(args: list[str], *, what: str, target: str, timeout: float, hint: str) -> dict[str, Any]:
    """Run lite_child; return its JSON result or raise a one-line EngineCrash."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pipeline.engines.lite_child", *args]
    head = f"stage=lite {what} target={target}"
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode("utf-8", "replace") if isinstance(exc.stderr, bytes) else exc.stderr
        raise EngineCrash(f"{head}: timeout after {timeout:g}s; stderr: {_tail(err or '')}",
                          hint) from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = _tail(proc.stderr or proc.stdout)
        raise EngineCrash(f"{head}: {exit_status(proc.returncode)}; stderr: {tail}", hint)
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    resources.note_child(result.get("peak_rss_mb"))
    return result


def nb_kernels(nb_path: str | os.PathLike) -> list[tuple[str, str, int, int]]:
    """Kernel keys stored in a naive-buffer .nb: (op, alias, target enum, precision enum)."""
    data = Path(nb_path).read_bytes()
    found: set[tuple[str, str, int, int]] = set()
    for m in _KERNEL_KEY.finditer(data):
        # Keys are uint32-LE length-prefixed; checking it rejects matches inside weights. A length
        # byte that is itself alphanumeric gets swallowed by the regex, hence the 1-byte shift.
        for shift in (0, 1):
            start, key = m.start(1) + shift, m.group(1)[shift:]
            if start >= 4 and int.from_bytes(data[start - 4:start], "little") == len(key):
                op, alias, tgt, prec, _layout = key.decode().split("/")
                found.add((op, alias, int(tgt), int(prec)))
                break
    return sorted(found)


def _nb_target(nb: Path) -> str:
    # Label crash messages with the .nb's target: the most common non-host kernel target.
    names = {2: "x86", 4: "arm"}
    tgts = [names.get(k[2], str(k[2])) for k in nb_kernels(nb) if k[2] not in (0, 1, 6)]
    return max(set(tgts), key=tgts.count) if tgts else "unknown"


def _opt(model: Path, params: Path, target: str, out_prefix: Path, *, fp16: bool = False,
         quant_type: str | None = None, timeout: float = 300) -> Path:
    args = ["opt", str(model), str(params), target, str(out_prefix)]
    args += ["--fp16"] if fp16 else []
    args += ["--quant-type", quant_type] if quant_type else []
    res = _child(args, what="opt", target=target, timeout=timeout,
                 hint="check unsupported ops / program_repair; opt aborts on malformed programs")
    return Path(res["path"])


_SUPPORTED: dict[str, set[str] | None] = {}
_SUPPORTED_NOTE: dict[str, str] = {}


def supported_ops(target: str) -> set[str] | None:
    """Ops the installed opt registers for target (Opt.print_supported_ops), or None if unavailable.

    Includes 'kUnk'-only ops (fake-quant ops): passes consume them, they need no kernel.
    """
    if target not in TARGETS:
        raise ConfigError(f"unknown Lite target {target!r}; expected one of {TARGETS}")
    if target not in _SUPPORTED:
        try:
            res = _child(["supported-ops", target], what="supported-ops", target=target,
                         timeout=60, hint="op listing is optional")
            _SUPPORTED[target] = set(res["ops"])
            _SUPPORTED_NOTE[target] = f"{len(res['ops'])} ops listed by opt {res.get('version')}"
        except (EngineCrash, KeyError, ValueError) as exc:
            _SUPPORTED[target] = None
            _SUPPORTED_NOTE[target] = f"installed opt cannot list supported ops: {exc}"
    return _SUPPORTED[target]


def unsupported_ops(ops: list[str] | set[str], target: str) -> list[str]:
    """Sorted ops missing from supported_ops(target); [] when the listing is unavailable."""
    known = supported_ops(target)
    return [] if known is None else sorted(set(ops) - known - {"feed", "fetch"})


_FP16_CACHE: dict[str, tuple[bool, str]] = {}
_PROBE: list[tuple[Path, Path]] = []


def _probe_model() -> tuple[Path, Path]:
    # Built once per process (paddle import + jit.save in a child costs ~4 s), removed at exit.
    if not _PROBE:
        tmp = tempdirs.make("lite-fp16-probe")
        atexit.register(shutil.rmtree, tmp, True)
        res = _child(["make-probe", tmp], what="make-probe", target="host", timeout=180,
                     hint="the probe model is built with paddle.jit.save")
        _PROBE.append((Path(res["model_file"]), Path(res["params_file"])))
    return _PROBE[0]


def fp16_status(target: str = "arm") -> tuple[bool, str]:
    """Does the installed opt REALLY emit FP16 kernels for target? Converts a tiny model with and
    without enable_fp16() and compares the kernel precisions stored in the .nb (size barely
    moves: weights stay fp32 in the file). Cached per process and target."""
    if target not in TARGETS:
        raise ConfigError(f"unknown Lite target {target!r}; expected one of {TARGETS}")
    if target in _FP16_CACHE:
        return _FP16_CACHE[target]
    with tempdirs.directory("lite-fp16") as tmp:
        try:
            model, params = _probe_model()
            nb32 = _opt(model, params, target, Path(tmp) / "fp32", timeout=120)
            nb16 = _opt(model, params, target, Path(tmp) / "fp16", fp16=True, timeout=120)
        except EngineCrash as exc:
            return _FP16_CACHE.setdefault(target, (False, f"fp16 probe failed: {exc.message}"))
        k32, k16 = nb_kernels(nb32), nb_kernels(nb16)
        s32, s16 = nb32.stat().st_size, nb16.stat().st_size
    n16 = sum(1 for k in k16 if _PREC_NAMES.get(k[3]) == "fp16")
    if n16:
        status = (True, f"enable_fp16() produced {n16} FP16 kernel types for {target} "
                        f"({s16} vs {s32} bytes); they cannot be executed/verified on this host")
    elif k16 == k32 and s16 == s32:
        status = (False, "fp16 not supported by installed opt: enable_fp16() produced "
                         f"identical kernels/size for {target}")
    else:
        status = (False, f"fp16 not supported by installed opt: enable_fp16() produced no FP16 "
                         f"kernels for {target} ({s16} vs {s32} bytes)")
    return _FP16_CACHE.setdefault(target, status)


def convert(model_file: str | os.PathLike, params_file: str | os.PathLike,
            out_prefix: str | os.PathLike, *, target: str = "arm", precision: str = "fp32",
            timeout: float = 300, repair: bool = True) -> ConvertResult:
    """Convert to `out_prefix + '.nb'` with Lite opt in a subprocess.

    precision: fp32 | fp16 (raises Unsupported when opt cannot emit FP16 kernels) |
    int8_weight / int16_weight (weight-only, set_quant_model + set_quant_type) |
    int8 (input must already be a PaddleSlim fake-quant model; opt detects the quant ops).
    repair=True applies program_repair to a temporary copy of the program (the input is
    never modified). Written atomically: nothing appears at the final path on failure.
    """
    t0 = time.monotonic()
    model, params = _convert_inputs(model_file, params_file, target, precision)
    final = Path(str(out_prefix) + ".nb")
    final.parent.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    # Temp dir beside the final file so os.replace stays on one filesystem (atomic).
    tmp = Path(tempfile.mkdtemp(prefix=".lite-", dir=final.parent))
    try:
        nb, effective = _convert_in(tmp, model, params, target, precision, timeout, repair, notes)
        os.replace(nb, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ConvertResult(path=final, size_bytes=final.stat().st_size, target=target,
                         precision_requested=precision, precision_effective=effective,
                         notes=notes, seconds=round(time.monotonic() - t0, 3))


def _convert_inputs(model_file, params_file, target: str, precision: str) -> tuple[Path, Path]:
    """Refuse what opt would crash on or silently mislabel, before any subprocess starts."""
    if target not in TARGETS:
        raise ConfigError(f"unknown Lite target {target!r}; expected one of {TARGETS}")
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    model, params = Path(model_file), Path(params_file)
    for f in (model, params):
        if not f.is_file() or f.stat().st_size == 0:
            raise MissingArtifact(f"Lite conversion input missing or empty: {f}")
    if precision == "fp16":
        ok, reason = fp16_status(target)
        if not ok:
            raise Unsupported(reason, "report FP16 as SKIPPED; an fp32 .nb is not an fp16 one")
    return model, params


def _convert_in(tmp: Path, model: Path, params: Path, target: str, precision: str, timeout: float,
                repair: bool, notes: list[str]) -> tuple[Path, str]:
    """Repair a copy of the program, run opt in a subprocess, read the kernel precisions back from the .nb."""
    from pipeline.engines.program_repair import list_ops, repair_for_lite

    if repair:
        fixed = tmp / "model.pdmodel"
        notes += [f"repaired: {r}" for r in repair_for_lite(model, fixed)]
        model = fixed
    ops = list_ops(model)
    if precision == "int8" and not any(o.startswith(_QUANT_OP_PREFIXES) for o in ops):
        raise DataError("precision='int8' needs a PaddleSlim PTQ/QAT model with fake-quant "
                        f"ops; this program has none (ops: {', '.join(ops)})")
    missing = unsupported_ops(ops, target)
    if supported_ops(target) is None:
        notes.append(f"op support not checked: {_SUPPORTED_NOTE[target]}")
    elif missing:
        notes.append(f"ops not listed as supported on {target}: {', '.join(missing)}")
    try:
        nb = _opt(model, params, target, tmp / "out", fp16=precision == "fp16",
                  quant_type=_QUANT_TYPE.get(precision), timeout=timeout)
    except EngineCrash as exc:
        if missing:
            exc.message = f"{exc.message}; unsupported ops: {', '.join(missing)}"
            exc.args = (exc.message,)
        raise
    return nb, _effective_precision(nb, target, precision, notes)


def _effective_precision(nb: Path, target: str, precision: str, notes: list[str]) -> str:
    """What the .nb's kernels really are (never the requested label without them)."""
    kernel_precs = {_PREC_NAMES.get(k[3], str(k[3])) for k in nb_kernels(nb)}
    effective = ("fp16" if "fp16" in kernel_precs else "int8" if "int8" in kernel_precs
                 else precision if precision in _QUANT_TYPE else "fp32")
    if precision in ("fp16", "int8") and effective != precision:
        raise Unsupported(f"opt produced no {precision} kernels for target={target} "
                          f"(kernel precisions: {sorted(kernel_precs)})")
    if precision in _QUANT_TYPE:
        notes.append(f"weight-only {precision}: weights stored quantized, dequantized to "
                     "fp32 at load; kernels are fp32")
    if not fp32_nb_runs_correctly_here(target, effective):
        notes.append("not verifiable by running here: only an x86 fp32 .nb gives correct "
                     "results on this host; verify with Paddle Inference instead")
    return effective


def _check_input(x: Any, expected_shape: list[int]) -> None:
    # Lite checks neither shape nor dtype (float64 yields NaN, a wrong shape garbage or an abort)
    validate_input(x, expected_shape, "Lite")


def run(nb_path: str | os.PathLike, x: np.ndarray, *, expected_shape: list[int],
        timeout: float = 120) -> np.ndarray:
    """Run a .nb on one input in a subprocess (a LiteWorker used once); returns output 0.

    Only meaningful numerically when fp32_nb_runs_correctly_here(target) holds.
    """
    _check_input(x, expected_shape)
    nb = Path(nb_path)
    if not nb.is_file() or nb.stat().st_size == 0:
        raise MissingArtifact(f"Lite model missing or empty: {nb}")
    worker = LiteWorker(nb, timeout)
    try:
        return worker.run(np.ascontiguousarray(x))
    finally:
        worker.close()


def fp32_nb_runs_correctly_here(target: str, precision: str = "fp32") -> bool:
    """Rule: only a .nb built for this host's architecture in fp32 can be verified by running it.

    On x86, ARM and quantized .nb files run without error but output garbage (STACK.md).
    """
    from pipeline.core.capabilities import host_arch
    return precision == "fp32" and target == host_arch()


def _npy_view(body: bytearray) -> np.ndarray:
    """The array of a .npy reply, on the received bytes (np.load would copy a 370 MB rec output once more)."""
    import io

    fmt = np.lib.format
    head = io.BytesIO(bytes(body[:1 << 16]))
    version = fmt.read_magic(head)
    shape, fortran, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(head)
    if fortran or dtype.hasobject:
        return np.load(io.BytesIO(body), allow_pickle=False)
    return np.frombuffer(body, dtype, count=int(np.prod(shape)), offset=head.tell()).reshape(shape)


class LiteWorker:
    """One `lite_child serve` subprocess holding a loaded .nb: many runs pay one start (~0.6 s of Python, numpy
    and Paddle Lite imports each; the OCR system's Lite row made ~100 such calls). Lite aborts the process on
    bad input, so a crash or a timeout ends this worker with a one-line EngineCrash and the next run starts a
    fresh one."""

    def __init__(self, nb: Path, timeout: float) -> None:
        self.nb, self.timeout = nb, timeout
        self.proc: subprocess.Popen | None = None
        self._stderr = None
        self.starts = 0

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self._stderr = tempfile.TemporaryFile()        # a file, not a pipe: Lite's chatter never blocks the child
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.engines.lite_child", "serve", str(self.nb)],
                                     cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr)
        self.starts += 1
        return self.proc

    def _crash(self, what: str, kill: bool = False) -> EngineCrash:
        self.close(kill)
        self._stderr.seek(0)
        tail = _tail(self._stderr.read().decode("utf-8", "replace"))
        return EngineCrash(f"stage=lite run {self.nb.name} target={_nb_target(self.nb)}: {what}; stderr: {tail}",
                           "the .nb may be truncated/corrupt or from another Lite version")

    def _read(self, proc: subprocess.Popen, n: int, deadline: float) -> bytearray:
        import selectors

        buf, got = bytearray(n), 0       # filled in place: `bytes +=` re-copied a 68 MB rec output per 64 KiB read
        view = memoryview(buf)
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while got < n:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise self._crash(f"timeout after {self.timeout:g}s", kill=True)
                k = os.readv(proc.stdout.fileno(), [view[got:]])
                if not k:
                    rc = proc.wait()
                    raise self._crash(exit_status(rc))
                got += k
        return buf

    def run(self, x: np.ndarray) -> np.ndarray:
        import io

        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        buf = io.BytesIO()
        np.save(buf, x, allow_pickle=False)
        try:
            proc.stdin.write(len(buf.getvalue()).to_bytes(8, "little") + buf.getvalue())
            proc.stdin.flush()
        except BrokenPipeError:
            raise self._crash(exit_status(proc.wait())) from None
        deadline = time.monotonic() + self.timeout
        head = self._read(proc, 9, deadline)
        body = self._read(proc, int.from_bytes(head[1:], "little"), deadline)
        if head[:1] != b"O":
            raise self._crash(body.decode("utf-8", "replace"))
        return _npy_view(body)

    def close(self, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if kill:
                raise OSError("hung worker")
            resources.note_child(resources.hwm_mb(proc.pid))    # alive, waiting on stdin: its own peak
            proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        proc.stdout.close()


class LiteEngine(Engine):
    """A .nb behind the engine interface, run in a worker subprocess (Lite aborts on bad input).

    The effective precision is read from the kernel keys stored in the .nb, not from its name.
    Numbers are meaningful only where fp32_nb_runs_correctly_here() holds (an x86 fp32 .nb on x86).
    """

    kind = "paddle-lite"

    def __init__(self, nb_path: str | os.PathLike, input_shape: list[int], timeout: float = 120) -> None:
        super().__init__()
        self.nb = Path(nb_path)
        if not self.nb.is_file() or self.nb.stat().st_size == 0:
            raise MissingArtifact(f"Lite model missing or empty: {self.nb}")
        self.input_shape = [-1 if d is None else int(d) for d in input_shape]
        self.timeout = timeout
        precs = sorted({_PREC_NAMES.get(k[3], str(k[3])) for k in nb_kernels(self.nb)})
        self.target = _nb_target(self.nb)
        self.effective_precision = "fp16" if "fp16" in precs else "int8" if "int8" in precs else "fp32"
        self.evidence = {"nb_kernel_precisions": precs, "target": self.target}
        self.worker = LiteWorker(self.nb, timeout)
        weakref.finalize(self, self.worker.close)
        self.settings = {"subprocess": "one worker per engine, restarted after a crash", "timeout_s": timeout}
        if not fp32_nb_runs_correctly_here(self.target, self.effective_precision):
            self.notes.append("outputs are not meaningful on this host (only an x86 fp32 .nb runs correctly here)")

    def _run(self, x: np.ndarray) -> np.ndarray:
        return self.worker.run(x)

    def close(self) -> None:
        self.worker.close()

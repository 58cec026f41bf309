"""Subprocess entry point for Paddle Lite: `python -m pipeline.engines.lite_child SUBCOMMAND ...`.

Paddle Lite aborts the whole process on bad input (LOG(FATAL) -> SIGABRT, null deref -> SIGSEGV),
so every opt/predictor call lives here and the parent (pipeline.engines.lite) turns the exit
status into an EngineCrash. On success the last stdout line starting with RESULT_PREFIX holds a
JSON object; Lite itself also prints progress lines to stdout, hence the prefix.
On a handled failure: message on stderr, exit code 2.
"""

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

RESULT_PREFIX = "LITE_CHILD_RESULT "
TARGETS = ("arm", "x86")
QUANT_TYPES = ("QUANT_INT8", "QUANT_INT16")


class ChildError(Exception):
    """A failure detected before/after a Lite call (Lite's own failures kill the process)."""


def _emit(result: dict[str, Any]) -> None:
    from pipeline.core.resources import hwm_mb

    sys.stdout.flush()      # with this child's own peak: the parent's rusage cannot tell it (core/resources.py)
    print(RESULT_PREFIX + json.dumps({**result, "peak_rss_mb": hwm_mb()}), flush=True)


def cmd_opt(a: argparse.Namespace) -> dict[str, Any]:
    import paddlelite.lite as lite

    for f in (a.model_file, a.params_file):
        if not Path(f).is_file():
            raise ChildError(f"missing input file: {f}")  # Lite would abort on this
    opt = lite.Opt()
    opt.set_model_file(a.model_file)
    opt.set_param_file(a.params_file)
    opt.set_model_type("naive_buffer")
    opt.set_optimize_out(a.out_prefix)
    if a.fp16:
        # Must precede set_valid_places: called after it, the .nb is unchanged (measured).
        opt.enable_fp16()
    opt.set_valid_places(a.target)
    if a.quant_type:
        opt.set_quant_model(True)
        opt.set_quant_type(a.quant_type)
    opt.run()
    nb = Path(a.out_prefix + ".nb")
    if not nb.is_file() or nb.stat().st_size == 0:
        raise ChildError(f"opt returned but wrote no model at {nb}")
    return {"path": str(nb), "size_bytes": nb.stat().st_size}


# samples per Lite run: the whole validation slice of PP-OCRv4 rec in one run was SIGKILLed (out of memory); Lite
# holds every activation of a run at once, so the chunk follows the input's size: 8 PP-OCRv4 det pages of 736x736
# (6.5 MB each) peaked the child at 5.5 GB (issue 48); rec lines (48x320, 184 KB) still run 8 at a time
RUN_CHUNK = 8
RUN_CHUNK_BYTES = 2 * 2 ** 20


def chunk_of(sample_bytes: int) -> int:
    """Samples per Lite run for samples of this many input bytes: RUN_CHUNK, fewer for big ones, at least 1."""
    return max(1, min(RUN_CHUNK, RUN_CHUNK_BYTES // max(1, sample_bytes)))


def _read_exact(f: Any, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def cmd_serve(a: argparse.Namespace) -> dict[str, Any]:
    """Load a .nb once and answer run requests on stdin until it closes (pipeline.engines.lite.LiteWorker).

    Frames: request = 8-byte little-endian length + .npy bytes; reply = b"O" or b"E", 8-byte length, then .npy
    bytes (output 0) or a UTF-8 error. Lite prints to fd 1 itself, so the frames go out on a copy of fd 1 and
    fd 1 is pointed at stderr. A Lite abort kills this process: the parent sees end-of-file and the signal."""
    import io

    import numpy as np
    import paddlelite.lite as lite

    nb = Path(a.nb_path)
    if not nb.is_file() or nb.stat().st_size == 0:
        raise ChildError(f"missing or empty model: {nb}")
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    config = lite.MobileConfig()
    config.set_model_from_file(str(nb))
    predictor = lite.create_paddle_predictor(config)
    inp = sys.stdin.buffer
    while (head := _read_exact(inp, 8)) is not None:
        body = _read_exact(inp, int.from_bytes(head, "little"))
        if body is None:
            break
        try:
            y = _run_chunks(predictor, np.load(io.BytesIO(body), allow_pickle=False))
            del body
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(y))
            out.write(b"O" + (len(head.getvalue()) + y.nbytes).to_bytes(8, "little") + head.getvalue())
            out.write(y.data)       # the .npy body as it lies in memory: no serialized copy
        except Exception as exc:  # Python-level failures from the Lite bindings
            payload = f"{type(exc).__name__}: {exc}".encode()
            out.write(b"E" + len(payload).to_bytes(8, "little") + payload)
        out.flush()
    return {}


def _run_chunks(predictor: Any, x: Any) -> Any:
    """Output 0 for x, run chunk_of(a sample's bytes) samples at a time into one array (Lite has no memory reuse across a batch;
    a whole PP-OCRv5 rec reply held 5 copies of its 370 MB output: the list, the join, the .npy, its bytes, the
    frame)."""
    import numpy as np

    y, step = None, chunk_of(x[:1].nbytes)
    for i in range(0, len(x), step):
        predictor.get_input(0).from_numpy(np.ascontiguousarray(x[i:i + step]))
        predictor.run()
        part = predictor.get_output(0).numpy()
        if y is None:
            y = np.empty((len(x), *part.shape[1:]), part.dtype)
        y[i:i + len(part)] = part
    return y


def _capture_fd1(fn: Any) -> str:
    # print_supported_ops writes with C++ std::cout straight to fd 1: redirect the fd itself.
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            fn()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode("utf-8", "replace")


def parse_supported_ops_table(text: str) -> dict[str, list[str]]:
    """Parse opt's 'Supported OPs on ...' table: {op: [targets with a 'Y']}.

    Cells are right-aligned under the header names, so a 'Y' belongs to the header column
    whose right edge it shares.
    """
    lines = text.splitlines()
    head_i = next((i for i, ln in enumerate(lines) if ln.strip().startswith("OP_name")), None)
    if head_i is None:
        raise ChildError("no 'OP_name' header in opt's supported-ops output")
    header = lines[head_i]
    cols = [(m.group(), m.end()) for m in re.finditer(r"\S+", header)][1:]
    ops: dict[str, list[str]] = {}
    for ln in lines[head_i + 1:]:
        m = re.match(r"\s*(\S+)", ln)
        if not m:
            continue
        where = [name for name, end in cols if end - 1 < len(ln) and ln[end - 1] == "Y"]
        ops[m.group(1)] = where
    return ops


def cmd_supported_ops(a: argparse.Namespace) -> dict[str, Any]:
    import paddlelite.lite as lite

    opt = lite.Opt()
    opt.set_valid_places(a.target)
    text = _capture_fd1(opt.print_supported_ops)
    table = parse_supported_ops_table(text)
    if not table:
        raise ChildError("opt printed an empty supported-ops table")
    return {"target": a.target, "source": "paddlelite.lite.Opt.print_supported_ops",
            "version": opt.version(), "ops": table}


def cmd_make_probe(a: argparse.Namespace) -> dict[str, Any]:
    """Save a tiny conv+linear model (for fp16_status); uses paddle, not Lite."""
    import paddle

    paddle.disable_static()
    paddle.seed(0)

    class Probe(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.conv = paddle.nn.Conv2D(1, 4, 3, padding=1)
            self.fc = paddle.nn.Linear(4 * 8 * 8, 10)

        def forward(self, x: Any) -> Any:
            x = paddle.nn.functional.relu(self.conv(x))
            return self.fc(paddle.flatten(x, 1))

    prefix = str(Path(a.out_dir) / "probe")
    layer = Probe()
    layer.eval()
    # clip_extra=False keeps flatten's XShape, so opt does not need program_repair here.
    paddle.jit.save(layer, prefix, clip_extra=False,
                    input_spec=[paddle.static.InputSpec([None, 1, 8, 8], "float32", "x")])
    return {"model_file": prefix + ".pdmodel", "params_file": prefix + ".pdiparams"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.engines.lite_child")
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("opt", help="convert a .pdmodel/.pdiparams pair to a naive-buffer .nb")
    o.add_argument("model_file")
    o.add_argument("params_file")
    o.add_argument("target", choices=TARGETS)
    o.add_argument("out_prefix", help="writes OUT_PREFIX.nb")
    o.add_argument("--fp16", action="store_true")
    o.add_argument("--quant-type", choices=QUANT_TYPES, help="weight-only quantization")
    o.set_defaults(fn=cmd_opt)
    w = sub.add_parser("serve", help="load a .nb once, run the .npy frames sent on stdin (LiteWorker)")
    w.add_argument("nb_path")
    w.set_defaults(fn=cmd_serve)
    s = sub.add_parser("supported-ops", help="ops the installed opt supports for a target")
    s.add_argument("target", choices=TARGETS)
    s.set_defaults(fn=cmd_supported_ops)
    m = sub.add_parser("make-probe", help="save a tiny paddle model for the fp16 probe")
    m.add_argument("out_dir")
    m.set_defaults(fn=cmd_make_probe)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.fn(args)
    except ChildError as exc:
        print(f"lite_child {args.cmd}: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # Python-level failures from the Lite bindings
        print(f"lite_child {args.cmd}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    _emit({"ok": True, "cmd": args.cmd, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())

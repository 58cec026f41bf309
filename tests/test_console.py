"""What a person reads on the console when it is not a terminal (a file, CI, cron): plain lines, no carriage
returns, no colour codes, and nothing Paddle / oneDNN / OpenVINO / NNCF / Lite print natively (that goes to the
run's log file, runs/<name>/log/native.log)."""
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.core import capabilities as caps
from pipeline.core.console import rich_console
from tests.conftest import smoke_args

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ("native-fd1", "native-fd2", "child-native", "c-printf", "py-print")


def test_native_output_goes_to_the_log_and_ours_to_the_console(tmp_path):
    """Fds 1 and 2 of the process and of its children reach the log; the pipeline logger reaches the pipe."""
    code = textwrap.dedent(f"""
        import ctypes, logging, os, subprocess, sys
        from pipeline.core import console
        console.setup_logging()
        with console.native_output_to({str(tmp_path / "native.log")!r}, "unit"):
            os.write(1, b"native-fd1\\n"); os.write(2, b"native-fd2\\n")
            subprocess.run(["sh", "-c", "echo child-native"])
            ctypes.CDLL(None).printf(b"c-printf\\n")        # C stdio, buffered in a file: flushed before fds move back
            print("py-print")
            logging.getLogger("pipeline").info("ours-inside")
        logging.getLogger("pipeline").info("ours-after")
        print("print-after")
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    console_text = res.stdout + res.stderr
    log = (tmp_path / "native.log").read_text()
    for word in NATIVE:
        assert word in log and word not in console_text, (word, console_text, log)
    for word in ("ours-inside", "ours-after", "print-after"):
        assert word in console_text and word not in log


def test_rich_tables_are_plain_text_off_a_terminal():
    out = io.StringIO()
    rich_console(file=out, width=80).print("[bold red]FAIL[/] [green]OK[/]")
    assert out.getvalue() == "FAIL OK\n"


def _plain(text: str) -> None:
    assert "\r" not in text, "carriage return in a non-terminal log"
    assert "\x1b[" not in text, "ANSI code in a non-terminal log"


@pytest.mark.slow
def test_the_smoke_chain_log_is_plain_and_native_printouts_went_to_the_run_log(smoke_chain):
    console_text = (smoke_chain.parent.parent / "console.txt").read_text()
    _plain(console_text)
    assert "[train] epoch 3/3" in console_text and "[server] running" in console_text and "run " in console_text
    native = (smoke_chain / "log" / "native.log").read_text()
    assert all(f"==== {s} " in native for s in ("train", "export", "server", "lite", "bundle"))
    # oneDNN's bf16 pass printout ("---    marked 18 operators to bfloat16") exists only where bf16 runs
    assert "operators to bfloat16" not in console_text
    if caps.bf16_cpu_status()[0] and not os.environ.get("PIPELINE_TEST_CPU_PROFILE"):     # a simulated profile runs fp32
        assert "operators to bfloat16" in native


@pytest.mark.slow
def test_quiet_and_the_json_summary(smoke_chain, tmp_path):
    base = smoke_chain.parent.parent
    out = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", "all", *smoke_args(base), "--quiet",
                          "--summary-json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    _plain(res.stdout + res.stderr)
    assert "[train]" not in res.stderr and "up to date" not in res.stderr     # quiet: no per-stage lines
    assert "bundle self-verification" in res.stdout                            # the summary table stays
    summary = json.loads(out.read_text())
    assert summary["ok"] is True and summary["exit_code"] == 0
    assert [s["stage"] for s in summary["stages"]] == ["train", "export", "server", "lite", "bundle"]
    assert {s["status"] for s in summary["stages"]} == {"CACHED"}
    assert any(g["stage"] == "export" and g["status"] == "OK" and g["checks"] for g in summary["gates"])

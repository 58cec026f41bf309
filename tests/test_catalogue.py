"""The stage catalogue: order from declared inputs, task applicability, aliases, declared outputs; gates that
cannot be skipped; the kernel-kill report and per-stage memory (fast, no training)."""
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import catalogue, resources, supervise
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError, IntegrityError, MissingArtifact
from pipeline.core.gates import FAIL, SKIPPED, skipped
from pipeline.core.runner import Runner, Stage, StageContext, StageResult

ROOT = Path(__file__).resolve().parent.parent


def test_order_comes_from_declared_inputs():
    names = list(catalogue.stages())
    for name, stage in catalogue.stages().items():
        assert all(names.index(dep) < names.index(name) for dep in stage.inputs), name
    assert names[-1] == "system"                 # reads other runs' bundles: after every single-run stage
    assert catalogue.for_task("classification") == ["train", "export", "server", "lite", "bundle"]
    assert catalogue.for_task("recognition") == catalogue.for_task("detection") == catalogue.for_task("classification")
    assert catalogue.for_task("ocr_system") == ["system"]


def test_every_stage_module_is_registered_from_above():
    """stages/__init__.py registers each module's STAGE (the catalogue, at the bottom, never imports `stages`)."""
    import importlib
    import pkgutil

    import stages
    declared = {importlib.import_module(f"stages.{m.name}").STAGE.name for m in pkgutil.iter_modules(stages.__path__)}
    assert declared == set(catalogue.stages())
    code = "from pipeline.core import catalogue\ntry:\n    catalogue.stages()\nexcept Exception as e:\n    print(e.one_line())"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "catalogue is empty" in res.stdout and "import the `stages` package" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("asked, task, expected", [
    (["all"], "classification", ["train", "export", "server", "lite", "bundle"]),
    (["deploy"], "recognition", ["server", "lite", "bundle"]),
    (["bundle", "train"], "detection", ["train", "bundle"]),            # dependency order, not typing order
    (["train", "export", "deploy"], "classification", ["train", "export", "server", "lite", "bundle"]),
    (["all"], "ocr_system", ["system"]),
])
def test_aliases_expand_per_task(asked, task, expected):
    assert catalogue.expand(asked, task) == expected


def test_unknown_and_inapplicable_stages_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        catalogue.expand(["trian"], "classification")
    with pytest.raises(ConfigError, match="system stage does not apply to task: classification") as e:
        catalogue.expand(["system"], "classification")
    assert "train, export, server, lite, bundle" in e.value.hint


def test_a_stage_reads_another_only_through_declared_names(tmp_path):
    ctx = StageContext(cfg=None, name="server", out_dir=tmp_path, work_dir=tmp_path,
                       inputs={"train": tmp_path / "train", "lite": tmp_path / "lite"}, input_manifests={})
    assert ctx.input("train", "calib.npz") == tmp_path / "train" / "calib.npz"
    assert ctx.input("lite", "arm_fp32.nb").name == "arm_fp32.nb"           # a declared pattern (*.nb)
    with pytest.raises(MissingArtifact, match="'scratch.npz' is not a declared output of the train stage"):
        ctx.input("train", "scratch.npz")


def test_declared_outputs_exist_in_the_stage_code():
    """Every declared output name appears in its stage's source (a rename without the declaration fails here)."""
    for name, stage in catalogue.stages().items():
        src = Path(sys.modules[stage.run.__module__].__file__).read_text()
        for rel in stage.outputs:
            assert rel.split("/")[-1] in src, (name, rel)


def test_makefile_takes_stage_lists_from_the_catalogue():
    make = (ROOT / "Makefile").read_text()
    assert "pipeline run deploy" in make and "pipeline run all" in make
    assert "run server lite bundle" not in make


def _runner(tmp_path) -> Runner:
    return Runner(load_config([ROOT / "configs" / "smoke.yaml"], [f"run.root={tmp_path}"]))


@pytest.mark.parametrize("gates", [[], [skipped("x", "a row", "fp32", "accuracy", "not here")]])
def test_a_stage_without_an_executed_gate_cannot_pass(tmp_path, gates):
    stage = Stage("x", (), ("export",), "x", run=lambda ctx: StageResult())
    man = _runner(tmp_path)._manifest(stage, "fp", {}, tmp_path, StageResult(gates=list(gates)), "now", 0.1)
    assert man["status"] == FAIL
    assert any("no executed gate" in g["reason"] for g in man["gates"])
    assert all(g["status"] in (FAIL, SKIPPED) for g in man["gates"])


def test_a_stage_that_skips_its_declared_output_is_refused(tmp_path):
    stage = Stage("export", ("train",), ("export",), "export", run=lambda ctx: StageResult(),
                  outputs=("inference.pdmodel",))
    (tmp_path / "out").mkdir()
    assert catalogue.missing_outputs(stage, tmp_path / "out") == ["inference.pdmodel"]
    (tmp_path / "out" / "inference.pdmodel").write_bytes(b"x")
    assert catalogue.missing_outputs(stage, tmp_path / "out") == []


def test_the_runner_refuses_a_passing_stage_without_its_declared_output(tmp_path):
    """A stage whose gates pass but which wrote nothing it declared: ERROR with IntegrityError naming the file."""
    from pipeline.core.gates import Gate

    passing = Gate("export", "x", "fp32", "fp32", "accuracy")
    stage = Stage("export", (), ("export",), "export", outputs=("inference.pdmodel",),
                  run=lambda ctx: StageResult(gates=[passing]))
    outcome = _runner(tmp_path)._run_one(stage)
    assert outcome.status == "ERROR" and isinstance(outcome.error, IntegrityError)
    assert "inference.pdmodel" in outcome.error.message


@pytest.mark.parametrize("bound", [True, False])
def test_a_machine_bound_result_is_not_reused_on_a_cpu_with_other_kernels(tmp_path, monkeypatch, caplog, bound):
    """server/lite/bundle/system rows were gated and timed on this CPU's kernels: a result cached on a host
    with other ones (another bf16/int8/vector family, another ONEDNN_MAX_CPU_ISA) re-runs, with the change
    named; a stage whose result holds anywhere (train, export) stays cached."""
    from pipeline.core import capabilities
    from pipeline.core.gates import Gate

    runs = []

    def run(ctx):
        runs.append(capabilities.kernel_key())
        return StageResult(gates=[Gate("server", "x", "fp32", "fp32", "accuracy")])

    stage = Stage("server", (), ("server",), "deploy", run=run, machine_bound=bound)
    runner = _runner(tmp_path)
    monkeypatch.setenv(capabilities.ISA_ENV, "AVX2")
    assert runner._run_one(stage).status == "OK"
    assert runner._run_one(stage).status == "CACHED"           # same host, same kernels
    monkeypatch.setenv(capabilities.ISA_ENV, "SSE41")          # oneDNN now runs other kernels on this very CPU
    with caplog.at_level("INFO", logger="pipeline"):
        outcome = runner._run_one(stage)
    assert outcome.status == ("OK" if bound else "CACHED")
    assert len(runs) == (2 if bound else 1)
    if bound:
        assert outcome.manifest["kernels"]["onednn_isa_cap"] == "SSE41"
        assert "onednn_isa_cap AVX2 -> SSE41" in caplog.text and "re-running" in caplog.text
        # a later stage reading it from a host with other kernels is told why it is stale
        monkeypatch.setenv(capabilities.ISA_ENV, "AVX2")
        reader = Stage("lite", ("server",), ("lite",), "deploy", run=run)
        with pytest.raises(MissingArtifact, match="other CPU kernels .onednn_isa_cap SSE41 -> AVX2"):
            runner._inputs(reader)


def test_a_kernel_killed_stage_is_named(capsys):
    code = supervise.run_supervised([], cmd=[sys.executable, "-c",
                                             "import os, signal, pipeline.core.supervise as s; s.mark_stage('server'); "
                                             "os.kill(os.getpid(), signal.SIGKILL)"])
    assert code == 128 + signal.SIGKILL
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the server stage was killed (SIGKILL") and "out of memory" in err
    assert len(err.splitlines()) == 1


def test_the_real_cli_is_supervised_and_passes_exit_codes_through():
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", "trian", "-c", "configs/smoke.yaml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == ConfigError.exit_code and "did you mean 'train'" in res.stderr
    assert "Traceback" not in res.stderr


def test_peak_memory_is_per_stage():
    ok = resources.reset_peak()
    blob = bytearray(64 << 20)                      # 64 MiB touched
    blob[::4096] = b"x" * len(blob[::4096])
    rec = resources.peak_record(ok)
    del blob
    assert rec["peak_rss_mb"] >= 64
    if rec["peak_is_per_stage"]:                    # reset worked: a new stage starts from the current size
        resources.reset_peak()
        assert resources.peak_record(True)["peak_rss_mb"] < rec["peak_rss_mb"]


def test_a_child_reports_its_own_peak_not_its_parents():
    """Linux starts a child's ru_maxrss at its parent's size (the forked memory's mark survives exec): a Lite child of
    a 5.5 GB stage read 5.5 GB. The stage records the peak a child reads from its own /proc status instead."""
    import resource

    if resources.hwm_mb() is None:
        pytest.skip("no VmHWM here (not Linux)")
    resources.reset_peak()
    blob = bytearray(256 << 20)
    blob[::4096] = b"x" * len(blob[::4096])
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"ready"     # started (just after exec its mark is still 0 kB)
    own = resources.hwm_mb(child.pid)                       # alive, waiting on stdin: its own mark
    assert own, (child.poll(), Path(f"/proc/{child.pid}/status").read_text()[:200])
    resources.note_child(own)
    child.communicate(b"")
    rec = resources.peak_record(True)
    assert rec["peak_rss_mb"] >= 256 and rec["largest_child_rss_mb"] < 128
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 >= 256    # what rusage would have said
    del blob
    assert resources.reset_peak() is True and resources.peak_record(True)["largest_child_rss_mb"] is None


def _fragment(mb: int):
    """`mb` MiB of 64 KiB malloc chunks freed below one live chunk (free() cannot shrink the heap) -> its pointer."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(mb * 16)]
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    for b in blocks[:-1]:
        libc.free(b)
    return lambda: libc.free(blocks[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_goes_back_before_a_stage_and_as_training_grows():
    """What a stage freed in small malloc chunks (Paddle's CPU tensors: 3.9 GB after the v4 rec fine-tune) stays in
    the process until malloc_trim; the runner releases it before the next stage, the training loop as it grows."""
    before = resources.release_memory()
    free_last = _fragment(200)
    held = resources.rss_mb()
    after = resources.release_memory()
    free_last()
    assert held - before > 150 and after - before < 50, (before, held, after)
    guard = resources.HeapGuard(step_mb=100)
    free_last = _fragment(200)
    guard()                                         # grew by >= 100 MiB: released
    free_last()
    assert resources.rss_mb() - guard.mark < 50 and guard.mark - before < 50, (before, guard.mark)


def _train_folder(tmp_path) -> Path:
    train = tmp_path / "train-out"
    train.mkdir()
    for name, data in (("calib.npz", b"declared"), ("scratch.npz", b"undeclared"), ("manifest.json", b"{}")):
        (train / name).write_bytes(data)
    return train


def test_a_stage_cannot_open_an_undeclared_file_of_its_input(tmp_path, monkeypatch):
    """The runner limits a stage's reads of its inputs' folders to their declared outputs (and their manifests), for
    any open in the process (np.load, read_bytes, ...), not only ctx.input: the run's ERROR names the file."""
    from pipeline.core.gates import Gate

    train, runner = _train_folder(tmp_path), _runner(tmp_path)
    seen = []

    def run(ctx):
        seen.append((train / "calib.npz").read_bytes())
        seen.append((train / "manifest.json").read_bytes())
        seen.append((train / "scratch.npz").read_bytes())
        return StageResult(gates=[Gate("export", "x", "fp32", "fp32", "accuracy")])

    reader = Stage("export", ("train",), ("export",), "export", run=run)
    monkeypatch.setattr(runner, "_inputs", lambda stage: ({"train": train}, {}))
    outcome = runner._run_one(reader)
    assert seen == [b"declared", b"{}"]
    assert outcome.status == "ERROR" and isinstance(outcome.error, MissingArtifact)
    line = outcome.error.one_line()
    assert "the export stage opened 'scratch.npz' in the train stage's output" in line and "optional_outputs" in line
    assert (train / "scratch.npz").read_bytes() == b"undeclared"        # outside a stage: no limit


def test_a_stage_that_writes_an_undeclared_file_is_refused(tmp_path):
    from pipeline.core.gates import Gate

    def run(ctx):
        (ctx.out_dir / "inference.pdmodel").write_bytes(b"x")
        (ctx.out_dir / "evidence").mkdir()
        (ctx.out_dir / "evidence" / "row.txt").write_text("a crashed row's traceback: a record, not an output")
        (ctx.out_dir / "side.bin").write_bytes(b"y")
        return StageResult(gates=[Gate("export", "x", "fp32", "fp32", "accuracy")])

    stage = Stage("export", (), ("export",), "export", outputs=("inference.pdmodel",), run=run)
    outcome = _runner(tmp_path)._run_one(stage)
    assert outcome.status == "ERROR" and isinstance(outcome.error, IntegrityError)
    assert "the export stage wrote 'side.bin', which its STAGE declaration does not name" in outcome.error.message


def test_every_server_model_the_bundle_copies_is_a_declared_server_output():
    """The bundle stage reads the server's per-precision models (the OpenVINO bf16 IR with its keep list too)."""
    from pipeline.bundle import layout

    server = catalogue.stages()["server"]
    assert all(catalogue.declares(server, rel) for rel in layout.SERVER_STAGE_MODELS)
    assert catalogue.declares(server, "models/int8/model.pdiparams")           # inside a declared folder
    assert not catalogue.declares(server, "openvino/model_fp32.xml")


def test_train_is_machine_bound_only_when_bf16_amp_runs_the_cpus_kernels(monkeypatch):
    """bf16 AMP on a CPU trains on that CPU's bf16 kernels (issue 49): its cached weights are not reused on a host
    with other ones; fp32/fp16 training holds on any CPU and stays cached."""
    from pipeline.core import capabilities
    from pipeline.core.runner import fingerprint
    from stages.train import STAGE

    plain = load_config([])
    bf16 = load_config([], ["train.amp.enable=true", "train.amp.dtype=bfloat16"])
    assert not STAGE.bound_to_machine(plain) and STAGE.bound_to_machine(bf16)
    prints = {}
    for cap in ("AVX2", "AVX512_CORE_BF16"):
        monkeypatch.setenv(capabilities.ISA_ENV, cap)
        prints[cap] = (fingerprint(plain, STAGE, {}), fingerprint(bf16, STAGE, {}))
    assert prints["AVX2"][0] == prints["AVX512_CORE_BF16"][0]          # fp32/fp16: the same on any kernels
    assert prints["AVX2"][1] != prints["AVX512_CORE_BF16"][1]          # bf16: bound to the kernels it ran on

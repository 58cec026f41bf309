"""A bundle served on a CPU other than the one it was measured on (issue 29): a row whose precision this CPU runs
on other kernels (or cannot run) is never served; the choice is re-ranked among the rows that passed, by the
bundle's own interleaved ranking, or falls back to fp32, with one log line. CPUs come from tests/cpuinfo and the
capability simulation (PIPELINE_TEST_CPU_PROFILE), never from the machine the test runs on."""
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from pipeline.bundle import serving_choice as sc
from pipeline.core import capabilities as caps

CPUINFO = Path(__file__).resolve().parent / "cpuinfo"


@pytest.fixture(autouse=True)
def _no_isa_cap_from_the_host(monkeypatch):
    """The CPU here is simulated (cpuinfo files, profiles): a cap set for the whole suite (ONEDNN_MAX_CPU_ISA=AVX2)
    is not part of it. Tests that cap set it themselves."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


def _flags(name: str, profile: str = "", monkeypatch=None) -> frozenset:
    """What capabilities reports for a synthetic cpuinfo file (under an optional simulated profile)."""
    monkeypatch.setattr(caps, "CPUINFO", str(CPUINFO / name))
    monkeypatch.setenv(caps.PROFILE_ENV, profile)
    return caps.cpu_flags()


def _bundle(tmp_path: Path, built: frozenset, chosen=("openvino", "bf16"), interleaved: bool = True,
            extra: dict | None = None, cap: str | None = None) -> tuple:
    """A model bundle folder whose server stage (on a CPU with `built` flags, under ONEDNN_MAX_CPU_ISA=cap) chose
    `chosen`; p50s in ms; extra: more rows {(engine, precision): ms}."""
    rows = {("openvino", "bf16"): 2.0, ("onnxruntime", "int8"): 3.0, ("openvino", "fp32"): 4.0,
            ("onnxruntime", "fp32"): 5.0, **(extra or {})}
    base = min((r for r in rows if r[1] == "fp32"), key=rows.get)
    cands = [{"row": f"{k} {p}", "engine": k, "precision": p, "latency_ms": ms,
              "speedup_vs_fp32": round(rows[base] / ms, 3), "verdict": "chosen" if (k, p) == chosen else "slower"}
             for (k, p), ms in rows.items()]
    timing = {"how": "interleaved", "session": "abc", "rounds": 2, "candidates": len(rows)} if interleaved else None
    ranking = [{"engine": f"{k} {p}", "latency_ms": {"p50": ms}, "throughput_sps": None, "timing": timing}
               for (k, p), ms in rows.items()]
    settings = {"batch1": {"threads": 1}, "batchN": {"threads": 1}}
    serving = {"engine": chosen[0], "precision": chosen[1], "by": "latency", "settings": settings,
               "why": "fastest within budget", "fp32": {"engine": base[0], "row": f"{base[0]} fp32"},
               "candidates": cands, "ranking": ranking, "tuning": {k: settings for k in ("openvino", "onnxruntime")}}
    (tmp_path / "server" / "onnx").mkdir(parents=True)
    for f in ("model.onnx", "model_int8.onnx"):
        (tmp_path / "server" / "onnx" / f).write_bytes(b"")
    (tmp_path / "server" / "openvino").mkdir()
    (tmp_path / "server" / "openvino" / "model_bf16.xml").write_bytes(b"")     # the bf16 row's own IR
    (tmp_path / "server" / "openvino" / "model_int8.xml").write_bytes(b"")
    hw = {"cpu": "build CPU", "capabilities": {"bf16": sorted(built & caps.BF16_FLAGS),
                                               "vnni": sorted(built & caps.VNNI_FLAGS), "onednn_isa_cap": cap}}
    (tmp_path / "manifest.json").write_text(json.dumps({"hardware": hw}))
    return tmp_path, {"serving": serving}


def test_kernel_families_of_the_synthetic_cpus(monkeypatch):
    fam = {n: (sc.kernel_family("bf16", _flags(n, "", monkeypatch)), sc.kernel_family("int8", _flags(n, "", monkeypatch)))
           for n in ("intel_amx", "amd_avx512_bf16_vnni", "amd_avx2", "arm_neoverse_n1")}
    assert fam == {"intel_amx": ("amx_bf16", "amx_int8"), "amd_avx512_bf16_vnni": ("avx512_bf16", "vnni"),
                   "amd_avx2": (None, "no-vnni"), "arm_neoverse_n1": (None, "no-vnni")}
    assert sc.kernel_family("fp32", frozenset()) == "fp32"
    amx = _flags("intel_amx", "", monkeypatch)
    assert sc.kernel_refusal("fp32", amx, frozenset()) is None
    assert "lacks avx512_bf16/amx_bf16" in sc.kernel_refusal("bf16", amx, _flags("amd_avx2", "", monkeypatch))
    # AMX-measured bf16 on a CPU with avx512_bf16 only: other kernels than the gate and the timing saw
    assert "amx_bf16 bf16 kernels, this CPU runs avx512_bf16" in \
        sc.kernel_refusal("bf16", amx, _flags("amd_avx512_bf16_vnni", "", monkeypatch))
    # int8 gated without VNNI is not served where VNNI kernels would run (other numbers), nor the other way round
    assert sc.kernel_refusal("int8", _flags("amd_avx2", "", monkeypatch), _flags("amd_avx512_bf16_vnni", "", monkeypatch))
    assert sc.kernel_refusal("int8", None, frozenset()) is None          # bundles without a CPU record: as before


def test_same_cpu_serves_the_recommendation(tmp_path, monkeypatch):
    here = _flags("amd_avx512_bf16_vnni", "", monkeypatch)
    folder, cfg = _bundle(tmp_path, here)
    got = sc.runnable_choice(folder, cfg, here)
    assert (got["engine"], got["precision"], got["cpu"]) == ("openvino", "bf16", None)


def test_no_bf16_here_reranks_among_the_rows_that_passed(tmp_path, monkeypatch):
    """Measured on the AMX CPU, served there with bf16 switched off (the simulation): int8 still runs on the
    amx_int8 kernels it was gated on, so the next fastest row that passed is served."""
    folder, cfg = _bundle(tmp_path, _flags("intel_amx", "", monkeypatch))
    got = sc.runnable_choice(folder, cfg, _flags("intel_amx", "no-bf16", monkeypatch))
    assert (got["engine"], got["precision"]) == ("onnxruntime", "int8")
    assert got["cpu"].startswith("the bundle recommends openvino bf16, but this CPU lacks avx512_bf16/amx_bf16 (bf16 cannot run): "
                                 "serving onnxruntime int8 (next fastest that passed, 1.33x fp32")
    assert got["settings"] == {"batch1": {"threads": 1}, "batchN": {"threads": 1}}


def test_built_and_served_under_the_same_isa_cap_serves_the_recommendation(tmp_path, monkeypatch):
    """A bundle built under ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI CPU gated its OpenVINO int8 row on AVX2 kernels: served
    under the same cap it runs those kernels (served as recommended); without the cap OpenVINO would run VNNI
    kernels the gate never saw (re-ranked). ONNX Runtime's kernels ignore the cap."""
    here = _flags("amd_avx512_bf16_vnni", "", monkeypatch)
    folder, cfg = _bundle(tmp_path, here, chosen=("openvino", "int8"), extra={("openvino", "int8"): 1.5}, cap="AVX2")
    monkeypatch.setenv(caps.ISA_ENV, "AVX2")
    got = sc.runnable_choice(folder, cfg, here)
    assert (got["engine"], got["precision"], got["cpu"]) == ("openvino", "int8", None)
    monkeypatch.delenv(caps.ISA_ENV)
    got = sc.runnable_choice(folder, cfg, here)
    assert (got["engine"], got["precision"]) != ("openvino", "int8") and "vnni" in got["cpu"], got


def test_other_kernels_for_every_low_precision_fall_back_to_fp32(tmp_path, monkeypatch):
    folder, cfg = _bundle(tmp_path, _flags("amd_avx512_bf16_vnni", "", monkeypatch))
    for cpu, profile in (("amd_avx2", ""), ("intel_amx", ""), ("amd_avx512_bf16_vnni", "avx2")):
        got = sc.runnable_choice(folder, cfg, _flags(cpu, profile, monkeypatch))
        assert (got["engine"], got["precision"]) == ("openvino", "fp32"), (cpu, profile)     # fastest fp32 that passed
        assert "serving openvino fp32" in got["cpu"]


def test_a_ranking_not_timed_interleaved_is_not_reranked(tmp_path, monkeypatch):
    folder, cfg = _bundle(tmp_path, _flags("intel_amx", "", monkeypatch), interleaved=False)
    got = sc.runnable_choice(folder, cfg, _flags("intel_amx", "no-bf16", monkeypatch))
    assert (got["engine"], got["precision"]) == ("openvino", "fp32") and "fp32 fallback" in got["cpu"]   # record.fp32


def test_load_engine_logs_one_line_and_records_the_choice(tmp_path, monkeypatch, caplog):
    """The served engine really loads the re-ranked row, says so once, and carries what /health reports."""
    import onnx
    from onnx import TensorProto, helper

    folder, cfg = _bundle(tmp_path, _flags("intel_amx", "", monkeypatch), chosen=("openvino", "bf16"))
    cfg["serving"]["candidates"] = [c for c in cfg["serving"]["candidates"] if c["precision"] != "int8"]
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], [float(i) for i in range(16)])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]),
              str(folder / "server" / "onnx" / "model.onnx"))
    _flags("intel_amx", "no-bf16", monkeypatch)
    with caplog.at_level(logging.WARNING):
        eng = sc.load_engine(folder, cfg, threads=1, label="recognition")
    lines = [r.getMessage() for r in caplog.records if "recommends" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("recognition: the bundle recommends openvino bf16")
    assert eng.kind == "openvino" and eng.serving["precision"] == "fp32" and eng.serving["cpu"]
    eng.close()


def _model_bundle(tmp_path: Path, built: frozenset) -> Path:
    import yaml

    folder, cfg = _bundle(tmp_path, built)
    cfg.update(task="recognition", input={"shape": [-1, 3, 48, 320]}, preprocess={}, postprocess={})
    (folder / "infer_config.yaml").write_text(yaml.safe_dump(cfg))
    return folder


def test_a_part_says_what_it_serves_and_why(tmp_path, monkeypatch):
    """The system bundle's served.<part>: the recommendation as this CPU runs it, or the config's pin."""
    from pipeline.bundle.system import part_serving
    from pipeline.core.errors import ConfigError

    sub = _model_bundle(tmp_path, _flags("intel_amx", "", monkeypatch))
    got = part_serving(sub, role="recognition")
    assert (got["engine"], got["precision"], got["by"]) == ("openvino", "bf16", "recommendation")
    assert got["why"] == "fastest within budget" and got["speedup_vs_fp32"] == 2.0 and "cpu" not in got
    assert got["measured_on"]["bf16"] == ["amx_bf16", "avx512_bf16"]
    assert got["model"] == "server/openvino/model_bf16.xml"          # the IR the row was gated on
    pinned = part_serving(sub, "onnxruntime fp32", "recognition")
    assert pinned["by"] == "pinned (system.pin.recognition)" and "recommended: openvino bf16" in pinned["why"]
    with pytest.raises(ConfigError, match="onnxruntime does not serve 'bf16'"):
        part_serving(sub, "onnxruntime bf16", "recognition")
    _flags("intel_amx", "no-bf16", monkeypatch)
    moved = part_serving(sub, role="recognition")
    assert (moved["engine"], moved["precision"]) == ("onnxruntime", "int8") and "lacks avx512_bf16" in moved["cpu"]


def test_system_pin_is_checked(tmp_path, monkeypatch):
    from pipeline.bundle.system import parts_served
    from pipeline.core.config import load_config
    from pipeline.core.errors import ConfigError

    base = ["configs/ppocr_v4_system.yaml"]
    with pytest.raises(ConfigError, match="expected '<engine> <precision>'"):
        load_config(base, ["system.pin={recognition: openvino-fp32}"])
    sub = _model_bundle(tmp_path, _flags("intel_amx", "", monkeypatch))
    sc_cfg = load_config(base, ["system.pin={recognition: 'openvino fp32'}"]).system
    assert parts_served(sc_cfg, {"recognition": sub})["recognition"]["engine"] == "openvino"
    with pytest.raises(ConfigError, match="no part for"):
        parts_served(sc_cfg, {"detection": sub})
    with pytest.raises(ConfigError, match="needs system.engine: auto"):
        parts_served(load_config(base, ["system.engine=onnxruntime", "system.pin={recognition: 'openvino fp32'}"]
                                  ).system, {"recognition": sub})


def test_bench_ocr_targets_follow_the_cpu():
    """Issue 29's bench-ocr targets: 3x RapidOCR 1.4.4 on AVX-512 (1.2x elsewhere), RapidOCR 3.10 f32, and RapidOCR
    3.10 as shipped only where it ships bf16."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_ocr", Path(__file__).resolve().parent.parent / "scripts"
                                                  / "bench_ocr.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sys_ = {"ours": {"agreement": 1.0, "known": 9, "of_known": 9}, "rapid": {"ours_vs": 2.5},
            "rapid3_f32": {"ours_vs": 1.1}, "rapid3_shipped": {"ours_vs": 0.9}}
    res = {"systems": sys_, "cpu": {"avx512": True, "bf16": True}}
    got = {what.split(" (")[0]: (lim, ok) for what, _, lim, ok in bench.targets(res)}
    assert got["ours / RapidOCR 1.4.4 pages/s"] == (3.0, False) and got["ours / RapidOCR 3.10 OpenVINO f32 pages/s"] \
        == (1.0, True) and got["ours / RapidOCR 3.10 OpenVINO as shipped pages/s"] == (1.0, False)
    got = {what.split(" (")[0]: (lim, ok) for what, _, lim, ok in
           bench.targets({**res, "cpu": {"avx512": False, "bf16": False}})}
    assert got["ours / RapidOCR 1.4.4 pages/s"] == (1.2, True) and not any("as shipped" in w for w in got)
    # --passes: each pass's ratio from that pass's seconds (the first pass: new shapes; the others: repeats)
    assert bench.per_pass({"ours": [2.0, 1.0], "rapid": [4.0, 3.0]}) == {"ours": [1.0, 1.0], "rapid": [2.0, 3.0]}
    assert bench.per_pass({"rapid": [1.0]}) == {}


def test_bench_ocr_all_cores_pass_reads_blocks_side_by_side_and_judges_issue_48():
    """The all-cores pass (issue 48): after the warm-up page, blocks of one page per core, each system reading a whole
    block (lanes: at once), the first system rotating per block; the targets add "ours reads every page as at 1
    thread" and ours >= 1.1x RapidOCR 3.10 as shipped at every core on a bf16 CPU."""
    import importlib.util
    import sys

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location("bench_ocr", scripts / "bench_ocr.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(scripts))
    log = []

    class Lanes:                      # reads a block at once, 1 s per block
        def warm(self, img):
            log.append(("lanes warm", int(img[0, 0, 0])))
            return []

        def pages(self, imgs):
            log.append(("lanes", [int(i[0, 0, 0]) for i in imgs]))
            return [[] for _ in imgs], 1.0

    class OneByOne:                   # 1 s per page
        def page(self, img):
            log.append(("one", int(img[0, 0, 0])))
            return [], 1.0

    import ocr_peers
    pages = {n: np.full((4, 4, 3), k, np.uint8) for k, n in enumerate([ocr_peers.WARMUP, "a", "b", "c", "d", "e"])}
    got, t, timed = ocr_peers.interleaved_blocks({"ours": Lanes(), "peer": OneByOne()}, pages, 2)
    assert timed == ["a", "b", "c", "d", "e"] and t == {"ours": 3.0, "peer": 5.0}
    assert log == [("lanes warm", 0), ("one", 0), ("lanes", [1, 2]), ("one", 1), ("one", 2), ("one", 3),
                   ("one", 4), ("lanes", [3, 4]), ("lanes", [5]), ("one", 5)]
    assert list(got["ours"]) == list(pages)
    res = {"systems": {"ours": {"agreement": 1.0, "known": 9, "of_known": 9}, "rapid": {"ours_vs": 3.1}},
           "cpu": {"avx512": True, "bf16": True},
           "all_cores": {"cores": 2, "timed": 5, "ours_differ_from_1_thread": ["b"],
                         "systems": {"rapid3_shipped": {"ours_vs": 1.12}}}}
    got = {what: (v, lim, ok) for what, v, lim, ok in bench.targets(res)}
    assert got["ours at 2 cores: pages read as at 1 thread"] == (5.0, 6.0, False)
    assert got["ours / RapidOCR 3.10 OpenVINO as shipped pages/s, 2 cores (bf16 CPU)"] == (1.12, 1.1, True)
    assert got["ours: lines identical to the fp32 reference"][1] == 0.97


def test_bench_lowprec_times_each_passed_bundled_row_this_cpu_runs(tmp_path, monkeypatch):
    """`make bench-lowprec` pairs each low-precision row that passed and is bundled with its engine's fp32; a row
    whose kernels this CPU does not run (bf16 measured on AMX, here AVX2) is listed as not run, with the reason."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_lowprec", Path(__file__).resolve().parent.parent / "scripts"
                                                  / "bench_lowprec.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    amx = _flags("intel_amx", "", monkeypatch)
    sub, cfg = _bundle(tmp_path, amx)
    cands = cfg["serving"]["candidates"]
    next(c for c in cands if c["row"] == "onnxruntime int8")["verdict"] = "failed gate"
    got = {(k, p): why for k, p, why in bench.low_rows(sub, cfg, amx)}
    assert got == {("openvino", "bf16"): None}          # fp32 rows are the baselines, a failed row is not timed
    avx2 = _flags("amd_avx2", "", monkeypatch)
    why = bench.low_rows(sub, cfg, avx2)[0][2]
    assert "lacks avx512_bf16/amx_bf16" in why
    assert bench.batch_of(np.zeros((3, 2)), 8).shape == (8, 2) and bench.batch_of(np.zeros((3, 2)), 2).shape == (3, 2)


def test_the_system_runs_a_part_in_bf16_only_where_its_own_bf16_row_passed(tmp_path):
    """On a bf16 CPU the system's Paddle bf16 row read 5 % of the lines (the v4 recogniser's bf16 row had failed
    its own gate, or not run): a part without a passing row of that subject is not run so."""
    from pipeline.evaluation.system_engines import part_passed

    (tmp_path / "manifest.json").write_text(json.dumps({"gates": [
        {"subject": "paddle-inference bf16", "status": "FAIL"}, {"subject": "openvino bf16", "status": "OK"}]}))
    assert part_passed(tmp_path, "openvino bf16") and not part_passed(tmp_path, "paddle-inference bf16")
    assert not part_passed(tmp_path / "missing", "openvino bf16")


def test_a_system_row_is_a_candidate_when_a_part_asked_for_that_row_only_as_a_candidate(tmp_path):
    """make real-ocr on Zen 4 failed on the system's Paddle bf16 row (every part on Paddle bf16, line accuracy drop
    0.021 > 0.02) though every part's config asks for bf16 only as a serving candidate (server.roles): the system
    row inherits that role (EXCLUDED, reported, not a failed run); a row every part requires stays required."""
    from pipeline.evaluation.system_engines import system_role

    subs = {}
    for part, role in (("det", "candidate"), ("rec", "required")):
        (tmp_path / part).mkdir()
        (tmp_path / part / "manifest.json").write_text(json.dumps({"gates": [
            {"stage": "server", "subject": "paddle-inference bf16", "status": "OK", "extra": {"role": role}},
            {"stage": "server", "subject": "paddle-inference int8", "status": "OK", "extra": {"role": "required"}},
            {"stage": "lite", "subject": "paddle-inference fp16", "status": "OK", "extra": {"role": "candidate"}}]}))
        subs[part] = tmp_path / part
    assert system_role(subs, "paddle-inference bf16") == "candidate"
    assert system_role(subs, "paddle-inference int8") == "required"
    assert system_role(subs, "paddle-inference fp16") == "required"     # another stage's row does not count
    assert system_role({"det": tmp_path / "missing"}, "paddle-inference bf16") == "required"


@pytest.mark.parametrize("chosen", [("paddle-inference", "int8"), ("openvino", "bf16")])
def test_onednn_isa_cap_reranks_like_the_simulated_cpu(chosen, tmp_path, monkeypatch):
    """Issue 47 cause 13: under ONEDNN_MAX_CPU_ISA=AVX2 the serving check read CPU flags only: Paddle int8 was
    served on kernels it was never gated on (no VNNI under the cap), OpenVINO bf16 did not start. The cap holds for
    oneDNN's engines (Paddle Inference, OpenVINO), not ONNX Runtime's (MLAS): its int8 row, gated on these VNNI
    kernels, is served instead, with one line naming the cap."""
    here = _flags("amd_avx512_bf16_vnni", "", monkeypatch)
    folder, cfg = _bundle(tmp_path, here, chosen=chosen)
    monkeypatch.delenv(caps.ISA_ENV, raising=False)
    got = sc.runnable_choice(folder, cfg, here)
    assert (got["engine"], got["precision"], got["cpu"]) == (*chosen, None)        # the control: no cap, as recommended
    monkeypatch.setenv(caps.ISA_ENV, "avx2")
    assert caps.kernel_family(chosen[1], caps.engine_flags(chosen[0], here)) != caps.kernel_family(chosen[1], here)
    got = sc.runnable_choice(folder, cfg, here)
    assert (got["engine"], got["precision"]) == ("onnxruntime", "int8")
    assert f"the bundle recommends {chosen[0]} {chosen[1]}, but" in got["cpu"] and "ONEDNN_MAX_CPU_ISA" in got["cpu"]
    assert "\n" not in got["cpu"]


def test_engine_flags_follow_the_onednn_ladder(monkeypatch):
    here = _flags("intel_amx", "", monkeypatch)
    for cap, bf16, int8 in (("", "amx_bf16", "amx_int8"), ("AVX512_CORE_BF16", "avx512_bf16", "vnni"),
                            ("AVX512_CORE_VNNI", None, "vnni"), ("AVX512_CORE", None, "no-vnni"),
                            ("AVX2", None, "no-vnni"), ("NOT_AN_ISA", "amx_bf16", "amx_int8")):
        monkeypatch.setenv(caps.ISA_ENV, cap)
        flags = caps.engine_flags("openvino", here)
        assert (caps.kernel_family("bf16", flags), caps.kernel_family("int8", flags)) == (bf16, int8), cap
        assert caps.engine_flags("onnxruntime", here) == here

"""The system config: its two parts, their shared run settings, and a clear refusal before the parts exist."""
from pathlib import Path

import pytest

from pipeline.core.composite import part_configs
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_parts_share_the_system_run_settings(tmp_path):
    cfg = load_config([ROOT / "configs" / "smoke_ocr_system.yaml"],
                      [f"run.root={tmp_path}", f"bundle.root={tmp_path}/b"])
    parts = part_configs(cfg)
    assert parts["detection"].task == "detection" and parts["recognition"].task == "recognition"
    assert parts["recognition"].data.source == "pages"
    for part in parts.values():
        assert part.run_dir.parent == tmp_path and part.bundle.root == f"{tmp_path}/b" and part.run.quiet


def test_nproc_reaches_both_parts_only_when_set(tmp_path):
    """`make train NPROC=1 CONFIG=configs/ocr_system.yaml` lays out the parts' training, not the system's."""
    base = [f"run.root={tmp_path}"]
    parts = part_configs(load_config([ROOT / "configs" / "ocr_system.yaml"], base + ["train.nproc=1"]))
    assert {p.train.nproc for p in parts.values()} == {1}
    parts = part_configs(load_config([ROOT / "configs" / "ocr_system.yaml"], base))
    assert {str(p.train.nproc) for p in parts.values()} == {"auto"}
    parts = part_configs(load_config([ROOT / "configs" / "smoke_ocr_system.yaml"], base))
    assert {p.train.nproc for p in parts.values()} == {1}                # a part's own setting stays


def test_part_with_the_wrong_task_or_missing_is_refused(tmp_path):
    cfg = load_config([ROOT / "configs" / "ocr_system.yaml"], ["system.detection=configs/ocr_rec.yaml"])
    with pytest.raises(ConfigError, match="expected detection"):
        part_configs(cfg)
    cfg = load_config([ROOT / "configs" / "ocr_system.yaml"], ["system.recognition=null"])
    with pytest.raises(ConfigError, match="system.recognition is empty"):
        part_configs(cfg)
    with pytest.raises(ConfigError, match="task: ocr_system"):
        part_configs(load_config([ROOT / "configs" / "ocr_det.yaml"]))


def test_system_stage_before_the_parts_names_what_to_run(tmp_path):
    from pipeline.core.runner import Runner

    cfg = load_config([ROOT / "configs" / "smoke_ocr_system.yaml"], [f"run.root={tmp_path}"])
    [outcome] = Runner(cfg).run(["system"])
    assert outcome.status == "ERROR" and outcome.error.exit_code == 3
    assert "gated 'detection' output" in outcome.error.message
    assert "make train export deploy" in outcome.error.hint


def test_parts_run_elsewhere_in_order_and_a_failed_part_stops_the_system(tmp_path):
    """The CLI hands each part to run_part (its own process: what one model left in the heap is gone before the
    next starts); only the system stage runs in the calling process, and not after a failed part."""
    from pipeline.core.composite import run_system

    cfg = load_config([ROOT / "configs" / "smoke_ocr_system.yaml"], [f"run.root={tmp_path}"])
    calls = []

    def here(c, names, force):
        calls.append(("here", c.task, names))
        return None, 0

    def part(code):
        return lambda role, names: calls.append(("part", role, names)) or code

    assert run_system(cfg, ["all"], False, here, part(0)) == 0
    assert [c[:2] for c in calls] == [("part", "detection"), ("part", "recognition"), ("here", "ocr_system")]
    assert calls[0][2][:2] == ["train", "export"] and calls[2][2] == ["system"]
    calls.clear()
    assert run_system(cfg, ["all"], False, here, part(3)) == 3
    assert calls == [("part", "detection", calls[0][2])]


def test_opencv_threads_follow_the_engines_and_zero_means_all_cores():
    """Issue 46: OpenCV kept its own pool while the label said "1 thread"; threads 0 is "all cores" in the config,
    while cv2.setNumThreads(0) would turn OpenCV's threading off."""
    import cv2

    from pipeline.core.env import cpu_count
    from pipeline.ocr.system import set_opencv_threads

    before = cv2.getNumThreads()
    try:
        assert set_opencv_threads(1) == 1 and cv2.getNumThreads() == 1
        assert set_opencv_threads(0) == cpu_count() and cv2.getNumThreads() == cpu_count()
    finally:
        cv2.setNumThreads(before)

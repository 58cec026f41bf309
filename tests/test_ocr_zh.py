"""Chinese invoices: CJK pages from the font the config names, and the recognition chain at a realistic
head size (7020 characters + blank) through export, Paddle Inference, PTQ, Lite opt and the x86 run.
SKIPPED, with the reason, where the font is not installed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
FONT = yaml.safe_load((ROOT / "configs" / "ocr_rec_pages_zh.yaml").read_text())["data"]["fonts"][0]
pytestmark = pytest.mark.skipif(not Path(FONT).is_file(),
                                reason=f"CJK font {FONT} not installed (apt-get install fonts-wqy-microhei, "
                                       "or point data.fonts at another CJK font)")


def test_chinese_pages_use_chinese_field_keys():
    from pipeline.data.invoice_pages import KEYS_CJK, load_or_render
    from pipeline.data.labelfile import load_charset

    charset = load_charset(ROOT / "configs" / "charsets" / "zh_invoice.txt")
    assert len(charset) > 5000
    pages = load_or_render(2, 5, 320, 320, max_boxes=32, fonts=[FONT], charset=charset, max_len=12)
    texts = {t for row in pages["texts"] for t in row if t}
    assert set(KEYS_CJK.values()) <= texts
    assert any("\u4e00" <= c <= "\u9fff" for t in texts for c in t if t not in KEYS_CJK.values())
    assert all(c in charset for t in texts for c in t)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PIPELINE_OCR_E2E") != "1",
                    reason="the 7021-class chain takes minutes: run `make test-ocr`")
def test_recognition_chain_at_realistic_head_size(tmp_path):
    tiny = ["run.quiet=true", "data.num_train=256", "data.num_val=32", "train.epochs=1", "train.min_metric=0.0",
            "train.val_slice=16", "server.precisions=[fp32,int8]", "server.gates.int8.metric_delta=1.0",
            "server.gates.int8.min_agreement=0.0",
            "server.perf.repeats=3", "server.perf.batch_size=8", "server.quant.batch_size=8",
            "server.quant.batch_nums=2", "server.http.enable=false", "server.engines=[paddle-inference]",
            "server.tuning.threads=[0]", "server.tuning.rounds=1", "lite.arm=[fp32]", "bundle.samples=2",
            f"run.root={tmp_path}", f"bundle.root={tmp_path}/bundles"]
    args = [a for o in tiny for a in ("-o", o)]
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", "all", "-c", "configs/ocr_rec_pages_zh.yaml", *args],
                         cwd=ROOT, capture_output=True, text=True, env=dict(os.environ), timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "ocr_rec_zh"
    with np.load(run / "export" / "reference.npz") as z:
        assert z["outputs"].shape[-1] == 7021                      # 7020 characters + the CTC blank
    lite = json.loads((run / "lite" / "manifest.json").read_text())
    x86 = next(g for g in lite["gates"] if g["subject"] == "lite x86 fp32")
    assert x86["status"] == "OK" and x86["value"] is not None      # executed and gated, not only converted
    name = json.loads((run / "bundle" / "manifest.json").read_text())["info"]["name"]
    infer = yaml.safe_load((tmp_path / "bundles" / name / "infer_config.yaml").read_text())
    assert len(infer["postprocess"]["charset"]) == 7020 and "票" in infer["postprocess"]["charset"]

"""system: one OCR bundle from a gated detection run and a gated recognition run.

Inputs are the two parts' published bundles (artifacts of other runs, see pipeline/core/composite.py);
nothing here imports another stage. On synthetic invoice pages from a seed neither model saw,
the flow page → boxes → crops → recognition runs per engine row, and each row is gated:
  the fp32 reference chain (each part's bundle reference: Paddle Inference fp32, or ONNX Runtime fp32 at basic
  graph optimizations for a part imported from .onnx; pipeline/bundle/reference.py): line and field accuracy floors;
  int8 / bf16 / fp16 pairs from the bundles, the ONNX Runtime and OpenVINO fp32 pairs, the Lite x86 .nb
  pair, HTTP /ocr: drop vs the fp32 chain.
Then the bundle is assembled, verifies itself (hashes, both model bundles, the system on its
sample pages) and is published next to the parts' bundles.
The pages live in pipeline/ocr/system_pages.py, the rows and the choice of what /ocr serves in
pipeline/evaluation/system_*.py (its rules in pipeline/bundle/system_choice.py), the /ocr gate in
pipeline/evaluation/http_rows.py, the bundle's files in pipeline/bundle/system_write.py.
"""
from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path

from pipeline.bundle.format import write_archive
from pipeline.bundle.system_write import verify_gate, write_bundle
from pipeline.core import env
from pipeline.core.composite import part_configs
from pipeline.core.config import ROOT
from pipeline.core.errors import ConfigError
from pipeline.core.gates import FAIL, Gate, run_row
from pipeline.core.runner import Stage, StageContext, StageResult
from pipeline.evaluation.http_rows import ocr_http_row
from pipeline.evaluation.system_engines import engine_rows
from pipeline.evaluation.system_rows import Chain

log = logging.getLogger("pipeline")


def _bundle_folder(ctx: StageContext, role: str) -> Path:
    name = ctx.input_manifests[role]["info"]["name"]
    return ctx.inputs[role] / name


def _read_rows(ctx, parts: dict) -> tuple[list[Gate], Chain]:
    from pipeline.bundle.format import load_infer_config
    from pipeline.data.invoice_pages import keys_for
    from pipeline.ocr.system import SystemSpec
    from pipeline.ocr.system_pages import eval_pages, page_charset
    from pipeline.tasks.ppocr_system import flow_of

    subs = {role: _bundle_folder(ctx, role) for role in parts}
    det_cfg, rec_cfg = load_infer_config(subs["detection"]), load_infer_config(subs["recognition"])
    cls_cfg = load_infer_config(subs["classifier"]) if "classifier" in subs else None
    spec = SystemSpec.from_infer_configs(det_cfg, rec_cfg, cls_cfg, flow_of(ctx.cfg.system.model_dump()))
    charset = page_charset(parts, rec_cfg)
    pages = eval_pages(ctx.cfg, det_cfg, charset, parts)
    threads = ctx.cfg.server.threads or env.cpu_count()
    log.info("[system] reading %d pages per engine row", len(pages["images"]))
    return engine_rows(ctx, subs, spec, pages, keys_for(charset), threads)


# the system stage's phases, each checked against server.memory_budget_mb after it ran (issue 48: under 4 GB)
PHASES = ROWS_PHASE, BUNDLE_PHASE, HTTP_PHASE, VERIFY_PHASE = (
    "the engine rows and the serving choice", "writing the bundle", "the HTTP /ocr row", "the bundle's self-verification")
BUDGET_FIX = ("raise server.memory_budget_mb in the system config, or serve fewer engines (server.engines); each "
              "phase's peak is in the stage's log")


def run(ctx: StageContext) -> StageResult:
    from pipeline.evaluation.rows import MemoryBudget

    cfg, sc = ctx.cfg, ctx.cfg.system
    parts = part_configs(cfg)
    budget = MemoryBudget(cfg.server.memory_budget_mb, stage="system", phases=PHASES, fix=BUDGET_FIX)
    gates, chain = _read_rows(ctx, parts)
    _phase(budget, ROWS_PHASE)
    version = cfg.bundle.version or datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = f"{cfg.run.name}-{version}"
    root = Path(cfg.bundle.root) if Path(cfg.bundle.root).is_absolute() else ROOT / cfg.bundle.root
    if (root / name).exists():
        raise ConfigError(f"bundle {root / name} already exists; bundles are never overwritten",
                          hint="set bundle.version to a new value (or leave it null for a timestamp)")
    b = ctx.out_dir / name
    write_bundle(ctx, b, name, version, chain, gates, parts)
    _phase(budget, BUNDLE_PHASE)
    threads = cfg.server.threads or env.cpu_count()
    if sc.http_pages:
        gates.append(ocr_http_row(ctx, b, chain, threads))
        _phase(budget, HTTP_PHASE)
    gates.append(run_row("system", "bundle self-verification", "fp32", "failed checks",
                         lambda: verify_gate(b, cfg.lite.timeout, threads), ctx.out_dir / "evidence"))
    _phase(budget, VERIFY_PHASE)
    if cfg.bundle.archive:
        write_archive(b, ctx.out_dir / f"{name}.tar.gz")
    if all(g.status != FAIL for g in gates):
        from pipeline.bundle.format import publish
        publish(ctx.out_dir, name, root, cfg.bundle.archive)
    summary = {k2: chain.ref[k2] for k2 in ("line_accuracy", "field_accuracy", "lines", "fields")}
    return StageResult(gates=gates, precision={g.subject: g.precision_effective for g in gates},
                       metrics=summary, info={"bundle": str(root / name), "name": name,
                                              "archive": str(root / name) + ".tar.gz" if cfg.bundle.archive else None,
                                              "memory": budget.record()})


def _phase(budget, name: str) -> None:
    """A phase's peak RSS, logged and kept on the budget's record; past server.memory_budget_mb the stage stops
    here with one line (nothing is published: publish comes last)."""
    budget.check(name)
    if name in budget.rows:
        log.info("[system] peak RSS in %s: %.0f MB (server.memory_budget_mb %d)", name, budget.rows[name],
                 budget.budget_mb)


def _external(cfg) -> dict[str, Path]:
    return {role: part.run_dir / "bundle" for role, part in part_configs(cfg).items()}


STAGE = Stage(name="system", inputs=(), config_keys=("system", "seed", "bundle", "lite", "server"), make_target="deploy",
              machine_bound=True,     # its rows ran (gated, timed) on this CPU's kernels
              applies_to=lambda task: task == "ocr_system",
              run=run, external_inputs=_external,
              optional_outputs=("*.tar.gz", "*/*"),    # the system bundle's archive and folder, as bundle's
              description="OCR system bundle from gated detection, recognition [and direction classifier] runs, "
                          "end-to-end gates")

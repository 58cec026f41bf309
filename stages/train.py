"""train: dygraph training through the AMP API → fp32 parameters, metrics, reference outputs.

Writes: model.pdparams (the best epoch's weights, float32), info.json (labels/charset, pre/post-processing
spec), val_slice.npz (inputs, labels and the trained model's outputs: the reference every later stage is
gated on), calib.npz (INT8 calibration inputs), metrics.jsonl (per-epoch telemetry). The manifest records
requested vs effective precision. The epoch loop, checkpoints/resume and the NaN guard live in
pipeline/training/loop.py; multi-process runs in pipeline/training/distributed.py; the checks before and after
training in pipeline/training/checks.py, the reference files in reference.py, the gate in validation.py, a model
imported instead of trained (model.source) in import_run.py.
"""
from __future__ import annotations

import json

from pipeline.core import env
from pipeline.core.artifacts import atomic_write_bytes, atomic_write_text
from pipeline.core.runner import Stage, StageContext, StageResult
from pipeline.tasks import get_task
from pipeline.training import amp, checkpoint
from pipeline.training.checks import check_data, check_weights_moved, pick_device, precheck_amp, seed_everything
from pipeline.training.distributed import launch_stage
from pipeline.training.import_run import import_model, import_onnx
from pipeline.training.reference import checked_model, reference_model, write_info, write_reference
from pipeline.training.validation import validation_gate


def run(ctx: StageContext) -> StageResult:

    from pipeline.training.distributed import world
    from pipeline.training.loop import require_visualdl, train_model

    cfg = ctx.cfg
    if cfg.model.source == "onnx":
        return import_onnx(ctx)
    if cfg.model.source in ("inference", "pir"):
        return import_model(ctx)
    if cfg.train.visualdl:
        require_visualdl()                  # missing package: fail now, not after training
    task = get_task(cfg.task, cfg.section("detection")["detection"])
    seed_everything(cfg.seed)
    device = pick_device(cfg.train.device)
    _, nproc = world()
    ds = task.load_data(cfg.section("data")["data"], cfg.seed)
    check_data(cfg, ds)
    spec = task.preprocess_spec(cfg.section("data")["data"], ds.info)
    model, pretrained, first, initial, before = checked_model(cfg, task, ds, spec)
    plan = amp.plan(cfg.train.amp, device, env.capabilities())
    plan, precheck_diff = precheck_amp(cfg, model, plan, first)

    best_state, history, train_info = train_model(ctx, task, model, ds, spec, plan, device)
    moved = check_weights_moved(model, initial, best_state, cfg.train.lr)
    model, best_state, bn_info = reference_model(cfg, task, ds, spec, best_state)

    val_x, val_out, val_metrics, k = write_reference(ctx, task, model, ds, spec)
    atomic_write_bytes(ctx.out_dir / "model.pdparams", checkpoint.stable_state_bytes(best_state))
    write_info(ctx, task, ds, spec)
    atomic_write_text(ctx.out_dir / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))

    gate = validation_gate(cfg, task, model, val_x, ds, plan, val_metrics[task.primary_metric], history)
    return StageResult(
        gates=[gate],
        precision={**plan.as_record(), "device": device, "amp_precheck_max_abs_diff": precheck_diff},
        metrics={**val_metrics, **moved, **before, "epochs": len(history), "best_epoch": train_info["best_epoch"],
                 "skipped_steps": sum(h["skipped_steps"] for h in history),
                 "scaler_skipped_steps": sum(h.get("scaler_skipped_steps", 0) for h in history),
                 "nonfinite_loss_steps": sum(h.get("nonfinite_loss_steps", 0) for h in history),
                 "samples_per_s": gate.extra["samples_per_s"],
                 "train_samples": int(len(ds.train.labels)), "val_samples": int(len(ds.val.labels)),
                 "skipped_samples": int(ds.train.skipped + ds.val.skipped)},
        info={"pretrained": pretrained, "bn_recalibrated": bn_info, "device": device, "val_slice": k, "nproc": nproc, "global_batch": train_info["global_batch"],
              "per_process_batch": train_info["per_process_batch"], "lr": train_info["lr"],
              "resumed_after_epoch": train_info["resumed_after_epoch"], "checkpoint": train_info["checkpoint"]},
    )


STAGE = Stage(name="train",
              # bf16 AMP on a CPU trains on that CPU's bf16 kernels (or falls back to fp32 on one without them)
              machine_bound=lambda cfg: bool(cfg.train.amp.enable and cfg.train.amp.dtype == "bfloat16"),
              inputs=(), config_keys=("task", "seed", "data", "model", "train", "detection"),
              make_target="train", run=run, layout_keys=("train.nproc",), launcher=launch_stage,
              outputs=("info.json", "val_slice.npz", "calib.npz"),
              # trained: weights and telemetry; imported (model.source=inference): the program's files
              optional_outputs=("model.pdparams", "metrics.jsonl", "imported/inference.pdmodel",
                                "imported/inference.pdiparams", "imported/model.onnx",
                                # model.source=pir: the translated program, and the dictionary its inference.yml gave
                                "translated/inference.pdmodel", "translated/inference.pdiparams", "translated/inference.yml",
                                "charset_from_yml.txt"),
              description="AMP training on the configured task")

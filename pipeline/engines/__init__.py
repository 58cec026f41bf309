"""Inference runtimes behind one interface (`base.Engine`): Paddle Inference, ONNX Runtime, OpenVINO, Paddle Lite.

Public: `registry` (make, tune and rank engines by kind), `base` (Engine, ShapeRouted), `evidence` (what proves
a precision ran), `perf` (timing), `quant` (PaddleSlim / ONNX / NNCF int8), `onnx_export`.
Private: program parsing and repair, amp emulation, the oneDNN grid, the Lite child process.
Imports only `core`.
"""

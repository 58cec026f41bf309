"""Evaluation: the gated rows the server and system stages run, each engine and precision against the fp32
reference, tuned and timed interleaved, and the HTTP gates of what is served.

Server rows: `rows` (one gated engine row, batch sizes within the memory budget, roles, device and threads),
`timing` (thread/ir_optim tuning, speed vs fp32 measured interleaved, GFLOP/s for perf.json), `paddle_rows`
(Paddle Inference fp32/fp16/bf16/int8), `int8_advice` (which layers to skip when the int8 row fails), `onnx_rows`
(ONNX Runtime and OpenVINO), `http_rows` (the served engine's batching choice and HTTP gates: /predict and /ocr).
OCR system rows: `system_rows` (the fp32 chain and the rows gated against it), `system_engines` (one row per
engine and precision), `system_serving` (each part's row chosen on the system's pages).

Imports everything up to `serving` (its HTTP gates start the real service); never `nightly`.
"""

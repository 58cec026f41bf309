"""The deployable bundle: its `layout` (the one place that spells bundle paths), `format` (write, archive, hashes,
open), `signing`, `reference` (a bundle's fp32 reference engine: Paddle Inference, or ONNX Runtime for an ONNX
import), `verify` (open, signature, dispatch by kind) over `verify_model` and `system` (the OCR system bundle), and
which row a bundle serves (`recommend` at deploy time, `serving_choice` at load time).

Imports `core`, `engines`, `data`, `ocr`, `tasks`; never `serving` or `nightly`.
"""

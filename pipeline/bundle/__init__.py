"""The deployable bundle: its `layout` (the one place that spells bundle paths), `format` (write, archive, hashes,
open), `signing`, `reference` (a bundle's fp32 reference engine: Paddle Inference, or ONNX Runtime for an ONNX
import), `verify` (open, signature, dispatch by kind) over `verify_model` and `system` (the OCR system bundle,
written by `system_write`), and which row a bundle serves (`recommend` the rules and `recommendation` applying them
at deploy time, `system_choice` per OCR part on the system's pages, `serving_choice` at load time).

Imports `core`, `engines`, `data`, `ocr`, `tasks`; never `serving` or `nightly`.
"""

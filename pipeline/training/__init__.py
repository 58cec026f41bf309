"""Training: the loop (`loop`), checkpoints, AMP (`amp`), batch norm handling (`bn`), and the distributed launcher
(`distributed`) with its per-rank worker (`rank_worker`); what a run checks before and after it trains (`checks`),
the model it starts from and the reference files it hands on (`reference`), its verdicts (`validation`), and a model
imported instead of trained (`import_run`). Imports `core`, `engines`, `data`, `models`, `ocr`, `tasks`.
"""

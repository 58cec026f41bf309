"""Training: the loop (`loop`), checkpoints, AMP (`amp`), batch norm handling (`bn`), and the distributed launcher
(`distributed`) with its per-rank worker (`rank_worker`). Imports `core`, `data`.
"""

"""The run core: everything a stage run needs, knowing no model, engine or stage.

Public: `config` (load_config, Config, overrides, "did you mean"), `catalogue` (the stage graph: the `stages` package
registers into it from above), `runner` (fingerprints, skip, atomic stage folders, manifests, declared reads and
writes), `code_closure` (the code a stage's fingerprint covers), `session` (a command's config + run_stages), `artifacts`
(atomic writes, hashes), `gates` (checks, run_row), `errors` (the one exception family, re-exported here),
`env` / `capabilities` (versions, CPU and GPU facts), `console` (what the console shows).
Private helpers: composite, process_layout, runlock, tempdirs, resources, supervise, summary, version.
Bottom of the package order: it imports no other package of `pipeline`.
"""
from pipeline.core.errors import (ConfigError, DataError, GateFailed, IntegrityError, MissingArtifact,
                                  PipelineError)

__all__ = ["ConfigError", "DataError", "GateFailed", "IntegrityError", "MissingArtifact", "PipelineError"]

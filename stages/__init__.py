"""One module per stage; each exposes STAGE. ORDER is the chain, read by pipeline.runner.registry()."""
ORDER = ("train", "export", "server", "lite", "bundle", "system")

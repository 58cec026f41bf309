"""Bundles past one machine: `batch` reads a folder, glob or manifest of images with a bundle on Ray Data (`batch`:
the driver; `reader`: one verified bundle loaded as `serve` loads it, reading an image into one output row; `store`:
inputs, the resumable output of part files, its content-hash keys), and `kserve_deploy` writes the KServe
ServingRuntime, InferenceService and container recipe that run `serve` on a cluster.

Sits above serving (it opens bundles the way serving/app.py does) and below nightly, stages and the CLI.
"""

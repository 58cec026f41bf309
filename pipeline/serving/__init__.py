"""HTTP serving (FastAPI + uvicorn): `app` opens and verifies a bundle and assembles the routes; `predict` (/predict),
`kserve` (Open Inference Protocol v2) and `ocr_routes` (/ocr) answer requests over `http_common` (bodies, uploads,
errors, request log), `limits` (uvicorn protocol limits) and `batching` (request coalescing).

Only `app` reads a bundle: a request's path stays inside serving, engines and the part it runs (ocr or tasks).
"""

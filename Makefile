# octfm: every stage is a make target. Variables (see README, `make help`): SRC DST SOURCE CACHE LOCAL CONFIG ARGS
# CKPT RUN RUNS OUT SHARD SHARDS STRICT ZIPPED LAYOUT OCT_MANIFEST PARTICIPANTS HOST HOSTS ACCEL CHIPS NPROC NNODES
# NODE_RANK MASTER_ADDR MASTER_PORT TORCH TORCH_INDEX; the learning check's SIZE CUE SEED LABELS CURVE FINETUNE
# FT_SEEDS RESULT. `make demo` and `make test` set everything up themselves.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

ZIPPED ?= 0
zipped  = $(filter 1 true yes,$(ZIPPED))
LAYOUT ?= $(if $(zipped),zipped,plain)
layout_tag = $(if $(filter-out plain,$(LAYOUT)),_$(LAYOUT))
SRC    ?= data/demo/b2$(layout_tag)
DST    ?= data/demo/gcs$(layout_tag)
SOURCE ?= $(DST)
CACHE  ?= data/cache
LOCAL  ?= data/local_cache
CONFIG ?=
ARGS   ?=
SHARD  ?=
SHARDS ?=
STRICT ?= 0
OCT_MANIFEST ?=
PARTICIPANTS ?=
CKPT   ?=
RUN    ?=
RUNS   ?=
OUT    ?=
NPROC  ?= 1
NNODES ?= 1
NODE_RANK   ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
HOST   ?=
HOSTS  ?=

strict_flag = $(if $(filter 1 true yes,$(STRICT)),--strict)
shard_flag  = $(if $(SHARD),--shard $(SHARD)) $(if $(SHARDS),--shards $(SHARDS))
table_flags = $(if $(OCT_MANIFEST),--oct-manifest $(OCT_MANIFEST)) $(if $(PARTICIPANTS),--participants $(PARTICIPANTS))
cache_cfg   = --config $(if $(CONFIG),$(CONFIG),configs/cache.yaml)
ckpt_flag   = $(if $(CKPT),--ckpt $(CKPT))
run_flags   = $(foreach r,$(RUN) $(RUNS),--run $(r))
local_cache = $(if $(filter command line environment,$(origin LOCAL)),data.cache=$(LOCAL))
# one process, or torchrun with NPROC processes on each of NNODES nodes (DDP: gloo on CPU, nccl on CUDA; NODE_RANK,
# MASTER_ADDR and MASTER_PORT as torchrun's static rendezvous takes them); XLA runs one process per host
nodes_flags = $(if $(filter-out 1,$(NNODES)),--nnodes $(NNODES) --node_rank $(NODE_RANK) --master_addr $(MASTER_ADDR) --master_port $(MASTER_PORT))
launch      = $(if $(filter-out 1,$(NPROC) $(NNODES)),$(PY) -m torch.distributed.run $(nodes_flags) --nproc_per_node $(NPROC),$(PY))

# The torch_xla lane: its own venv outside the clone, keyed by its requirements, reused by CI.
XLA_REQ  := torch==2.9.0 torch_xla==2.9.0
XLA_KEY  := $(shell echo "$(XLA_REQ)" | sha1sum | cut -c1-10)
XLA_VENV ?= $(HOME)/.cache/octfm/xla-venv-$(XLA_KEY)
XPY      := $(XLA_VENV)/bin/python

.PHONY: help venv venv-tpu demo test test-heavy test-deps test-xla xla-venv bench results learning-check learning-check-device mirror manifest cache expand stage pretrain probe finetune leaderboard report export embed clean-demo plan wheelhouse device-check need-export need-embed need-pretrain need-plan need-expand need-stage

help:
	@echo "octfm: the commands, in the order a user runs them (README.md; docs/README.md for the rest)"
	@echo "make venv [TORCH_INDEX=<wheel index URL>]   .venv with torch==2.13.0 first, then the project (demo and test make it too)"
	@echo "make venv-tpu        on a Cloud TPU VM: uv (installed when missing), Python 3.11, torch 2.9 + torch_xla 2.9 (the tpu extra)"
	@echo "make demo            synthetic AI-READI tree -> mirror -> manifest -> cache -> smoke pretraining -> probes, leaderboard, report"
	@echo "make demo ZIPPED=1   the same with the DICOMs in per-device ZIP archives, read in place"
	@echo "make demo LAYOUT=repack   the same from a bucket packed as one research group packs theirs (tables at the root, <device>/<device>.zip)"
	@echo "make test            the test suite (real rclone, GCS emulator and S3 server on loopback)"
	@echo ""
	@echo "make mirror SRC=b2:bucket/dataset DST=gs://bucket/dataset [ARGS='--transfers 32 --checkers 64 --retries 5 --low-level-retries 20 --retries-sleep 10s']"
	@echo "make manifest SOURCE=<dataset root> [CACHE=...] [OCT_MANIFEST=<path>] [PARTICIPANTS=<path>] [CONFIG=configs/cache.yaml]"
	@echo "make cache SOURCE=... CACHE=... [CONFIG=configs/cache.yaml] [ARGS='k=v ...'] [SHARD=i/N] [STRICT=1]"
	@echo "make expand SOURCE=<zipped dataset root> DST=<folder or gs://...> [STRICT=1]"
	@echo "make report CACHE=... [RUN=runs/<name>] [OUT=report.html]   one HTML page: cache QC, curves, probes"
	@echo "make stage CACHE=gs://... LOCAL=/mnt/ssd/cache [CONFIG=<pretraining config> HOST=i HOSTS=n: one host's share] [ARGS='k=v ...']"
	@echo "make plan CONFIG=... ACCEL=tpu-v4|tpu-v5e|tpu-v5p|h100|h200 [CHIPS=N]   the batch per chip, memory, step time and chip-hours (estimate)"
	@echo "make pretrain CONFIG=configs/pretrain_smoke.yaml [LOCAL=<staged cache>] [ARGS='optim.lr=3e-4 max_steps=50'] [CKPT=...] [NPROC=8] [NNODES=n NODE_RANK=i MASTER_ADDR=host]"
	@echo ""
	@echo "make probe RUN=<runs/<name> or gs://...> | CKPT=<checkpoint> [CONFIG=configs/probe.yaml] [ARGS='device=cuda epochs=30']"
	@echo "make leaderboard RUN=<runs/<name> or gs://...> [RUNS='runs/b runs/c'] [CONFIG=configs/probe.yaml] [ARGS='max_checkpoints=8']"
	@echo "make finetune CKPT=<checkpoint or model folder> [CONFIG=configs/finetune.yaml] [ARGS='task=diabetic label_fraction=0.1'] [NPROC=2]"
	@echo "make export CKPT=<checkpoint or run> OUT=<model folder>   the EMA encoder as safetensors + config.json + model card"
	@echo "make embed CKPT=<checkpoint or run> [CACHE=...] [OUT=...]   <run>/embeddings.parquet: one row per volume, pooled embedding"
	@echo "make learning-check  [SIZE=cpu|gpu] [CUE=lesions|layers|scanners] [SEED=29] [SOURCE=<labelled root>] [LABELS=1 | CURVE=1] [FINETUNE=1 [FT_SEEDS=3]] [ARGS='max_steps=3000 --set random_draws=1']: pretrained vs random-init, a verdict line per question (CURVE: a supervised reference at 10, 25 and 100% of labels, not only 10%; --set: any CheckConfig key, check/config.py)"
	@echo "make results RESULT=runs/learning_check/<cue>/result.json   that run's line in README's Results table (docs/results.jsonl)"
	@echo ""
	@echo "Developer targets (tests beyond make test, benchmarks, a lent GPU machine):"
	@echo "make test-heavy      the heavy lane: kill -9 faults, a store going away, thousands of volumes"
	@echo "make test-xla        the torch_xla 2.9 lane on the CPU backend (own venv under ~/.cache/octfm)"
	@echo "make bench           benchmarks -> runs/bench/bench.json + bench.md [VJEPA2_SRC=<vjepa2 checkout>: the reference step beside ours]"
	@echo "make wheelhouse [VJEPA2_SRC=<checkout>]   wheels (Python 3.12) and vjepa2 for a GPU machine without network, in .device/"
	@echo "make device-check OUT=<folder>   on a lent H100/H200: the ViT-B step (eager, pred_heads 12 beside the recipe's 6, cuDNN), vjepa2 beside it, the stem conv, compiled per block, the check step, a real run, CUDA tests; each within its predicted cost and cap"
	@echo "make learning-check-device OUT=<folder> [FT_SEEDS=3 | FINETUNE=0] [SMOKE=1] [TIMEOUT=s] [ARGS='--curve']   on a lent H100/H200 (wheels from make wheelhouse): the check at GPU size (SMOKE: every stage, small)"
	@echo "make xla-venv        the torch_xla lane's own venv under ~/.cache/octfm (make test-xla makes it)"

venv: $(STAMP)

# torch first, pinned; pyproject only says torch>=2.9. From PyPI on Linux x86-64 this is a CUDA build (a GPU
# node needs nothing more); where a CPU build lies on disk (CI) pip takes that. TORCH_INDEX=<wheel index URL> picks
# another build, e.g. https://download.pytorch.org/whl/cu130 for CUDA 13 or .../whl/cpu for a CPU-only machine.
# A TPU VM's venv (make venv-tpu, marked .venv/.tpu) is uv's, with the torch the tpu extra pins beside torch_xla:
# a later change of pyproject.toml refreshes it with uv and that extra, never with pip or TORCH.
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
UV          ?= $(or $(shell command -v uv 2>/dev/null),$(HOME)/.local/bin/uv)
tpu_venv     = $(wildcard $(VENV)/.tpu)
$(STAMP): pyproject.toml
ifneq ($(tpu_venv),)
	$(UV) pip install -q --python $(PY) -e '.[tpu,test]'
else
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[test,bench]'
endif
	touch $@

# A Cloud TPU VM (its images carry Python 3.10; zarr 3.1 needs 3.11): uv brings a managed 3.11 and installs the
# project with the tpu extra (torch 2.9 + torch_xla[tpu] 2.9, as `make test-xla`).
venv-tpu:
	test -x $(UV) || curl -LsSf https://astral.sh/uv/install.sh | sh
	test -x $(PY) || $(UV) venv --python 3.11 $(VENV)
	touch $(VENV)/.tpu
	$(UV) pip install -q --python $(PY) -e '.[tpu,test]'
	touch $(STAMP)

# The demo cohort: the lesion generator with its per-eye confounders, plus an easy class cue (inner
# nuclear layer thickness, --signal) so a 150-step run's probes are above chance; cached small, on the grid
# (the phantom's anatomy is drawn relative to the volume, not in mm: docs/data.md, "Resampling").
DEMO_COHORT := --participants 40 --lesions 1 --signal 2 --other-modalities
DEMO_SHAPE  := preprocess.target_shape=[32,128,128] preprocess.resample=grid

demo: $(STAMP)
	@test -f $(SRC)/participants.tsv || $(PY) -m ingest.synth --out $(SRC) $(DEMO_COHORT) --layout $(LAYOUT)
	$(PY) -m ingest.mirror --src $(SRC) --dst $(DST)
	$(PY) -m manifests.build --source $(DST) --out $(CACHE)/sources.parquet
	$(PY) -m cache.preview --cache $(CACHE) $(cache_cfg) $(DEMO_SHAPE)
	$(PY) -m cache.build --source $(DST) --cache $(CACHE) $(cache_cfg) $(DEMO_SHAPE)
	$(PY) -m train.pretrain --config configs/pretrain_smoke.yaml data.cache=$(CACHE) data.stride=[1,1,1]
	$(PY) -m evals.probe --config configs/probe.yaml run=runs/pretrain_smoke
	$(PY) -m evals.leaderboard --config configs/probe.yaml --run runs/pretrain_smoke
	$(PY) -m report --cache $(CACHE) --run runs/pretrain_smoke
	@echo "demo: done. Open runs/pretrain_smoke/report.html. Inspect the manifest with: $(PY) -c \"import pandas as pd; print(pd.read_parquet('$(CACHE)/manifest.parquet'))\""
	@$(PY) -m check.learning_check --line runs/pretrain_smoke

# The test lanes keep compiled bytecode (in gitignored __pycache__ folders), as a default Python does: with
# PYTHONDONTWRITEBYTECODE set (some images set it), each of the light lane's ~150 Python processes compiled
# the repository's modules again, and each worker rewrote every test module (docs/testing.md).
test test-heavy test-xla: export PYTHONDONTWRITEBYTECODE :=

test: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/xla -m "not slow" -n 2 --dist worksteal --durations=15

# The heavy lane (tests marked slow): kill -9 of builds, workers and training, store outages, a full disk, gs:// checkpoints, thousands of volumes. CI runs it.
test-heavy: $(STAMP) test-deps
	$(PY) -m pytest -q --ignore=tests/xla -m slow

# Debian's chromium renders `make report` pages in the tests (headless); installed when missing (root).
test-deps:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" != 0 ]; then echo "make test-heavy: chromium is missing; as root: apt-get install -y chromium" >&2; exit 1; fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get -y -q install chromium || { apt-get -q update && apt-get -y -q install chromium; }; }

xla-venv:
	@test -f $(XLA_VENV)/.complete || { rm -rf $(XLA_VENV) && $(PYTHON) -m venv $(XLA_VENV) && \
	  $(XPY) -m pip install -q --upgrade pip && $(XPY) -m pip install -q $(XLA_REQ) && touch $(XLA_VENV)/.complete; }
	$(XPY) -m pip install -q -e '.[test]'

test-xla: xla-venv
	PJRT_DEVICE=CPU OCTFM_REQUIRE_XLA=1 $(XPY) -m pytest -q tests/xla

# The analytic memory plan of a pretraining config on an accelerator (train/plan.py); exit 1 when it does not fit.
ACCEL ?= tpu-v4
CHIPS ?=
plan: need-plan $(STAMP)
	$(PY) -m train.plan --config $(CONFIG) --accel $(ACCEL) $(if $(CHIPS),--chips $(CHIPS)) $(ARGS)

# A GPU machine lent without network: the wheels its image lacks (bench/device_wheels.txt) for its Python,
# and a copy of facebookresearch/vjepa2's src/ and app/ for the reference step, in the ignored .device/
# (plain pip download: no venv needed to fetch wheels for another machine's Python). Each device target's
# steps are bench/device_run.py's.
WHEEL_PY  ?= 3.12
wheelhouse:
	$(PYTHON) -m bench.device_run wheelhouse --python-version $(WHEEL_PY) --vjepa2 '$(VJEPA2_SRC)'

# On the GPU machine (its own python3; no venv, no network): the wheels into a temporary site folder, then the check.
DEVICE_PY ?= python3
device-check:
	@$(DEVICE_PY) -m bench.device_run device-check --out '$(OUT)' -- $(ARGS)

# On the GPU machine, as device-check: the learning check at GPU size from nothing (cohort, cache and runs under
# LC_WORK; the log, result files and the pretraining's metrics and curves copied to OUT, also when TIMEOUT=<seconds>
# cuts it short). SMOKE=1: every stage small first, one fine-tuning seed.
LC_WORK ?= /tmp/octfm-learning-check
learning-check-device:
	@$(DEVICE_PY) -m bench.device_run learning-check --out '$(OUT)' --work $(LC_WORK) --cue '$(CUE)' --seed '$(SEED)' \
	  --finetune '$(FINETUNE)' --ft-seeds '$(FT_SEEDS)' --smoke '$(SMOKE)' --timeout '$(TIMEOUT)' -- $(ARGS)

bench: $(STAMP)
	$(PY) -m bench --xla-python $(XPY) $(ARGS)

# SOURCE only when given on the command line (its default is the demo mirror): else the generated cohort
learning-check: $(STAMP)
	$(PY) -m check.learning_check $(if $(SIZE),--size $(SIZE)) $(if $(CUE),--cue $(CUE)) $(if $(SEED),--seed $(SEED)) \
		$(if $(filter-out 0,$(LABELS)),--label-efficiency) $(if $(filter-out 0,$(CURVE)),--curve) $(if $(filter-out 0,$(FINETUNE)),--finetune) $(if $(FT_SEEDS),--finetune-seeds $(FT_SEEDS)) \
		$(if $(filter command line environment,$(origin SOURCE)),--source $(SOURCE)) $(ARGS)

# README's Results table: RESULT's record into docs/results.jsonl, then the table rewritten (bench/results_table.py)
RESULT ?=
results: $(STAMP)
	$(PY) -m bench.results_table $(RESULT)

mirror: $(STAMP)
	$(PY) -m ingest.mirror --src $(SRC) --dst $(DST) $(ARGS)

# The listing, then what the cache config will make of it (cache/preview.py); exit 3 (STRICT) after the preview.
manifest: $(STAMP)
	@status=0; $(PY) -m manifests.build --source $(SOURCE) --out $(CACHE)/sources.parquet $(table_flags) $(strict_flag) \
	  || status=$$?; [ $$status = 0 ] || [ $$status = 3 ] || exit $$status; \
	  $(PY) -m cache.preview --cache $(CACHE) $(cache_cfg) $(ARGS) && exit $$status

cache: $(STAMP)
	$(PY) -m cache.build --source $(SOURCE) --cache $(CACHE) $(cache_cfg) $(shard_flag) $(table_flags) $(strict_flag) $(ARGS)

# Optional: manifest and cache read ZIP members in place. DST is required (never a default).
expand: need-expand $(STAMP)
	$(PY) -m ingest.expand --source $(SOURCE) --dst $(DST) $(strict_flag)

# HOSTS=n: host HOST's share of the training volumes and what every host reads besides, for CONFIG (train/shares.py)
stage: need-stage $(STAMP)
	$(if $(HOSTS),$(PY) -m train.shares --config $(CONFIG) --host $(HOST) --hosts $(HOSTS),$(PY) -m cache.stage) \
	  --cache $(CACHE) --local $(LOCAL) $(if $(HOSTS),$(ARGS))

report: $(STAMP)
	$(PY) -m report --cache $(CACHE) $(if $(RUN),--run $(RUN)) $(if $(OUT),--out $(OUT)) $(ARGS)

probe: $(STAMP)
	$(PY) -m evals.probe --config $(if $(CONFIG),$(CONFIG),configs/probe.yaml) $(ckpt_flag) $(if $(RUN),run=$(RUN)) $(ARGS)

finetune: $(STAMP)
	$(launch) -m evals.finetune --config $(if $(CONFIG),$(CONFIG),configs/finetune.yaml) $(ckpt_flag) $(ARGS)

leaderboard: $(STAMP)
	$(PY) -m evals.leaderboard --config $(if $(CONFIG),$(CONFIG),configs/probe.yaml) $(run_flags) $(ARGS)

# A model folder others load with train.encoder.load_encoder (safetensors + config.json + model card).
export: need-export $(STAMP)
	$(PY) -m evals.export --ckpt $(CKPT) --out $(OUT) $(if $(filter command line environment,$(origin CACHE)),--cache $(CACHE))

# One row per cached volume: the manifest's keys and the pooled embedding (resumable).
embed: need-embed $(STAMP)
	$(PY) -m evals.embed --ckpt $(CKPT) $(if $(filter command line environment,$(origin CACHE)),--cache $(CACHE)) $(if $(OUT),--out $(OUT)) $(ARGS)

# LOCAL, when given (command line or environment), is the run's cache: the folder `make stage LOCAL=...` filled
pretrain: need-pretrain $(STAMP)
	$(launch) -m train.pretrain --config $(CONFIG) $(ckpt_flag) $(local_cache) $(ARGS)

# Usage checks run before the venv is made: a missing variable is answered at once, on any checkout (exit 2).
need-export:
	$(if $(and $(CKPT),$(OUT)),,$(error make export: set CKPT=<checkpoint> and OUT=<model folder>))
need-embed:
	$(if $(CKPT),,$(error make embed: set CKPT=<checkpoint>))
need-pretrain:
	$(if $(CONFIG),,$(error make pretrain: set CONFIG=configs/<file>.yaml))
need-expand:
	$(if $(filter file,$(origin SOURCE) $(origin DST)),$(error make expand: set SOURCE=<zipped dataset root> and DST=<folder or gs://...>))
need-plan:
	$(if $(CONFIG),,$(error make plan: set CONFIG=configs/<file>.yaml ACCEL=<tpu-v4|tpu-v5e|tpu-v5p|h100|h200>))
need-stage:
	$(if $(HOSTS),$(if $(and $(CONFIG),$(HOST)),,$(error make stage HOSTS=$(HOSTS): set HOST=<this host, 0 to HOSTS-1> and CONFIG=<the pretraining config the hosts run>)))

clean-demo:
	rm -rf data/demo data/cache runs/pretrain_smoke

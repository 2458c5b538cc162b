# The two commands of the quickstart: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MAR := model_store/minilm.mar
BENCH_GPU_OUT ?= bench/results/gpu

.PHONY: serve stop test check fuzz bench bench-gpu gpu-travel loadtest soak mar clean help image test-image

help:
	@echo "make serve  - install, build the default model, start TorchServe, wait until it embeds"
	@echo "make stop   - stop TorchServe"
	@echo "make test   - install the test extras and run the whole suite"
	@echo "make check  - the unit tests only (no TorchServe, no Java): the inner loop"
	@echo "make fuzz   - schemathesis against a server it starts, from the served OpenAPI document (>= 10,000 requests)"
	@echo "make bench  - benchmark against sentence-transformers; results in bench/results/"
	@echo "make bench-gpu - the GPU path in one run (CUDA when available, else CPU mode); results in $(BENCH_GPU_OUT)/"
	@echo "make gpu-travel - what scripts/gpu_run.sh needs on a GPU machine without network, in build/gpu/ (docs/gpu.md)"
	@echo "make loadtest - Locust load test of every route (starts the server if needed); report in bench/results/"
	@echo "make soak   - 10-minute memory soak and kill -9 recovery (MiniLM); results in bench/results/"
	@echo "make mar    - (re)build the default model archive"
	@echo "make image  - build the CPU container image (podman; no registry needed); prints its size"
	@echo "make test-image - build the image, test it as the Kubernetes Deployment runs it; figures in bench/results/"
	@echo "make clean  - remove the virtual environment, archives and logs"

$(VENV)/.installed: setup.cfg pyproject.toml
	@bash scripts/bootstrap.sh "$(PYTHON)" "$(VENV)" openvino
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	@bash scripts/bootstrap.sh "$(PYTHON)" "$(VENV)" test
	@touch $@

$(MAR): $(VENV)/.installed $(shell find embedserve -name '*.py') embedserve/archive/model-config.yaml
	./build_mar.sh

$(VENV)/.installed-bench: $(VENV)/.installed
	@bash scripts/bootstrap.sh "$(PYTHON)" "$(VENV)" bench
	@touch $@

bench: $(VENV)/.installed-bench
	@bash scripts/require_java.sh
	$(PY) -m bench.run

bench-gpu: $(VENV)/.installed-bench
	$(PY) -m bench.gpu --out $(BENCH_GPU_OUT) $(BENCH_GPU_ARGS)

gpu-travel: $(VENV)/.installed
	@bash scripts/gpu_travel.sh

loadtest: $(VENV)/.installed-bench $(MAR)
	@bash scripts/require_java.sh
	$(PY) -m embedserve.scripts.loadtest $(LOADTEST_ARGS)

soak: $(VENV)/.installed-bench
	@bash scripts/require_java.sh
	$(PY) -m bench.recovery
	$(PY) -m bench.soak

mar: $(VENV)/.installed
	./build_mar.sh

serve: $(VENV)/.installed $(MAR)
	@bash scripts/require_java.sh
	@$(PY) -m embedserve.scripts.serverctl start

stop:
	@if [[ -x $(PY) ]]; then $(PY) -m embedserve.scripts.serverctl stop; else echo "nothing to stop"; fi

test: $(VENV)/.installed-test
	@bash scripts/require_java.sh
	@bash scripts/require_redis.sh
	@bash scripts/require_chromium.sh
	$(PY) -m pytest -n 2

check: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 tests/unit

# The CI fuzzer (about 200 examples per operation) at a size of over 10,000 requests; prints its summary.
FUZZ_EXAMPLES ?= 2500
fuzz: $(VENV)/.installed-test
	@bash scripts/require_java.sh
	EMBEDSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest tests/integration/test_openapi.py -q -s -p no:cacheprovider

image: $(VENV)/.installed
	@bash scripts/require_podman.sh
	@bash scripts/image/build.sh

test-image: $(VENV)/.installed-test image
	@bash scripts/require_java.sh
	EMBEDSERVE_REQUIRE_IMAGE=1 $(PY) -m pytest tests/integration/test_image.py -p no:cacheprovider
	$(PY) scripts/image/record.py

clean: stop
	rm -rf $(VENV) model_store logs .run key_file.json *.egg-info

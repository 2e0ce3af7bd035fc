# The two commands of the README: `make run` (the main job) and `make test` (the whole suite).
# `make test-fast` is the edit loop: no `slow` tests (the notebooks are slow), no doctests.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast lint docs docs-build bench clean

# Byte code. `make setup` installs with --no-compile, so Python compiles what a process imports
# when it first imports it, and keeps the result here. Where PYTHONDONTWRITEBYTECODE is set it
# could keep nothing, and every process would compile every module it imports again: measured,
# `import jaxckpt` took 5.5 s instead of 2.4 s, and collecting the suite 24 s instead of 11 s,
# in each xdist worker, notebook kernel and child process of the tests.
export PYTHONPYCACHEPREFIX := $(abspath $(VENV))/pycache
unexport PYTHONDONTWRITEBYTECODE

$(PY):
	python3 -m venv $(VENV)

# --no-compile: byte-compiling every installed module took about 90 s of CPU on 2 cores; Python
# compiles the modules a process imports, once, on first import instead (see PYTHONPYCACHEPREFIX).
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install --no-compile "torch==2.13.0"
	$(PIP) install --no-compile -e ".[torch,dev,gpu-aot,tpu-aot,docs]"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/jaxckpt compare

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# --durations: every run prints its slowest tests, so the 15-minute rule is watched where it is kept.
# --dist loadfile: a file's tests run in one worker, so what a module fixture or a cache of the
# file builds (a trained checkpoint, a traced step) is built once, not in both workers: 4% less
# CPU on tests/nn, tests/remat and two training files (470 -> 451 CPU-s, fresh compile cache).
PYTEST := TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) -m pytest -n 2 --dist loadfile --durations=25

test: lint docs-build
	$(PYTEST) --doctest-modules tests jaxckpt torch_bridge npu_backend

# The documentation site: `make docs` serves it locally; `make test` builds it with --strict.
docs-build: setup
	$(VENV)/bin/mkdocs build --strict --site-dir .site

docs: setup
	$(VENV)/bin/mkdocs serve

# The edit loop, at most 3 minutes with the compile cache warm: no `slow` test (2 s or more
# warm: the notebooks, the fault and kill rounds, the CLI runs) and no `gpu_compile` or
# `tpu_compile` test (the deviceless XLA:GPU and XLA:TPU compiles, which the persistent cache
# does not keep). No doctests either:
# they are examples. `make test` runs every one of them.
test-fast: lint
	$(PYTEST) -m "not slow and not gpu_compile and not tpu_compile" tests

# The browser tests (marker `browser`): the page `jaxckpt plan --explain --plot FILE.html` draws,
# loaded in real headless Chromium, Debian's package, installed here when it is missing (as root,
# or through sudo). `make test` runs them too where Chromium is installed and skips them, saying
# so, where it is not.
.PHONY: test-browser
test-browser: setup
	command -v chromium >/dev/null || { $$(test "$$(id -u)" = 0 || echo sudo) apt-get update && \
		$$(test "$$(id -u)" = 0 || echo sudo) apt-get install -y chromium; }
	$(PYTEST) -m browser tests/browser

# The XLA FFI attention library of npu_backend (npu_backend/ffi/build/). Rebuilds only when
# its sources change; with no C++ compiler it says so and exits 0 (the FFI tests then skip).
.PHONY: ffi
ffi: setup
	$(PY) npu_backend/ffi/build.py

test test-fast: ffi

bench: setup
	$(PY) benchmarks/speed/bench_attention.py
	$(VENV)/bin/jaxckpt compare --model small --batch 4 --seq 1024 --steps 3
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) benchmarks/speed/bench_vs_torch.py
	$(PY) benchmarks/speed/bench_planner.py
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) benchmarks/speed/bench_convert.py
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) benchmarks/speed/bench_finetune.py
	$(PY) benchmarks/speed/bench_fsdp.py
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) benchmarks/speed/bench_lora.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .site

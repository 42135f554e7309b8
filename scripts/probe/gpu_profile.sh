#!/usr/bin/env bash
# Nsight Compute profiles of the issue-24 target kernels (decode b64 x 4k bf16; e4m3 with fragments
# converted in registers, the default, and in shared memory, fp8smem; b1 x 32k bf16 and e4m3, and e4m3 on the
# opt-in occ3 decode (3 CTAs per SM); prefill 4096 wide and tall;
# MLA decode b64 x 4k,
# mla_decompress 2k): for each case, the 3rd launch of each kvkernels kernel (warm caches, warm clocks)
# with the sections that say why a kernel is slow — speed of light (DRAM and SM throughput vs peak),
# occupancy and its limiter, launch stats (registers, shared memory, waves), memory workload, warp
# stall reasons, and the source counters (the SASS / source lines with the most stall samples; the
# build has -lineinfo), then scripts/probe/ncu_hot.py's summary of the report: the warp-state samples by
# reason, source line and instruction, hottest first (it reads the report with NVIDIA's ncu_report
# module: Nsight Compute's own copy next to ncu, or a carried ncu_report wheel in .whl/). Text in
# $OUT/profile.txt; one ncu report per case in $OUT/profiles.tar.gz. Reuses the build in the tree (run after scripts/gpu_validate.sh on the warm
# machine; builds first if there is none). BUDGET seconds in all (default 150).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-150}; T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
exec > >(tee "$OUT/profile.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "== $(date -Is) ncu: ${NCU:-missing}; budget ${BUDGET}s"
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== no CUDA device: a dry run (the cases only parse and say so)"; NCU=""
elif ! python3 -c "import torch, kvkernels, sys; sys.exit(0 if torch._C._dispatch_has_kernel_for_dispatch_key('kvkernels::paged_attention', 'CUDA') else 1)" 2>/dev/null; then
  echo "== no CUDA build in the tree: building"
  TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 timeout $(( $(left) - 30 )) python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 ||
    { echo "build failed"; exit 1; }
fi
mkdir -p /tmp/ncu
if [ -n "$NCU" ]; then  # ncu_report for ncu_hot.py: next to ncu, else a carried wheel
  export PYTHONPATH="$PYTHONPATH:$(dirname "$(readlink -f "$NCU")")/extras/python"
  for w in .whl/ncu_report-*.whl; do
    [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/ncu_site "$w" &&
      export PYTHONPATH="$PYTHONPATH:/tmp/ncu_site"
  done
fi
for c in decode-bf16-b64-4k decode-e4m3-b64-4k decode-bf16-b1-32k decode-e4m3-b1-32k prefill-bf16-4k mla-decode-b64-4k mla-decompress-2k decode-e4m3-b1-32k-occ3 decode-e4m3-b64-4k-fp8smem prefill-bf16-4k-tall; do
  [ "$(left)" -lt 25 ] && { echo "== deadline: $c and later cases skipped"; break; }
  echo "== $c"
  if [ -z "$NCU" ]; then python3 scripts/probe/profile_cases.py "$c"; continue; fi
  # --clock-control none: ncu would otherwise lock the clocks to base for the run; the card's settings
  # are left as they are found (the device machine's rules), so the kernels run at the clocks the
  # benchmarks see.
  timeout -k 5 $(( $(left) - 10 )) "$NCU" --clock-control none --target-processes all --kernel-name-base demangled \
    --kernel-name 'regex:kvkernels' --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section SourceCounters \
    -o "/tmp/ncu/$c" -f python3 scripts/probe/profile_cases.py "$c" 2>&1 | grep -v "^==PROF==" | tail -5
  # The report's details as text (a report written with -o is not printed by the profiling run).
  [ -f "/tmp/ncu/$c.ncu-rep" ] && "$NCU" -i "/tmp/ncu/$c.ncu-rep" --page details 2>&1 | grep -v "^\s*$" | cut -c1-160
  [ -f "/tmp/ncu/$c.ncu-rep" ] && timeout 60 python3 scripts/probe/ncu_hot.py --top 12 "/tmp/ncu/$c.ncu-rep" 2>&1 | cut -c1-170
done
tar -czf "$OUT/profiles.tar.gz" -C /tmp ncu 2>/dev/null
echo "== done in $((SECONDS - T0))s"

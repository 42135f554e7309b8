#!/usr/bin/env bash
# Why do kvkernels' CUDA ops crash (SIGSEGV) on the GPU machine? A diagnostic command for the device tool:
# builds with host debug info, runs each case of cases.py in its own process with a native backtrace
# on a crash (segv_backtrace.c, LD_PRELOAD), symbolizes kvkernels' frames with addr2line, then, time
# permitting, a cuda-gdb backtrace of the first crashing case. Everything goes to $OUT/probe.log.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-300}; T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
exec > >(tee "$OUT/probe.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
echo "== env $(date -Is)"
for c in g++ c++ gcc /usr/bin/g++ /opt/gcc/bin/g++; do echo "$c: $(command -v $c) $($c --version 2>/dev/null | head -1)"; done
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
python3 -c "import torch; [print(l.split()[-1]) for l in open('/proc/self/maps') if 'libstdc' in l or 'libgcc_s' in l]" | sort -u
echo "== build (host -g)"
export TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 KVKERNELS_DEBUG_INFO=1
timeout 200 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; echo "build rc=$? in $((SECONDS - T0))s"
SO=$(ls kvkernels/_C*.so); ldd "$SO" | grep -E "stdc|gcc_s|cudart|torch|c10"
objdump -T "$SO" | grep -o "GLIBCXX_[0-9.]*\|CXXABI_[0-9.]*" | sort -uV | tail -3
gcc -shared -fPIC -o /tmp/segv.so scripts/probe/segv_backtrace.c || echo "segv helper: build failed"
first_crash=""
symbolize() {  # backtrace lines "path(+0xOFF)[...]" of kvkernels' .so -> function and line
  grep -o "_C[^ ]*\.so(+0x[0-9a-f]*)" "$1" | sed 's/.*(+\(0x[0-9a-f]*\))/\1/' |
    while read -r off; do echo "  $off: $(addr2line -f -C -i -e "$SO" "$off" | paste -sd' ')"; done
}
for dev in cpu cuda; do
  cases="empty_like merge merge_out merge_err reshape reshape_err gather attn attn_out"
  [ "$dev" = cpu ] && cases="merge merge_err attn"
  for c in $cases; do
    [ "$(left)" -lt 20 ] && { echo "deadline: stop"; break 2; }
    echo "== case $c $dev"
    LD_PRELOAD=/tmp/segv.so timeout 60 python3 scripts/probe/cases.py "$c" "$dev" >/tmp/case.log 2>&1
    rc=$?; grep -v "^  File\|^    " /tmp/case.log | tail -40; echo "rc=$rc"
    if grep -q "native backtrace" /tmp/case.log; then
      symbolize /tmp/case.log
      [ -z "$first_crash" ] && first_crash="$c $dev"
    fi
  done
done
# Hypothesis: the host compiler. The build used the first g++ on PATH; if the system's differs, build
# a copy of the tree with it (nvcc gets it as -ccbin through CC) and rerun the cases there.
alt=/usr/bin/g++
if [ -n "$first_crash" ] && [ -x $alt ] && [ "$(left)" -gt 100 ] &&
   [ "$($alt --version | head -1)" != "$(g++ --version | head -1)" ]; then
  echo "== alternative build with $alt ($($alt --version | head -1))"
  rm -rf /tmp/alt && mkdir /tmp/alt && git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C /tmp/alt
  (cd /tmp/alt && CC=/usr/bin/gcc CXX=$alt timeout $(( $(left) - 40 )) python3 setup.py build_ext --inplace \
     > "$OUT/build_alt.log" 2>&1; echo "alt build rc=$?")
  for c in merge merge_err gather attn; do
    echo "== alt case $c cuda"
    (cd /tmp/alt && PYTHONPATH=/tmp/alt LD_PRELOAD=/tmp/segv.so timeout 60 python3 scripts/probe/cases.py $c cuda 2>&1 |
       grep -v "^  File\|^    " | tail -12; echo "rc=${PIPESTATUS[0]}")
  done
fi
if [ -n "$first_crash" ] && [ "$(left)" -gt 60 ] && command -v cuda-gdb >/dev/null; then
  echo "== cuda-gdb: $first_crash"
  timeout -k 5 $(( $(left) - 15 )) cuda-gdb -batch -nx -ex "set pagination off" -ex "set confirm off" \
    -ex run -ex bt -ex "info registers rip rsp rdi rsi" -ex "x/8i \$pc" \
    --args python3 scripts/probe/cases.py $first_crash 2>&1 | grep -v "^\[New Thread\|^\[Thread .* exited\|^\[Detaching" | tail -80
fi
echo "== done in $((SECONDS - T0))s"

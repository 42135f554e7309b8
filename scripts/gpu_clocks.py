"""One line on the GPU's clocks while a benchmark ran, from the samples `nvidia-smi --query-gpu=...
--format=csv,noheader,nounits -lms 200` wrote (scripts/gpu_common.sh: clocks_start / clocks_stop).

Why: the first GPU run's decode kernels spent ~5 us per key tile whether 8 or 264 CTAs ran, which a
low SM clock would also explain; the card's clocks are measured as found (never set), so a benchmark
says what they were. Columns: timestamp, utilization.gpu, clocks.sm, clocks.mem, power.draw,
temperature.gpu[, clocks_event_reasons.active]. Busy samples (utilization > 0) are the ones a kernel
ran in; the event reasons (a bit mask) name why the clock was held below its maximum.

    python scripts/gpu_clocks.py clocks.csv  ->  clocks: sm 1980 MHz (min 1755, max 1980) in 42 busy ...
"""

import statistics
import sys

# nvidia-smi's clocks_event_reasons bits (nvml.h, nvmlClocksEventReason*).
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "sw power cap", 0x8: "hw slowdown", 0x10: "sync boost",
           0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake", 0x100: "display clocks"}


def parse(lines):
    """Rows of floats (None where a column says N/A) and the event-reason masks, from the CSV lines."""
    rows = []
    for line in lines:
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 6:
            continue
        try:
            util, sm, mem = float(cols[1]), float(cols[2]), float(cols[3])
        except ValueError:  # a header, an error message, "[N/A]"
            continue
        power = _number(cols[4])
        temp = _number(cols[5])
        mask = int(cols[6], 16) if len(cols) > 6 and cols[6].lower().startswith("0x") else None
        rows.append((util, sm, mem, power, temp, mask))
    return rows


def _number(text):
    try:
        return float(text)
    except ValueError:
        return None


def summary(lines) -> str:
    rows = parse(lines)
    if not rows:
        return "clocks: no samples (nvidia-smi gave none)"
    busy = [r for r in rows if r[0] > 0]
    use = busy or rows
    sm = [r[1] for r in use]
    mem = [r[2] for r in use]
    power = [r[3] for r in use if r[3] is not None]
    temp = [r[4] for r in use if r[4] is not None]
    masks = 0
    for r in use:
        masks |= r[5] or 0
    names = [name for bit, name in REASONS.items() if masks & bit and bit != 0x1]
    kind = f"{len(busy)} busy of {len(rows)} samples" if busy else f"{len(rows)} samples, none busy"
    parts = [f"clocks: sm {statistics.median(sm):.0f} MHz (min {min(sm):.0f}, max {max(sm):.0f}) in {kind}",
             f"mem {statistics.median(mem):.0f} MHz"]
    if power:
        parts.append(f"power max {max(power):.0f} W")
    if temp:
        parts.append(f"temp max {max(temp):.0f} C")
    if any(r[5] is not None for r in use):
        parts.append("held below max by: " + (", ".join(names) if names else "nothing"))
    return "; ".join(parts)


if __name__ == "__main__":
    with open(sys.argv[1], errors="replace") as f:
        print(summary(f.read().splitlines()))

"""What a run leaves behind: the table on stdout, the JSON record and the PNG plot."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from kvkernels.bench.core import CaseResult, ImplResult

SMOKE_NOTE = "quick smoke run — not a measurement"
SMOKE_BANNER = f"*** {SMOKE_NOTE} (--quick: tiny shapes, short timings) ***"
DEFAULT_OUT = Path("benchmarks/results")


def output_dir(args: argparse.Namespace) -> Path:
    """The directory a run writes to (created): ``--out``; without it ``./benchmarks/results`` for a
    measurement and, for a ``--quick`` smoke run, a new temporary directory, so that tiny-shape
    numbers never land among the measurements (or in a checkout's source tree)."""
    if args.out is not None:
        out = Path(args.out)
    elif args.quick:
        out = Path(tempfile.mkdtemp(prefix="kvkernels-bench-quick-"))
    else:
        out = DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    return out

_COLUMNS = (("case", 34, "<"), ("impl", 16, "<"), ("layers", 6, ">"), ("reps", 4, ">"), ("median", 10, ">"),
            ("min", 10, ">"), ("GB/s", 7, ">"), ("of BW", 11, ">"), ("TFLOP/s", 7, ">"), ("kvk speedup", 11, ">"),
            ("check", 0, "<"))


def _seconds(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def _number(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _check(result: ImplResult) -> str:
    if result.checked is None:
        return "-"
    if result.checked:
        return f"ok ({result.max_abs_diff:.1e})"
    return f"!!! FAILED: max |diff| {result.max_abs_diff:.2e} > {result.tolerance:g}"


def _row(cells: list[str]) -> str:
    return "  ".join(format(cell, f"{align}{width}") for cell, (_, width, align) in zip(cells, _COLUMNS)).rstrip()


def _impl_row(case: CaseResult, label: str, name: str, result: ImplResult) -> str:
    if result.skipped is not None:
        word = "!!! FAILED" if result.checked is False else "skipped"  # an error, or a choice
        return _row([label, name, str(result.layers or "-"), "-", f"{word} ({result.skipped})"])
    ours = case.impls.get("kvkernels")
    speedup = ours.speedup_vs.get(name) if ours is not None and name != "kvkernels" else None
    fraction = "-" if result.fraction is None else f"{result.fraction:.0%} {case.bandwidth_ref}"
    note = f"  [{result.note}]" if result.note else ""
    return _row([label, name, str(result.layers), str(result.reps), _seconds(result.median_s),
                 _seconds(result.min_s), _number(result.gbps, ".2f"), fraction, _number(result.tflops, ".3f"),
                 "-" if speedup is None else f"{speedup:.2f}x", _check(result) + note])


def format_table(cases: list[CaseResult], bandwidth: dict, outputs: str) -> str:
    """One row per case x implementation ('kvk speedup' = baseline time / kvkernels time), then
    the measured bandwidth, the cases' notes and ``outputs`` (where the JSON and PNG went)."""
    lines = [_row([name for name, _, _ in _COLUMNS]), _row(["-" * max(width, len(name))
                                                            for name, width, _ in _COLUMNS])]
    notes = []
    for case in cases:
        for i, (name, result) in enumerate(case.impls.items()):
            lines.append(_impl_row(case, case.name if i == 0 else "", name, result))
        if case.note and case.note not in notes:
            notes.append(case.note)
    failed = [f"{case.name} / {name}" for case in cases for name, r in case.impls.items() if r.checked is False]
    lines += ["", f"measured bandwidth: read {bandwidth['read']:.1f} GB/s ({bandwidth['read_method']}), "
                  f"copy {bandwidth['copy']:.1f} GB/s (read + write bytes), "
                  f"buffers of {bandwidth['buffer_bytes'] / 2**20:.0f} MiB, {bandwidth['threads']} threads"]
    lines += [f"note: {note}" for note in notes]
    lines.append(outputs)
    if failed:
        lines += ["", "!!! FAILED (wrong output, or the call raised): " + ", ".join(failed)]
    return "\n".join(lines)


def _finite(value):
    """JSON has no inf/NaN (a NaN in a checked output gives an infinite difference): write null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, header: dict, bandwidth: dict, cases: list[CaseResult]) -> None:
    record = dict(header, bandwidth_gbps=bandwidth, cases=[asdict(case) for case in cases])
    path.write_text(json.dumps(_finite(record), indent=1, allow_nan=False) + "\n")


def write_plot(path: Path, cases: list[CaseResult], bandwidth: dict, title: str) -> Optional[str]:
    """Decode: GB/s of KV read against context (log-log), a grid of batch (rows) x dtype (columns),
    one line per implementation and the measured read bandwidth dashed. Below, the other
    memory-bound cases: % of the measured bandwidth, kvkernels next to its baseline. Returns why no
    PNG was written, or None."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: pip install matplotlib"
    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    decode = [c for c in cases if c.kind == "decode"]
    others = [c for c in cases if c.kind != "decode" and c.bandwidth_ref is not None]
    if not decode and not others:
        return "no memory-bound case to plot"
    dtypes = list(dict.fromkeys(c.dtype for c in decode))
    batches = sorted({c.batch for c in decode})
    rows, cols = len(batches) + (1 if others else 0), max(len(dtypes), 1)
    width = max(4.2 * cols, 1.6 * len(others))  # room for every bar label
    fig = plt.figure(figsize=(width, 3.4 * rows + (0.8 if others else 0)), constrained_layout=True)
    grid = fig.add_gridspec(rows, cols)
    for r, batch in enumerate(batches):
        for c, dtype in enumerate(dtypes):
            ax = fig.add_subplot(grid[r, c])
            _decode_panel(ax, [x for x in decode if x.batch == batch and x.dtype == dtype], bandwidth["read"])
            ax.set_title(f"decode {dtype}, batch {batch}", fontsize=10)
            if r == 0 and c == 0:  # the same lines everywhere: one legend is enough
                ax.legend(fontsize=7)
    if others:
        _bars_panel(fig.add_subplot(grid[rows - 1, :]), others)
    fig.suptitle(title)
    fig.savefig(path, dpi=110, metadata={"Title": title})
    plt.close(fig)
    return None


_COLORS = {"kvkernels": "C0", "gather+sdpa": "C1", "sdpa-contiguous": "C2"}


def _decode_panel(ax, cases: list[CaseResult], read_gbps: float) -> None:
    contexts = sorted({case.context for case in cases})
    for name, color in _COLORS.items():
        points = [(case.context, case.impls[name].gbps) for case in cases
                  if name in case.impls and case.impls[name].gbps is not None]
        if points:
            ax.plot(*zip(*sorted(points)), marker="o", color=color, label=name,
                    zorder=3 if name == "kvkernels" else 2)  # ours on top where lines overlap
    ax.axhline(read_gbps, linestyle="--", color="gray", label=f"measured read {read_gbps:.0f} GB/s")
    # Log y: scalar and SIMD kernels, fp8 and fp32 differ by orders of magnitude.
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("GB/s of KV read")
    ax.grid(alpha=0.3)


def _bars_panel(ax, cases: list[CaseResult]) -> None:
    labels = []
    for x, case in enumerate(cases):
        baselines = [name for name in case.impls if name != "kvkernels"]
        labels.append(case.name.replace(" ", "\n") + "".join(f"\nvs {name}" for name in baselines))
        for offset, name in ((-0.2, "kvkernels"), *((0.2, name) for name in baselines[:1])):
            fraction = case.impls[name].fraction
            if fraction is not None:
                ax.bar(x + offset, 100 * fraction, width=0.4, color="C0" if name == "kvkernels" else "C7")
    ax.axhline(100, linestyle="--", color="gray")
    ax.set_xticks(range(len(cases)), labels, fontsize=7)
    ax.set_ylabel("% of measured bandwidth\n(read or copy, see table)")
    ax.set_title("other memory-bound cases: kvkernels (blue) and the PyTorch baseline (gray)", fontsize=10)

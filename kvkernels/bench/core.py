"""What every benchmark case shares: the run's settings, result records, timing with layer
rotation, the baseline time limit, and cache filling."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from kvkernels.reference import quantize_fp8

# Cache dtypes of the benchmarks, by the names the CLI takes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp8_e4m3": torch.float8_e4m3fn}
GIB = 1 << 30
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Loose tolerances of the one-off output check (max abs difference against a float32 computation).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float8_e4m3fn: 2e-2}
# Random values drawn per fill; larger tensors repeat the chunk (drawing every element costs
# seconds per GiB and the values do not change any timing).
_FILL_CHUNK = 1 << 24


@dataclass
class Settings:
    """What the cases need to know about the run (from the command line and the machine)."""

    min_time: float
    rotate_bytes: int  # total size the rotated copies of a case's data must reach; 0: no rotation
    memory_budget: int  # bytes a case may hold at once, baselines included
    baselines: bool
    max_baseline_seconds: float
    step: Callable[[str], None] = lambda label: None  # progress: the implementation being timed
    # Best GB/s seen per (kind, dtype, implementation): predicts a baseline's time on a bigger case.
    best_gbps: dict = field(default_factory=dict)
    # (call, min_time, limit_s) -> (Timing, first result); None: ``measure`` (the host clock).
    timer: Optional[Callable] = None


@dataclass
class ImplResult:
    """One implementation of one case. ``layers``: independent copies of the data it rotated through."""

    layers: int = 1
    median_s: Optional[float] = None
    min_s: Optional[float] = None
    reps: int = 0
    gbps: Optional[float] = None
    fraction: Optional[float] = None  # of the measured read or copy bandwidth (case.bandwidth_ref)
    tflops: Optional[float] = None
    speedup_vs: dict = field(default_factory=dict)  # kvkernels only: baseline seconds / ours
    checked: Optional[bool] = None  # output check passed (None: not checked)
    max_abs_diff: Optional[float] = None
    tolerance: Optional[float] = None
    skipped: Optional[str] = None  # the reason, when it was not timed
    note: str = ""


@dataclass
class CaseResult:
    name: str
    kind: str  # decode | prefill | copy_blocks | reshape_and_cache | gather_kv | merge | mla_decode
    dtype: str
    batch: Optional[int]
    context: Optional[int]
    bytes: int  # bytes one call must move: the same count for every implementation
    bandwidth_ref: Optional[str]  # "read" | "copy": the measured bandwidth it is compared with
    flops: Optional[int] = None
    check_reference: str = ""  # what the outputs were compared with
    note: str = ""
    impls: dict = field(default_factory=dict)  # implementation name -> ImplResult


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def num_layers(layer_bytes: int, settings: Settings) -> int:
    """Copies of one case's data that together reach ``rotate_bytes`` (>= 2x the last-level cache).

    A single small cache would stay in the LLC between calls and look faster than memory; a model
    reads a different layer's cache on each call, which is what rotating through copies emulates.
    """
    if settings.rotate_bytes <= 0:
        return 1
    return max(1, math.ceil(settings.rotate_bytes / layer_bytes))


def copies_that_fit(wanted: int, layer_bytes: int, available: int) -> int:
    """At most ``wanted`` copies within ``available`` bytes (0: not even one fits)."""
    return max(0, min(wanted, available // layer_bytes))


def fill_random(t: torch.Tensor, gen: torch.Generator, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Fill contiguous ``t`` with N(0, 1) values, quantized with ``scale`` for fp8 dtypes.

    Every page gets written: untouched memory reads as the kernel's shared zero page, which sits
    in the cache and would inflate every bandwidth number.
    """
    flat = t.view(-1)
    chunk = torch.randn(min(flat.numel(), _FILL_CHUNK), generator=gen)
    chunk = quantize_fp8(chunk, scale, t.dtype) if is_fp8(t.dtype) else chunk.to(t.dtype)
    for start in range(0, flat.numel(), chunk.numel()):
        piece = flat[start:start + chunk.numel()]
        piece.copy_(chunk[:piece.numel()])
    return t


@dataclass
class Timing:
    median_s: float
    min_s: float
    reps: int
    note: str = ""


def measure(call: Callable[[int], Any], min_time: float, limit_s: Optional[float] = None,
            max_reps: int = 50) -> tuple[Timing, Any]:
    """Time ``call(i)`` (the i-th call; the callee rotates its data copies by i) with perf_counter.

    Warmup: 2 calls, or 1 when the first takes over 0.1 s (its cold start is then noise). Then at
    least 3 timed calls and at least ``min_time`` seconds, at most ``max_reps`` calls. If the first
    call already exceeds ``limit_s``, it is the only measurement. Returns the timing and the first
    call's result (computed on copy 0, for the output check).
    """
    start = time.perf_counter()
    first = call(0)
    first_s = time.perf_counter() - start
    if limit_s is not None and first_s > limit_s:
        return Timing(first_s, first_s, 1, f"1 call only: it took {first_s:.1f} s "
                                           f"> --max-baseline-seconds {limit_s:g}"), first
    index = 1
    if first_s <= 0.1:
        call(index)
        index += 1
    times: list[float] = []
    while len(times) < max_reps and (len(times) < 3 or sum(times) < min_time):
        start = time.perf_counter()
        call(index)
        times.append(time.perf_counter() - start)
        index += 1
    return Timing(statistics.median(times), min(times), len(times)), first


def run_impl(case: CaseResult, name: str, call: Callable[[int], Any], layers: int, settings: Settings, *,
             baseline: bool, verify: Optional[Callable[[Any], float]] = None,
             tolerance: float = 0.0) -> None:
    """Time one implementation of ``case`` and record it under ``name``.

    Baselines are skipped (with the reason recorded) when their predicted time per call exceeds
    ``--max-baseline-seconds``; ``verify(first_result)`` returns the max abs difference against the
    case's reference. An implementation that raises is recorded as failed, and the run goes on.
    ``settings.timer`` measures (``measure``: host clock; the CUDA benchmark uses CUDA events).
    """
    settings.step(name)
    result = case.impls[name] = ImplResult(layers=layers)
    limit = settings.max_baseline_seconds if baseline else None
    key = (case.kind, case.dtype, name)
    if limit is not None and key in settings.best_gbps:
        predicted = case.bytes / (settings.best_gbps[key] * 1e9)
        if predicted > limit:
            result.skipped = (f"predicted {predicted:.1f} s per call from earlier cases "
                              f"> --max-baseline-seconds {limit:g}")
            return
    try:
        timing, first = (settings.timer or measure)(call, settings.min_time, limit)
    except Exception as error:  # noqa: BLE001  (one broken implementation must not end a long run)
        result.skipped = f"raised {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        result.checked = False  # counted as a failure: loud in the table, exit code 1
        return
    result.median_s, result.min_s, result.reps, result.note = (timing.median_s, timing.min_s, timing.reps,
                                                               timing.note)
    settings.best_gbps[key] = max(settings.best_gbps.get(key, 0.0), case.bytes / timing.median_s / 1e9)
    if verify is not None:
        result.max_abs_diff = verify(first)
        result.tolerance = tolerance
        result.checked = result.max_abs_diff <= tolerance


def skip(case: CaseResult, names: tuple[str, ...], reason: str, layers: int = 0) -> None:
    """Record ``names`` as skipped with ``reason``: a result is never silently missing."""
    for name in names:
        case.impls[name] = ImplResult(layers=layers, skipped=reason)


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max |actual - expected| in float32; NaN anywhere counts as an infinite difference."""
    diff = (actual.float() - expected.float()).abs()
    if diff.numel() == 0:
        return 0.0
    return float("inf") if diff.isnan().any() else float(diff.max())


def finalize(case: CaseResult, bandwidth: dict[str, float]) -> None:
    """Derived numbers: GB/s, fraction of the measured bandwidth, TFLOP/s, kvkernels' speedups."""
    for result in case.impls.values():
        if result.median_s is None:
            continue
        if case.bandwidth_ref is not None:
            result.gbps = case.bytes / result.median_s / 1e9
            result.fraction = result.gbps / bandwidth[case.bandwidth_ref]
        if case.flops is not None:
            result.tflops = case.flops / result.median_s / 1e12
    ours = case.impls.get("kvkernels")
    if ours is None or ours.median_s is None:
        return
    for name, result in case.impls.items():
        if name != "kvkernels" and result.median_s is not None:
            ours.speedup_vs[name] = result.median_s / ours.median_s

"""CUDA paged-attention benchmark cases (issue 6): decode and causal prefill on the GPU, timed with CUDA
events, against the device's measured copy bandwidth and the PyTorch baselines on the same data.

Entry point (for the GPU script / the bench CLI)::

    from kvkernels.bench import cuda_attention
    parser = argparse.ArgumentParser(); cuda_attention.add_arguments(parser)
    rows = cuda_attention.run(parser.parse_args([...]))   # list of dicts, one per (case, implementation)
    # or: python -m kvkernels.bench.cuda_attention [--quick] [--json out.json]

``run(args=None)`` (``None``: the defaults below) returns plain dicts, JSON-ready:

    {"case": "decode bfloat16 b64 ctx4096", "kind": "decode" | "prefill" | "copy", "dtype", "batch",
     "context", "impl": "kvkernels" | "kvkernels-<variant>" (--decode-variants / --prefill-variants) |
     "sdpa-flash-contiguous" | "sdpa-cudnn-contiguous" (prefill) |
     "flex-paged" | "flashinfer-paged" | "flashinfer-paged-cuda-cores" (decode) | "flashinfer-fa3-paged"
     (prefill; kvkernels.bench.flashinfer_peer) | "copy",
     "ms": median milliseconds per call, "gbps": KV-cache bytes of the case / time (decode),
     "fraction_of_copy_bw": gbps / measured copy bandwidth (decode), "tflops" (prefill),
     "speedup_vs": {baseline: baseline_ms / kvkernels_ms} (kvkernels rows), "max_abs_diff",
     "tolerance", "checked", "skipped": reason or None, "note", "device", "torch"}

Cases (issue 6): decode batch {1, 16, 64, 256} x context {1k, 4k, 32k}, 32 query heads / 8 kv heads, head
dim 128, block 16, bfloat16 and fp8 (e4m3 cache, bfloat16 queries, per-tensor scales); prefill 4096
queries over 4096 keys, causal, bfloat16 (``--attn-prefill-dtypes``: also fp8_e4m3). Baselines: the copy bandwidth (``dst.copy_(src)`` of a large
buffer, bytes read + written per second), SDPA restricted to the flash backend over a contiguous
[batch, kv_heads, context, dim] copy of the same K/V (fp8: dequantized to bfloat16 first, outside the
timing; decode folds the GQA group into the query length, which is exact for one query per sequence),
FlexAttention over the paged cache through torch's experimental PagedAttention block-mask conversion
(recorded as skipped, with the error, where it does not run).

Targets of issue 37 (reported by ``targets(rows)``): decode >= 0.9 of the copy bandwidth at batch 64 x 4k and
batch 1 x 32k in bfloat16; the fp8 e4m3 cache >= 1.8x bfloat16 (same batch / context); prefill of 4096 x 4096
>= 1.0x cuDNN SDPA at head dim 128 (>= 0.8x at 64 / 256) on contiguous keys, 512 x 1024 >= 1.3x SDPA flash, the
e4m3-cache prefill >= 1.0x the bf16-cache one. ``--graph`` times every decode row as a replayed CUDA graph
(each target line says [graph] or [eager]).

Decode variants (``--decode-variants wide,deep``): the tensor-core decode kernel has two configurations,
chosen per call by KVKERNELS_CUDA_ATTN_PATH (csrc/cuda/README.md): ``wide`` (the default: 64 keys per stage,
2 stages at head dim 128) and ``deep`` (16 KiB stages, 4 in flight); ``fp8smem`` is the wide one with fp8 tiles
dequantized in shared memory instead of in registers (the same kernel as ``wide`` over 16-bit caches). With
the option, every
decode case times each named variant on the same data in one process, in alternating batches (A B B A ...),
as rows ``kvkernels-<variant>`` instead of ``kvkernels``; ``targets`` and ``variant_lines`` report each
against the targets and against each other. A name may force the KV split count: ``deep-s1`` is the deep
configuration with KVKERNELS_CUDA_ATTN_SPLITS=1 (``deep`` alone: the planner's own count), so ``deep,deep-s1``
times the planner's wave-filling splits against none. ``occ3`` (mma-decode-occ3: the wide kernel held to the
registers of 3 CTAs per SM, its splits counting them) and ``fused`` (mma-decode-fused: first tiles issued before
the query load, splits merged in the kernel) and ``persistent`` (mma-decode-persistent: the fused kernel as a grid
of the resident CTA slots, each walking (work item, split) units with its copies running on across items) are the
opt-in variants of csrc/cuda/README.md "Decode at the bandwidth limit". ``--graph`` times each variant (and
every other decode row) as a CUDA graph of one call per data copy, replayed: an eager call costs ~40 us of host
time on the H200 machine (b1 x 1k took 0.040 ms), as much as the GPU time of b1 x 32k, so eager timing there
measures the host.

Prefill variants (``--prefill-variants wide,deep``): the same for the tensor-core prefill kernel's two
configurations (KVKERNELS_CUDA_ATTN_PATH=mma-prefill-wide / mma-prefill-deep: ``wide``, the default, has 64
keys per stage, 2 stages at head dim 128; ``deep`` 16 KiB stages, 4 in flight; ``tall``, mma-prefill-tall, 2 row
tiles of 16 per warp and 32 keys per stage, so each K / V fragment feeds two mma; ``wgmma``, wgmma-prefill, the
sm_90a kernel of csrc/cuda/attention_sm90.cuh, run with KVKERNELS_CUDA_WGMMA=require so that a call it cannot
take is a skipped row naming the reason, never a timing of the fallback; ``wgmma-overlap``,
wgmma-prefill-overlap, the same kernel with intra-warpgroup overlap, its plain loop at head dim 256;
``wgmma-persistent``, wgmma-prefill-persistent, that kernel persistent (min(work items, SMs) CTAs walking the
items longest-first);
``wgmma-gather`` / ``wgmma-overlap-gather``: the same two with KVKERNELS_CUDA_NO_TMA=1, every K / V tile gathered
by cp.async, where the others load whole-page tiles by TMA): rows ``kvkernels-<variant>`` of each
prefill case, timed in alternating batches on the same data, each against SDPA flash and, where this torch
has it, cuDNN SDPA (``SDPBackend.CUDNN_ATTENTION``), both on the same K/V made contiguous
(``prefill_variant_lines``).

Timing: each implementation rotates through enough copies of its data that the bytes touched between two
reuses exceed ``--rotate-mib`` (default 4x a 50 MiB L2), so a case never times an L2-resident cache; the
median of ``--reps`` batches of calls, each batch timed with one pair of CUDA events.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kvkernels import ops
from kvkernels.bench.attention import BLOCK, FP8_SCALE, HEAD_DIM, HEADS, KV_HEADS

GROUP = HEADS // KV_HEADS
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 32768)
PREFILL = (4096, 4096)  # (queries, context)
CHECKED_SEQS = 2
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-4}


# ----------------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _shapes(text: str) -> list[tuple[int, int]]:
    """"64x4096,1x32768" -> [(64, 4096), (1, 32768)]."""
    try:
        return [(int(b), int(c)) for b, c in (x.lower().split("x") for x in text.split(",") if x)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT[,...], got {text!r}") from None


# --decode-variants / --prefill-variants names -> KVKERNELS_CUDA_ATTN_PATH values (csrc/cuda/attention.cu).
DECODE_VARIANTS = {"deep": "mma-decode-deep", "wide": "mma-decode-wide", "fp8smem": "mma-decode-fp8-smem",
                   "occ3": "mma-decode-occ3", "fused": "mma-decode-fused", "persistent": "mma-decode-persistent"}
PREFILL_VARIANTS = {"deep": "mma-prefill-deep", "wide": "mma-prefill-wide", "tall": "mma-prefill-tall",
                    "wgmma": "wgmma-prefill", "wgmma-overlap": "wgmma-prefill-overlap",
                    "wgmma-gather": "wgmma-prefill", "wgmma-overlap-gather": "wgmma-prefill-overlap",
                    "wgmma-persistent": "wgmma-prefill-persistent"}
# The wgmma prefill with every K / V tile gathered by cp.async (KVKERNELS_CUDA_NO_TMA=1): the A/B of its TMA
# loads (the other wgmma variants run with the switch unset: TMA where the block size allows).
GATHER_VARIANTS = ("wgmma-gather", "wgmma-overlap-gather")
PREFILL_DTYPES = ("bfloat16", "fp8_e4m3")


def _variant_parts(name: str, known: dict) -> tuple[str, Optional[str]]:
    """"deep" -> ("deep", None); "deep-s3" -> ("deep", "3"): the configuration (a key of ``known``) and the
    forced KV split count (KVKERNELS_CUDA_ATTN_SPLITS; None: the planner's own)."""
    config, sep, splits = name.partition("-s")
    if config not in known or (sep and not (splits.isdigit() and int(splits) >= 1)):
        raise ValueError(name)
    return config, splits if sep else None


def _variants_of(known: dict) -> Callable[[str], list[str]]:
    """The parser of --decode-variants (known = DECODE_VARIANTS) / --prefill-variants (PREFILL_VARIANTS):
    "wide,deep,deep-s1" -> ["wide", "deep", "deep-s1"] (known configurations, each with an optional -s<N>: N KV
    splits forced; no repeats)."""
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        try:
            for name in names:
                _variant_parts(name, known)
            if len(set(names)) != len(names):
                raise ValueError(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected distinct names of {sorted(known)}, each optionally "
                                             f"with -s<splits>, got {text!r}") from None
        return names
    return parse


def _prefill_dtypes(text: str) -> list[str]:
    """"bfloat16,fp8_e4m3" -> ["bfloat16", "fp8_e4m3"] (cache dtypes of the prefill cases)."""
    names = [x for x in text.split(",") if x]
    if not names or any(x not in PREFILL_DTYPES for x in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct names of {list(PREFILL_DTYPES)}, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CUDA attention")
    g.add_argument("--attn-batches", type=_ints, default=list(DECODE_BATCHES))
    g.add_argument("--attn-contexts", type=_ints, default=list(DECODE_CONTEXTS))
    g.add_argument("--attn-shapes", type=_shapes, default=None,
                   help="decode batch x context pairs, e.g. 64x4096,1x32768 (instead of batches x contexts, "
                        "also with --quick)")
    g.add_argument("--attn-dtypes", default="bfloat16,fp8_e4m3", help="decode cache dtypes")
    g.add_argument("--attn-prefill", type=_ints, default=list(PREFILL), help="queries,context ('' = none)")
    g.add_argument("--attn-prefill-dtypes", type=_prefill_dtypes, default=["bfloat16"],
                   help="prefill cache dtypes (bfloat16 queries): bfloat16, fp8_e4m3 (e4m3 cache, per-tensor scale)")
    g.add_argument("--attn-head-dim", type=int, choices=(64, 128, 256), default=HEAD_DIM,
                   help="head dim of every case (default 128; the case names say it when it is not 128)")
    g.add_argument("--attn-block-size", type=int, choices=(8, 16, 32, 64, 128, 256), default=BLOCK,
                   help="block size of the paged caches (default 16; the case names say it when it is not 16: "
                        "the wgmma prefill's K / V TMA boxes are min(block size, key tile) keys)")
    g.add_argument("--attn-reps", type=int, default=10, help="timed batches per implementation")
    g.add_argument("--attn-min-ms", type=float, default=20.0, help="minimum milliseconds per timed batch")
    g.add_argument("--rotate-mib", type=int, default=200, help="bytes between reuses of one data copy")
    g.add_argument("--memory-fraction", type=float, default=0.8, help="of free GPU memory a case may use")
    g.add_argument("--no-baselines", action="store_true")
    g.add_argument("--no-flex", action="store_true", help="skip the FlexAttention baseline (compile time)")
    g.add_argument("--no-flashinfer", action="store_true",
                   help="skip the FlashInfer rows (kvkernels.bench.flashinfer_peer; skipped rows where it is absent)")
    g.add_argument("--decode-variants", type=_variants_of(DECODE_VARIANTS), default=[],
                   help="time these configurations of the tensor-core decode kernel (wide: the default, "
                        "deep: 4-stage; -s<N> forces N KV splits, e.g. deep-s1) on the same data, alternating "
                        "batches: rows kvkernels-<variant>")
    g.add_argument("--graph", action="store_true",
                   help="time every decode row (each --decode-variants variant, or kvkernels, and the peers: SDPA, "
                        "FlexAttention, FlashInfer) as a replayed CUDA graph of one call per data copy (no host "
                        "launch cost in the time; a row whose capture fails is timed eager and says why)")
    g.add_argument("--prefill-variants", type=_variants_of(PREFILL_VARIANTS), default=[],
                   help="time these configurations of the tensor-core prefill kernel (wide: the default, "
                        "deep: 4-stage) on the same data, alternating batches: rows kvkernels-<variant>")
    g.add_argument("--quick", action="store_true", help="small shapes, few reps (a smoke run)")


def _defaults() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([])


# ----------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------


def time_cuda(call: Callable[[int], object], reps: int, min_ms: float) -> float:
    """Median milliseconds per call of ``call(i)``, i counting up (the callee rotates its copies)."""
    for i in range(3):
        call(i)
    torch.cuda.synchronize()
    # Calls per timed batch: enough for min_ms, from one probe batch.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call(3)
    end.record()
    end.synchronize()
    per_call = max(start.elapsed_time(end), 1e-3)
    n = max(1, min(1000, math.ceil(min_ms / per_call)))
    times, index = [], 4
    for _ in range(reps):
        start.record()
        for _ in range(n):
            call(index)
            index += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


@contextlib.contextmanager
def env_var(name: str, value: Optional[str], none_unsets: bool = True):
    """os.environ[name] = value inside the block (None: unset, or with none_unsets=False left as it is),
    restored after it; the CUDA planners and launchers read their switches on every call."""
    before = os.environ.get(name)
    try:
        if value is not None:
            os.environ[name] = value
        elif none_unsets:
            os.environ.pop(name, None)
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def attn_path_env(value: Optional[str]):
    """KVKERNELS_CUDA_ATTN_PATH = value (None: unset) inside the block."""
    return env_var("KVKERNELS_CUDA_ATTN_PATH", value)


def variant_env(name: str, paths: dict) -> contextlib.ExitStack:
    """The environment of a --decode-variants / --prefill-variants name inside the block:
    KVKERNELS_CUDA_ATTN_PATH = paths[configuration], and KVKERNELS_CUDA_ATTN_SPLITS = N for <config>-s<N>
    (unset otherwise: the planner chooses)."""
    config, splits = _variant_parts(name, paths)
    stack = contextlib.ExitStack()
    stack.enter_context(attn_path_env(paths[config]))
    stack.enter_context(env_var("KVKERNELS_CUDA_ATTN_SPLITS", splits))
    # the wgmma prefill falls back to the wide one where it cannot run: require it, so such a call fails
    stack.enter_context(env_var("KVKERNELS_CUDA_WGMMA", "require" if paths[config].startswith("wgmma-") else None))
    if paths[config].startswith("wgmma-"):
        stack.enter_context(env_var("KVKERNELS_CUDA_NO_TMA", "1" if config in GATHER_VARIANTS else None))
    return stack


def variant_setting(name: str, paths: dict) -> str:
    """What a variant's row notes: its environment (variant_env)."""
    config, splits = _variant_parts(name, paths)
    return (f"KVKERNELS_CUDA_ATTN_PATH={paths[config]}" + (f" KVKERNELS_CUDA_ATTN_SPLITS={splits}" if splits else "") +
            (" KVKERNELS_CUDA_WGMMA=require" if paths[config].startswith("wgmma-") else "") +
            (" KVKERNELS_CUDA_NO_TMA=1" if config in GATHER_VARIANTS else ""))


def time_paired(calls: dict, reps: int, min_ms: float, setting: Callable[[str], object]) -> dict:
    """Median milliseconds per call of each ``calls[name](i)``, measured in alternating batches (A B, then
    B A, ...) so that clock and thermal drift hit every variant alike; ``setting(name)`` is the context
    (an environment variable) each batch of ``name`` runs in. The call index counts up across variants, so
    each batch starts at another rotated data copy."""
    names = list(calls)
    per_batch, index = {}, 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for name in names:
        with setting(name):
            for _ in range(3):
                calls[name](index)
                index += 1
            torch.cuda.synchronize()
            start.record()
            calls[name](index)
            index += 1
            end.record()
            end.synchronize()
        per_batch[name] = max(1, min(1000, math.ceil(min_ms / max(start.elapsed_time(end), 1e-3))))
    times = {name: [] for name in names}
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            with setting(name):
                start.record()
                for _ in range(per_batch[name]):
                    calls[name](index)
                    index += 1
                end.record()
                end.synchronize()
            times[name].append(start.elapsed_time(end) / per_batch[name])
    return {name: statistics.median(t) for name, t in times.items()}


def skip_reason(error: BaseException) -> str:
    """What a result row says when its implementation raised: the type and the first line of the message."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"


def time_paired_into(by_impl: dict, calls: dict, reps: int, min_ms: float,
                     setting: Callable[[str], object]) -> None:
    """``time_paired`` over ``calls``, each median into ``by_impl[name]["ms"]``; if the timing raises, every
    timed row is marked skipped with the error (the rows' checks stay)."""
    try:
        for name, ms in time_paired(calls, reps, min_ms, setting).items():
            by_impl[name]["ms"] = ms
    except Exception as error:  # noqa: BLE001 - report the failure in the rows, keep the run going
        for name in calls:
            by_impl[name]["skipped"] = skip_reason(error)
        torch.cuda.synchronize()


def copy_bandwidth(nbytes: int, reps: int) -> float:
    """GB/s of dst.copy_(src) on the device, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_cuda(lambda i: dst.copy_(src), reps, 50.0)
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------


def _fill(t: torch.Tensor, scale: Optional[torch.Tensor], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = (x / scale).clamp(-448, 448)
    t.copy_(x)
    return t


class Paged:
    """``copies`` rotated copies of one paged K/V layer [blocks, 16, 8, 128], one shared shuffled table."""

    def __init__(self, batch: int, context: int, num_queries: int, dtype: torch.dtype, copies: int,
                 gen: torch.Generator):
        per_seq = math.ceil(context / BLOCK)
        num_blocks = batch * per_seq
        self.block_ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).view(
            batch, per_seq).cuda()
        self.block_tables = self.block_ids.to(torch.int32)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.scale = torch.tensor([FP8_SCALE], device="cuda") if fp8 else None
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        first_k = _fill(torch.empty(shape, dtype=dtype, device="cuda"), self.scale, gen)
        first_v = _fill(torch.empty(shape, dtype=dtype, device="cuda"), self.scale, gen)
        self.keys = [first_k] + [first_k.clone() for _ in range(copies - 1)]
        self.values = [first_v] + [first_v.clone() for _ in range(copies - 1)]
        self.query = torch.randn(num_queries, HEADS, HEAD_DIM, generator=gen, device="cuda",
                                 dtype=torch.float32).to(torch.bfloat16)
        self.context, self.batch, self.dtype = context, batch, dtype

    def dequantized(self, cache: torch.Tensor, seqs: Optional[int] = None) -> torch.Tensor:
        """Contiguous bfloat16 [seqs, kv_heads, context, dim] of one cache copy (default: every sequence),
        built a few sequences at a time so that large caches need no full-size temporaries."""
        seqs = self.batch if seqs is None else seqs
        out = torch.empty(seqs, KV_HEADS, self.context, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        step = max(1, (256 << 20) // (self.context * KV_HEADS * HEAD_DIM * 4))
        for s0 in range(0, seqs, step):
            ids = self.block_ids[s0:min(s0 + step, seqs)]  # the first `seqs` only
            x = cache[ids].reshape(ids.shape[0], -1, KV_HEADS, HEAD_DIM)[:, :self.context].transpose(1, 2)
            if self.scale is not None:
                x = x.float() * self.scale
            out[s0:s0 + step] = x
        return out

    def reference(self, seqs: int, causal_queries: bool) -> torch.Tensor:
        """float32 attention of the first ``seqs`` sequences (decode) or of all queries (prefill)."""
        k = self.dequantized(self.keys[0], seqs).float()
        v = self.dequantized(self.values[0], seqs).float()
        if causal_queries:  # prefill: one sequence, queries = the last len(query) positions
            k, v = k.repeat_interleave(GROUP, dim=1), v.repeat_interleave(GROUP, dim=1)
            q = self.query.float().transpose(0, 1)[None]  # [1, H, Tq, D]
            tq, s = q.shape[2], k.shape[2]
            logits = q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5
            mask = torch.arange(s, device="cuda")[None, :] > torch.arange(tq, device="cuda")[:, None] + (s - tq)
            return (logits.masked_fill(mask, float("-inf")).softmax(-1) @ v)[0].transpose(0, 1)
        q = self.query[:seqs].float().view(seqs, KV_HEADS, GROUP, HEAD_DIM)  # GQA group as query rows
        w = (q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5).softmax(-1)
        return (w @ v).reshape(seqs, HEADS, HEAD_DIM)


def rotation_copies(nbytes: int, rotate_mib: float) -> int:
    """Copies of an ``nbytes`` input to rotate through so that they span ``rotate_mib`` (no L2 hits)."""
    return max(1, math.ceil(rotate_mib * (1 << 20) / max(nbytes, 1)))


def _row(case: str, kind: str, dtype: str, batch: int, context: int, impl: str, **extra) -> dict:
    row = dict(case=case, kind=kind, dtype=dtype, batch=batch, context=context, impl=impl, ms=None, gbps=None,
               fraction_of_copy_bw=None, tflops=None, speedup_vs={}, max_abs_diff=None, tolerance=None,
               checked=None, skipped=None, note="", device=torch.cuda.get_device_name(), torch=torch.__version__)
    row.update(extra)
    return row


def attempt(row: dict, call: Callable[[int], object], reps: int, min_ms: float,
            check: Optional[Callable] = None, graph_copies: int = 0) -> None:
    """Time ``call`` into ``row``; an implementation that raises is recorded as skipped with the error.
    ``graph_copies`` > 0: timed as a replayed CUDA graph of ``call(0 .. graph_copies - 1)`` (its rotation of
    data copies), per call; ``row["timing"]`` says which timing the row got (an implementation whose capture
    fails is timed eager, and the row says why)."""
    try:
        if check is not None:
            out = call(0)
            torch.cuda.synchronize()
            row["max_abs_diff"], row["tolerance"] = check(out)
            row["checked"] = row["max_abs_diff"] <= row["tolerance"]
        timed, per = graphed(row, call, graph_copies)
        row["ms"] = time_cuda(timed, reps, min_ms) / per
    except Exception as error:  # noqa: BLE001 - one failing implementation must not end the run
        row["skipped"] = skip_reason(error)
        torch.cuda.synchronize()


def graphed(row: dict, call: Callable[[int], object], copies: int) -> tuple[Callable[[int], object], int]:
    """(timed call, calls per timed call): a replayed CUDA graph of ``call(0 .. copies - 1)`` when ``copies`` > 0,
    else ``call`` itself; ``row["timing"]`` says which. A capture that fails (an implementation that syncs
    with the host, say) leaves the call eager and the row says why: a timing, not a skipped row."""
    row["timing"] = "eager"
    if copies <= 0:
        return call, 1
    try:
        timed = graph_of(call, copies)
    except Exception as error:  # noqa: BLE001 - capture is the implementation's limit, not a failure
        torch.cuda.synchronize()
        row["timing"] = f"eager: CUDA graph capture failed ({skip_reason(error)})"
        return call, 1
    row["timing"] = f"CUDA graph of {copies} calls, replayed"
    return timed, copies


def _free_bytes() -> int:
    free, _ = torch.cuda.mem_get_info()
    return free


# ----------------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------------


def flex_paged_decode(data: Paged):
    """FlexAttention over the paged cache through torch.nn.attention.experimental PagedAttention: the
    caches are re-laid as [1, kv_heads, blocks * 16, dim] (outside the timing) and a logical block mask
    over each sequence's pages is converted to physical pages. Returns call(i) or raises."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    num_blocks = data.keys[0].shape[0]
    pa = PagedAttention(num_blocks, BLOCK, data.batch, device="cuda")
    per_seq = data.block_ids.shape[1]
    pa.page_table[:, :per_seq] = data.block_ids
    for b in range(data.batch):
        pa.physical_to_logical[b, data.block_ids[b]] = torch.arange(per_seq, device="cuda")
    pa.capacity[:] = per_seq * BLOCK
    pa.empty_pages = []

    def relayout(c: torch.Tensor) -> torch.Tensor:
        if data.scale is not None:
            c = (c.to(torch.bfloat16) * data.scale.to(torch.bfloat16))
        return c.permute(2, 0, 1, 3).reshape(1, KV_HEADS, num_blocks * BLOCK, HEAD_DIM).contiguous()

    ks = [relayout(c) for c in data.keys]
    vs = [relayout(c) for c in data.values]
    context = data.context

    def visible(b, h, q_idx, kv_idx):
        return kv_idx < context

    logical = create_block_mask(visible, data.batch, None, GROUP, per_seq * BLOCK, device="cuda",
                                BLOCK_SIZE=(GROUP, BLOCK))
    physical = pa.convert_logical_block_mask(logical)
    flex = torch.compile(flex_attention, dynamic=False)
    # Decode with GQA folded into the query length: q [batch, kv_heads, group, dim] per kv head.
    q = data.query.view(data.batch, KV_HEADS, GROUP, HEAD_DIM)

    def call(i: int):
        j = i % len(ks)
        # flex needs a batch of 1 over the shared physical cache; the block mask picks each batch's pages.
        k = ks[j].expand(data.batch, -1, -1, -1)
        v = vs[j].expand(data.batch, -1, -1, -1)
        return flex(q, k, v, block_mask=physical).reshape(data.batch, HEADS, HEAD_DIM)

    return call


def decode_case(dtype_name: str, batch: int, context: int, copy_gbps: float, args,
                gen: torch.Generator) -> list[dict]:
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}[dtype_name]
    name = f"decode {dtype_name} b{batch} ctx{context}" + (f" block{BLOCK}" if BLOCK != 16 else "")
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize
    layer_bytes = 2 * batch * math.ceil(context / BLOCK) * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    budget = int(_free_bytes() * args.memory_fraction)
    rows = []
    copies = min(rotation_copies(layer_bytes, args.rotate_mib), budget // layer_bytes)
    if copies < 1:
        return [_row(name, "decode", dtype_name, batch, context, "kvkernels",
                     skipped=f"one cache copy ({layer_bytes / 2**30:.1f} GiB) exceeds the memory budget")]
    data = Paged(batch, context, batch, dtype, copies, gen)
    expected = data.reference(min(CHECKED_SEQS, batch), causal_queries=False)

    def check(out):
        return float((out[:expected.shape[0]].float() - expected).abs().max()), TOLERANCE[torch.bfloat16]

    def kernel(i: int):
        j = i % copies
        return ops.paged_attention(data.query, data.keys[j], data.values[j], data.block_tables, data.seq_lens,
                                   k_scale=data.scale, v_scale=data.scale)[0]

    variants = getattr(args, "decode_variants", None) or []
    graph = getattr(args, "graph", False)
    if variants:
        mine_rows = variant_rows(name, "decode", dtype_name, batch, context, copies, variants, DECODE_VARIANTS,
                                 kernel, check, args)
    else:
        mine_rows = [_row(name, "decode", dtype_name, batch, context, "kvkernels", copies=copies)]
        attempt(mine_rows[0], kernel, args.attn_reps, args.attn_min_ms, check, graph_copies=copies if graph else 0)
    rows += mine_rows

    if not args.no_baselines:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        contig_layer = 2 * batch * context * KV_HEADS * HEAD_DIM * 2  # bfloat16
        n = min(rotation_copies(contig_layer, args.rotate_mib), (budget - copies * layer_bytes) // max(contig_layer, 1))
        sd = _row(name, "decode", dtype_name, batch, context, "sdpa-flash-contiguous",
                  note="bfloat16 [B, Hkv, ctx, D] K/V (fp8: dequantized outside the timing); GQA folded into "
                       "the query length; GB/s counts the case's cache bytes")
        if n < 1:
            sd["skipped"] = "no room for a contiguous bfloat16 copy next to the paged cache"
        else:
            ks = [data.dequantized(data.keys[i % copies]) for i in range(n)]
            vs = [data.dequantized(data.values[i % copies]) for i in range(n)]
            q = data.query.view(batch, KV_HEADS, GROUP, HEAD_DIM)

            def sdpa(i: int):
                j = i % n
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, ks[j], vs[j]).reshape(batch, HEADS, HEAD_DIM)

            attempt(sd, sdpa, args.attn_reps, args.attn_min_ms, check, graph_copies=n if graph else 0)
            del ks, vs
        rows.append(sd)
        if not args.no_flex:
            fx = _row(name, "decode", dtype_name, batch, context, "flex-paged",
                      note="torch.compile(flex_attention) with PagedAttention.convert_logical_block_mask; "
                           "cache re-laid [1, Hkv, blocks*16, D] bfloat16 outside the timing")
            try:
                attempt(fx, flex_paged_decode(data), args.attn_reps, args.attn_min_ms, check,
                        graph_copies=copies if graph else 0)
            except Exception as error:  # noqa: BLE001
                fx["skipped"] = skip_reason(error)
            rows.append(fx)
    if not args.no_baselines and not getattr(args, "no_flashinfer", False):
        rows += flashinfer_rows(name, "decode", dtype_name, batch, context, args, check,
                                lambda fi, tensor_cores: fi.decode_call(data, tensor_cores, HEADS, KV_HEADS,
                                                                        HEAD_DIM, BLOCK),
                                graph_copies=copies if graph else 0)
    for r in rows:
        if r["ms"]:
            r["gbps"] = kv_bytes / (r["ms"] * 1e-3) / 1e9
            r["fraction_of_copy_bw"] = r["gbps"] / copy_gbps
    for mine in mine_rows:
        for r in rows:
            if r is not mine and r["ms"] and mine["ms"]:
                mine["speedup_vs"][r["impl"]] = r["ms"] / mine["ms"]
    del data
    torch.cuda.empty_cache()
    return rows


def flashinfer_rows(name: str, kind: str, dtype_name: str, batch: int, context: int, args, check: Callable,
                    make_call: Callable, graph_copies: int = 0) -> list[dict]:
    """FlashInfer's rows of a case (kvkernels.bench.flashinfer_peer): decode with its tensor-core and its
    CUDA-core kernels, prefill with its FA3 template, over the same paged cache; ``make_call(module,
    tensor_cores)`` builds the timed call. Where FlashInfer is absent, or a module is not in the bundle the GPU
    script carries, the row is skipped with the reason."""
    from kvkernels.bench import flashinfer_peer as fi

    absent = fi.import_error()
    impls = fi.DECODE_IMPLS if kind == "decode" else {fi.PREFILL_IMPL: True}
    rows = []
    for impl, tensor_cores in impls.items():
        row = _row(name, kind, dtype_name, batch, context, impl,
                   note="the same paged cache and block table (NHD K / V tuple), planned outside the timing"
                        + ("" if absent else f"; flashinfer {fi.version()}"))
        if absent:
            row["skipped"] = absent
        else:
            try:
                call = make_call(fi, tensor_cores)
            except Exception as error:  # noqa: BLE001 - a peer that cannot plan is a skipped row
                row["skipped"] = skip_reason(error)
                torch.cuda.synchronize()
            else:
                attempt(row, call, args.attn_reps, args.attn_min_ms, check, graph_copies=graph_copies)
        rows.append(row)
    return rows


def variant_rows(name: str, kind: str, dtype_name: str, batch: int, context: int, copies: int,
                 variants: list[str], env_values: dict, kernel: Callable[[int], object], check: Callable,
                 args, note: str = "") -> list[dict]:
    """One ``kvkernels-<variant>`` row per kernel configuration (``env_values``: configuration ->
    KVKERNELS_CUDA_ATTN_PATH; a -s<N> suffix forces N KV splits, variant_env): each checked against the
    reference, then all timed together by ``time_paired`` (a variant that raises is recorded as skipped, the
    others still run)."""
    rows, calls, per = {}, {}, {}
    graph = getattr(args, "graph", False)
    for v in variants:
        row = _row(name, kind, dtype_name, batch, context, f"kvkernels-{v}", copies=copies,
                   note=f"{note}{variant_setting(v, env_values)}; timed in batches alternating with "
                        f"{', '.join(x for x in variants if x != v) or 'nothing'}")
        rows[v] = row
        try:
            with variant_env(v, env_values):
                out = kernel(0)
                torch.cuda.synchronize()
                calls[v], per[v] = graphed(row, kernel, copies if graph else 0)
            row["max_abs_diff"], row["tolerance"] = check(out)
            row["checked"] = row["max_abs_diff"] <= row["tolerance"]
        except Exception as error:  # noqa: BLE001 - one failing variant must not end the run
            row["skipped"] = skip_reason(error)
            calls.pop(v, None)
            torch.cuda.synchronize()
    if calls:
        time_paired_into(rows, calls, args.attn_reps, args.attn_min_ms, lambda v: variant_env(v, env_values))
        for v in calls:  # a replay is `copies` calls
            if rows[v]["ms"]:
                rows[v]["ms"] /= per[v]
    return list(rows.values())


def graph_of(kernel: Callable[[int], object], copies: int) -> Callable[[int], object]:
    """``call(i)`` replaying a CUDA graph of ``kernel(j)`` for every data copy j, captured in the current
    environment (the planner reads KVKERNELS_CUDA_ATTN_PATH / _SPLITS at capture, so the graph holds the
    variant's kernels); warmed up on a side stream first, as torch's capture asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for j in range(copies):
            kernel(j)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(copies):
            kernel(j)
    return lambda i: g.replay()


# ----------------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------------


def prefill_case(q_len: int, context: int, args, gen: torch.Generator, dtype_name: str = "bfloat16") -> list[dict]:
    name = (f"prefill {dtype_name} q{q_len} ctx{context}" + (f" d{HEAD_DIM}" if HEAD_DIM != 128 else "") +
            (f" block{BLOCK}" if BLOCK != 16 else ""))
    dtype = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[dtype_name]
    layer_bytes = 2 * math.ceil(context / BLOCK) * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    copies = rotation_copies(layer_bytes, args.rotate_mib)
    data = Paged(1, context, q_len, dtype, copies, gen)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    pairs = sum(context - q_len + i + 1 for i in range(q_len))
    flops = 4 * HEAD_DIM * HEADS * pairs
    expected = data.reference(1, causal_queries=True)

    def check(out):
        return float((out.float() - expected).abs().max()), TOLERANCE[torch.bfloat16]

    def kernel(i: int):
        j = i % copies
        return ops.paged_attention(data.query, data.keys[j], data.values[j], data.block_tables, data.seq_lens,
                                   qsl, k_scale=data.scale, v_scale=data.scale)[0]

    note = "flops = 4 * head_dim * heads * (query, key) pairs inside the causal mask"
    variants = getattr(args, "prefill_variants", None) or []
    if variants:
        mine_rows = variant_rows(name, "prefill", dtype_name, 1, context, copies, variants, PREFILL_VARIANTS,
                                 kernel, check, args, note=note + "; ")
    else:
        mine_rows = [_row(name, "prefill", dtype_name, 1, context, "kvkernels", copies=copies, note=note)]
        attempt(mine_rows[0], kernel, args.attn_reps, args.attn_min_ms, check)
    rows = list(mine_rows)
    if not args.no_baselines:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        ks = [data.dequantized(c) for c in data.keys]
        vs = [data.dequantized(c) for c in data.values]
        q4 = data.query.transpose(0, 1)[None].contiguous()  # [1, H, Tq, D]
        mask = causal_lower_right(q_len, context) if q_len != context else None
        sd = _row(name, "prefill", dtype_name, 1, context, "sdpa-flash-contiguous",
                  note="causal (lower-right aligned), enable_gqa, contiguous bfloat16 K/V (fp8: dequantized "
                       "outside the timing)")

        def sdpa(i: int):
            j = i % copies
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                if mask is None:
                    out = F.scaled_dot_product_attention(q4, ks[j], vs[j], is_causal=True, enable_gqa=True)
                else:
                    out = F.scaled_dot_product_attention(q4, ks[j], vs[j], attn_mask=mask, enable_gqa=True)
            return out[0].transpose(0, 1)

        attempt(sd, sdpa, args.attn_reps, args.attn_min_ms, check)
        rows.append(sd)
        # cuDNN's SDPA (the fastest peer on an H200: 0.258 ms at this size, causal), same K/V; skipped where
        # this torch or device has no cuDNN attention backend.
        cd = _row(name, "prefill", dtype_name, 1, context, "sdpa-cudnn-contiguous",
                  note="SDPBackend.CUDNN_ATTENTION, causal (lower-right aligned), K/V heads repeated to the query "
                       "heads (contiguous bfloat16)")
        backend = getattr(SDPBackend, "CUDNN_ATTENTION", None)
        if backend is None:
            cd["skipped"] = "this torch has no SDPBackend.CUDNN_ATTENTION"
        else:
            kr = [k.repeat_interleave(GROUP, dim=1) for k in ks]  # cuDNN's SDPA takes no enable_gqa
            vr = [v.repeat_interleave(GROUP, dim=1) for v in vs]

            def cudnn(i: int):
                j = i % copies
                with sdpa_kernel(backend):
                    if mask is None:
                        out = F.scaled_dot_product_attention(q4, kr[j], vr[j], is_causal=True)
                    else:
                        out = F.scaled_dot_product_attention(q4, kr[j], vr[j], attn_mask=mask)
                return out[0].transpose(0, 1)

            attempt(cd, cudnn, args.attn_reps, args.attn_min_ms, check)
        rows.append(cd)
    if not args.no_baselines and not getattr(args, "no_flashinfer", False):
        rows += flashinfer_rows(name, "prefill", dtype_name, 1, context, args, check,
                                lambda fi, _: fi.prefill_call(data, q_len, HEADS, KV_HEADS, HEAD_DIM, BLOCK))
    for r in rows:
        r["queries"], r["head_dim"] = q_len, HEAD_DIM  # (targets: the goal depends on them)
        if r["ms"]:
            r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
    for mine in mine_rows:
        for r in rows:
            if r is not mine and r["ms"] and mine["ms"]:
                mine["speedup_vs"][r["impl"]] = r["ms"] / mine["ms"]
    del data
    torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------------


def run(args: Optional[argparse.Namespace] = None,
        emit: Optional[Callable[[list[dict]], None]] = None) -> list[dict]:
    """Every case; one dict per (case, implementation), plus one "copy" row with the bandwidth.
    ``emit(rows)``, if given, gets each case's rows as soon as the case is done (a run stopped part-way
    has reported what it measured)."""
    if args is None:
        args = _defaults()
    emit = emit or (lambda new_rows: None)
    # --attn-head-dim: the module's HEAD_DIM, read by every case when it runs (kvkernels.bench.attention's
    # value by default)
    global HEAD_DIM, BLOCK
    HEAD_DIM = getattr(args, "attn_head_dim", HEAD_DIM)
    BLOCK = getattr(args, "attn_block_size", BLOCK)  # (--attn-block-size, the same way)
    if not torch.cuda.is_available():
        rows = [dict(case="cuda attention", kind="copy", impl="copy", skipped="no CUDA device")]
        emit(rows)
        return rows
    if args.quick:
        args.attn_batches, args.attn_contexts, args.attn_prefill = [1, 4], [1024], [512, 1024]
        args.attn_reps, args.attn_min_ms, args.rotate_mib = 3, 2.0, 64
    shapes = args.attn_shapes or [(b, c) for b in args.attn_batches for c in args.attn_contexts]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbps = copy_bandwidth(1 << 30 if not args.quick else 1 << 28, args.attn_reps)
    rows = [_row("copy bandwidth", "copy", "-", 0, 0, "copy", gbps=copy_gbps,
                 note="dst.copy_(src), bytes read + written per second")]
    emit(rows[:])
    for dtype_name in [d for d in args.attn_dtypes.split(",") if d]:
        for batch, context in shapes:
            new_rows = decode_case(dtype_name, batch, context, copy_gbps, args, gen)
            rows += new_rows
            emit(new_rows)
    if args.attn_prefill:
        for dtype_name in getattr(args, "attn_prefill_dtypes", None) or ["bfloat16"]:
            new_rows = prefill_case(args.attn_prefill[0], args.attn_prefill[1], args, gen, dtype_name)
            rows += new_rows
            emit(new_rows)
    return rows


def _timing_tag(r: dict) -> str:
    """" [graph]" / " [eager]": how a decode row was timed (eager calls include ~40 us of host time)."""
    t = r.get("timing") or ""
    return " [graph]" if t.startswith("CUDA graph") else " [eager]" if t else ""


def targets(rows: list[dict], impl: str = "kvkernels", prefill_impl: str = "kvkernels") -> list[str]:
    """Issue 37's targets, evaluated on the rows that exist (a missing case says so), for the decode rows of
    ``impl`` (``kvkernels``, or ``kvkernels-<variant>`` with --decode-variants) and the prefill rows of
    ``prefill_impl`` (the same with --prefill-variants): decode >= 0.9 of the copy bandwidth at b64 x 4k and
    b1 x 32k (bf16); the e4m3 cache >= 1.8x bf16 at the same shape; prefill of 2k+ queries >= 1.0x cuDNN SDPA at
    head dim 128 and >= 0.8x at 64 / 256, smaller prefills >= 1.3x SDPA flash; the e4m3-cache prefill >=
    1.0x the bf16-cache one of the same implementation."""
    def get(case: str, who: str = impl) -> Optional[dict]:
        return next((r for r in rows if r["case"] == case and r["impl"] == who), None)

    lines = []
    for case in ("decode bfloat16 b64 ctx4096", "decode bfloat16 b1 ctx32768"):
        r = get(case)
        frac = r and r.get("fraction_of_copy_bw")
        lines.append(f"{case}: {'missing' if frac is None else f'{frac:.2f}'} of copy bandwidth "
                     f"(target 0.9){_timing_tag(r) if r else ''}")
    for r in rows:
        if r["impl"] == impl and r["kind"] == "decode" and r["dtype"] == "fp8_e4m3" and r["ms"]:
            b = get(r["case"].replace("fp8_e4m3", "bfloat16"))
            if b and b["ms"]:
                lines.append(f"{r['case']}: fp8 {b['ms'] / r['ms']:.2f}x bfloat16 (target 1.8){_timing_tag(r)}")
    for r in rows:
        if r["kind"] != "prefill" or r["impl"] != prefill_impl:
            continue
        if r["queries"] >= 2048:
            s, peer, goal = (r["speedup_vs"].get("sdpa-cudnn-contiguous"), "cuDNN SDPA",
                             1.0 if r["head_dim"] == 128 else 0.8)
        else:
            s, peer, goal = r["speedup_vs"].get("sdpa-flash-contiguous"), "SDPA flash", 1.3
        lines.append(f"{r['case']}: {'missing' if s is None else f'{s:.2f}'}x {peer} (target {goal})")
        if r["dtype"] == "fp8_e4m3":
            b = get(r["case"].replace("fp8_e4m3", "bfloat16"), prefill_impl)
            ratio = b["ms"] / r["ms"] if b and b.get("ms") and r.get("ms") else None
            lines.append(f"{r['case']}: {'missing' if ratio is None else f'{ratio:.2f}'}x its bfloat16 cache "
                         f"(target 1.0)")
    return lines


def ab_lines(rows: list[dict], kind: str, variants: list[str], detail: Callable[[dict], str],
             peer=None) -> list[str]:
    """One line per case of ``kind`` timed with --<kind>-variants (the A/B of one run, same data): each
    variant's time with ``detail(row)``, how much faster it is than the first variant named, MISMATCH where
    its check failed; then, where their rows exist, the peers (``(impl, name)`` or a list of them: SDPA flash,
    cuDNN SDPA, the torch matmul)."""
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows if r.get("kind") == kind):
        by = {r["impl"]: r for r in rows if r["case"] == case}
        first = by.get(f"kvkernels-{variants[0]}")
        entries = [(v, by.get(f"kvkernels-{v}"), True) for v in variants]
        for impl, label in ([peer] if isinstance(peer, tuple) else peer or []):
            if impl in by:
                entries.append((label, by[impl], False))
        parts = []
        for name, r, ours in entries:
            if r is None or not r.get("ms"):
                parts.append(f"{name} {'missing' if r is None else 'skipped: ' + str(r.get('skipped'))}")
                continue
            text = f"{name} {r['ms']:.4f} ms" + detail(r)
            if ours and r is not first and first and first.get("ms"):
                text += f" = {first['ms'] / r['ms']:.2f}x {variants[0]}"
            if r.get("checked") is False:
                text += " MISMATCH"
            parts.append(text)
        lines.append(f"{case}: " + ", ".join(parts))
    return lines


def variant_lines(rows: list[dict], variants: list[str]) -> list[str]:
    """--decode-variants: each variant's time and fraction of the copy bandwidth (ab_lines)."""
    return ab_lines(rows, "decode", variants, lambda r: f" ({r['fraction_of_copy_bw']:.2f} of copy)"
                    if r.get("fraction_of_copy_bw") else "")


def prefill_variant_lines(rows: list[dict], variants: list[str]) -> list[str]:
    """--prefill-variants: each variant's time and speed against SDPA flash (the issue's 0.8x target) and
    cuDNN SDPA where timed, then the peers' own times (ab_lines)."""
    def detail(r):
        sdpa = (r.get("speedup_vs") or {}).get("sdpa-flash-contiguous")
        cudnn = (r.get("speedup_vs") or {}).get("sdpa-cudnn-contiguous")
        return ((f" ({sdpa:.2f}x SDPA flash" if sdpa else "") + (f", {cudnn:.2f}x cuDNN" if sdpa and cudnn else
                f" ({cudnn:.2f}x cuDNN" if cudnn else "") + (")" if sdpa or cudnn else ""))
    return ab_lines(rows, "prefill", variants, detail,
                    peer=[("sdpa-flash-contiguous", "sdpa-flash"), ("sdpa-cudnn-contiguous", "sdpa-cudnn"),
                          ("flashinfer-fa3-paged", "flashinfer-fa3")])


def prefill_fp8_lines(rows: list[dict], variants: list[str]) -> list[str]:
    """--prefill-variants with --attn-prefill-dtypes bfloat16,fp8_e4m3: per variant, the e4m3-cache prefill's time
    against the same variant's bfloat16-cache prefill (the wgmma issue's target: e4m3 >= 1.0x our bf16 prefill,
    i.e. no slower), from the rows of one run."""
    lines = []
    for v in variants:
        impl = f"kvkernels-{v}"
        for r in rows:
            if r.get("kind") != "prefill" or r["impl"] != impl or r.get("dtype") != "fp8_e4m3":
                continue
            b = next((x for x in rows if x["case"] == r["case"].replace("fp8_e4m3", "bfloat16") and x["impl"] == impl),
                     None)
            if r.get("ms") and b and b.get("ms"):
                lines.append(f"{r['case']} [{v}]: {r['ms']:.4f} ms = {b['ms'] / r['ms']:.2f}x its bfloat16 cache "
                             f"({b['ms']:.4f} ms) (target 1.0)")
            else:
                lines.append(f"{r['case']} [{v}]: missing against its bfloat16 cache")
    return lines


def peer_lines(rows: list[dict]) -> list[str]:
    """One line per decode / prefill case that has a peer row (SDPA, cuDNN, FlexAttention, FlashInfer): our
    fastest row's time, then each peer's time and how many times ours is faster (peer ms / our ms), or why the
    peer was skipped (shortened); the same data in the same process."""
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows if r.get("kind") in ("decode", "prefill")):
        mine = [r for r in rows if r["case"] == case and r["impl"].startswith("kvkernels") and r.get("ms")]
        peers = [r for r in rows if r["case"] == case and not r["impl"].startswith("kvkernels")]
        if not peers:
            continue
        best = min(mine, key=lambda r: r["ms"]) if mine else None
        parts = []
        for r in peers:
            if r.get("ms"):
                parts.append(f"{r['impl']} {r['ms']:.4f} ms" +
                             (f" (ours {r['ms'] / best['ms']:.2f}x faster)" if best else ""))
            else:
                parts.append(f"{r['impl']} skipped ({str(r.get('skipped'))[:80]})")
        ours = f"{best['impl']} {best['ms']:.4f} ms" if best else "ours missing"
        lines.append(f"{case}: {ours}; " + ", ".join(parts))
    return lines


def row_text(r: dict) -> tuple[str, str]:
    """A result row's time (or why it was skipped) and its rate, as the benchmarks print them."""
    extra = (f"{r['gbps']:.0f} GB/s ({r['fraction_of_copy_bw']:.2f} of copy)" if r.get("fraction_of_copy_bw")
             else f"{r['tflops']:.0f} TFLOP/s" if r.get("tflops")
             else f"{r['gbps']:.0f} GB/s" if r.get("gbps") else "")
    ms = f"{r['ms']:.4f} ms" if r.get("ms") else f"skipped: {r['skipped']}" if r.get("skipped") else ""
    return ms, extra


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="CUDA paged-attention benchmark (kvkernels issue 6)")
    add_arguments(parser)
    parser.add_argument("--json", help="write the rows to this file (rewritten after every case)")
    args = parser.parse_args(argv)
    done: list[dict] = []

    def emit(new_rows: list[dict]) -> None:
        done.extend(new_rows)
        for r in new_rows:
            ms, extra = row_text(r)
            print(f"{r['case']:<36} {r['impl']:<24} {ms:<18} {extra} {r.get('speedup_vs') or ''}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(done, f, indent=1)

    rows = run(args, emit)
    # Decode target lines per decode variant (or for "kvkernels"; none when no decode case was asked for),
    # prefill lines per prefill variant.
    for v in (args.decode_variants or [None]) if any(args.attn_dtypes.split(",")) else []:
        for line in targets(rows, f"kvkernels-{v}" if v else "kvkernels"):
            if not line.startswith("prefill"):
                print(f"target: [{v}]" if v else "target:", line)
    for v in args.prefill_variants or [None]:
        for line in targets(rows, prefill_impl=f"kvkernels-{v}" if v else "kvkernels"):
            if line.startswith("prefill"):
                print(f"target: [{v}]" if v else "target:", line)
    if args.decode_variants:
        for line in variant_lines(rows, args.decode_variants):
            print("variant:", line)
    if args.prefill_variants:
        for line in prefill_variant_lines(rows, args.prefill_variants):
            print("variant:", line)
        for line in prefill_fp8_lines(rows, args.prefill_variants):
            print("variant:", line)
    for line in peer_lines(rows):
        print("peer:", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CUDA MLA benchmark cases (issue 7): absorbed MLA decode (``mla_paged_attention``) against the device's
measured copy bandwidth, and ``mla_decompress`` against a torch matmul of the same GEMM shape. Timed with
CUDA events; the timing helpers, copy-bandwidth probe and row format are those of
:mod:`kvkernels.bench.cuda_attention`. Written without a GPU: importable on CPU, not yet run.

Entry point (for scripts/gpu_validate.sh)::

    python -m kvkernels.bench.cuda_mla [--quick] [--json out.json]
    rows = kvkernels.bench.cuda_mla.run(args)   # list of dicts, one per (case, implementation)

Cases:
  decode   DeepSeek-V3 latent shapes (kv_lora_rank 512 + rope 64, block 64), 16 heads (one TP-8 shard)
           and 128 heads, batch {1, 16, 64, 128} x context {1k, 4k, 32k}, bfloat16 and fp8 e4m3 caches
           (bfloat16 q). "gbps" counts the latent bytes the call must read (batch x context x 576 x
           element size), "fraction_of_copy_bw" divides it by the measured dst.copy_(src) bandwidth.
           Checked against a float32 torch computation of the first sequences.
  decompress  tokens {4096, 32768} x heads {16, 128}, qk_nope = v = 128, with RMSNorm, bfloat16 and an fp8
           e4m3 cache; baseline "torch-matmul": latent[T, 512] @ w_kv_b.T on an already gathered,
           normalized, contiguous bfloat16 latent (the GEMM alone, a lower bound for any unfused
           implementation); "speedup_vs" = baseline_ms / kvkernels_ms, "tflops" = 2 T R N / time.

Decompress kernel A/B (``--decompress-variants tile64,persist64,persist128``): mla_decompress has two CUDA
kernels for fp16 / bf16 weights, chosen per call by KVKERNELS_CUDA_DECOMPRESS (csrc/cuda/README.md):
``persist`` (the default: a CTA keeps its latent tile and streams many 128-column weight tiles; ``persist64``
/ ``persist128`` force its 64- or 128-token tile, ``persist`` picks one from the device's shared memory) and
``tile64`` (the first: one CTA per 64 x 64 output tile), plus the opt-in sm_90a ``wgmma`` kernel (warp-specialized,
TMA + wgmma; a device where it cannot run gives a skipped row with the reason). With the option every decompress case checks each
named variant and times them and the torch matmul in one process on the same data, in alternating batches
(A B C, C B A, ...),
as rows ``kvkernels-<variant>`` and ``torch-matmul``; the matmul's latent is the case's own latent rows,
gathered, normalized and rounded to bfloat16 beforehand. "variant:" lines give each time and the speed-up of
every variant over the first named.

Decode kernel A/B (``--mla-attn-variants mma,wgmma,wgmma-seesaw``): ``mma`` is the planner's default (the
mma.sync kernels: 64 rows per CTA above 16 heads, 16 rows at 16 heads), ``wgmma`` the opt-in sm_90a kernel
(KVKERNELS_CUDA_MLA_PATH=wgmma with KVKERNELS_CUDA_WGMMA=require, so a fallback shows as a skipped row, not as
the other kernel timed twice), ``wgmma-seesaw`` the same kernel with its seesaw consumer schedule, and
``wgmma-meta`` / ``wgmma-seesaw-meta`` the two on the split plan of the metadata pass
(KVKERNELS_CUDA_MLA_SCHED=metadata). Each decode case checks every named variant, then times them in one process
on the same data in alternating batches, as rows ``kvkernels-<variant>`` with TFLOP/s (2 x heads x context x
(R + P + R) per sequence) beside GB/s and the fraction of the copy bandwidth; "variant:" lines give each time
and the speed-up over the first named.

Each decode implementation rotates through enough copies of its data that the bytes touched between two reuses
exceed ``--rotate-mib`` (so no case times an L2-resident cache); the decompress cases use one copy (bf16
latent rows: 2.25 MiB at T = 2048, L2-resident; 36 MiB at T = 32768).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import sys
from typing import Callable, Optional

import torch

from kvkernels import ops
from kvkernels.bench.cuda_attention import (_ints, _row, ab_lines, attempt, copy_bandwidth, env_var, graphed,
                                            peer_lines, rotation_copies, row_text, skip_reason, time_paired_into)

RANK, ROPE, BLOCK = 512, 64, 64
NOPE, VDIM = 128, 128
DECODE_HEADS = (16, 128)
DECODE_BATCHES = (1, 16, 64, 128)
DECODE_CONTEXTS = (1024, 4096, 32768)
DECOMPRESS_TOKENS = (4096, 32768)
FP8_SCALE = 0.05
SCALE = (NOPE + ROPE) ** -0.5
DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
DEVICE = "cuda"  # where the cases' data lives (the tests run the cases' arithmetic on "cpu")
# --decompress-variants names = KVKERNELS_CUDA_DECOMPRESS values (csrc/cuda/mla_decompress.cu).
DECOMPRESS_VARIANTS = ("persist", "persist64", "persist128", "tile64", "wgmma")
# --mla-attn-variants names -> (KVKERNELS_CUDA_MLA_PATH, KVKERNELS_CUDA_WGMMA, KVKERNELS_CUDA_MLA_SCHED)
# (csrc/cuda/mla_attention.cu); -meta: the split plan of the metadata pass (mla_sched.cuh).
ATTN_VARIANTS = {"mma": (None, None, None), "wgmma": ("wgmma", "require", None),
                 "wgmma-seesaw": ("wgmma-seesaw", "require", None), "wgmma-meta": ("wgmma", "require", "metadata"),
                 "wgmma-seesaw-meta": ("wgmma-seesaw", "require", "metadata")}


def _names_of(known, what: str) -> Callable[[str], list[str]]:
    """The parser of a comma-separated list of distinct names of ``known`` (``what`` names them in errors):
    --decompress-variants (DECOMPRESS_VARIANTS), --mla-attn-variants (ATTN_VARIANTS)."""
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        bad = [x for x in names if x not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {bad}: choose from {tuple(known)}")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"a {what} named twice: {names}")
        return names
    return parse


def _mixed_batches(text: str) -> list[list[int]]:
    """--mla-mixed: comma-separated batches, each LENxCOUNT terms joined by + (32768x1+1024x63)."""
    batches = []
    for spec in (x for x in text.split(",") if x):
        try:
            lens = [int(n) for term in spec.split("+") for n, k in [term.split("x")] for _ in range(int(k))]
        except ValueError:
            raise argparse.ArgumentTypeError(f"a mixed batch is LENxCOUNT[+LENxCOUNT...], not {spec!r}") from None
        if not lens or min(lens) < 0:
            raise argparse.ArgumentTypeError(f"a mixed batch needs sequences of lengths >= 0: {spec!r}")
        batches.append(lens)
    return batches


_variants = _names_of(DECOMPRESS_VARIANTS, "decompress variant")
_attn_variants = _names_of(ATTN_VARIANTS, "MLA decode variant")


@contextlib.contextmanager
def attn_variant_env(name: Optional[str]):
    """The environment of a --mla-attn-variants name inside the block (None: unchanged)."""
    if name is None:
        yield
        return
    path, wgmma, sched = ATTN_VARIANTS[name]
    with env_var("KVKERNELS_CUDA_MLA_PATH", path), env_var("KVKERNELS_CUDA_WGMMA", wgmma), \
            env_var("KVKERNELS_CUDA_MLA_SCHED", sched):
        yield


def decompress_env(value: Optional[str]):
    """KVKERNELS_CUDA_DECOMPRESS = value (None: unchanged) inside the block."""
    return env_var("KVKERNELS_CUDA_DECOMPRESS", value, none_unsets=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CUDA MLA")
    g.add_argument("--mla-batches", type=_ints, default=list(DECODE_BATCHES))
    g.add_argument("--mla-contexts", type=_ints, default=list(DECODE_CONTEXTS))
    g.add_argument("--mla-heads", type=_ints, default=list(DECODE_HEADS))
    g.add_argument("--mla-dtypes", default="bfloat16,fp8_e4m3", help="latent cache dtypes")
    g.add_argument("--mla-decompress-tokens", type=_ints, default=list(DECOMPRESS_TOKENS))
    g.add_argument("--decompress-variants", type=_variants, default=[],
                   help="A/B of the mla_decompress kernels, e.g. tile64,persist (KVKERNELS_CUDA_DECOMPRESS values): "
                        "each decompress case times them and the torch matmul in alternating batches")
    g.add_argument("--mla-attn-variants", type=_attn_variants, default=[],
                   help="A/B of the decode kernels, e.g. mma,wgmma,wgmma-seesaw,wgmma-meta (alternating batches, "
                        "same data)")
    g.add_argument("--mla-mixed", type=_mixed_batches, default=[],
                   help="decode batches of mixed lengths after the uniform ones, e.g. 32768x1+1024x63 (one 32k and 63 "
                        "1k sequences); several separated by commas")
    g.add_argument("--mla-prefill-tokens", type=_ints, default=[],
                   help="MLA prefill end to end (mla_decompress + paged_attention vs torch.matmul + SDPA), "
                        "causal, one sequence of each of these lengths, at each --mla-heads")
    g.add_argument("--mla-graph", action="store_true",
                   help="time every decode row (each variant, or kvkernels, and the dense torch reference) as a "
                        "replayed CUDA graph of one call per data copy: an eager call carries ~40 us of host time "
                        "on the H200 machine, more than a b1 decode's GPU time")
    g.add_argument("--no-mla-dense", action="store_true",
                   help="skip the decode cases' dense bfloat16 torch reference row (torch-dense-bf16)")
    g.add_argument("--mla-reps", type=int, default=10, help="timed batches per implementation")
    g.add_argument("--mla-min-ms", type=float, default=20.0, help="minimum milliseconds per timed batch")
    g.add_argument("--mla-rotate-mib", type=int, default=200, help="bytes between reuses of one data copy")
    g.add_argument("--mla-memory-fraction", type=float, default=0.7, help="of free GPU memory a case may use")
    g.add_argument("--quick", action="store_true", help="small shapes, few reps (a smoke run)")


def _defaults() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([])


def _fits(nbytes: int, args) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes <= args.mla_memory_fraction * free


class LatentCache:
    """``copies`` rotated copies of one latent layer [blocks, 64, 576], one shuffled block table; ``lens``: the
    sequences' lengths (default: all ``context``), each with its own blocks (table columns past them: block 0)."""

    def __init__(self, batch: int, context: int, dtype: torch.dtype, copies: int, gen: torch.Generator,
                 lens: Optional[list[int]] = None):
        self.lens = lens or [context] * batch
        per_seq = math.ceil(context / BLOCK)
        need = [math.ceil(n / BLOCK) for n in self.lens]
        num_blocks = sum(need)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
        ids = torch.zeros(batch, per_seq, dtype=torch.int64)
        for i, start in enumerate(itertools.accumulate([0] + need[:-1])):
            ids[i, :need[i]] = perm[start:start + need[i]]
        self.block_ids = ids.to(DEVICE)
        self.block_tables = self.block_ids.to(torch.int32)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32, device=DEVICE)
        fp8 = dtype == torch.float8_e4m3fn
        self.scale = torch.tensor([FP8_SCALE], device=DEVICE) if fp8 else None
        x = torch.randn(num_blocks, BLOCK, RANK + ROPE, generator=gen, device=DEVICE)
        first = (x / FP8_SCALE).clamp(-448, 448).to(dtype) if fp8 else x.to(dtype)
        self.caches = [first] + [first.clone() for _ in range(copies - 1)]
        self.batch, self.context = batch, context

    def rows(self, seq: int) -> torch.Tensor:
        """float32 latent rows [its length, 576] of one sequence (dequantized)."""
        x = self.caches[0][self.block_ids[seq]].reshape(-1, RANK + ROPE)[:self.lens[seq]].float()
        return x * self.scale if self.scale is not None else x


# ----------------------------------------------------------------------------------------------------
# decode: mla_paged_attention
# ----------------------------------------------------------------------------------------------------


def decode_case(dtype_name: str, heads: int, batch: int, context: int, copy_gbps: float, args,
                gen: torch.Generator, lens: Optional[list[int]] = None) -> list[dict]:
    """One decode case: ``batch`` sequences of ``context`` keys, or of the lengths ``lens`` (--mla-mixed; context is
    then the longest, GB/s and TFLOP/s count the keys of all)."""
    dtype = DTYPES[dtype_name]
    esize = torch.empty(0, dtype=dtype).element_size()
    keys = sum(lens) if lens else batch * context
    layer_bytes = sum(math.ceil(n / BLOCK) for n in (lens or [context] * batch)) * BLOCK * (RANK + ROPE) * esize
    case = (f"mla decode {dtype_name} h{heads} b{batch} ctx{context}" if lens is None else
            f"mla decode {dtype_name} h{heads} b{batch} mixed max{context} keys{keys}")
    variants = getattr(args, "mla_attn_variants", None) or []
    graph = getattr(args, "mla_graph", False)
    rows = [_row(case, "decode", dtype_name, batch, context, f"kvkernels-{v}" if variants else "kvkernels",
                 heads=heads) for v in (variants or [None])]
    row = rows[0]
    copies = rotation_copies(layer_bytes, args.mla_rotate_mib)
    if not _fits(layer_bytes * (copies + 1), args):
        copies = 1
        if not _fits(layer_bytes * 2, args):
            for r in rows:
                r["skipped"] = "does not fit in GPU memory"
            return rows
    data = LatentCache(batch, context, dtype, copies, gen, lens)
    q = torch.randn(batch, heads, RANK + ROPE, generator=gen, device=DEVICE).to(torch.bfloat16)

    def call(i):
        return ops.mla_paged_attention(q, data.caches[i % copies], data.block_tables, data.seq_lens,
                                       kv_lora_rank=RANK, scale=SCALE, kv_scale=data.scale)

    def check(result):
        out, _ = result
        diff = 0.0
        for s in range(min(2, batch)):
            rows = data.rows(s)
            w = (q[s].float() @ rows.T * SCALE).softmax(-1)
            diff = max(diff, float((w @ rows[:, :RANK] - out[s].float()).abs().max()))
        return diff, 2e-2

    if variants:
        calls, per = {}, {}
        for v, r in zip(variants, rows):
            others = [x for x in variants if x != v]
            r["note"] = (f"KVKERNELS_CUDA_MLA_PATH / _WGMMA / _MLA_SCHED = {ATTN_VARIANTS[v]}"
                         + (f"; timed in batches alternating with {', '.join(others)}" if others else ""))
            try:
                with attn_variant_env(v):
                    out = call(0)
                    torch.cuda.synchronize()
                r["max_abs_diff"], r["tolerance"] = check(out)
                r["checked"] = r["max_abs_diff"] <= r["tolerance"]
                with attn_variant_env(v):  # a graph holds the kernels the planner picked at capture
                    calls[r["impl"]], per[r["impl"]] = graphed(r, call, copies if graph else 0)
            except Exception as error:  # noqa: BLE001 - one failing variant must not end the run
                r["skipped"] = skip_reason(error)
                torch.cuda.synchronize()
        if calls:
            time_paired_into({r["impl"]: r for r in rows}, calls, args.mla_reps, args.mla_min_ms,
                             lambda impl: attn_variant_env(impl[len("kvkernels-"):]))
            for r in rows:  # a replay is `copies` calls
                if r["impl"] in calls and r["ms"]:
                    r["ms"] /= per[r["impl"]]
    else:
        attempt(row, call, args.mla_reps, args.mla_min_ms, check, graph_copies=copies if graph else 0)
    if not getattr(args, "no_mla_dense", False) and lens is None:  # (the dense reference needs equal lengths)
        rows.append(dense_decode_row(case, dtype_name, heads, batch, context, data, q, check, args))
    for r in rows:
        if r["impl"].startswith("kvkernels") and r.get("ms"):
            r["speedup_vs"] = {x["impl"]: x["ms"] / r["ms"] for x in rows if x is not r and x.get("ms")}
        if r.get("ms"):
            r["gbps"] = keys * (RANK + ROPE) * esize / (r["ms"] * 1e-3) / 1e9
            r["fraction_of_copy_bw"] = r["gbps"] / copy_gbps
            r["tflops"] = 2.0 * heads * keys * (2 * RANK + ROPE) / (r["ms"] * 1e-3) / 1e12
    del data
    return rows


def dense_decode_row(case: str, dtype_name: str, heads: int, batch: int, context: int, data: "LatentCache",
                     q: torch.Tensor, check: Callable, args) -> dict:
    """The absorbed decode as plain torch on contiguous bfloat16 latents (gathered, and dequantized for an fp8
    cache, outside the timing): scores = q @ latents^T (batched matmul), softmax in float32, then @ the first
    512 columns: the dense reference time of the issue. Skipped when the contiguous copy does not fit."""
    r = _row(case, "decode", dtype_name, batch, context, "torch-dense-bf16", heads=heads,
             note="bmm(q, latents^T) * scale, float32 softmax, bmm(p, latents[:, :, :512]) on contiguous bf16 "
                  "latents gathered outside the timing")
    if not _fits(batch * context * (RANK + ROPE) * 2 + batch * heads * context * 6, args):
        r["skipped"] = "a contiguous bf16 copy of the latents does not fit in GPU memory"
        return r
    lat = torch.stack([data.rows(s).to(torch.bfloat16) for s in range(batch)])  # [B, ctx, 576]

    def dense(i):
        p = (torch.bmm(q, lat.transpose(1, 2)).float() * SCALE).softmax(-1).to(torch.bfloat16)
        return torch.bmm(p, lat[:, :, :RANK]), None

    attempt(r, dense, args.mla_reps, args.mla_min_ms, check, graph_copies=1 if getattr(args, "mla_graph", False) else 0)
    del lat
    return r


def attn_variant_lines(rows: list[dict], variants: list[str]) -> list[str]:
    """--mla-attn-variants: each decode variant's time, TFLOP/s, GB/s and fraction of the copy bandwidth,
    and its speed-up over the first variant named (ab_lines)."""
    return ab_lines(rows, "decode", variants,
                    lambda r: f" ({r['tflops']:.0f} TFLOP/s, {r['gbps']:.0f} GB/s, {r['fraction_of_copy_bw']:.2f} of copy)")


# ----------------------------------------------------------------------------------------------------
# mla_decompress vs the GEMM alone
# ----------------------------------------------------------------------------------------------------


def decompress_case(dtype_name: str, tokens: int, heads: int, args, gen: torch.Generator) -> list[dict]:
    dtype = DTYPES[dtype_name]
    n = heads * (NOPE + VDIM)
    case = f"mla decompress {dtype_name} T{tokens} h{heads}"
    variants = getattr(args, "decompress_variants", None) or []
    impls = [f"kvkernels-{v}" for v in variants] if variants else ["kvkernels"]
    rows = [_row(case, "decompress", dtype_name, 1, tokens, impl, heads=heads)
            for impl in impls + ["torch-matmul"]]
    out_bytes = tokens * heads * (NOPE + ROPE + VDIM) * 2
    if not _fits(3 * out_bytes + 4 * tokens * (RANK + ROPE) * 4, args):
        for r in rows:
            r["skipped"] = "does not fit in GPU memory"
        return rows
    data = LatentCache(1, tokens, dtype, 1, gen)
    w = (torch.randn(n, RANK, generator=gen, device=DEVICE) * RANK ** -0.5).to(torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(RANK, generator=gen, device=DEVICE)).to(torch.bfloat16)

    def call(i):
        return ops.mla_decompress(data.caches[0], data.block_tables, data.seq_lens, w, kv_lora_rank=RANK,
                                  qk_nope_head_dim=NOPE, v_head_dim=VDIM, norm_weight=norm, scale=data.scale,
                                  num_tokens=tokens)

    def check(result):
        key, value = result
        lat = data.rows(0)[:256, :RANK]
        lat = lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()
        kv = (lat.to(torch.bfloat16).float() @ w.float().T).view(-1, heads, NOPE + VDIM)
        diff = max(float((kv[..., :NOPE] - key[:256, :, :NOPE].float()).abs().max()),
                   float((kv[..., NOPE:] - value[:256].float()).abs().max()))
        return diff, 5e-2

    base = rows[-1]
    if variants:
        decompress_variant_rows(rows, variants, call, check, data, w, norm, tokens, args)
    else:
        attempt(rows[0], call, args.mla_reps, args.mla_min_ms, check)
        latent = torch.randn(tokens, RANK, generator=gen, device=DEVICE).to(torch.bfloat16)
        attempt(base, lambda i: latent @ w.T, args.mla_reps, args.mla_min_ms)
    flops = 2.0 * tokens * RANK * n
    for r in rows:
        if r["ms"]:
            r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
    for r in rows[:-1]:
        if r["ms"] and base["ms"]:
            r["speedup_vs"] = {"torch-matmul": base["ms"] / r["ms"]}
    return rows


def decompress_variant_rows(rows: list[dict], variants: list[str], call: Callable[[int], object],
                            check: Callable, data: "LatentCache", w: torch.Tensor, norm: torch.Tensor,
                            tokens: int, args) -> None:
    """Fills rows (one per variant, then torch-matmul): each variant checked, then every variant and the
    matmul timed by ``time_paired`` on the same data (a variant that raises is skipped, the others run).
    The matmul multiplies this case's latent rows, gathered, normalized and rounded beforehand."""
    calls, settings = {}, {}
    for v, row in zip(variants, rows):
        others = [x for x in variants if x != v] + ["torch-matmul"]
        row["note"] = (f"KVKERNELS_CUDA_DECOMPRESS={v}; timed in batches alternating with {', '.join(others)}")
        try:
            with decompress_env(v):
                out = call(0)
                torch.cuda.synchronize()
            row["max_abs_diff"], row["tolerance"] = check(out)
            row["checked"] = row["max_abs_diff"] <= row["tolerance"]
            calls[row["impl"]], settings[row["impl"]] = call, v
        except Exception as error:  # noqa: BLE001 - one failing variant must not end the run
            row["skipped"] = skip_reason(error)
            torch.cuda.synchronize()
    lat = data.rows(0)[:, :RANK]
    lat = (lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()).to(torch.bfloat16)
    rows[-1]["note"] = "latent @ w_kv_b.T on this case's latent rows (gathered, normalized, bfloat16)"
    calls["torch-matmul"], settings["torch-matmul"] = (lambda i: lat @ w.T), None
    time_paired_into({r["impl"]: r for r in rows}, calls, args.mla_reps, args.mla_min_ms,
                     lambda impl: decompress_env(settings[impl]))


def decompress_variant_lines(rows: list[dict], variants: list[str]) -> list[str]:
    """--decompress-variants: each variant's time and TFLOP/s, its speed-up over the first variant named, and
    the torch matmul's time (ab_lines)."""
    return ab_lines(rows, "decompress", variants, lambda r: f" ({r['tflops']:.0f} TFLOP/s)" if r.get("tflops") else "",
                    peer=("torch-matmul", "torch-matmul"))


# ----------------------------------------------------------------------------------------------------
# MLA prefill end to end: mla_decompress + paged_attention vs torch.matmul + SDPA
# ----------------------------------------------------------------------------------------------------


PREFILL_CHECKED = 64  # the last queries of the sequence, checked against float32


def prefill_flops(tokens: int, heads: int) -> float:
    """The decompression GEMM (2 T R heads (dn + dv)) plus causal attention (2 (dn + P + dv) heads per visible
    (query, key) pair: T (T + 1) / 2 pairs)."""
    return 2.0 * tokens * RANK * heads * (NOPE + VDIM) + 2.0 * heads * (NOPE + ROPE + VDIM) * tokens * (tokens + 1) / 2


def prefill_case(dtype_name: str, tokens: int, heads: int, args, gen: torch.Generator) -> list[dict]:
    """The whole MLA prefill of one sequence of ``tokens`` new tokens over its latent cache, causal:
    ``kvkernels``: mla_decompress (RMSNorm + fp8 dequantization fused) into per-head K [T, h, 128 + 64] and
    V [T, h, 128], then paged_attention over them (the contiguous K / V viewed as a cache of 16-token blocks
    with an identity block table: no copy; Dv != Dk); ``torch-matmul+sdpa-cudnn`` / ``-flash``: the same GEMM
    by torch.matmul on latents already gathered, normalized and rounded to bfloat16 (outside the timing: a
    lower bound for any unfused implementation), the rotary key broadcast to the heads, then SDPA with the
    cuDNN backend (flash: V padded to 192, which it needs). Checked on the last queries against float32."""
    dtype = DTYPES[dtype_name]
    case = f"mla prefill {dtype_name} T{tokens} h{heads}"
    impls = ["kvkernels", "torch-matmul+sdpa-cudnn", "torch-matmul+sdpa-flash"]
    rows = [_row(case, "prefill", dtype_name, 1, tokens, impl, heads=heads) for impl in impls]
    kv_bytes = tokens * heads * (NOPE + ROPE + VDIM) * 2
    if tokens % 16 or not _fits(6 * kv_bytes + tokens * (RANK + ROPE) * 8, args):
        for r in rows:
            r["skipped"] = "tokens not a multiple of 16" if tokens % 16 else "does not fit in GPU memory"
        return rows
    data = LatentCache(1, tokens, dtype, 1, gen)
    w = (torch.randn(heads * (NOPE + VDIM), RANK, generator=gen, device=DEVICE) * RANK ** -0.5).to(torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(RANK, generator=gen, device=DEVICE)).to(torch.bfloat16)
    q = torch.randn(tokens, heads, NOPE + ROPE, generator=gen, device=DEVICE).to(torch.bfloat16)
    blocks = torch.arange(tokens // 16, dtype=torch.int32, device=DEVICE)[None]
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE)

    def ours(i):
        key, value = ops.mla_decompress(data.caches[0], data.block_tables, data.seq_lens, w, kv_lora_rank=RANK,
                                        qk_nope_head_dim=NOPE, v_head_dim=VDIM, norm_weight=norm, scale=data.scale,
                                        num_tokens=tokens)
        return ops.paged_attention(q, key.view(-1, 16, heads, NOPE + ROPE), value.view(-1, 16, heads, VDIM),
                                   blocks, seq_lens, qsl)[0]

    rows_f = data.rows(0)
    lat32 = rows_f[:, :RANK] * torch.rsqrt(rows_f[:, :RANK].pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()
    lat = lat32.to(torch.bfloat16)
    k_pe = rows_f[:, RANK:].to(torch.bfloat16)

    # float32 reference of the last PREFILL_CHECKED queries (keys from the bf16-rounded normalized latents, as
    # both implementations use them)
    kv32 = (lat.float() @ w.float().T).view(tokens, heads, NOPE + VDIM)
    k32 = torch.cat([kv32[..., :NOPE], k_pe.float()[:, None].expand(tokens, heads, ROPE)], -1)
    last = min(PREFILL_CHECKED, tokens)
    logits = torch.einsum("qhd,khd->hqk", q[-last:].float(), k32) * (NOPE + ROPE) ** -0.5
    mask = torch.arange(tokens, device=DEVICE)[None, :] > torch.arange(tokens - last, tokens, device=DEVICE)[:, None]
    expected = torch.einsum("hqk,khd->qhd", logits.masked_fill(mask, float("-inf")).softmax(-1), kv32[..., NOPE:])
    del kv32, k32, logits

    def check(out):
        return float((out[-last:].float() - expected).abs().max()), 2e-2

    from torch.nn.attention import SDPBackend, sdpa_kernel
    q4 = q.transpose(0, 1)[None]

    def torch_prefill(backend, pad_v: bool):
        def call(i):
            kv = (lat @ w.T).view(tokens, heads, NOPE + VDIM)
            k = torch.cat([kv[..., :NOPE], k_pe[:, None].expand(tokens, heads, ROPE)], -1).transpose(0, 1)[None]
            v = kv[..., NOPE:]
            if pad_v:
                v = torch.nn.functional.pad(v, (0, NOPE + ROPE - VDIM))
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q4, k, v.transpose(0, 1)[None], is_causal=True)
            return out[0, :, :, :VDIM].transpose(0, 1)
        return call

    attempt(rows[0], ours, args.mla_reps, args.mla_min_ms, check)
    cudnn = getattr(SDPBackend, "CUDNN_ATTENTION", None)
    if cudnn is None:
        rows[1]["skipped"] = "this torch has no SDPBackend.CUDNN_ATTENTION"
    else:
        attempt(rows[1], torch_prefill(cudnn, False), args.mla_reps, args.mla_min_ms, check)
    attempt(rows[2], torch_prefill(SDPBackend.FLASH_ATTENTION, True), args.mla_reps, args.mla_min_ms, check)
    rows[0]["note"] = ("mla_decompress (RMSNorm, fp8 dequantization fused) + paged_attention over the decompressed "
                       "K / V as 16-token blocks")
    rows[1]["note"] = rows[2]["note"] = "torch.matmul on pre-normalized bf16 latents + rope broadcast + SDPA"
    flops = prefill_flops(tokens, heads)
    for r in rows:
        if r.get("ms"):
            r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
    if rows[0].get("ms"):
        rows[0]["speedup_vs"] = {r["impl"]: r["ms"] / rows[0]["ms"] for r in rows[1:] if r.get("ms")}
    return rows


# ----------------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------------


def run(args: Optional[argparse.Namespace] = None,
        emit: Optional[Callable[[list[dict]], None]] = None) -> list[dict]:
    """Every case; one dict per (case, implementation), plus one "copy" row with the bandwidth.
    ``emit(rows)``, if given, gets each case's rows as soon as the case is done."""
    if args is None:
        args = _defaults()
    emit = emit or (lambda new_rows: None)
    if not torch.cuda.is_available():
        rows = [dict(case="cuda mla", kind="copy", impl="copy", skipped="no CUDA device")]
        emit(rows)
        return rows
    if args.quick:
        args.mla_batches, args.mla_contexts, args.mla_heads = [1, 16], [1024], [16]
        args.mla_decompress_tokens, args.mla_reps, args.mla_min_ms, args.mla_rotate_mib = [2048], 3, 2.0, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbps = copy_bandwidth(1 << 30 if not args.quick else 1 << 28, args.mla_reps)
    rows = [_row("copy bandwidth", "copy", "-", 0, 0, "copy", gbps=copy_gbps,
                 note="dst.copy_(src), bytes read + written per second")]
    emit(rows[:])
    dtypes = [d for d in args.mla_dtypes.split(",") if d]
    for dtype_name in dtypes:
        for heads in args.mla_heads:
            for batch in args.mla_batches:
                for context in args.mla_contexts:
                    new_rows = decode_case(dtype_name, heads, batch, context, copy_gbps, args, gen)
                    rows += new_rows
                    emit(new_rows)
            for lens in getattr(args, "mla_mixed", None) or []:
                new_rows = decode_case(dtype_name, heads, len(lens), max(lens), copy_gbps, args, gen, lens)
                rows += new_rows
                emit(new_rows)
    for dtype_name in dtypes:
        for tokens in getattr(args, "mla_prefill_tokens", None) or []:
            for heads in args.mla_heads:
                new_rows = prefill_case(dtype_name, tokens, heads, args, gen)
                rows += new_rows
                emit(new_rows)
    for dtype_name in dtypes:
        for tokens in args.mla_decompress_tokens:
            for heads in args.mla_heads:
                new_rows = decompress_case(dtype_name, tokens, heads, args, gen)
                rows += new_rows
                emit(new_rows)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="CUDA MLA benchmark (kvkernels issue 7)")
    add_arguments(parser)
    parser.add_argument("--json", help="write the rows to this file (rewritten after every case)")
    args = parser.parse_args(argv)
    done: list[dict] = []

    def emit(new_rows: list[dict]) -> None:
        done.extend(new_rows)
        for r in new_rows:
            ms, extra = row_text(r)
            check = ("" if r.get("checked") is None
                     else "ok" if r["checked"] else f"MISMATCH {r['max_abs_diff']:.3g}")
            print(f"{r['case']:<44} {r['impl']:<14} {ms:<18} {extra} {r.get('speedup_vs') or ''} {check}",
                  flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(done, f, indent=1)

    rows = run(args, emit)
    if args.mla_attn_variants:
        for line in attn_variant_lines(rows, args.mla_attn_variants):
            print("variant:", line)
    if args.decompress_variants:
        for line in decompress_variant_lines(rows, args.decompress_variants):
            print("variant:", line)
    for line in peer_lines(rows):  # ours against the dense decode reference and the torch prefill pipelines
        print("peer:", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fuzzer's worker process: builds one op call from a spec, runs it and the reference, returns a verdict.

tests/test_fuzz.py draws specs with hypothesis (plain dicts: op, sizes, dtypes, layouts, a data seed and at
most one perturbation) and sends them here; this process builds the tensors from the spec alone, calls the
op, and checks the contract of docs/ops.md:

- a valid call returns what ``kvkernels.reference`` returns (float64 oracle, the tolerances of
  ``helpers.TOLERANCES``; cache writes, copies and gathers byte for byte), writes nothing outside its
  outputs, and leaves its inputs byte-identical (a caller-provided out / lse: every element holds the
  reference's result, every byte around it is unchanged, the wrapper returns the given tensors);
- an invalid call raises ``RuntimeError("kvkernels.<op>: <argument>: ...")`` naming one of the op's
  arguments (the perturbed one, where the docs say which), before anything is written: every byte of every
  tensor argument's storage is unchanged.

A crash (SIGSEGV, SIGFPE, an ASan or UBSan abort) kills only this process; the parent records the spec as a
crash finding and starts a new worker. Protocol: length-prefixed pickles, specs on stdin, verdicts on the
original stdout (file descriptor 1 is pointed at stderr, so nothing the op or torch prints can corrupt it).
``python tests/fuzz_worker.py --spec '<repr of a spec>'`` runs one spec in the foreground (a reproducer).
"""

from __future__ import annotations

import functools
import math
import os
import pickle
import signal
import struct
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The repository's kvkernels, after PYTHONPATH (the parent points that at the package it imported).
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvkernels  # noqa: E402
from helpers import (alloc_kv_cache, assert_close, is_fp8, kv_views, make_paged_kv,  # noqa: E402
                     make_paged_mla, make_query, poison, query_start_loc, quantize, unaligned_copy, upcast)
from kvkernels import ops, reference  # noqa: E402

f32, f16, bf16, f64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = {"f32": f32, "f16": f16, "bf16": bf16, "f64": f64, "e4m3": E4M3, "e5m2": E5M2, "i32": torch.int32,
          "i64": torch.int64, "u8": torch.uint8, "bool": torch.bool}
FLOATS = ("f32", "bf16", "f16")
FP8 = {"e4m3": E4M3, "e5m2": E5M2}

OPS = ["reshape_and_cache", "paged_attention", "merge_attention_states", "copy_blocks", "swap_blocks",
       "gather_kv", "concat_and_cache_mla", "mla_decompress", "mla_paged_attention"]

# What each tensor argument is to its op: a float input read, a cache read or written in place, an index
# tensor, an fp8 scale, a per-head float32 vector, an lse input, swap_blocks' source.
ROLES = {
    "reshape_and_cache": dict(key="in", value="in", key_cache="rw", value_cache="rw", slot_mapping="index",
                              k_scale="scale", v_scale="scale"),
    "paged_attention": dict(query="in", key_cache="ro", value_cache="ro", block_tables="index",
                            seq_lens="index", query_start_loc="index", alibi_slopes="vec", sinks="vec",
                            k_scale="scale", v_scale="scale"),
    "merge_attention_states": dict(out_a="in", lse_a="lse", out_b="in", lse_b="lse"),
    "copy_blocks": dict(cache="rw", block_mapping="index"),
    "swap_blocks": dict(src="src", dst="rw", block_mapping="index"),
    "gather_kv": dict(key_cache="ro", value_cache="ro", block_tables="index", seq_lens="index",
                      k_scale="scale", v_scale="scale"),
    "concat_and_cache_mla": dict(kv_c="in", k_pe="in", kv_cache="rw", slot_mapping="index", scale="scale"),
    "mla_decompress": dict(kv_cache="ro", block_tables="index", seq_lens="index", w_kv_b="in",
                           norm_weight="in", scale="scale"),
    "mla_paged_attention": dict(q="in", kv_cache="ro", block_tables="index", seq_lens="index",
                                query_start_loc="index", kv_scale="scale"),
}
# The ops with a caller-provided-output twin (<op>_out, the wrappers' out= / lse=; docs/ops.md "Caller-provided
# outputs") and the argument whose dtype and device out must have. Their out / lse have the role "out": written
# by the op like a cache, but every element of them is overwritten (checked against the reference).
OUT_OPS = {"paged_attention": "query", "mla_paged_attention": "q", "merge_attention_states": "out_a"}
for _op in OUT_OPS:
    ROLES[_op].update(out="out", lse="out")
WRITES = {op: [a for a, r in roles.items() if r == "rw"] for op, roles in ROLES.items()}
# Ops whose results are compared byte for byte (NaN as NaN: fp8 NaN encodings may differ).
EXACT = {"reshape_and_cache", "copy_blocks", "swap_blocks", "gather_kv", "concat_and_cache_mla"}
# Which fp8 scale goes with which cache (a scale is read only when its cache is fp8).
SCALE_OF = {"k_scale": "key_cache", "v_scale": "value_cache", "scale": "kv_cache", "kv_scale": "kv_cache"}

# The perturbations each op is fuzzed with (None: the valid call as built).
KINDS = ["dtype", "mixfloat", "ndim", "zero", "shape", "laststride", "pad", "expand", "nonfinite", "bigdim",
         "hugetokens", "index", "scalar", "missing"]
# Perturbations of one op family only: bad caller-provided outputs, a value cache whose head dim is not
# allowed (or narrower, valid), an MLA latent cache with several kv heads.
EXTRA_KINDS = {"paged_attention": ["out", "headdim"], "merge_attention_states": ["out"],
               "mla_paged_attention": ["out", "mlaheads"], "concat_and_cache_mla": ["mlaheads"],
               "mla_decompress": ["mlaheads"]}
# "out" (16 cases) is drawn three times as often as one generic kind, so each case gets a few calls per 1000.
OP_KINDS = {op: KINDS + ["alias"] + [k for k in EXTRA_KINDS.get(op, []) for _ in range(3 if k == "out" else 1)]
            for op in OPS}

# Calls with NaN/inf inputs (or non-finite reference results) are compared with the reference, NaN
# positions included: docs/ops.md "Non-finite values" defines them on every path. What it leaves
# unspecified (a non-finite value whose float32 weight is exactly 0) is kept out by the perturbations.
# KVKERNELS_FUZZ_NONFINITE=shape-only checks such calls for "no crash, right shapes, inputs untouched" only.
COMPARE_NONFINITE = os.environ.get("KVKERNELS_FUZZ_NONFINITE", "") != "shape-only"

BIG = (2**31 + 8, 2**32 + 8)  # sizes that do not fit an int (multiples of 8: past the divisibility checks)


class Expect:
    """What a call must do: "valid" (succeed and match the reference), "error" (raise naming one of
    ``names``, or any argument of the op when ``names`` is None) or "either" (both allowed, each checked);
    "ref": whatever the reference does (its index checks raise the same errors as the ops)."""

    def __init__(self, kind, names=None, why="", arg=None, says=None, ref_same=False):
        self.kind, self.names, self.why, self.arg = kind, names, why, arg
        self.says = says  # a phrase the error message must contain
        self.ref_same = ref_same  # kvkernels.reference must reject the call naming the same argument


V = Expect("valid")


def X(why=""):
    return Expect("either", why=why)


def E(*names, why=""):
    return Expect("error", set(names) or None, why)


class Skip(Exception):
    """The perturbation does not apply to this call (no tensor of that kind, no token...)."""


# ----------------------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------------------


def gen_seed(gen):
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def copy_into(dst, src):
    if is_fp8(src.dtype) or src.dtype == torch.bool:
        dst.view(torch.uint8).copy_(src.view(torch.uint8))
    else:
        dst.copy_(src)
    return dst


def relayout(x, mode):
    """The same values in another memory layout: "contig", "pad" (unaligned rows of a wider NaN-filled
    allocation) or "transposed" (dims 0 and 1 swapped in memory); the last stride stays 1."""
    if x is None or mode == "contig" or x.dim() == 0:
        return x
    if mode == "pad":
        return unaligned_copy(x)
    if mode == "transposed" and x.dim() >= 2:
        base = poison(torch.empty(x.shape[1], x.shape[0], *x.shape[2:], dtype=x.dtype))
        return copy_into(base.transpose(0, 1), x)
    return x


def random_bytes(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=gen)
    if dtype.is_floating_point and not is_fp8(dtype):  # finite values: no NaN payloads to compare
        return torch.randn(shape, generator=gen, dtype=f64).to(dtype)
    return raw.view(dtype).reshape(shape)


def paged_kv(cfg, gen):
    layout = cfg["layout"]
    kv = make_paged_kv(seq_lens=cfg["seq_lens"], num_kv_heads=cfg["hkv"], head_dim=cfg["d"],
                       block_size=cfg["block_size"], dtype=DTYPES[cfg["dtype"]],
                       layout="NHD" if layout == "interleaved" else layout, fp8=cfg["fp8"],
                       per_head_scale=tuple(cfg["per_head"]), seed=gen_seed(gen),
                       extra_blocks=cfg["extra_blocks"], extra_cols=cfg["extra_cols"], head_dim_v=cfg.get("dv"))
    kc, vc = kv.key_cache, kv.value_cache
    if layout == "interleaved":  # vLLM: K and V side by side in one [N, B, H, Dk + Dv] allocation
        d, dv = kc.shape[-1], vc.shape[-1]
        both = poison(torch.empty(*kc.shape[:-1], d + dv, dtype=kc.dtype))
        kc, vc = copy_into(both[..., :d], kc), copy_into(both[..., d:], vc)
    k_scale, v_scale = kv.k_scale, kv.v_scale
    if not cfg["fp8"] and cfg.get("stray_scales"):  # scales next to a non-fp8 cache: ignored
        k_scale, v_scale = torch.rand(1, generator=gen) + 0.5, torch.rand(cfg["hkv"], generator=gen) + 0.5
    return kc, vc, kv.block_tables, kv.seq_lens, k_scale, v_scale


def slots_for(t, num_slots, gen, skip_every):
    """Distinct slots for t tokens (tokens beyond the cache's slots, and every skip_every-th, skipped)."""
    slots = torch.randperm(max(num_slots, 1), generator=gen)[:t].to(torch.int64) if num_slots else \
        torch.empty(0, dtype=torch.int64)
    slots = torch.cat([slots, torch.full((t - slots.numel(),), -1, dtype=torch.int64)])
    if skip_every:
        slots[::skip_every] = torch.tensor([-1, -7, -(2**40), -(2**63)])[
            torch.arange(slots[::skip_every].numel()) % 4]
    return slots


def qsl_for(cfg):
    return None if cfg["q_lens"] is None else query_start_loc(cfg["q_lens"])


def given_output(shape, dtype, mode):
    """A NaN-poisoned caller-provided output (docs/ops.md "Caller-provided outputs") of ``shape``: "contig",
    "slice" (rows [:T] of a longer buffer: contiguous), "pad" (rows inside wider ones: the last dim padded),
    "transposed" (dims 0 and 1 swapped in memory: an lse [H, T] passed as .t()). Every byte of the storage
    around the view must still be NaN after the call."""
    if mode == "slice":
        return poison(torch.empty(shape[0] + 3, *shape[1:], dtype=dtype))[:shape[0]]
    return relayout(poison(torch.empty(shape, dtype=dtype)), {"contig": "contig", "pad": "pad",
                                                             "transposed": "transposed"}[mode])


def add_outputs(op, cfg, kw):
    """The call's out= / lse= (None: the allocating op), poisoned, of the shape the op returns."""
    kw["out"] = kw["lse"] = None
    if not cfg.get("out"):
        return kw
    kw["out"] = given_output(output_shape(op, kw, "out"), kw[OUT_OPS[op]].dtype, cfg["out"])
    if cfg.get("lse_out"):
        kw["lse"] = given_output(output_shape(op, kw, "lse"), f32, cfg["lse_out"])
    return kw


# ----------------------------------------------------------------------------------------------------------
# valid calls (keyword names = schema names)
# ----------------------------------------------------------------------------------------------------------


def build_reshape_and_cache(cfg, gen):
    t, h, d, n, b = cfg["t"], cfg["h"], cfg["d"], cfg["n"], cfg["block_size"]
    dv = cfg.get("dv") or d  # the value's own head dim
    dtype = DTYPES[cfg["dtype"]]
    cache_dtype = FP8[cfg["fp8"]] if cfg["fp8"] else dtype
    layout = cfg["layout"]
    if layout == "interleaved":
        both = poison(torch.empty(n, b, h, d + dv, dtype=cache_dtype))
        kc, vc = both[..., :d], both[..., d:]
    else:
        kc, vc = kv_views(alloc_kv_cache(layout, n, b, h, d, cache_dtype, head_dim_v=dv), layout, (d, dv))
    qkv = torch.randn(t, 4 + 2 * h, max(d, dv), generator=gen, dtype=f64).mul_(3).to(dtype)
    key = relayout(qkv[:, 4:4 + h, :d], cfg["in_layout"])
    value = relayout(qkv[:, 4 + h:, :dv], cfg["in_layout"])
    scales = {}
    if cfg["fp8"] or cfg.get("stray_scales"):
        pk, pv = cfg["per_head"]
        scales = dict(k_scale=0.01 + 0.04 * torch.rand(h if pk else 1, generator=gen),
                      v_scale=0.01 + 0.04 * torch.rand(h if pv else 1, generator=gen))
    return dict(key=key, value=value, key_cache=kc, value_cache=vc,
                slot_mapping=slots_for(t, n * b, gen, cfg["skip_every"]),
                k_scale=scales.get("k_scale"), v_scale=scales.get("v_scale"))


def build_paged_attention(cfg, gen):
    kc, vc, bt, sl, ks, vs = paged_kv(cfg, gen)
    q_lens = cfg["q_lens"] if cfg["q_lens"] is not None else [1] * len(cfg["seq_lens"])
    dtype = DTYPES[cfg["dtype"]]
    hq = cfg["hkv"] * cfg["group"]
    strided = {"contig": None, "pad": "fused", "transposed": "transposed"}[cfg["in_layout"]]
    query = make_query(sum(q_lens), hq, cfg["d"], dtype, gen, strided=strided)
    alibi = torch.tensor([2.0 ** (-8 * (h + 1) / hq) for h in range(hq)]) if cfg["alibi"] else None
    sinks = torch.randn(hq, generator=gen) * 2 if cfg["sinks"] else None
    return add_outputs("paged_attention", cfg, dict(
        query=query, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl, query_start_loc=qsl_for(cfg),
        scale=None if cfg["scale"] is None else cfg["scale"] / math.sqrt(cfg["d"]), window_left=cfg["window_left"],
        soft_cap=cfg["soft_cap"], alibi_slopes=alibi, sinks=sinks, k_scale=ks, v_scale=vs,
        causal=cfg.get("causal", True)))


def build_merge_attention_states(cfg, gen):
    t, h, d = cfg["t"], cfg["h"], cfg["d"]
    dtype = DTYPES[cfg["dtype"]]
    out = {}
    for side in "ab":
        out[f"out_{side}"] = relayout(torch.randn(t, h, d, generator=gen, dtype=f64).to(dtype), cfg["in_layout"])
        lse = torch.randn(t, h, generator=gen) * 3
        empty = torch.rand(t, h, generator=gen) < cfg["empty_frac"]  # sides that saw no key
        out[f"lse_{side}"] = relayout(lse.masked_fill(empty, float("-inf")), cfg["in_layout"])
    return add_outputs("merge_attention_states", cfg, out)


def block_tensor(shape, dtype, mode, gen):
    x = random_bytes(shape, dtype, gen)
    if mode == "permuted" and x.dim() >= 2:  # memory order reversed: no dim has unit stride but the last?
        base = torch.empty(tuple(reversed(shape)), dtype=dtype)
        return copy_into(base.permute(*reversed(range(x.dim()))), x)
    return relayout(x, mode)


def mapping_for(num_src, num_dst, n, gen, same):
    """n (src, dst) pairs: distinct destinations, never a source when src and dst are one tensor."""
    if same:
        perm = torch.randperm(num_dst, generator=gen)
        dst = perm[:n]
        pool = perm[n:]
        src = pool[torch.randint(0, max(pool.numel(), 1), (n,), generator=gen)] if n else pool[:0]
    else:
        dst = torch.randperm(num_dst, generator=gen)[:n]
        src = torch.randint(0, max(num_src, 1), (n,), generator=gen)
    return torch.stack([src, dst], dim=1).to(torch.int64).reshape(-1, 2)


def build_copy_blocks(cfg, gen):
    shape, bd = cfg["shape"], cfg["block_dim"]
    cache = block_tensor(shape, DTYPES[cfg["dtype"]], cfg["in_layout"], gen)
    nb = shape[bd]
    mapping = mapping_for(nb, nb, min(cfg["pairs"], nb // 2), gen, same=True)
    if cfg["map_layout"] == "transposed":
        mapping = mapping.t().contiguous().t()
    return dict(cache=cache, block_mapping=mapping, block_dim=bd - len(shape) if cfg["neg_dim"] else bd)


def build_swap_blocks(cfg, gen):
    shape, bd = cfg["shape"], cfg["block_dim"]
    dtype = DTYPES[cfg["dtype"]]
    dst_shape = list(shape)
    dst_shape[bd] = cfg["dst_blocks"]
    src = block_tensor(shape, dtype, cfg["in_layout"], gen)
    dst = block_tensor(dst_shape, dtype, cfg["out_layout"], gen)
    n = min(cfg["pairs"], cfg["dst_blocks"], shape[bd] if shape[bd] else 0)
    mapping = mapping_for(shape[bd], cfg["dst_blocks"], n, gen, same=False)
    if cfg["overlap"] and shape[bd] == cfg["dst_blocks"]:  # src is dst: every source read before any write
        src = dst
        mapping = mapping_for(shape[bd], cfg["dst_blocks"], n, gen, same=False)
    return dict(src=src, dst=dst, block_mapping=mapping, block_dim=bd - len(shape) if cfg["neg_dim"] else bd)


def build_gather_kv(cfg, gen):
    kc, vc, bt, sl, ks, vs = paged_kv(cfg, gen)
    return dict(key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl, k_scale=ks, v_scale=vs,
                num_tokens=sum(cfg["seq_lens"]) if cfg["with_num_tokens"] else None,
                out_dtype=DTYPES[cfg["out_dtype"]] if cfg["out_dtype"] else None)


def build_concat_and_cache_mla(cfg, gen):
    t, r, p, n, b = cfg["t"], cfg["r"], cfg["p"], cfg["n"], cfg["block_size"]
    dtype = DTYPES[cfg["dtype"]]
    cache_dtype = FP8[cfg["fp8"]] if cfg["fp8"] else dtype
    alloc = poison(torch.empty(n, b, r + p + (16 if cfg["cache_pad"] else 0), dtype=cache_dtype))
    x = torch.randn(t, r + p + 8, generator=gen, dtype=f64).mul_(2).to(dtype)
    kv_c, k_pe = relayout(x[:, :r], cfg["in_layout"]), relayout(x[:, r + 8:], cfg["in_layout"])
    scale = 0.01 + 0.04 * torch.rand(1, generator=gen) if cfg["fp8"] or cfg.get("stray_scales") else None
    return dict(kv_c=kv_c, k_pe=k_pe, kv_cache=alloc[..., :r + p],
                slot_mapping=slots_for(t, n * b, gen, cfg["skip_every"]), scale=scale)


def paged_mla(cfg, gen):
    mla = make_paged_mla(cfg["seq_lens"], cfg["r"], cfg["p"], cfg["block_size"], dtype=DTYPES[cfg["dtype"]],
                         fp8=cfg["fp8"], seed=gen_seed(gen), strided=cfg["cache_pad"])
    scale = mla.scale
    if not cfg["fp8"] and cfg.get("stray_scales"):
        scale = torch.rand(1, generator=gen) + 0.5
    return mla, scale


def build_mla_decompress(cfg, gen):
    mla, scale = paged_mla(cfg, gen)
    dtype = DTYPES[cfg["dtype"]]
    r, h, dn, dv = cfg["r"], cfg["h"], cfg["dn"], cfg["dv"]
    w = torch.randn(h * (dn + dv), r, generator=gen, dtype=f64).mul_(0.1).to(dtype)
    if cfg["in_layout"] == "transposed":
        w = w.t().contiguous().t()
    else:
        w = relayout(w, cfg["in_layout"])
    nw = (1 + 0.5 * torch.randn(r, generator=gen, dtype=f64)).to(dtype) if cfg["norm"] else None
    return dict(kv_cache=mla.kv_cache, block_tables=mla.block_tables, seq_lens=mla.seq_lens, w_kv_b=w,
                kv_lora_rank=r, qk_nope_head_dim=dn, v_head_dim=dv, norm_weight=nw, norm_eps=cfg["norm_eps"],
                scale=scale, num_tokens=sum(cfg["seq_lens"]) if cfg["with_num_tokens"] else None)


def build_mla_paged_attention(cfg, gen):
    mla, scale = paged_mla(cfg, gen)
    q_lens = cfg["q_lens"] if cfg["q_lens"] is not None else [1] * len(cfg["seq_lens"])
    width = cfg["r"] + cfg["p"]
    q = relayout(torch.randn(sum(q_lens), cfg["h"], width, generator=gen, dtype=f64).to(DTYPES[cfg["dtype"]]),
                 cfg["in_layout"])
    return add_outputs("mla_paged_attention", cfg, dict(
        q=q, kv_cache=mla.kv_cache, block_tables=mla.block_tables, seq_lens=mla.seq_lens, kv_lora_rank=cfg["r"],
        scale=cfg["scale_factor"] / math.sqrt(width), query_start_loc=qsl_for(cfg), kv_scale=scale))


BUILD = {op: globals()[f"build_{op}"] for op in OPS}


# ----------------------------------------------------------------------------------------------------------
# perturbations: each changes one thing of a valid call and says what the op must do
# ----------------------------------------------------------------------------------------------------------


def pick(seq, k):
    seq = list(seq)
    if not seq:
        raise Skip("nothing to pick from")
    return seq[k % len(seq)]


def tensor_args(op, kw, roles=None):
    return [a for a, r in ROLES[op].items() if isinstance(kw.get(a), torch.Tensor) and (roles is None or r in roles)]


def fp8_call(op, kw):
    caches = [a for a in ("key_cache", "kv_cache", "cache", "dst") if isinstance(kw.get(a), torch.Tensor)]
    return any(is_fp8(kw[a].dtype) for a in caches)


def scale_read(op, kw, arg):
    """Whether the op reads scale ``arg``: its cache is fp8."""
    cache = kw.get(SCALE_OF[arg])
    return isinstance(cache, torch.Tensor) and is_fp8(cache.dtype)


def is_block_op(op):
    return op in ("copy_blocks", "swap_blocks")


def p_dtype(op, kw, k, v):
    """A dtype no op takes for this argument (float64, integers, bool)."""
    arg = pick(tensor_args(op, kw), k)
    role = ROLES[op][arg]
    t = kw[arg]
    if role == "index":
        new = pick([torch.int32, torch.float32, torch.int16] if t.dtype == torch.int64 else
                   [torch.int64, torch.float32, torch.uint8], v)
        kw[arg] = t.to(new)
        return E(arg)
    new = pick([d for d in (f64, torch.int32, torch.int64, torch.bool, torch.uint8) if d != t.dtype], v)
    kw[arg] = t.to(new) if not is_fp8(t.dtype) else t.view(torch.uint8).to(new)
    if role == "out":
        return E(arg)
    if op == "copy_blocks" and arg == "cache":
        return V  # any dtype
    if role == "scale" and not scale_read(op, kw, arg):
        return V  # not read
    return E()


def p_mixfloat(op, kw, k, v):
    """Another float (or fp8) dtype for one float tensor."""
    arg = pick(tensor_args(op, kw, ("in", "ro", "rw", "src", "lse", "vec", "scale", "out")), k)
    role, t = ROLES[op][arg], kw[arg]
    choices = [f32, bf16, f16] + ([E4M3, E5M2] if role in ("ro", "rw", "src") else [])
    new = pick([d for d in choices if d != t.dtype], v)
    values = t.float()
    scale_arg = next((s for s, c in SCALE_OF.items() if c == arg and s in ROLES[op]), None)
    if is_fp8(t.dtype) and scale_arg:  # the stored values, dequantized with the call's scale
        values = reference.dequantize(t, kw[scale_arg])
    if is_fp8(new):  # requantized with the call's scale (or 0.05 when it has none: then an error)
        scale = kw.get(scale_arg) if scale_arg and kw.get(scale_arg) is not None else torch.tensor([0.05])
        per_head = values.dim() >= 2 and scale.numel() == values.shape[-2]
        kw[arg] = quantize(values, scale if per_head else scale.reshape(-1)[:1], new)
    else:
        kw[arg] = values.to(new)
    fp8_before = fp8_call(op, {**kw, arg: t})
    if role == "out":  # out has the query's dtype, lse float32: nothing else
        return E(arg)
    if op == "copy_blocks":
        return V
    if role == "scale":
        return E(arg) if scale_read(op, kw, arg) else V
    if arg in ("query", "q") and fp8_before:  # an fp8 cache takes any query dtype; a given out has the old one
        return V if kw.get("out") is None else E("out")
    if arg == "w_kv_b" and fp8_before and kw.get("norm_weight") is None:
        return V
    partner = {"mla_decompress": "w_kv_b", "mla_paged_attention": "q", "concat_and_cache_mla": "kv_c"}.get(op)
    if partner and arg == "kv_cache":  # the one cache of an MLA op: its partner's dtype, or fp8 with a scale
        scale = kw.get("kv_scale" if op == "mla_paged_attention" else "scale")
        if new == kw[partner].dtype or is_fp8(new) and scale is not None and scale.numel() == 1:
            return V
    return E()


def p_ndim(op, kw, k, v):
    """One more leading dim (or one fewer)."""
    arg = pick(tensor_args(op, kw), k)
    role, t = ROLES[op][arg], kw[arg]
    if v % 2 or t.dim() == 0 or t.shape[0] == 0:
        kw[arg] = t.unsqueeze(0)
    else:
        kw[arg] = t.select(0, 0)
    if role == "scale":  # read by its element count: 1, or one per kv head
        return V if kw[arg].numel() in (1, t.numel()) or not scale_read(op, kw, arg) else E(arg)
    if op == "copy_blocks" and arg == "cache":
        return V if kw["block_dim"] < 0 and kw[arg].dim() > t.dim() else X("block_dim now selects another dim")
    return E(arg) if role in ("index", "vec", "out") else E()


def p_zero(op, kw, k, v):
    """One dim of one tensor narrowed to size 0."""
    arg = pick([a for a in tensor_args(op, kw) if kw[a].dim() > 0], k)
    t = kw[arg]
    kw[arg] = t.narrow(v % t.dim(), 0, 0)
    return X()


def p_shape(op, kw, k, v):
    """One dim one shorter or one longer (the extra row NaN / -1)."""
    arg = pick([a for a in tensor_args(op, kw) if kw[a].dim() > 0], k)
    t = kw[arg]
    d = v % t.dim()
    if (v // 2) % 2 and t.shape[d] > 0:
        kw[arg] = t.narrow(d, 0, t.shape[d] - 1)
    else:
        extra = torch.empty(*t.shape[:d], 1, *t.shape[d + 1:], dtype=t.dtype)
        kw[arg] = torch.cat([t, poison(extra) if t.dtype != torch.bool else extra.fill_(False)], dim=d)
    if ROLES[op][arg] == "out":  # a wrong shape is an error, never a resize
        return Expect("error", {arg}, ref_same=True)
    return X()


def last_dim_strided(t):
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    return copy_into(wide[..., ::2], t)


def p_laststride(op, kw, k, v):
    """Stride 2 along the last dim: caches need stride 1 there (copy/swap tensors do not)."""
    arg = pick([a for a in tensor_args(op, kw) if kw[a].dim() > 0], k)
    role, t = ROLES[op][arg], kw[arg]
    kw[arg] = last_dim_strided(t)
    if role in ("ro", "rw") and not is_block_op(op) and t.shape[-1] > 1:
        return E(arg)
    return V


def p_pad(op, kw, k, v):
    """The same values in another layout with a unit last stride: valid for every tensor."""
    arg = pick([a for a in tensor_args(op, kw) if kw[a].dim() > 0], k)
    kw[arg] = relayout(kw[arg], pick(["pad", "transposed"], v))
    return V


def p_expand(op, kw, k, v):
    """A stride-0 (expand()ed) dim of size > 1: fine to read, an error to write."""
    cands = [(a, d) for a in tensor_args(op, kw) if ROLES[op][a] != "index"
             for d in range(kw[a].dim()) if kw[a].shape[d] > 1]
    arg, d = pick(cands, k + 7 * v)
    role, t = ROLES[op][arg], kw[arg]
    kw[arg] = t.narrow(d, 0, 1).expand(t.shape)
    if role in ("ro", "rw") and not is_block_op(op) and d == t.dim() - 1:
        return E(arg)  # a cache's last dim needs stride 1, empty or not
    if role == "rw":
        return E(arg) if t.numel() else V  # an empty output has no element to share
    if role == "out":
        return E(arg) if t.numel() else X("an empty expanded out")
    return V


def storage_view(like, storage_of, dtype=None, shape=None):
    """A contiguous tensor of ``like``'s shape and dtype placed inside ``storage_of``'s storage, overlapping
    ``storage_of``'s first element (or the end of the storage when it does not fit from there)."""
    dtype = dtype or like.dtype
    shape = tuple(like.shape if shape is None else shape)
    item = torch.empty(0, dtype=dtype).element_size()
    storage = storage_of.untyped_storage()
    numel = math.prod(shape)
    cap = storage.nbytes() // item
    if numel == 0 or storage_of.numel() == 0 or numel > cap:
        raise Skip("does not fit")
    start = storage_of.storage_offset() * storage_of.element_size() // item
    start = min(start, cap - numel)
    return torch.empty(0, dtype=dtype).set_(storage, start, shape)


def p_alias(op, kw, k, v):
    """An argument sharing memory with a tensor the op writes (swap_blocks' src may: valid). An op that writes
    nothing in place may read one tensor as two arguments (value_cache is key_cache, out_b is out_a): valid."""
    writes = written(op, kw)
    if not writes:
        pairs = [(a, b) for a in tensor_args(op, kw) for b in tensor_args(op, kw) if a < b and
                 ROLES[op][a] == ROLES[op][b] and kw[a].shape == kw[b].shape and kw[a].dtype == kw[b].dtype]
        a, b = pick(pairs, k)
        kw[b] = kw[a]
        return V
    out = pick(writes, k)
    if not kw[out].numel():
        raise Skip("an empty output shares memory with nothing")
    others = [a for a in tensor_args(op, kw) if a != out]
    arg = pick(others, v)
    role = ROLES[op][arg]
    if role == "rw":  # value_cache := key_cache
        if kw[arg].shape != kw[out].shape or kw[arg].dtype != kw[out].dtype:
            raise Skip("caches differ")
        kw[arg] = kw[out]
        return E(arg, out)
    kw[arg] = storage_view(kw[arg], kw[out])
    if role == "src":
        return Expect("ref", why="swap_blocks' src may overlap dst")
    # A scale next to a non-fp8 cache is not read, but it is an argument like any other: inside a written
    # tensor it is an error too (docs/ops.md, Common rules).
    return E(arg, out)


def byte_span(t):
    """[first, end) bytes of the storage that tensor ``t``'s elements lie in (empty: None)."""
    if not t.numel():
        return None
    es = t.element_size()
    first = t.storage_offset() * es
    last = first + sum((n - 1) * st * es for n, st in zip(t.shape, t.stride()) if n > 0)
    return first, last + es


def span_overlaps(kw, target):
    """The tensor arguments sharing a storage with kw[target] whose byte spans intersect its span."""
    t = kw[target]
    span = byte_span(t)
    out = []
    for a, x in kw.items():
        if a == target or not isinstance(x, torch.Tensor) or x.is_meta or span is None:
            continue
        if x.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            continue
        other = byte_span(x)
        if other is not None and other[0] < span[1] and span[0] < other[1]:
            out.append(a)
    return out


def written(op, kw):
    """The tensors this call writes: the caches of a write op, or the given out / lse."""
    return WRITES[op] + [a for a in ("out", "lse") if ROLES[op].get(a) == "out" and kw.get(a) is not None]


INDEX_ARGS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "block_mapping", "num_tokens")


def p_index(op, kw, k, v):
    """Index values at and beyond every boundary; the reference's index checks (docs/ops.md: the same errors
    as the ops) decide, and the boundary values below are errors whatever it says."""
    present = [a for a in INDEX_ARGS if a in ROLES[op] or a == "num_tokens" and "num_tokens" in kw]
    arg = pick([a for a in present if kw.get(a) is not None or a in ("query_start_loc", "num_tokens")], k)
    w = v // 16
    if arg == "slot_mapping":
        t = kw[arg] = kw[arg].clone()
        if not t.numel():
            raise Skip("no token")
        cache = kw.get("key_cache", kw.get("kv_cache"))
        num_slots = cache.shape[0] * cache.shape[1]
        tok = t.numel() - 1 if w % 2 else w % t.numel()  # the last token often: a kernel writing while checking
        val = pick([num_slots, num_slots + 1, 2**31, 2**40, 2**63 - 1, num_slots - 1, -1, -(2**63), -num_slots], v)
        if val == num_slots - 1:
            t[t == val] = -1  # one token per slot (duplicates store an unspecified one)
        t[tok] = val
        return E(arg) if val >= num_slots else V
    if arg == "block_mapping":
        t = kw[arg] = kw[arg].clone()
        if not t.numel():
            raise Skip("no pair")
        src_n = (kw["cache"] if op == "copy_blocks" else kw["src"]).shape[kw["block_dim"]]
        dst_n = (kw["cache"] if op == "copy_blocks" else kw["dst"]).shape[kw["block_dim"]]
        row, col = (t.shape[0] - 1 if w % 2 else w % t.shape[0]), (w // 2) % 2
        n = src_n if col == 0 else dst_n
        sub = v % 8
        if sub == 7 and t.shape[0] > 1:  # a duplicate destination
            t[row, 1] = t[(row + 1) % t.shape[0], 1]
            return E(arg)
        if sub == 6 and op == "copy_blocks":  # a destination that is a source
            t[row, 1] = t[(row + 1) % t.shape[0], 0] if t.shape[0] > 1 else t[row, 0]
            return E(arg)
        val = pick([n, n + 1, -1, 2**31, 2**63 - 1, -(2**63)], sub)
        t[row, col] = val
        return E(arg)
    if arg == "num_tokens":
        total = int(kw["seq_lens"].sum()) if isinstance(kw.get("seq_lens"), torch.Tensor) else 0
        kw[arg] = pick([total + 1, total - 1, -1, 2**31, 2**62, 2**63 - 1, total], v)
        return V if kw[arg] == total else E(arg)
    if arg == "query_start_loc":
        sl = kw["seq_lens"]
        if kw[arg] is None:  # decode: the same call as varlen with one query per sequence
            kw[arg] = torch.arange(sl.numel() + 1, dtype=torch.int32)
            return Expect("ref")
        t = kw[arg] = kw[arg].clone()
        i = w % t.numel()
        t[i] = pick([t[i] + 1, t[i] - 1, 2**31 - 1, -1, -(2**31), 0], v)
        return Expect("ref")
    if arg == "block_tables":
        t = kw[arg] = kw[arg].clone()
        lens = kw["seq_lens"].tolist()
        b = (kw.get("key_cache", kw.get("kv_cache"))).shape[1]
        n = (kw.get("key_cache", kw.get("kv_cache"))).shape[0]
        used = [(s, j) for s, ln in enumerate(lens) for j in range(-(-ln // b))]
        unused = [(s, j) for s in range(t.shape[0]) for j in range(-(-lens[s] // b), t.shape[1])]
        if (v // 8) % 4 == 0 and unused:  # junk past a sequence's blocks: never read
            s, j = pick(unused, w)
            t[s, j] = pick([-1, -(2**31), 2**31 - 1, n], v)
            return V
        s, j = pick(used, w)
        val = pick([n, n + 1, -1, -(2**31), 2**31 - 1, n - 1], v)
        t[s, j] = val
        return V if 0 <= val < n else E(arg)
    if arg == "seq_lens":
        t = kw[arg] = kw[arg].clone()
        if not t.numel():
            raise Skip("no sequence")
        s = w % t.numel()
        b = (kw.get("key_cache", kw.get("kv_cache"))).shape[1]
        cap = kw["block_tables"].shape[1] * b
        val = pick([cap, cap + 1, -1, 2**31 - 1, -(2**31), 0, int(t[s]) + 1, int(t[s]) - 1], v)
        t[s] = val
        if val > cap or val < 0:
            return E(arg)
        return Expect("ref")
    raise Skip(arg)


SCALARS = {
    "paged_attention": {
        "scale": [(float("nan"), "E"), (float("inf"), "E"), (float("-inf"), "E"), (0.0, "V"), ("neg", "V"),
                  (1e30, "huge"), (1e-30, "V"), (None, "V")],
        "soft_cap": [(-1.0, "E"), (float("nan"), "E"), (float("inf"), "E"), (1e-30, "V"), (1e30, "V"), (0.0, "V")],
        "window_left": [(2**31, "E"), (2**62, "E"), (2**31 - 1, "V"), (-2, "V"), (-(2**40), "V"), (0, "V")],
    },
    "mla_paged_attention": {
        "scale": [(float("nan"), "E"), (float("inf"), "E"), (0.0, "V"), ("neg", "V"), (1e30, "huge")],
        "kv_lora_rank": [(0, "E"), (-8, "E"), (7, "E"), (513, "E"), (520, "E"), (2**31, "E"), (2**63 - 1, "E"),
                         ("r-8", "rank"), ("r+8", "rank")],
    },
    "mla_decompress": {
        "kv_lora_rank": [(0, "E"), (-8, "E"), (7, "E"), (520, "E"), (2**32, "E"), ("r-8", "rank-w"),
                         ("r+8", "rank-w")],
        "qk_nope_head_dim": [(0, "E"), (-1, "E"), (2**31, "E"), (2**62, "E"), ("swap", "V")],
        "v_head_dim": [(0, "E"), (-5, "E"), (2**31 - 1, "E"), (2**63 - 1, "E"), ("swap", "V")],
        "norm_eps": [(float("nan"), "E"), (-1e-6, "E"), (float("-inf"), "E"), (float("inf"), "V"), (0.0, "V"),
                     (1e30, "V")],
    },
    "gather_kv": {
        "out_dtype": [(torch.int32, "E"), (E4M3, "E"), (f64, "E"), (torch.bool, "E"), (f32, "V"), (f16, "V"),
                      (bf16, "V")],
    },
    "copy_blocks": {"block_dim": [("ndim", "E"), ("-ndim-1", "E"), (2**40, "E"), (-(2**40), "E"), ("other", "R")]},
    "swap_blocks": {"block_dim": [("ndim", "E"), ("-ndim-1", "E"), (2**62, "E"), ("other", "R")]},
}


def p_scalar(op, kw, k, v):
    table = SCALARS.get(op)
    if not table:
        raise Skip("no scalar arguments")
    arg = pick(table, k)
    val, outcome = pick(table[arg], v)
    if val == "neg":  # a negative scale of the usual size (larger ones leave the tolerances' regime: f32
        # logits of |s| ~ 50 lose ~1e-5 relative, as any float32 attention would)
        default = kw["query"].shape[-1] ** -0.5 if op == "paged_attention" else None
        val = -(kw[arg] if kw[arg] is not None else default)
    elif val == "r-8":
        val = kw[arg] - 8
    elif val == "r+8":
        val = kw[arg] + 8
    elif val == "swap":
        kw["qk_nope_head_dim"], kw["v_head_dim"] = kw["v_head_dim"], kw["qk_nope_head_dim"]
        return V
    elif isinstance(val, str):
        ndim = (kw["cache"] if op == "copy_blocks" else kw["src"]).dim()
        val = {"ndim": ndim, "-ndim-1": -ndim - 1, "other": (kw["block_dim"] + 1 + v) % ndim}[val]
        if op == "swap_blocks" and outcome == "R" and any(
                a != b for d, (a, b) in enumerate(zip(kw["src"].shape, kw["dst"].shape)) if d != val):
            kw[arg] = val
            return E("src", "dst")  # sizes must match outside block_dim (the reference does not check them)
    kw[arg] = val
    if outcome == "rank":  # another split of the same rows: valid while it is a multiple of 8 within the row
        ok = 0 < val <= min(512, kw["kv_cache"].shape[-1]) and val % 8 == 0
        if kw.get("out") is not None:  # sized for the old rank
            return E("kv_lora_rank", "kv_cache", "out")
        return V if ok else E("kv_lora_rank", "kv_cache")
    if outcome == "huge":  # logits of ~1e30: float32 rounding of the dot products (1e-5 relative where they
        # cancel) is 1e24 absolute; no tolerance of helpers.TOLERANCES applies, so only the shapes are checked
        return Expect("valid", why="shape-only (scale 1e30: outside the tolerances' regime)")
    if outcome == "rank-w":  # w_kv_b's width no longer matches (or the rank is invalid)
        return E("kv_lora_rank", "w_kv_b", "kv_cache")
    return {"E": E(arg), "V": V, "R": Expect("ref")}[outcome]


def p_nonfinite(op, kw, k, v):
    """NaN / +inf / -inf in a few elements of a float tensor (a cache's stored rows included)."""
    arg = pick([a for a in tensor_args(op, kw) if kw[a].dtype.is_floating_point and kw[a].numel()], k)
    t = kw[arg]  # written in place, through the view (the call's tensors are fresh)
    flat_idx = torch.randint(0, t.numel(), (1 + v % 3,), generator=torch.Generator().manual_seed(v))
    val = pick([float("nan"), float("inf"), float("-inf")], v)
    idx = torch.unravel_index(flat_idx, t.shape)
    if is_fp8(t.dtype):
        src = torch.full((flat_idx.numel(),), val).to(t.dtype)
        t.view(torch.uint8)[idx] = src.view(torch.uint8)
    else:
        t[idx] = val
    if ROLES[op][arg] == "out":  # poison of another kind in a caller-provided output: overwritten
        return V
    e = Expect("valid", why="nonfinite")
    e.arg = arg
    return e


def p_bigdim(op, kw, k, v):
    """A dim expanded to a size that does not fit an int: an error naming an argument, before any copy."""
    table = {
        "reshape_and_cache": [("key", 1), ("value", 1), ("value", 2), ("slot_mapping", 0)],
        "paged_attention": [("query", 1), ("query", 0), ("alibi_slopes", 0), ("sinks", 0), ("k_scale", 0)],
        "merge_attention_states": [("out_a", 1), ("out_a", 0), ("lse_b", 1), ("out_b", 2)],
        "copy_blocks": [("cache", -1), ("cache", 0)],
        "swap_blocks": [("src", -1), ("dst", -1)],
        "gather_kv": [("k_scale", 0), ("v_scale", 0)],
        "concat_and_cache_mla": [("kv_c", 0), ("k_pe", 1), ("kv_c", 1), ("scale", 0)],
        "mla_decompress": [("norm_weight", 0), ("scale", 0)],
        "mla_paged_attention": [("q", 1), ("q", 0), ("kv_scale", 0)],
    }[op]
    arg, d = pick([(a, d) for a, d in table if isinstance(kw.get(a), torch.Tensor) and kw[a].dim()], k)
    t = kw[arg]
    d = d % t.dim()
    if t.shape[d] == 0 or op == "swap_blocks" and d == kw["block_dim"] % t.dim():
        raise Skip("empty, or swap_blocks' block dim (its size may differ between src and dst)")
    shape = list(t.shape)
    shape[d] = pick(BIG, v)
    kw[arg] = t.narrow(d, 0, 1).expand(shape)
    if ROLES[op][arg] == "scale" and not scale_read(op, kw, arg):
        return V  # not read
    return E()


TOKEN_ARGS = {"reshape_and_cache": ["key", "value", "slot_mapping"], "paged_attention": ["query"],
              "merge_attention_states": ["out_a", "lse_a", "out_b", "lse_b"],
              "concat_and_cache_mla": ["kv_c", "k_pe", "slot_mapping"], "mla_paged_attention": ["q"]}


def p_hugetokens(op, kw, k, v):
    """Every per-token input expand()ed to 2^40 tokens (a stride-0 token dim; with v odd also a last stride of 2,
    which the op must copy away): consistent shapes, but no call of that length can allocate what it needs, so
    the op must raise naming an argument (a length check, or an allocation that fails) before any copy or
    write, never crash or run for hours."""
    if op not in TOKEN_ARGS:
        raise Skip("no per-token input")
    for arg in TOKEN_ARGS[op]:
        t = kw[arg]
        row = t[:1] if t.shape[0] else torch.zeros(1, *t.shape[1:], dtype=t.dtype)
        if v % 2 and row.dim() > 1 and row.shape[-1] > 1:
            row = last_dim_strided(row)
        kw[arg] = row.expand(2**40, *t.shape[1:])
    return E()


def p_missing(op, kw, k, v):
    """An optional tensor left out, or one given that the call did not have."""
    opt = {"reshape_and_cache": ["k_scale", "v_scale"], "paged_attention": ["k_scale", "v_scale", "alibi_slopes",
           "sinks"], "gather_kv": ["k_scale", "v_scale"], "concat_and_cache_mla": ["scale"],
           "mla_decompress": ["scale", "norm_weight"], "mla_paged_attention": ["kv_scale"]}.get(op, [])
    opt = opt + (["out", "lse"] if op in OUT_OPS else [])
    if not opt:
        raise Skip("no optional tensor")
    arg = pick(opt, k)
    if arg in ("out", "lse"):  # lse= needs out=; out= alone is fine (docs/ops.md "Caller-provided outputs")
        if kw[arg] is not None:
            kw[arg] = None
        else:
            kw[arg] = fresh_output(op, kw, arg)
        if kw["lse"] is not None and kw["out"] is None:
            return Expect("error", {"lse"}, ref_same=True)
        return V
    if kw.get(arg) is not None:
        kw[arg] = None
        if ROLES[op][arg] == "scale":
            return E(arg) if scale_read(op, kw, arg) else V
        return V
    if ROLES[op][arg] == "scale":
        kw[arg] = torch.full((pick([1, 2, 3], v),), 0.03)
        if not scale_read(op, kw, arg):
            return V
        return Expect("either", why="a scale of 2 or 3 elements is per head where the cache has that many heads")
    if arg == "norm_weight":
        kw[arg] = (1 + 0.5 * torch.randn(kw["kv_lora_rank"], generator=torch.Generator().manual_seed(v),
                                         dtype=f64)).to(kw["w_kv_b"].dtype)
        return V
    hq = kw["query"].shape[1]
    kw[arg] = torch.randn(hq, generator=torch.Generator().manual_seed(v)) * (0.1 if arg == "alibi_slopes" else 2)
    return V


def output_shape(op, kw, arg):
    """The shape of the op's out ([T, Hq, Dv]; MLA [T, Hq, kv_lora_rank]; merge: out_a's) or lse ([T, Hq])."""
    like = kw[OUT_OPS[op]]
    t, h = like.shape[0], like.shape[1]
    if arg == "lse":
        return (t, h)
    width = {"paged_attention": lambda: kw["value_cache"].shape[-1], "merge_attention_states": lambda: like.shape[2],
             "mla_paged_attention": lambda: kw["kv_lora_rank"]}[op]()
    return (t, h, width)


def fresh_output(op, kw, arg):
    return poison(torch.empty(output_shape(op, kw, arg), dtype=f32 if arg == "lse" else kw[OUT_OPS[op]].dtype))


OUT_CASES = ["shape", "empty", "dtype", "device", "expand", "overlap-input", "is-input", "lse-shape", "lse-layout",
             "lse-dtype", "lse-device", "lse-in-out", "lse-overlap-input", "lse-without-out",
             "lse-in-padding", "beside-input"]


def p_out(op, kw, k, v):
    """A caller-provided out / lse the op must reject (docs/ops.md "Caller-provided outputs"): a wrong shape
    (never resized, an empty tensor included), dtype or device, a stride-0 dim, memory shared with an input (out
    is the query / out_a) or with each other, lse= without out=."""
    case = pick(OUT_CASES, k)
    CONTEXT["case"] = case
    if case in ("lse-in-padding", "beside-input"):
        return out_sharing_an_allocation(op, kw, case)
    like = kw[OUT_OPS[op]]
    if kw["out"] is None and case != "lse-without-out":
        kw["out"] = fresh_output(op, kw, "out")
    if case.startswith("lse") and case != "lse-without-out" and kw["lse"] is None:
        kw["lse"] = fresh_output(op, kw, "lse")
    out, lse = kw["out"], kw["lse"]
    if case == "shape":  # one dim one longer or one shorter
        d = v % 3
        shape = list(out.shape)
        shape[d] += 1 if (v // 3) % 2 or shape[d] == 0 else -1
        kw["out"] = poison(torch.empty(shape, dtype=out.dtype))
        return Expect("error", {"out"}, ref_same=True)
    if case == "empty":  # torch's out= would resize it (with a warning): here an error
        if out.numel() == 0:
            raise Skip("the right shape is empty")
        kw["out"] = torch.empty(0, dtype=out.dtype)
        return Expect("error", {"out"}, ref_same=True)
    if case == "dtype":
        kw["out"] = poison(torch.empty(out.shape, dtype=pick([d for d in (f32, f16, bf16, f64) if d != out.dtype], v)))
        return Expect("error", {"out"}, ref_same=True)
    if case == "device":
        kw["out"] = torch.empty(out.shape, dtype=out.dtype, device="meta")
        return Expect("error", {"out"}, ref_same=True)
    if case == "expand":
        dims = [d for d in range(3) if out.shape[d] > 1]
        if not dims or not out.numel():
            raise Skip("no dim of size > 1, or empty (no element to share)")
        d = pick(dims, v)
        kw["out"] = poison(out.narrow(d, 0, 1).clone()).expand(out.shape)
        return E("out")
    if case in ("overlap-input", "lse-overlap-input"):  # placed over (part of) an input's memory
        target = "out" if case == "overlap-input" else "lse"
        inputs = [a for a in tensor_args(op, kw) if ROLES[op][a] != "out"
                  and not (ROLES[op][a] == "scale" and not scale_read(op, kw, a))]
        arg = pick(inputs, v)
        kw[target] = storage_view(kw[target], kw[arg])
        # placed at arg's first element, or back from the storage's end: it may cover a neighbour too (the
        # key cache before a stacked value cache); any argument whose bytes it spans may be named
        return E(target, *span_overlaps(kw, target))
    if case == "is-input":  # out = query / out_a (an in-place merge)
        if like.shape != out.shape or not out.numel():
            raise Skip("out's shape differs from the input's, or empty (no element to share)")
        kw["out"] = like
        return E("out", OUT_OPS[op])
    if case == "lse-shape":
        kw["lse"] = poison(torch.empty(lse.shape[0], lse.shape[1] + 1 + v % 2, dtype=f32))
        return Expect("error", {"lse"}, ref_same=True)
    if case == "lse-layout":  # vLLM's [H, T] lse passed as it is, not as .t()
        if lse.shape[0] == lse.shape[1]:
            raise Skip("square lse")
        kw["lse"] = poison(torch.empty(lse.shape[1], lse.shape[0], dtype=f32))
        return Expect("error", {"lse"}, ref_same=True)
    if case == "lse-dtype":
        kw["lse"] = poison(torch.empty(lse.shape, dtype=pick([f64, bf16, f16], v)))
        return Expect("error", {"lse"}, ref_same=True)
    if case == "lse-device":
        kw["lse"] = torch.empty(lse.shape, dtype=f32, device="meta")
        return Expect("error", {"lse"}, ref_same=True)
    if case == "lse-in-out":  # lse inside out's memory
        kw["lse"] = storage_view(lse, out)
        return E("lse", "out")
    if case == "lse-without-out":
        kw["out"] = None
        if kw["lse"] is None:
            kw["lse"] = fresh_output(op, kw, "lse")
        return Expect("error", {"lse"}, ref_same=True)
    raise Skip(case)


def out_sharing_an_allocation(op, kw, case):
    """Valid: views of one allocation whose elements are disjoint (docs/ops.md, Common rules) -- lse in the
    padding bytes of out's rows, or out next to the query / out_a in rows holding both. The overlap checks
    must not reject them, and writing out (through a temporary when strided) must not touch the neighbour."""
    like_arg = OUT_OPS[op]
    like = kw[like_arg]
    t, h, w = output_shape(op, kw, "out")
    if case == "beside-input":
        wl = like.shape[-1]
        both = poison(torch.empty(t, h, wl + w, dtype=like.dtype))
        kw[like_arg] = copy_into(both[..., :wl], like)
        kw["out"] = both[..., wl:]
        return V
    es = like.element_size()
    row = -(-(w * es + 8) // 4) * 4  # bytes per row: 8 bytes of padding (lse's 4 among them), then out
    storage = poison(torch.empty(t * h * row, dtype=torch.uint8)).untyped_storage()
    kw["out"] = poison(torch.empty(0, dtype=like.dtype).set_(storage, 8 // es, (t, h, w),
                                                             (h * row // es, row // es, 1)))
    kw["lse"] = torch.empty(0, dtype=f32).set_(storage, 0, (t, h), (h * row // 4, row // 4))
    return V


def p_headdim(op, kw, k, v):
    """Head dims: the value cache narrowed to a multiple of 8 (another valid Dv), to one that is not, or a
    key / value cache 520 wide (past the CPU's 512): errors name key_cache / value_cache."""
    vc, kc = kw["value_cache"], kw["key_cache"]
    case = pick(["narrow8", "odd", "wide-v", "wide-k"], k)
    CONTEXT["case"] = case
    if case == "narrow8":
        if vc.shape[-1] < 16:
            raise Skip("Dv < 16")
        kw["value_cache"] = vc[..., :vc.shape[-1] - 8]
        # the given out was sized for the old Dv
        return E("out") if kw["out"] is not None else V
    if case == "odd":
        if vc.shape[-1] < 8:
            raise Skip("Dv < 8")
        kw["value_cache"] = vc[..., :vc.shape[-1] - 4]
        return E("value_cache", *(["out"] if kw["out"] is not None else []))  # the docs fix no order
    if case == "wide-v":
        kw["value_cache"] = torch.zeros(*vc.shape[:-1], 520, dtype=vc.dtype)
        return E("value_cache", *(["out"] if kw["out"] is not None else []))
    kw["key_cache"] = torch.zeros(*kc.shape[:-1], 520, dtype=kc.dtype)
    q = kw["query"]
    kw["query"] = torch.zeros(*q.shape[:-1], 520, dtype=q.dtype)
    return E("key_cache")


def p_mlaheads(op, kw, k, v):
    """An MLA latent cache [N, B, h_kv, R + P] (FlashMLA's tests run h_kv 1..8): rejected with a reason."""
    cache = kw["kv_cache"]
    h = pick([1, 2, 4, 8], v)
    kw["kv_cache"] = cache.unsqueeze(2).repeat(1, 1, h, 1) if cache.dtype != E4M3 and cache.dtype != E5M2 else \
        cache.view(torch.uint8).unsqueeze(2).repeat(1, 1, h, 1).view(cache.dtype)
    return Expect("error", {"kv_cache"}, says="several kv heads")


PERTURB = {name: globals()[f"p_{name}"] for name in KINDS + ["alias", "out", "headdim", "mlaheads"]}


# ----------------------------------------------------------------------------------------------------------
# checking
# ----------------------------------------------------------------------------------------------------------


class Finding(Exception):
    pass


def storages(kw):
    """{storage key: (tensor, uint8 copy of its whole storage)} of every tensor argument."""
    out = {}
    for name, t in kw.items():
        if isinstance(t, torch.Tensor) and not t.is_meta:  # a meta out / lse (the wrong device) has no data
            s = t.untyped_storage()
            key = (s.data_ptr(), s.nbytes())
            if key not in out:
                out[key] = (name, torch.empty(0, dtype=torch.uint8).set_(s).clone())
    return out


def storage_now(t):
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def check_untouched(kw, before, what):
    for key, (name, old) in before.items():
        t = next(x for x in kw.values() if isinstance(x, torch.Tensor) and not x.is_meta and
                 (x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()) == key)
        now = storage_now(t)
        if not torch.equal(now, old):
            diff = (now != old).nonzero().flatten()
            raise Finding(f"{what}: the storage of {name} changed ({diff.numel()} bytes, first at byte "
                          f"{diff[:4].tolist()})")


def check_written_only(kw, before, outs):
    """A valid call with caller-provided outputs: no byte of any storage changed except the elements of
    ``outs`` (padding around a strided out, the rest of a longer buffer and every input untouched)."""
    for key, (name, old) in before.items():
        t = next(x for x in kw.values() if isinstance(x, torch.Tensor) and
                 (x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()) == key)
        now = storage_now(t)
        allowed = torch.zeros(now.shape, dtype=torch.bool)
        for o in outs:
            if (kw[o].untyped_storage().data_ptr(), kw[o].untyped_storage().nbytes()) == key:
                byte_view(allowed, kw[o]).fill_(True)
        bad = (now != old) & ~allowed
        if bad.any():
            pos = bad.nonzero().flatten()
            raise Finding(f"the storage of {name} changed outside out / lse ({pos.numel()} bytes, first at byte "
                          f"{pos[:4].tolist()})")


def cloned_call(kw):
    """The call's arguments on copies of their storages (views keep offsets, strides and sharing)."""
    clones = {}
    out = {}
    for name, t in kw.items():
        if isinstance(t, torch.Tensor) and t.is_meta:
            out[name] = t
        elif isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            key = (s.data_ptr(), s.nbytes())
            if key not in clones:
                clones[key] = s.clone()
            out[name] = torch.empty(0, dtype=t.dtype).set_(clones[key], t.storage_offset(), t.shape, t.stride())
        else:
            out[name] = t
    return out


def byte_view(storage_u8, t):
    k = t.element_size()
    return storage_u8.as_strided((*t.shape, k), tuple(s * k for s in t.stride()) + (1,), t.storage_offset() * k)


def check_same_storages(op, kw, ref_kw):
    """Every byte of every argument's storage as the reference left its copy, except where both hold NaN in a
    tensor the op writes (fp8 NaN encodings may differ)."""
    seen = set()
    for name, t in kw.items():
        if not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key in seen:
            continue
        seen.add(key)
        now, ref = storage_now(t), storage_now(ref_kw[name])
        if torch.equal(now, ref):
            continue
        allowed = torch.zeros(now.shape, dtype=torch.bool)
        for w in WRITES[op]:
            out = kw[w]
            if (out.untyped_storage().data_ptr(), out.untyped_storage().nbytes()) != key:
                continue
            if not out.dtype.is_floating_point:
                continue
            both_nan = torch.isnan(out.float()) & torch.isnan(ref_kw[w].float())
            byte_view(allowed, out)[both_nan] = True
        bad = (now != ref) & ~allowed
        if bad.any():
            pos = bad.nonzero().flatten()
            raise Finding(f"{name}'s storage differs from the reference's in {pos.numel()} bytes, first at "
                          f"{pos[:4].tolist()}")


def assert_same(actual, expected, what):
    """Same dtype, shape, NaN positions, and bytes everywhere else."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise Finding(f"{what}: {actual.dtype} {list(actual.shape)} != reference {expected.dtype} "
                      f"{list(expected.shape)}")
    # fresh row-major copies: .contiguous() keeps a size-1 last dim's stride of 2 (an out with a strided last dim)
    a, e = [torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in (actual, expected)]
    na, ne = torch.isnan(a.float()), torch.isnan(e.float())
    if not torch.equal(na, ne):
        raise Finding(f"{what}: NaN positions differ ({int(na.sum())} vs {int(ne.sum())} in the reference)")
    k = a.element_size()
    ab, eb = a.view(torch.uint8).reshape(*a.shape, k), e.view(torch.uint8).reshape(*e.shape, k)
    if not torch.equal(ab[~na], eb[~ne]):
        raise Finding(f"{what}: values differ from the reference's")


# Float arguments handed to the reference in float64. Not w_kv_b / norm_weight: the reference's rounding of the
# normalised latent to w_kv_b's dtype (docs/ops.md, mla_decompress) needs that dtype.
UPCAST = {"query", "q", "out_a", "out_b", "key_cache", "value_cache", "kv_cache"}


def reference_args(op, kw):
    rk = cloned_call(kw)
    if op in EXACT:
        return rk, rk
    return rk, {a: (upcast(t) if a in UPCAST and isinstance(t, torch.Tensor) else t) for a, t in rk.items()}


def finite(*ts):
    return all(bool(torch.isfinite(t).all()) for t in ts if t.dtype.is_floating_point)


def check_reference_out(op, kw, ref_result):
    """kvkernels.reference with the same out= / lse= (on copies, in the op's dtypes): returns the given tensors,
    holding its own float64 result rounded to their dtypes."""
    res, err, rk = run_reference(op, kw, keep_outputs=True)
    if err is not None:
        raise Finding(f"the reference rejects the valid out= / lse= call: {type(err).__name__}: {str(err)[:400]}")
    if not (isinstance(res, tuple) and len(res) == 2 and res[0] is rk["out"] and res[1] is rk["lse"]):
        raise Finding("the reference's out= / lse= call did not return the given tensors")
    for name, got, want in zip(("out", "lse"), res, ref_result):
        if got is not None:
            assert_same(got, want.to(got.dtype), f"the reference's {name}= (vs its allocating call)")


def compare(op, kw, result, ref_result, undefined_inputs, shape_only=None):
    if op in ("reshape_and_cache", "copy_blocks", "swap_blocks", "concat_and_cache_mla"):
        return "compared"  # the storages are compared by check_same_storages
    if op == "gather_kv":
        for name, got, want in zip(("key", "value"), result, ref_result):
            assert_same(got, want, name)
        return "compared"
    names = {"mla_decompress": ("key", "value")}.get(op, ("out", "lse"))
    for name, got, want in zip(names, result, ref_result):
        dtype = f32 if name == "lse" else next(
            kw[a] for a in ("query", "q", "out_a", "w_kv_b") if a in kw).dtype
        given = kw.get(name) is got  # a caller-provided output: any strides
        if got.dtype != dtype or got.shape != want.shape or not (given or got.is_contiguous()):
            raise Finding(f"{name}: {got.dtype} {list(got.shape)} (contiguous: {got.is_contiguous()}), expected "
                          f"{dtype} {list(want.shape)} contiguous")
    # -inf lse (a row that sees no key) is a defined result; anything else non-finite is not, yet.
    defined = finite(*[w for n, w in zip(names, ref_result) if n != "lse"]) and all(
        not bool(torch.isnan(w).any() or torch.isposinf(w).any()) for n, w in zip(names, ref_result) if n == "lse")
    if shape_only:
        return shape_only
    if not COMPARE_NONFINITE and (undefined_inputs or not defined):
        return "shape-only (non-finite)"
    for name, got, want in zip(names, result, ref_result):
        try:
            assert_close(got, want, f32 if name == "lse" else got.dtype, msg=name)
        except AssertionError as e:
            raise Finding(str(e)) from None
    return "compared"


def arg_named(op, msg):
    """The argument an error message names: "kvkernels.<op>: <arg>: ..." (None when it names none)."""
    prefix = f"kvkernels.{op}: "
    if not msg.startswith(prefix):
        return None
    arg = msg[len(prefix):].split(":", 1)[0]
    return arg if arg in ARG_NAMES[op] else None


ARG_NAMES = {op: [a.name for name in (op, f"{op}_out") if hasattr(torch.ops.kvkernels, name)
                 for a in getattr(torch.ops.kvkernels, name).default._schema.arguments] for op in OPS}


def call_op(op, api, kw):
    if op not in OUT_OPS:
        fn = getattr(ops, op) if api == "ops" else getattr(torch.ops.kvkernels, op)
        return fn(**kw)
    kw = dict(kw)
    out, lse = kw.pop("out"), kw.pop("lse")
    if out is None and lse is None:
        fn = getattr(ops, op) if api == "ops" else getattr(torch.ops.kvkernels, op)
        return fn(**kw)
    if api == "ops" or out is None:  # lse= without out=: only the wrappers can be called so (out is required)
        result = getattr(ops, op)(**kw, out=out, lse=lse)
        if not (isinstance(result, tuple) and len(result) == 2 and result[0] is out and result[1] is lse):
            raise Finding(f"ops.{op}(out=, lse=) returned {type(result).__name__}, not (out, lse) themselves")
        return result
    result = getattr(torch.ops.kvkernels, f"{op}_out")(**kw, out=out, lse=lse)
    if result is not None:
        raise Finding(f"torch.ops.kvkernels.{op}_out returned {type(result).__name__}, not None")
    return out, lse


def run_reference(op, kw, keep_outputs=False):
    """(result, None, arguments) or (None, exception, arguments) of the reference, on copies of the arguments'
    storages (the arguments returned are those copies, before any upcast: what a write op wrote).
    ``keep_outputs``: pass out= / lse= on (their shape, dtype and device checks); else the reference returns
    its float64 result, compared with what the op wrote into them."""
    rk_storage, rk = reference_args(op, kw)
    if keep_outputs:
        rk = rk_storage  # not upcast: out has the query's dtype
    elif op in OUT_OPS:
        rk.pop("out"), rk.pop("lse")
    try:
        return getattr(reference, op)(**rk), None, rk_storage
    except Exception as e:  # noqa: BLE001 - any error of the reference is part of the verdict
        return None, e, rk_storage


def run_spec(spec):
    """Build, perturb, run and check one call. Returns the verdict's details; raises Finding."""
    if spec["isa"] in supported_isas():
        os.environ["KVKERNELS_CPU_ISA"] = spec["isa"]
    else:  # "best", or a path this CPU lacks: the kernels' own choice
        os.environ.pop("KVKERNELS_CPU_ISA", None)
    torch.set_num_threads(spec["threads"])
    op = spec["op"]
    gen = torch.Generator().manual_seed(spec["seed"])
    kw = BUILD[op](spec["cfg"], gen)
    expect, kind = V, "none"
    if spec.get("perturb"):
        kind, k, v = spec["perturb"]
        built = dict(kw)
        try:
            expect = PERTURB[kind](op, kw, k, v)
        except Skip:
            kind = "none"
        changed = [a for a in kw if kw[a] is not built[a]]
        CONTEXT.update(kind=kind, args=sorted(set(changed) | ({expect.arg} if expect.arg else set())))
    # NaN / inf put into a query, weight, scale, lse, ALiBi slope or sink: a result docs/ops.md does not
    # define yet (see COMPARE_NONFINITE). In a cache or an out_a / out_b they are defined where the reference
    # result is finite: rows the call must not read (unused slots, a side whose lse is -inf).
    undefined_inputs = kind == "nonfinite" and (
        ROLES[op].get(expect.arg) not in ("ro", "rw", "src", "out") and expect.arg not in ("out_a", "out_b"))
    CONTEXT["features"] = features(op, spec, kw)
    before = storages(kw)
    ref_result, ref_error, ref_storage_kw = None, None, None
    if expect.kind != "error":
        ref_result, ref_error, ref_storage_kw = run_reference(op, kw)
    try:
        result, error = call_op(op, spec["api"], kw), None
    except Finding:  # call_op's own checks of what an out= call returned
        raise
    except Exception as e:  # noqa: BLE001 - the verdict classifies it
        result, error = None, e
    if expect.kind == "ref":
        if ref_error is not None and arg_named(op, str(ref_error)):
            # An index argument the reference rejects: the op names the same one (docs/ops.md). Other
            # perturbations: the reference checks only index arguments, the op may find another fault first.
            named = arg_named(op, str(ref_error)) if kind == "index" else None
            expect = E(*([named] if named else []), why=f"the reference raises {str(ref_error)[:200]}")
        elif ref_error is None:
            expect = V
        else:
            expect = X("the reference fails with a non-kvkernels error")
    if error is not None:
        msg = f"{type(error).__name__}: {error}"
        if expect.kind == "valid":
            raise Finding(f"a valid call raised {msg[:600]}")
        if not isinstance(error, (RuntimeError, ValueError)):
            raise Finding(f"wrong exception type: {msg[:600]}")
        arg = arg_named(op, str(error))
        if arg is None:
            raise Finding(f"the error names no argument of {op} (expected 'kvkernels.{op}: <argument>: ...'): "
                          f"{msg[:600]}")
        if expect.kind == "error" and expect.names and arg not in expect.names:
            raise Finding(f"the error names {arg}, expected one of {sorted(expect.names)}: {msg[:600]}")
        if expect.says and expect.says not in str(error):
            raise Finding(f"the error does not say {expect.says!r}: {msg[:600]}")
        check_untouched(kw, before, "after the error")
        if expect.ref_same:  # shapes, dtypes, devices of out / lse: the reference checks them too
            _, ref_error, _ = run_reference(op, kw, keep_outputs=True)
            if ref_error is None or arg_named(op, str(ref_error)) != arg:
                raise Finding(f"the op raised naming {arg}, the reference "
                              f"{'accepted the call' if ref_error is None else 'raised ' + str(ref_error)[:300]}")
        return dict(outcome="error", kind=kind, arg=arg, features=CONTEXT["features"])
    if expect.kind == "error":
        raise Finding(f"no error (expected one naming {sorted(expect.names) if expect.names else 'an argument'}"
                      f"{': ' + expect.why if expect.why else ''})")
    if ref_error is not None:
        raise Finding(f"the op accepted a call the reference rejects: {type(ref_error).__name__}: "
                      f"{str(ref_error)[:600]}")
    if op in WRITES and WRITES[op]:
        check_same_storages(op, kw, ref_storage_kw)
    elif written(op, kw):
        check_written_only(kw, before, written(op, kw))
        result = tuple(t for t in result if t is not None)  # out= alone: lse is not compared
        check_reference_out(op, kw, ref_result)
    else:
        check_untouched(kw, before, "inputs after a valid call")
    how = compare(op, kw, result, ref_result, undefined_inputs, expect.why if expect.why.startswith("shape-only")
                  else None)
    return dict(outcome="valid", kind=kind, how=how, features=CONTEXT["features"])


CONTEXT = {}  # what run_spec perturbed, for the verdict of a finding


def features(op, spec, kw):
    """The newer parts of the contract this call exercises (tests/test_fuzz.py counts calls per feature)."""
    cfg, f = spec["cfg"], []
    if CONTEXT["kind"] in ("out", "headdim"):
        f.append(f"perturb {CONTEXT['kind']}: {CONTEXT['case']}")
    elif CONTEXT["kind"] == "mlaheads":
        f.append("perturb mlaheads")
    elif CONTEXT["kind"] == "alias" and written(op, kw) and not WRITES[op]:
        f.append("perturb alias: an input inside out/lse")
    elif CONTEXT["kind"] != "none" and set(CONTEXT["args"]) & {"out", "lse"}:
        f.append(f"perturb {CONTEXT['kind']} of out/lse")
    if op in OUT_OPS:
        if kw.get("out") is not None:
            f.append(f"out={cfg.get('out') or 'added'}" + ("" if kw.get("lse") is not None else ", no lse"))
        if kw.get("lse") is not None and cfg.get("lse_out"):
            f.append(f"lse={cfg['lse_out']}")
    if op in ("paged_attention", "mla_paged_attention") and cfg.get("q_lens") is not None:
        if any(q > n for q, n in zip(cfg["q_lens"], cfg["seq_lens"])):
            f.append("q_len > seq_len")
        if any(q > 0 and n == 0 for q, n in zip(cfg["q_lens"], cfg["seq_lens"])):
            f.append("seq_len 0 with queries")
    if op in ("paged_attention", "gather_kv", "reshape_and_cache"):
        d, dv = cfg["d"], cfg.get("dv") or cfg["d"]
        if dv != d:
            f.append("Dv > Dk" if dv > d else "Dv < Dk")
            if cfg["fp8"]:
                f.append("Dv != Dk, fp8")
            if cfg["layout"] != "NHD":
                f.append(f"Dv != Dk, {cfg['layout']}")
        if max(d, dv) > 256:
            f.append("head dim > 256")
    if op == "paged_attention":
        f.append(f"causal={cfg.get('causal', True)}")
    if op in ("paged_attention", "mla_paged_attention") and any(n >= 256 for n in cfg["seq_lens"]):
        f.append("seq_len >= 256 (split-KV possible)")
    return f


def selftest(spec):
    """What the harness must survive (tests/test_fuzz.py checks it): a signal, or a call that never returns."""
    if spec["cfg"]["do"] == "hang":
        while True:
            time.sleep(60)
    os.kill(os.getpid(), getattr(signal, spec["cfg"]["do"]))


def verdict(spec):
    if spec["op"] == "_selftest":
        selftest(spec)
    CONTEXT.clear()
    CONTEXT.update(kind="none", args=[])
    try:
        return dict(status="ok", **run_spec(spec))
    except Finding as f:
        return dict(status="finding", message=str(f), perturbed=f"{CONTEXT['kind']} {','.join(CONTEXT['args'])}",
                    features=CONTEXT.get("features", []))
    except Exception:  # noqa: BLE001 - a bug of the fuzzer itself (a builder failing): reported as such
        return dict(status="fuzzer-error", message=traceback.format_exc()[-3000:])


@functools.lru_cache(maxsize=None)
def supported_isas():
    out = []
    for name in ("portable", "avx2", "avx512", "avx512vbmi", "avx512bf16", "avx512amx"):
        os.environ["KVKERNELS_CPU_ISA"] = name
        try:
            if kvkernels.cpu_isa() == name:
                out.append(name)
        except RuntimeError:
            pass
    os.environ.pop("KVKERNELS_CPU_ISA", None)
    return tuple(out)


def limit_memory():
    """A worker not under ASan gets at most 8 GiB of address space (an allocation a bug sized from an
    unchecked argument fails instead of taking the machine); ASan reserves terabytes of shadow and cannot."""
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        return
    import resource
    limit = int(os.environ.get("KVKERNELS_FUZZ_WORKER_MEMORY", 8 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def serve():
    limit_memory()
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the verdict stream

    def send(obj):
        data = pickle.dumps(obj)
        out.write(struct.pack("<Q", len(data)) + data)
        out.flush()

    send(dict(isas=list(supported_isas()), pid=os.getpid()))
    while True:
        head = inp.read(8)
        if len(head) < 8:
            return
        spec = pickle.loads(inp.read(struct.unpack("<Q", head)[0]))
        send(verdict(spec))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--spec":
        import ast
        print(verdict(ast.literal_eval(sys.argv[2])))
    else:
        serve()

"""torch.library.opcheck on every op (schema incl. mutation annotations, fake kernels, autograd
registration, AOT dispatch with dynamic shapes), with non-contiguous and fp8 samples."""

import pytest
import torch

import kvkernels  # noqa: F401  (loads the extension and registers the fake kernels)
from helpers import generator, make_paged_kv, make_paged_mla, make_query, query_start_loc, randn

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def finite_(t):
    """Replace the NaN poison of unused cache slots by zeros (opcheck compares whole tensors)."""
    if t.dtype in (E4M3, E5M2):
        b = t.view(torch.uint8)
        b.masked_fill_(torch.isnan(t.float()), 0)
    else:
        t.nan_to_num_(0.0)
    return t


def paged(dtype=f32, layout="NHD", fp8=None, per_head=False, b=4, hkv=2, d=16, seq_lens=(5, 0, 9), seed=0,
          dv=None):
    kv = make_paged_kv(seq_lens=list(seq_lens), num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype,
                       layout=layout, fp8=fp8, per_head_scale=per_head, seed=seed, head_dim_v=dv)
    for t in kv.storage:
        finite_(t)
    return kv


def mla(dtype=f32, fp8=None, r=64, p=16, b=4, strided=False, seq_lens=(5, 0, 9)):
    m = make_paged_mla(list(seq_lens), r, p, b, dtype=dtype, fp8=fp8, seed=1, strided=strided)
    finite_(m.kv_cache)
    return m


def fused_pair(t, a, b, dtype, gen):
    """Two non-contiguous [t, a] and [t, b] slices of one [t, a + b + 8] buffer (like a fused projection)."""
    base = randn(t, a + b + 8, gen=gen, dtype=dtype)
    return base[:, :a], base[:, a + 8:]


def slots(kv, t, gen, skip=True):
    s = torch.randperm(kv.num_blocks * kv.block_size, generator=gen)[:t]
    if skip:
        s[0] = -1
    return s


# Each sample: () -> (args, kwargs). Tensors are built fresh for every test.

def rc_sample(dtype, layout, fp8=None, per_head=False, strided=False, dv=16):
    def build():
        gen = generator(2)
        kv = paged(dtype, layout, fp8, per_head, dv=dv)
        if strided:
            key, value = fused_pair(6, 32, 2 * dv, dtype, gen)
            key, value = key.reshape(6, 2, 16), value.reshape(6, 2, dv)
        else:
            key, value = randn(6, 2, 16, gen=gen, dtype=dtype), randn(6, 2, dv, gen=gen, dtype=dtype)
        return (key, value, kv.key_cache, kv.value_cache, slots(kv, 6, gen)), kv.scales
    return build


def pa_sample(dtype, layout, fp8=None, per_head=False, varlen=False, strided=None, dv=None, q_lens=None, **opts):
    def build():
        kv = paged(dtype, layout, fp8, per_head, hkv=2, dv=dv)
        nonlocal q_lens
        q_lens = q_lens or ([3, 0, 4] if varlen else [1, 1, 1])
        q = make_query(sum(q_lens), 4, 16, dtype, generator(3), strided=strided)
        qsl = query_start_loc(q_lens) if varlen else None
        return (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl), dict(opts, **kv.scales)
    return build


def merge_sample(dtype, transposed=False, with_inf=False):
    def build():
        gen = generator(4)
        out_a = randn(5, 3, 16, gen=gen, dtype=dtype)
        out_b = randn(3, 5, 16, gen=gen, dtype=dtype).transpose(0, 1) if transposed else randn(5, 3, 16, gen=gen,
                                                                                             dtype=dtype)
        lse_a, lse_b = randn(5, 3, gen=gen), randn(3, 5, gen=gen).t()
        if with_inf:
            lse_a[0] = float("-inf")
            lse_a[1, 0] = lse_b[1, 0] = float("-inf")
        return (out_a, lse_a, out_b, lse_b), {}
    return build


def cb_sample(kind):
    def build():
        gen = generator(5)
        mapping = torch.tensor([[0, 2], [3, 1], [3, 4]])
        if kind == "NHD":
            return (randn(6, 4, 2, 8, gen=gen), mapping), {}
        if kind == "stacked":
            return (randn(2, 2, 6, 4, 2, 8, gen=gen, dtype=bf16), mapping), dict(block_dim=2)
        cache = randn(6, 2, 4, 8, gen=gen).to(E4M3).transpose(1, 2)  # fp8 HND view, negative block_dim
        return (cache, mapping), dict(block_dim=-4)
    return build


def sb_sample(kind):
    def build():
        gen = generator(6)
        mapping = torch.tensor([[0, 6], [3, 1], [2, 0]])
        if kind == "NHD":
            return (randn(4, 4, 2, 8, gen=gen), randn(7, 4, 2, 8, gen=gen), mapping), {}
        if kind == "stacked":
            src = randn(2, 2, 4, 4, 2, 8, gen=gen, dtype=bf16)
            dst = randn(2, 2, 7, 4, 2, 8, gen=gen, dtype=bf16)
            return (src, dst, mapping), dict(block_dim=-4)
        src = randn(4, 2, 4, 8, gen=gen).to(E5M2).transpose(1, 2)
        dst = randn(7, 4, 2, 8, gen=gen).to(E5M2)
        return (src, dst, mapping), {}
    return build


def gk_sample(dtype, layout, fp8=None, per_head=False, num_tokens=False, out_dtype=None, dv=None):
    def build():
        kv = paged(dtype, layout, fp8, per_head, dv=dv)
        opts = dict(kv.scales, out_dtype=out_dtype, num_tokens=int(kv.seq_lens.sum()) if num_tokens else None)
        return (kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens), opts
    return build


def cm_sample(dtype, fp8=None, strided=False):
    def build():
        gen = generator(7)
        m = mla(dtype, fp8, strided=strided)
        kv_c, k_pe = fused_pair(5, 64, 16, dtype, gen)
        if not strided:
            kv_c, k_pe = kv_c.contiguous(), k_pe.contiguous()
        s = torch.randperm(m.kv_cache.shape[0] * 4, generator=gen)[:5]
        s[2] = -1
        return (kv_c, k_pe, m.kv_cache, s), dict(scale=m.scale)
    return build


def md_sample(dtype, fp8=None, norm=False, strided=False, num_tokens=False):
    def build():
        gen = generator(8)
        m = mla(dtype, fp8, strided=strided)
        w = randn(2 * (16 + 24), 64, gen=gen, dtype=dtype, std=0.125)
        opts = dict(norm_weight=randn(64, gen=gen, dtype=dtype) if norm else None, scale=m.scale,
                    num_tokens=int(m.seq_lens.sum()) if num_tokens else None)
        return (m.kv_cache, m.block_tables, m.seq_lens, w, 64, 16, 24), opts
    return build


def mp_sample(dtype, fp8=None, varlen=False, strided=None, q_lens=None):
    def build():
        m = mla(dtype, fp8)
        nonlocal q_lens
        q_lens = q_lens or ([3, 0, 4] if varlen else [1, 1, 1])
        q = make_query(sum(q_lens), 4, 80, dtype, generator(9), strided=strided)
        qsl = query_start_loc(q_lens) if varlen else None
        return (q, m.kv_cache, m.block_tables, m.seq_lens, 64, 0.125), dict(query_start_loc=qsl, kv_scale=m.scale)
    return build


def with_out(build, out_dim=None, strided=False, lse=True):
    """A sample of an allocating op turned into one of its *_out twin: the given out (a padded view when
    ``strided``) and lse (or none), NaN-filled; the written tensors are compared after the call."""
    def build_out():
        args, kwargs = build()
        first = args[0]
        t, h, d = first.shape
        d = out_dim or d
        out = torch.full((t, h, d + 8) if strided else (t, h, d), float("nan"), dtype=first.dtype)
        out = out[..., 4:4 + d] if strided else out
        given = torch.full((h, t), float("nan")).t() if lse and strided else (
            torch.full((t, h), float("nan")) if lse else None)
        return args, dict(kwargs, out=out, lse=given)
    return build_out


SAMPLES = {
    "reshape_and_cache": {
        "f32-NHD": rc_sample(f32, "NHD"),
        "bf16-HND-strided-key": rc_sample(bf16, "HND", strided=True),
        "e4m3-head-stacked": rc_sample(f32, "stacked", "e4m3", per_head=True),
        "e5m2-tensor-f16-HND": rc_sample(f16, "HND", "e5m2"),
        "dv8-bf16-stacked-strided": rc_sample(bf16, "stacked", strided=True, dv=8),
        "dv40-e4m3-NHD": rc_sample(f32, "NHD", "e4m3", dv=40),
    },
    "paged_attention": {
        "f32-decode-NHD": pa_sample(f32, "NHD"),
        "bf16-varlen-HND-strided-q-window-softcap": pa_sample(bf16, "HND", varlen=True, strided="fused",
                                                              window_left=3, soft_cap=2.0),
        "e4m3-head-f16-stacked-alibi-sinks": pa_sample(f16, "stacked", "e4m3", per_head=True, strided="transposed",
                                                      alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
                                                      sinks=torch.tensor([0.1, -0.2, 0.3, 1.0])),
        "e5m2-varlen-f32-scale": pa_sample(f32, "NHD", "e5m2", varlen=True, scale=0.3),
        "bf16-varlen-noncausal-window": pa_sample(bf16, "HND", varlen=True, window_left=2, causal=False),
        "f32-decode-noncausal-sinks": pa_sample(f32, "NHD", causal=False, sinks=torch.tensor([0.1, -0.2, 0.3, 1.0])),
        "f16-more-queries-than-keys": pa_sample(f16, "NHD", varlen=True, q_lens=[9, 2, 30]),
        "e4m3-more-queries-than-keys-noncausal": pa_sample(f32, "stacked", "e4m3", varlen=True, q_lens=[9, 2, 30],
                                                           causal=False),
        "dv8-f32-varlen-HND": pa_sample(f32, "HND", varlen=True, dv=8),
        "dv48-bf16-stacked-strided-q": pa_sample(bf16, "stacked", strided="fused", dv=48),
        "dv32-e4m3-f16-decode": pa_sample(f16, "NHD", "e4m3", dv=32, window_left=2),
        "dv32-bf16-varlen-noncausal": pa_sample(bf16, "NHD", varlen=True, dv=32, causal=False),
    },
    "paged_attention_out": {
        "f32-decode-NHD": with_out(pa_sample(f32, "NHD")),
        "bf16-varlen-HND-strided-out-no-lse": with_out(pa_sample(bf16, "HND", varlen=True, soft_cap=2.0),
                                                       strided=True, lse=False),
        "e4m3-head-f16-stacked-strided-out-and-lse": with_out(pa_sample(f16, "stacked", "e4m3", per_head=True,
                                                                        sinks=torch.tensor([0.1, -0.2, 0.3, 1.0])),
                                                              strided=True),
        "f32-varlen-noncausal-more-queries-than-keys": with_out(pa_sample(f32, "NHD", varlen=True, q_lens=[9, 2, 30],
                                                                          causal=False)),
        "dv32-bf16-varlen-noncausal-window-strided-out": with_out(
            pa_sample(bf16, "HND", varlen=True, dv=32, causal=False, window_left=2), out_dim=32, strided=True),
    },
    "merge_attention_states_out": {
        "f32": with_out(merge_sample(f32)),
        "bf16-transposed-strided-out": with_out(merge_sample(bf16, transposed=True), strided=True),
        "f16-inf-no-lse": with_out(merge_sample(f16, with_inf=True), lse=False),
    },
    "mla_paged_attention_out": {
        "f32-decode": with_out(mp_sample(f32), out_dim=64),
        "bf16-varlen-strided-out": with_out(mp_sample(bf16, varlen=True, strided="fused"), out_dim=64, strided=True),
        "e4m3-decode-no-lse": with_out(mp_sample(bf16, "e4m3"), out_dim=64, lse=False),
    },
    "merge_attention_states": {
        "f32": merge_sample(f32),
        "bf16-transposed": merge_sample(bf16, transposed=True),
        "f16-inf": merge_sample(f16, with_inf=True),
    },
    "copy_blocks": {"NHD": cb_sample("NHD"), "stacked-dim2": cb_sample("stacked"), "fp8-HND-neg-dim": cb_sample("fp8")},
    "swap_blocks": {"NHD": sb_sample("NHD"), "stacked-neg-dim": sb_sample("stacked"),
                    "fp8-transposed-src": sb_sample("fp8")},
    "gather_kv": {
        "f32-NHD": gk_sample(f32, "NHD"),
        "e4m3-HND-default-dtype": gk_sample(bf16, "HND", "e4m3", per_head=True),
        "bf16-stacked-num_tokens-f32": gk_sample(bf16, "stacked", num_tokens=True, out_dtype=f32),
        "dv24-f32-NHD": gk_sample(f32, "NHD", dv=24),
        "dv8-e5m2-stacked-num_tokens": gk_sample(f16, "stacked", "e5m2", num_tokens=True, dv=8),
    },
    "concat_and_cache_mla": {
        "f32": cm_sample(f32),
        "bf16-strided": cm_sample(bf16, strided=True),
        "e4m3": cm_sample(f32, "e4m3"),
    },
    "mla_decompress": {
        "f32": md_sample(f32),
        "bf16-norm-strided": md_sample(bf16, norm=True, strided=True),
        "e4m3-num_tokens": md_sample(f32, "e4m3", num_tokens=True),
    },
    "mla_paged_attention": {
        "f32-decode": mp_sample(f32),
        "bf16-varlen-strided": mp_sample(bf16, varlen=True, strided="fused"),
        "f32-more-queries-than-keys": mp_sample(f32, varlen=True, q_lens=[8, 1, 12]),
        "e4m3-decode": mp_sample(bf16, "e4m3", strided="transposed"),
    },
}

CASES = [pytest.param(op, build, id=f"{op}-{name}") for op, samples in SAMPLES.items()
         for name, build in samples.items()]


def has_fp8(args, kwargs):
    return any(isinstance(t, torch.Tensor) and t.dtype in (E4M3, E5M2) for t in (*args, *kwargs.values()))


@pytest.mark.parametrize("op,build", CASES)
def test_opcheck(op, build):
    args, kwargs = build()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if has_fp8(args, kwargs):
        # torch's SchemaCheckMode compares every tensor argument with allclose, which has no fp8 kernel
        # ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn', torch 2.13); test_schema runs on
        # the other samples of each op, which have the same schema.
        utils = utils[1:]
    torch.library.opcheck(getattr(torch.ops.kvkernels, op).default, args, kwargs, test_utils=utils)


# Which arguments each op writes (docs/ops.md); every other argument must be read-only in the schema.
WRITES = {"reshape_and_cache": {"key_cache", "value_cache"}, "copy_blocks": {"cache"}, "swap_blocks": {"dst"},
          "concat_and_cache_mla": {"kv_cache"}, "paged_attention_out": {"out", "lse"},
          "merge_attention_states_out": {"out", "lse"}, "mla_paged_attention_out": {"out", "lse"}}


@pytest.mark.parametrize("op", SAMPLES)
def test_schema_mutation_annotations(op):
    schema = getattr(torch.ops.kvkernels, op).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == WRITES.get(op, set())
    alias_sets = [a.alias_info.before_set for a in schema.arguments if a.alias_info is not None]
    assert len(alias_sets) == len(set(map(frozenset, alias_sets))), "each written tensor has its own alias set"
    if op in WRITES:
        assert len(schema.returns) == 0, "mutating ops return ()"
    else:
        assert all(r.alias_info is None for r in schema.returns), "outputs are fresh tensors"


def test_every_op_is_sampled():
    assert set(SAMPLES) == {"reshape_and_cache", "paged_attention", "merge_attention_states", "copy_blocks",
                            "swap_blocks", "gather_kv", "concat_and_cache_mla", "mla_decompress",
                            "mla_paged_attention", "paged_attention_out", "merge_attention_states_out",
                            "mla_paged_attention_out"}
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("kvkernels::")}
    assert "paged_attention_out" in registered
    assert registered <= set(SAMPLES), f"ops without opcheck samples: {registered - set(SAMPLES)}"

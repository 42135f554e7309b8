"""Bad input: every op raises RuntimeError("kvkernels.<op>: <argument>: ...") before writing anything.

Each case builds valid arguments for one op, breaks one thing, and checks the message names the argument
and that every tensor argument (caches above all) is bit-identical afterwards. Where a multi-token write
has one bad index, it is the LAST one, so a kernel that writes while validating is caught. Where docs/ops.md
leaves open which of two arguments is "the wrong one" (a key whose head_dim differs from the cache's), the
case accepts either name.

Both entry points are checked: the Python wrapper (kvkernels.ops) and the op itself (torch.ops.kvkernels).
"""

import pytest
import torch

from helpers import assert_bytes_equal, generator, quantize, randn
from kvkernels import ops

f32, f16, bf16, f64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
E4M3 = torch.float8_e4m3fn

# A small paged layout shared by the attention-like ops: 3 sequences, block size 4, 4 table columns.
SEQ_LENS = [5, 9, 1]
BLOCKS = [[3, 0], [5, 1, 6], [2]]
NUM_BLOCKS, BLOCK_SIZE, WIDTH = 8, 4, 4


def paged_table():
    table = torch.full((len(BLOCKS), WIDTH), -1, dtype=torch.int32)
    for i, ids in enumerate(BLOCKS):
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return table, torch.tensor(SEQ_LENS, dtype=torch.int32)


def cache_tensor(shape, dtype, fp8, gen, scale=0.05):
    x = randn(*shape, gen=gen)
    return quantize(x, torch.tensor([scale]), fp8) if fp8 else x.to(dtype)


def scale_tensor(fp8, n=1):
    return torch.full((n,), 0.05, dtype=f32) if fp8 else None


# ----------------------------------------------------------------------------------------------------
# valid arguments of each op (keyword names = schema names)
# ----------------------------------------------------------------------------------------------------


def reshape_and_cache_args(dtype=f32, fp8=None, t=4, h=2, d=16, dv=None):
    gen = generator(1)
    dv = d if dv is None else dv  # the value's head dim may differ from the key's
    return dict(key=randn(t, h, d, gen=gen, dtype=dtype), value=randn(t, h, dv, gen=gen, dtype=dtype),
                key_cache=cache_tensor((3, 4, h, d), dtype, fp8, gen),
                value_cache=cache_tensor((3, 4, h, dv), dtype, fp8, gen),
                slot_mapping=torch.randperm(12, generator=gen)[:t], k_scale=scale_tensor(fp8),
                v_scale=scale_tensor(fp8, h))


def paged_attention_args(dtype=f32, fp8=None, h=4, hkv=2, d=16, varlen=False, dv=None):
    gen = generator(2)
    table, lens = paged_table()
    q_lens = [2, 3, 1] if varlen else [1, 1, 1]
    dv = d if dv is None else dv  # the value's head dim may differ from the key's
    return dict(query=randn(sum(q_lens), h, d, gen=gen, dtype=dtype),
                key_cache=cache_tensor((NUM_BLOCKS, BLOCK_SIZE, hkv, d), dtype, fp8, gen),
                value_cache=cache_tensor((NUM_BLOCKS, BLOCK_SIZE, hkv, dv), dtype, fp8, gen),
                block_tables=table, seq_lens=lens,
                query_start_loc=torch.tensor([0, 2, 5, 6], dtype=torch.int32) if varlen else None,
                k_scale=scale_tensor(fp8), v_scale=scale_tensor(fp8, hkv))


def merge_attention_states_args(dtype=f32, t=5, h=3, d=16):
    gen = generator(3)
    return dict(out_a=randn(t, h, d, gen=gen, dtype=dtype), lse_a=randn(t, h, gen=gen),
                out_b=randn(t, h, d, gen=gen, dtype=dtype), lse_b=randn(t, h, gen=gen))


def copy_blocks_args(stacked=False):
    gen = generator(4)
    if stacked:
        return dict(cache=randn(3, 2, 6, 4, 2, 8, gen=gen), block_mapping=torch.tensor([[0, 3], [1, 4]]),
                    block_dim=2)
    return dict(cache=randn(6, 4, 2, 8, gen=gen), block_mapping=torch.tensor([[0, 3], [1, 4]]), block_dim=0)


def swap_blocks_args():
    gen = generator(5)
    return dict(src=randn(4, 4, 2, 8, gen=gen), dst=randn(8, 4, 2, 8, gen=gen),
                block_mapping=torch.tensor([[0, 5], [3, 7]]), block_dim=0)


def gather_kv_args(fp8=None, dv=None):
    args = paged_attention_args(fp8=fp8, dv=dv)
    del args["query"], args["query_start_loc"]
    return dict(args, num_tokens=None, out_dtype=None)


def concat_and_cache_mla_args(dtype=f32, fp8=None, r=64, p=16, t=4):
    gen = generator(6)
    return dict(kv_c=randn(t, r, gen=gen, dtype=dtype), k_pe=randn(t, p, gen=gen, dtype=dtype),
                kv_cache=cache_tensor((3, 4, r + p), dtype, fp8, gen),
                slot_mapping=torch.randperm(12, generator=gen)[:t], scale=scale_tensor(fp8))


def mla_decompress_args(dtype=f32, fp8=None, r=64, p=16, h=2, dn=16, dv=16):
    gen = generator(7)
    table, lens = paged_table()
    return dict(kv_cache=cache_tensor((NUM_BLOCKS, BLOCK_SIZE, r + p), dtype, fp8, gen), block_tables=table,
                seq_lens=lens, w_kv_b=randn(h * (dn + dv), r, gen=gen, dtype=dtype, std=0.1), kv_lora_rank=r,
                qk_nope_head_dim=dn, v_head_dim=dv, norm_weight=None, norm_eps=1e-6, scale=scale_tensor(fp8),
                num_tokens=None)


def mla_paged_attention_args(dtype=f32, fp8=None, r=64, p=16, h=4, varlen=False):
    gen = generator(8)
    table, lens = paged_table()
    q_lens = [2, 3, 1] if varlen else [1, 1, 1]
    return dict(q=randn(sum(q_lens), h, r + p, gen=gen, dtype=dtype),
                kv_cache=cache_tensor((NUM_BLOCKS, BLOCK_SIZE, r + p), dtype, fp8, gen), block_tables=table,
                seq_lens=lens, kv_lora_rank=r, scale=0.1,
                query_start_loc=torch.tensor([0, 2, 5, 6], dtype=torch.int32) if varlen else None,
                kv_scale=scale_tensor(fp8))


BUILDERS = {f.__name__[:-len("_args")]: f for f in (
    reshape_and_cache_args, paged_attention_args, merge_attention_states_args, copy_blocks_args,
    swap_blocks_args, gather_kv_args, concat_and_cache_mla_args, mla_decompress_args, mla_paged_attention_args)}


def call(api, op, kwargs):
    fn = getattr(ops, op) if api == "kvkernels.ops" else getattr(torch.ops.kvkernels, op)
    return fn(**kwargs)


APIS = ["kvkernels.ops", "torch.ops"]

# ----------------------------------------------------------------------------------------------------
# the valid base cases run
# ----------------------------------------------------------------------------------------------------

VALID = [(op, {}) for op in BUILDERS] + [
    ("reshape_and_cache", dict(fp8=E4M3)), ("paged_attention", dict(fp8=E4M3)),
    ("paged_attention", dict(varlen=True)), ("copy_blocks", dict(stacked=True)), ("gather_kv", dict(fp8=E4M3)),
    ("concat_and_cache_mla", dict(fp8=E4M3)), ("mla_decompress", dict(fp8=E4M3)),
    ("mla_paged_attention", dict(fp8=E4M3, varlen=True)),
    # The value's head dim differs from the key's (docs/ops.md).
    ("reshape_and_cache", dict(dv=8)), ("reshape_and_cache", dict(dv=32, fp8=E4M3)),
    ("paged_attention", dict(dv=8, varlen=True)), ("paged_attention", dict(dv=48, fp8=E4M3)),
    ("gather_kv", dict(dv=24)), ("paged_attention", dict(d=512)), ("paged_attention", dict(dv=512)),
]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("op,base", VALID, ids=[f"{op}{base}" for op, base in VALID])
def test_valid_base_case(op, base, api):
    call(api, op, BUILDERS[op](**base))


# ----------------------------------------------------------------------------------------------------
# the bad cases
# ----------------------------------------------------------------------------------------------------


def set_(**changes):
    return lambda a: a.update(changes)


def last_dim_strided(t):
    """The same values with last-dim stride 2."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def setitem(name, index, value):
    def mutate(a):
        a[name][index] = value
    return mutate


def over_capacity(a):
    """Sequence 1 needs WIDTH + 1 blocks; its table row holds WIDTH valid ids."""
    a["block_tables"][1] = torch.tensor([5, 1, 6, 7], dtype=torch.int32)
    a["seq_lens"][1] = WIDTH * BLOCK_SIZE + 1


def bad_block_id(value):
    """The last used entry of the last sequence that uses two blocks (seq 1, column 2)."""
    return setitem("block_tables", (1, 2), value)


def C(op, name, arg, mutate, **base):
    return pytest.param(op, base, mutate, arg, id=f"{op}-{name}")


RC, PA, MA = "reshape_and_cache", "paged_attention", "merge_attention_states"
CB, SB, GK = "copy_blocks", "swap_blocks", "gather_kv"
CM, MD, MP = "concat_and_cache_mla", "mla_decompress", "mla_paged_attention"
K_OR_CACHE = "key|key_cache"
Q_OR_CACHE = "query|key_cache"

CASES = [
    C(RC, "key-int32", "key", lambda a: a.update(key=a["key"].to(torch.int32))),
    C(RC, "value-float64", "value", lambda a: a.update(value=a["value"].double())),
    C(RC, "key-2d", "key", lambda a: a.update(key=a["key"][:, 0])),
    C(RC, "cache-dtype-ne-key", K_OR_CACHE, lambda a: a.update(key=a["key"].bfloat16(), value=a["value"].bfloat16())),
    C(RC, "value-cache-dtype", "value_cache", lambda a: a.update(value_cache=a["value_cache"].half())),
    C(RC, "fp8-no-k_scale", "k_scale", set_(k_scale=None), fp8=E4M3),
    C(RC, "fp8-v_scale-size3", "v_scale", set_(v_scale=torch.ones(3)), fp8=E4M3),
    C(RC, "fp8-k_scale-float64", "k_scale", set_(k_scale=torch.ones(1, dtype=f64)), fp8=E4M3),
    C(RC, "head_dim-mismatch", K_OR_CACHE, lambda a: a.update(key=a["key"][..., :8], value=a["value"][..., :8])),
    C(RC, "num_kv_heads-mismatch", K_OR_CACHE, lambda a: a.update(key=a["key"].repeat(1, 2, 1),
                                                                  value=a["value"].repeat(1, 2, 1))),
    C(RC, "value-shape", "value", lambda a: a.update(value=a["value"][:, :1])),
    C(RC, "value_cache-shape", "value_cache", lambda a: a.update(value_cache=a["value_cache"][:2])),
    C(RC, "value_cache-heads", "value_cache", lambda a: a.update(value_cache=a["value_cache"][:, :, :1])),
    C(RC, "value-head_dim-ne-value_cache", "value|value_cache",
      lambda a: a.update(value=a["value"][..., :8]), dv=16),
    C(RC, "value-head_dim-ne-value_cache-dv", "value|value_cache",
      lambda a: a.update(value_cache=a["value_cache"][..., :16]), dv=24),
    C(RC, "value-tokens", "value", lambda a: a.update(value=a["value"][:3]), dv=8),
    C(RC, "fp8-v_scale-size3-dv", "v_scale", set_(v_scale=torch.ones(3)), fp8=E4M3, dv=8),
    C(RC, "slot_mapping-length", "slot_mapping", lambda a: a.update(slot_mapping=a["slot_mapping"][:-1])),
    C(RC, "slot_mapping-int32", "slot_mapping", lambda a: a.update(slot_mapping=a["slot_mapping"].int())),
    C(RC, "value_cache-last-stride", "value_cache",
      lambda a: a.update(value_cache=last_dim_strided(a["value_cache"]))),
    C(RC, "slot-out-of-range-last", "slot_mapping", setitem("slot_mapping", -1, 12)),
    C(RC, "fp8-slot-out-of-range-last", "slot_mapping", setitem("slot_mapping", -1, 2**40), fp8=E4M3),

    C(PA, "query-float64", "query", lambda a: a.update(query=a["query"].double())),
    C(PA, "query-bf16-cache-f32", Q_OR_CACHE, lambda a: a.update(query=a["query"].bfloat16())),
    C(PA, "value_cache-dtype", "value_cache", lambda a: a.update(value_cache=a["value_cache"].half())),
    C(PA, "fp8-no-k_scale", "k_scale", set_(k_scale=None), fp8=E4M3),
    C(PA, "fp8-v_scale-size3", "v_scale", set_(v_scale=torch.ones(3)), fp8=E4M3),
    C(PA, "fp8-k_scale-f16", "k_scale", set_(k_scale=torch.ones(1, dtype=f16)), fp8=E4M3),
    C(PA, "head_dim-mismatch", Q_OR_CACHE, lambda a: a.update(query=a["query"][..., :8])),
    C(PA, "value_cache-heads", "value_cache", lambda a: a.update(value_cache=a["value_cache"][:, :, :1])),
    C(PA, "value_cache-block_size", "value_cache", lambda a: a.update(value_cache=a["value_cache"][:, :2])),
    C(PA, "value_cache-num_blocks", "value_cache", lambda a: a.update(value_cache=a["value_cache"][:6])),
    C(PA, "value_cache-head_dim-12", "value_cache", set_(), dv=12),
    C(PA, "value_cache-head_dim-520", "value_cache", set_(), dv=520),
    C(PA, "value_cache-head_dim-12-fp8", "value_cache", set_(), dv=12, fp8=E4M3),
    C(PA, "value_cache-dtype-dv", "value_cache", lambda a: a.update(value_cache=a["value_cache"].half()), dv=8),
    C(PA, "heads-not-multiple", Q_OR_CACHE, lambda a: a.update(query=a["query"][:, :3])),
    C(PA, "head_dim-12", Q_OR_CACHE, set_(), d=12),
    C(PA, "head_dim-520", Q_OR_CACHE, set_(), d=520),
    C(PA, "head_dim-mismatch-dv", Q_OR_CACHE, lambda a: a.update(query=a["query"][..., :8]), dv=32),
    C(PA, "key_cache-last-stride", "key_cache", lambda a: a.update(key_cache=last_dim_strided(a["key_cache"]))),
    C(PA, "block_tables-int64", "block_tables", lambda a: a.update(block_tables=a["block_tables"].long())),
    C(PA, "block-id-too-large", "block_tables", bad_block_id(NUM_BLOCKS)),
    C(PA, "block-id-negative", "block_tables", bad_block_id(-1)),
    C(PA, "seq_len-over-capacity", "seq_lens", over_capacity),
    C(PA, "seq_lens-int64", "seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].long())),
    C(PA, "seq_len-negative", "seq_lens", setitem("seq_lens", 2, -1)),
    C(PA, "block_tables-rows", "block_tables|seq_lens", lambda a: a.update(block_tables=a["block_tables"][:2])),
    C(PA, "decode-tokens-ne-seqs", "query|seq_lens", lambda a: a.update(query=a["query"][:2])),
    C(PA, "qsl-first-nonzero", "query_start_loc", set_(query_start_loc=torch.tensor([1, 2, 5, 6]).int()),
      varlen=True),
    C(PA, "qsl-decreasing", "query_start_loc", set_(query_start_loc=torch.tensor([0, 4, 3, 6]).int()),
      varlen=True),
    C(PA, "qsl-last-ne-tokens", "query_start_loc", set_(query_start_loc=torch.tensor([0, 2, 5, 5]).int()),
      varlen=True),
    # (A sequence with more queries than keys is allowed: tests/test_causal.py.) causal=False keeps
    # every index rule:
    C(PA, "noncausal-qsl-decreasing", "query_start_loc",
      set_(query_start_loc=torch.tensor([0, 4, 3, 6]).int(), causal=False), varlen=True),
    C(PA, "noncausal-block-id-too-large", "block_tables",
      lambda a: (bad_block_id(NUM_BLOCKS)(a), a.update(causal=False)), varlen=True),
    C(PA, "noncausal-seq_len-over-capacity", "seq_lens", lambda a: (over_capacity(a), a.update(causal=False))),
    C(PA, "qsl-int64", "query_start_loc", set_(query_start_loc=torch.tensor([0, 2, 5, 6])), varlen=True),
    C(PA, "qsl-length", "query_start_loc", set_(query_start_loc=torch.tensor([0, 2, 6]).int()), varlen=True),
    C(PA, "alibi-size", "alibi_slopes", set_(alibi_slopes=torch.ones(2))),
    C(PA, "alibi-float64", "alibi_slopes", set_(alibi_slopes=torch.ones(4, dtype=f64))),
    C(PA, "sinks-size", "sinks", set_(sinks=torch.ones(5))),

    C(MA, "lse_a-f16", "lse_a", lambda a: a.update(lse_a=a["lse_a"].half())),
    C(MA, "lse_a-shape", "lse_a", lambda a: a.update(lse_a=a["lse_a"][:, :2])),
    C(MA, "out_b-shape", "out_b", lambda a: a.update(out_b=a["out_b"][:4])),
    C(MA, "out_b-dtype", "out_b", lambda a: a.update(out_b=a["out_b"].half())),
    C(MA, "lse_b-shape", "lse_b", lambda a: a.update(lse_b=a["lse_b"][:4])),
    C(MA, "out_a-int32", "out_a", lambda a: a.update(out_a=a["out_a"].int(), out_b=a["out_b"].int())),

    C(CB, "src-out-of-range-last", "block_mapping", set_(block_mapping=torch.tensor([[0, 3], [6, 4]]))),
    C(CB, "dst-out-of-range-last", "block_mapping", set_(block_mapping=torch.tensor([[0, 3], [1, 6]]))),
    C(CB, "negative-id", "block_mapping", set_(block_mapping=torch.tensor([[0, 3], [-1, 4]]))),
    C(CB, "stacked-id-beyond-block_dim", "block_mapping", set_(block_mapping=torch.tensor([[0, 3], [5, 6]])),
      stacked=True),
    C(CB, "duplicate-dst", "block_mapping", set_(block_mapping=torch.tensor([[0, 3], [1, 3]]))),
    C(CB, "dst-is-source", "block_mapping", set_(block_mapping=torch.tensor([[0, 3], [3, 4]]))),
    C(CB, "dst-is-later-source", "block_mapping", set_(block_mapping=torch.tensor([[0, 3], [1, 4], [4, 5]]))),
    C(CB, "mapping-int32", "block_mapping", set_(block_mapping=torch.tensor([[0, 3], [1, 4]]).int())),
    C(CB, "mapping-n-by-3", "block_mapping", set_(block_mapping=torch.tensor([[0, 3, 1], [1, 4, 2]]))),
    C(CB, "mapping-1d", "block_mapping", set_(block_mapping=torch.tensor([0, 3]))),
    C(CB, "block_dim-4", "block_dim", set_(block_dim=4)),
    C(CB, "block_dim--5", "block_dim", set_(block_dim=-5)),

    C(SB, "shape-mismatch", "src|dst", lambda a: a.update(dst=a["dst"][:, :, :1])),
    C(SB, "dtype-mismatch", "src|dst", lambda a: a.update(dst=a["dst"].half())),
    C(SB, "ndim-mismatch", "src|dst", lambda a: a.update(dst=a["dst"][..., 0])),
    C(SB, "dst-out-of-range-last", "block_mapping", set_(block_mapping=torch.tensor([[0, 5], [3, 8]]))),
    C(SB, "src-out-of-range-last", "block_mapping", set_(block_mapping=torch.tensor([[0, 5], [4, 7]]))),
    C(SB, "negative-id", "block_mapping", set_(block_mapping=torch.tensor([[0, 5], [3, -1]]))),
    C(SB, "duplicate-dst", "block_mapping", set_(block_mapping=torch.tensor([[0, 5], [3, 5]]))),
    C(SB, "mapping-int32", "block_mapping", set_(block_mapping=torch.tensor([[0, 5], [3, 7]]).int())),
    C(SB, "mapping-n-by-3", "block_mapping", set_(block_mapping=torch.tensor([[0, 5, 0], [3, 7, 0]]))),
    C(SB, "block_dim-4", "block_dim", set_(block_dim=4)),

    C(GK, "num_tokens-wrong", "num_tokens", set_(num_tokens=sum(SEQ_LENS) + 1)),
    C(GK, "fp8-no-k_scale", "k_scale", set_(k_scale=None), fp8=E4M3),
    C(GK, "out_dtype-int32", "out_dtype", set_(out_dtype=torch.int32)),
    C(GK, "out_dtype-fp8", "out_dtype", set_(out_dtype=E4M3), fp8=E4M3),
    C(GK, "block-id-too-large", "block_tables", bad_block_id(NUM_BLOCKS)),
    C(GK, "value_cache-dtype", "value_cache", lambda a: a.update(value_cache=a["value_cache"].half())),
    C(GK, "seq_len-over-capacity", "seq_lens", over_capacity),
    C(GK, "seq_lens-int64", "seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].long())),
    C(GK, "value_cache-heads", "value_cache", lambda a: a.update(value_cache=a["value_cache"][:, :, :1]), dv=8),
    C(GK, "value_cache-block_size", "value_cache", lambda a: a.update(value_cache=a["value_cache"][:, :3]), dv=8),
    C(GK, "value_cache-last-stride", "value_cache",
      lambda a: a.update(value_cache=last_dim_strided(a["value_cache"])), dv=24),

    C(CM, "kv_c-int32", "kv_c", lambda a: a.update(kv_c=a["kv_c"].int())),
    C(CM, "k_pe-dtype", "k_pe", lambda a: a.update(k_pe=a["k_pe"].half())),
    C(CM, "k_pe-rows", "k_pe", lambda a: a.update(k_pe=a["k_pe"][:3])),
    C(CM, "width-mismatch", "kv_c|k_pe|kv_cache", lambda a: a.update(k_pe=a["k_pe"][:, :8])),
    C(CM, "cache-dtype-ne-kv_c", "kv_c|kv_cache", lambda a: a.update(kv_cache=a["kv_cache"].bfloat16())),
    C(CM, "kv_cache-last-stride", "kv_cache", lambda a: a.update(kv_cache=last_dim_strided(a["kv_cache"]))),
    C(CM, "fp8-no-scale", "scale", set_(scale=None), fp8=E4M3),
    C(CM, "fp8-scale-size2", "scale", set_(scale=torch.ones(2)), fp8=E4M3),
    C(CM, "slot-out-of-range-last", "slot_mapping", setitem("slot_mapping", -1, 12)),
    C(CM, "slot_mapping-length", "slot_mapping", lambda a: a.update(slot_mapping=a["slot_mapping"][:3])),
    # MLA latent caches with several kv heads are not supported (docs/ops.md): a message of their own.
    C(CM, "kv_cache-heads", "kv_cache", lambda a: a.update(kv_cache=a["kv_cache"][:, :, None].repeat(1, 1, 2, 1))),

    C(MD, "kv_lora_rank-ne-w", "kv_lora_rank|w_kv_b", set_(kv_lora_rank=56)),
    C(MD, "w_kv_b-cols", "kv_lora_rank|w_kv_b", lambda a: a.update(w_kv_b=a["w_kv_b"][:, :56])),
    C(MD, "w_kv_b-rows", "w_kv_b", lambda a: a.update(w_kv_b=a["w_kv_b"][:-8])),
    C(MD, "w_kv_b-int32", "w_kv_b", lambda a: a.update(w_kv_b=a["w_kv_b"].int())),
    C(MD, "kv_lora_rank-60", "kv_lora_rank", set_(), r=60),
    C(MD, "kv_lora_rank-520", "kv_lora_rank", set_(), r=520, p=8),
    C(MD, "row-584", "kv_cache|kv_lora_rank", set_(), r=512, p=72),
    C(MD, "kv_lora_rank-gt-row", "kv_lora_rank|kv_cache", lambda a: a.update(
        kv_lora_rank=88, w_kv_b=torch.zeros(64, 88))),
    C(MD, "norm_weight-size", "norm_weight", set_(norm_weight=torch.ones(32))),
    C(MD, "norm_weight-dtype", "norm_weight", set_(norm_weight=torch.ones(64, dtype=f16))),
    C(MD, "cache-dtype-ne-w", "kv_cache|w_kv_b", lambda a: a.update(w_kv_b=a["w_kv_b"].bfloat16())),
    C(MD, "fp8-no-scale", "scale", set_(scale=None), fp8=E4M3),
    C(MD, "fp8-scale-size2", "scale", set_(scale=torch.ones(2)), fp8=E4M3),
    C(MD, "num_tokens-wrong", "num_tokens", set_(num_tokens=sum(SEQ_LENS) - 1)),
    C(MD, "block-id-too-large", "block_tables", bad_block_id(NUM_BLOCKS)),
    C(MD, "kv_cache-heads", "kv_cache", lambda a: a.update(kv_cache=a["kv_cache"][:, :, None].repeat(1, 1, 2, 1))),

    C(MP, "q-last-dim", "q|kv_cache", lambda a: a.update(q=a["q"][..., :72])),
    C(MP, "q-float64", "q", lambda a: a.update(q=a["q"].double())),
    C(MP, "cache-dtype-ne-q", "q|kv_cache", lambda a: a.update(q=a["q"].half())),
    C(MP, "kv_lora_rank-60", "kv_lora_rank", set_(kv_lora_rank=60)),
    C(MP, "kv_lora_rank-gt-row", "kv_lora_rank|kv_cache", set_(kv_lora_rank=88)),
    C(MP, "fp8-no-kv_scale", "kv_scale", set_(kv_scale=None), fp8=E4M3),
    C(MP, "block-id-too-large", "block_tables", bad_block_id(NUM_BLOCKS)),
    C(MP, "seq_len-over-capacity", "seq_lens", over_capacity),
    C(MP, "qsl-last-ne-tokens", "query_start_loc", set_(query_start_loc=torch.tensor([0, 2, 5, 7]).int()),
      varlen=True),
    C(MP, "decode-tokens-ne-seqs", "q|seq_lens", lambda a: a.update(q=a["q"][:2])),
    C(MP, "kv_cache-heads", "kv_cache", lambda a: a.update(kv_cache=a["kv_cache"][:, :, None].repeat(1, 1, 2, 1))),
]


MLA_HEADS_MESSAGE = "latent caches with several kv heads"


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("op,base,mutate,arg", CASES)
def test_bad_input(op, base, mutate, arg, api):
    kwargs = BUILDERS[op](**base)
    mutate(kwargs)
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(RuntimeError, match=rf"kvkernels\.{op}: ({arg}):"):
        call(api, op, kwargs)
    for name, old in before.items():  # nothing written, not even partly
        assert_bytes_equal(kwargs[name], old, msg=f"{name} changed")


@pytest.mark.parametrize("op", [CM, MD, MP])
def test_mla_cache_with_several_kv_heads_is_unsupported(op):
    """A latent cache [N, B, h_kv, R + P] is refused with a message that says what is unsupported, not
    only that the cache has the wrong number of dimensions."""
    kwargs = BUILDERS[op]()
    kwargs["kv_cache"] = kwargs["kv_cache"][:, :, None].repeat(1, 1, 2, 1)
    with pytest.raises(RuntimeError, match=rf"kvkernels\.{op}: kv_cache: {MLA_HEADS_MESSAGE}"):
        call("kvkernels.ops", op, kwargs)

"""Ops-level smoke test of an installed kvkernels, for the stable-ABI check (scripts/check_stable_abi.sh).

Runs every op once on the CPU against kvkernels.reference (reshape_and_cache and a varlen GQA
paged_attention in float32 and bfloat16, an fp8 cache write + decode, merge_attention_states,
copy_blocks, swap_blocks, gather_kv, concat_and_cache_mla, mla_decompress, mla_paged_attention), then
torch.library.opcheck of reshape_and_cache and paged_attention. Needs only torch and numpy (no pytest,
no repository on sys.path), so it runs in a venv that has nothing but another torch and the wheel.

    python scripts/abi_smoke.py [--torch 2.10.0] [--installed]
    --torch: fail unless this torch version is imported; --installed: fail if kvkernels is imported
    from the source tree (PYTHONPATH=. runs it on an in-place build)
"""

import argparse
import os
import sys

import torch

import kvkernels
from kvkernels import ops, reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
checked = []


def close(name, got, want, tol):
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    checked.append(name)


def paged_case(gen, dtype, seq_lens, num_blocks=16, block_size=4, hkv=2, d=16):
    """Caches with shuffled block ids, filled through reshape_and_cache and checked against the reference."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    ids = torch.randperm(num_blocks, generator=gen)[:sum(blocks_per_seq)].tolist()
    width = max(blocks_per_seq)
    tables, slots = [], []
    for n, nb in zip(seq_lens, blocks_per_seq):
        own, ids = ids[:nb], ids[nb:]
        tables.append(own + [-1] * (width - nb))
        slots += [own[t // block_size] * block_size + t % block_size for t in range(n)]
    shape = (num_blocks, block_size, hkv, d)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    t = len(slots)
    key = torch.randn(t, hkv, d, generator=gen).to(dtype)
    value = torch.randn(t, hkv, d, generator=gen).to(dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    reference.reshape_and_cache(key, value, k_ref, v_ref, slot_mapping)
    close(f"reshape_and_cache {dtype}", torch.cat([k_cache, v_cache]), torch.cat([k_ref, v_ref]), 0)
    return (k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
            slot_mapping, key, value)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch", help="the torch version that must be the one imported")
    ap.add_argument("--installed", action="store_true", help="fail if kvkernels comes from the source tree")
    args = ap.parse_args()
    so = kvkernels._C.__file__
    print(f"torch {torch.__version__} ({torch.__file__})\nkvkernels extension {so}")
    if args.installed and os.path.dirname(os.path.dirname(os.path.abspath(kvkernels.__file__))) == REPO:
        sys.exit(f"abi_smoke: kvkernels was imported from the source tree ({kvkernels.__file__}), not installed")
    if args.torch and torch.__version__.split("+")[0] != args.torch:
        sys.exit(f"abi_smoke: expected torch {args.torch}, imported {torch.__version__}")
    gen = torch.Generator().manual_seed(0)

    for dtype in (torch.float32, torch.bfloat16):
        k_cache, v_cache, tables, seq_lens, *_ = paged_case(gen, dtype, [5, 9, 1])
        q_lens = [2, 9, 1]  # chunked prefill, full prefill, decode; 8 query heads over 2 kv heads
        q = torch.randn(sum(q_lens), 8, 16, generator=gen).to(dtype)
        qsl = torch.tensor([0, 2, 11, 12], dtype=torch.int32)
        out, lse = ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl)
        ref_out, ref_lse = reference.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl)
        close(f"paged_attention {dtype}", out, ref_out, TOL[dtype])
        close(f"paged_attention lse {dtype}", lse, ref_lse, TOL[torch.float32] * 10)

        out_b, lse_b = torch.randn(out.shape, generator=gen).to(dtype), torch.randn(lse.shape, generator=gen)
        got = ops.merge_attention_states(out, lse, out_b, lse_b)
        want = reference.merge_attention_states(out, lse, out_b, lse_b)
        close(f"merge_attention_states {dtype}", got[0], want[0], TOL[dtype])

        got = ops.gather_kv(k_cache, v_cache, tables, seq_lens)
        want = reference.gather_kv(k_cache, v_cache, tables, seq_lens)
        close(f"gather_kv {dtype}", torch.cat(got), torch.cat(want), 0)

    # fp8 cache: quantizing write with a per-tensor scale, then decode.
    e4m3 = torch.float8_e4m3fn
    scale = torch.tensor([0.05])
    shape = (8, 4, 2, 16)
    k8, v8 = torch.zeros(shape, dtype=e4m3), torch.zeros(shape, dtype=e4m3)
    k8r, v8r = k8.clone(), v8.clone()
    key, value = torch.randn(6, 2, 16, generator=gen), torch.randn(6, 2, 16, generator=gen)
    slots = torch.tensor([12, 13, 14, 15, 20, 21])
    ops.reshape_and_cache(key, value, k8, v8, slots, k_scale=scale, v_scale=scale)
    reference.reshape_and_cache(key, value, k8r, v8r, slots, k_scale=scale, v_scale=scale)
    close("reshape_and_cache fp8", torch.cat([k8, v8]).view(torch.uint8), torch.cat([k8r, v8r]).view(torch.uint8), 0)
    tables, seq_lens = torch.tensor([[3, 5]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    q = torch.randn(1, 4, 16, generator=gen)
    got = ops.paged_attention(q, k8, v8, tables, seq_lens, k_scale=scale, v_scale=scale)
    want = reference.paged_attention(q, k8, v8, tables, seq_lens, k_scale=scale, v_scale=scale)
    close("paged_attention fp8 decode", got[0], want[0], 1e-4)

    # Block copies: copy_blocks over a stacked [layers, 2, blocks, ...] cache, swap_blocks between two caches.
    stacked = torch.randn(2, 2, 8, 4, 2, 16, generator=gen)
    want = stacked.clone()
    mapping = torch.tensor([[0, 5], [3, 7]], dtype=torch.int64)
    ops.copy_blocks(stacked, mapping, block_dim=2)
    reference.copy_blocks(want, mapping, block_dim=2)
    close("copy_blocks", stacked, want, 0)
    src, dst = torch.randn(8, 4, 2, 16, generator=gen), torch.zeros(8, 4, 2, 16)
    want = dst.clone()
    ops.swap_blocks(src, dst, mapping)
    reference.swap_blocks(src, want, mapping)
    close("swap_blocks", dst, want, 0)

    # MLA: latent rows (rank 64 + rope 16), decompression through kv_b_proj, absorbed decode.
    rank, rope, heads, dn, dv = 64, 16, 4, 8, 8
    kv = torch.zeros(8, 4, rank + rope)
    kv_ref = kv.clone()
    kv_c, k_pe = torch.randn(7, rank, generator=gen), torch.randn(7, rope, generator=gen)
    slots = torch.tensor([8, 9, 10, 11, 24, 25, 26])
    ops.concat_and_cache_mla(kv_c, k_pe, kv, slots)
    reference.concat_and_cache_mla(kv_c, k_pe, kv_ref, slots)
    close("concat_and_cache_mla", kv, kv_ref, 0)
    tables, seq_lens = torch.tensor([[2, 6]], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    w_kv_b = torch.randn(heads * (dn + dv), rank, generator=gen) * 0.1
    opts = dict(kv_lora_rank=rank, qk_nope_head_dim=dn, v_head_dim=dv)
    got = ops.mla_decompress(kv, tables, seq_lens, w_kv_b, **opts)
    want = reference.mla_decompress(kv, tables, seq_lens, w_kv_b, **opts)
    close("mla_decompress", torch.cat([got[0].flatten(), got[1].flatten()]),
          torch.cat([want[0].flatten(), want[1].flatten()]), 1e-4)
    q = torch.randn(1, heads, rank + rope, generator=gen)
    got = ops.mla_paged_attention(q, kv, tables, seq_lens, kv_lora_rank=rank, scale=0.1)
    want = reference.mla_paged_attention(q, kv, tables, seq_lens, kv_lora_rank=rank, scale=0.1)
    close("mla_paged_attention", got[0], want[0], 1e-4)

    # opcheck: schema (mutation annotations), fake kernel, AOT dispatch of the two main ops.
    k_cache, v_cache, tables, seq_lens, slot_mapping, key, value = paged_case(gen, torch.float32, [5, 3])
    torch.library.opcheck(torch.ops.kvkernels.reshape_and_cache.default,
                          (key, value, k_cache, v_cache, slot_mapping, None, None))
    checked.append("opcheck reshape_and_cache")
    q = torch.randn(2, 4, 16, generator=gen)
    torch.library.opcheck(torch.ops.kvkernels.paged_attention.default,
                          (q, k_cache, v_cache, tables, seq_lens, None, None, -1, 0.0, None, None, None, None))
    checked.append("opcheck paged_attention")

    print(f"abi_smoke: {len(checked)} checks passed on torch {torch.__version__} "
          f"(CPU ISA {kvkernels.cpu_isa()}):\n  " + "\n  ".join(checked))


if __name__ == "__main__":
    main()

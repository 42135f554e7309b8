"""``python -m kvkernels demo kernels``: the ops alone — greedy generation of a tiny hand-written
Llama-style decoder on a paged KV cache (no ``transformers`` needed).

The model has random weights from a fixed seed (nothing is downloaded). All layers keep their keys
and values in one stacked paged allocation, written by ``ops.reshape_and_cache`` and read by
``ops.paged_attention``: one varlen call covers the prompts of the whole batch (prefill), then one
decode call per generated token. The same model is then run again without any cache (full recompute,
dense causal SDPA) and the logits and greedy tokens of the two runs are compared.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from kvkernels import ops

# A Llama decoder shrunk so that the whole demo runs in seconds on a small CPU.
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 512, 256, 4, 8, 2, 32, 704
ROPE_THETA, NORM_EPS = 10000.0, 1e-5
SCALE = HEAD_DIM ** -0.5


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalized in float32 (as Llama does) so that bfloat16 runs keep the small terms.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return (xf * self.weight.float()).to(x.dtype)


def rope(x, positions):
    """Rotary position embedding (rotate-half form) of x [T, heads, HEAD_DIM] at positions [T]."""
    inv_freq = ROPE_THETA ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = positions.float()[:, None] * inv_freq  # [T, HEAD_DIM / 2]
    cos = angles.cos().repeat(1, 2)[:, None, :]
    sin = angles.sin().repeat(1, 2)[:, None, :]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def _linear(gen, in_features, out_features):
    # std 1/sqrt(fan_in) keeps activations O(1): random logits then have clear argmaxes, so greedy
    # decoding is not decided by rounding noise.
    layer = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features))
    return layer


class DecoderLayer(nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.q = _linear(gen, HIDDEN, HEADS * HEAD_DIM)
        self.k = _linear(gen, HIDDEN, KV_HEADS * HEAD_DIM)
        self.v = _linear(gen, HIDDEN, KV_HEADS * HEAD_DIM)
        self.o = _linear(gen, HEADS * HEAD_DIM, HIDDEN)
        self.gate = _linear(gen, HIDDEN, FFN)
        self.up = _linear(gen, HIDDEN, FFN)
        self.down = _linear(gen, FFN, HIDDEN)

    def forward(self, x, positions, attend):
        t = x.shape[0]
        h = self.attn_norm(x)
        q = rope(self.q(h).view(t, HEADS, HEAD_DIM), positions)
        k = rope(self.k(h).view(t, KV_HEADS, HEAD_DIM), positions)
        v = self.v(h).view(t, KV_HEADS, HEAD_DIM)
        x = x + self.o(attend(q, k, v).reshape(t, HEADS * HEAD_DIM))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))  # SwiGLU


class TinyLlama(nn.Module):
    def __init__(self, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
        self.layers = nn.ModuleList(DecoderLayer(gen) for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = _linear(gen, HIDDEN, VOCAB)

    def forward(self, tokens, positions, attend, rows):
        """Float32 logits [len(rows), VOCAB] of the tokens at `rows` of the flat token list.

        `attend(layer, q, k, v) -> out` is the only thing the paged and the reference runs change."""
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, lambda q, k, v, i=i: attend(i, q, k, v))
        return self.lm_head(self.norm(x[rows])).float()  # only the rows we sample from


class BlockAllocator:
    """Hands out cache blocks one at a time in a shuffled order, so a sequence's pages end up
    scattered over the pool and only its block table says where they are."""

    def __init__(self, num_blocks, block_size, batch, max_blocks, gen):
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_size = block_size
        self.blocks = [[] for _ in range(batch)]
        # -1 marks "no block yet": the kernels must never read entries past a sequence's length.
        self.block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)

    def slots(self, seq, start, count):
        """Slots (block_id * block_size + offset) of positions start .. start+count-1 of `seq`,
        allocating a new block whenever a position crosses into one."""
        out = []
        for pos in range(start, start + count):
            index, offset = divmod(pos, self.block_size)
            if index == len(self.blocks[seq]):
                self.blocks[seq].append(self.free.pop())
                self.block_tables[seq, index] = self.blocks[seq][-1]
            out.append(self.blocks[seq][index] * self.block_size + offset)
        return out


def _progress(iterable, total, desc):
    """tqdm when it is installed (it is not a dependency), else a one-line counter on stderr."""
    try:
        from tqdm import tqdm
        return tqdm(iterable, total=total, desc=desc, leave=False)
    except ImportError:
        live = sys.stderr.isatty()  # "\r" redraws only make sense on a terminal; logs get one line

        def counter():
            for i, item in enumerate(iterable, 1):
                yield item
                if live or i == total:
                    end = "" if i < total else "\n"
                    print(f"\r{desc}: {i}/{total}", end=end, file=sys.stderr, flush=True)
        return counter()


def paged_attend(kv, block_tables, slot_mapping, seq_lens, query_start_loc):
    """attend() for the paged run: store this step's K/V, then attend over each sequence's pages."""
    def attend(layer, q, k, v):
        key_cache, value_cache = kv[layer, 0], kv[layer, 1]  # strided views of the stacked storage
        ops.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
        out, _lse = ops.paged_attention(q, key_cache, value_cache, block_tables, seq_lens,
                                        query_start_loc, scale=SCALE)
        return out
    return attend


def dense_attend(layer, q, k, v):
    """attend() for the reference run: one whole sequence, causal SDPA over contiguous K/V."""
    group = HEADS // KV_HEADS  # GQA: each kv head serves `group` consecutive query heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, T, D]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)[0].transpose(0, 1)


def generate_paged(model, prompts, new_tokens, block_size, dtype, gen):
    batch, lens = len(prompts), [len(p) for p in prompts]
    # The last generated token is never fed back, so it never needs a cache slot.
    final_lens = [n + new_tokens - 1 for n in lens]
    blocks_needed = [math.ceil(n / block_size) for n in final_lens]
    num_blocks = 2 * sum(blocks_needed)  # spare blocks, so the shuffled ids spread over a larger pool
    kv = torch.zeros(LAYERS, 2, num_blocks, block_size, KV_HEADS, HEAD_DIM, dtype=dtype)
    alloc = BlockAllocator(num_blocks, block_size, batch, max(blocks_needed), gen)

    # Prefill: every prompt in one varlen call per layer (tokens concatenated, query_start_loc splits).
    start = time.perf_counter()
    tokens = torch.cat(prompts)
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.tensor([s for b, n in enumerate(lens) for s in alloc.slots(b, 0, n)], dtype=torch.int64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query_start_loc = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    attend = paged_attend(kv, alloc.block_tables, slots, seq_lens, query_start_loc)
    logits = model(tokens, positions, attend, query_start_loc[1:].long() - 1)
    step_logits, generated = [logits], [logits.argmax(-1)]
    prefill_s = time.perf_counter() - start

    # Decode: one new token per sequence per step (query_start_loc=None selects decode).
    start = time.perf_counter()
    for _ in _progress(range(new_tokens - 1), new_tokens - 1, "decode"):
        positions = seq_lens.long()  # the new token's position = tokens already cached
        slots = [alloc.slots(b, int(seq_lens[b]), 1)[0] for b in range(batch)]
        slots = torch.tensor(slots, dtype=torch.int64)
        seq_lens = seq_lens + 1  # seq_lens count the token written in this step
        attend = paged_attend(kv, alloc.block_tables, slots, seq_lens, None)
        logits = model(generated[-1], positions, attend, torch.arange(batch))
        step_logits.append(logits)
        generated.append(logits.argmax(-1))
    decode_s = time.perf_counter() - start
    return torch.stack(generated, 1), torch.stack(step_logits, 1), prefill_s, decode_s, alloc, kv


def check_against_reference(model, prompts, generated, paged_logits, float32):
    """Recompute every sequence from scratch at every step (no cache) on the tokens the paged run
    chose, and compare last-position logits and greedy choices."""
    batch, steps = generated.shape
    max_diff, worst_ratio, agree, ties = 0.0, 0.0, 0, 0
    for s in _progress(range(steps), steps, "reference"):
        for b in range(batch):
            seq = torch.cat([prompts[b], generated[b, :s]])
            ref = model(seq, torch.arange(len(seq)), dense_attend, torch.tensor([len(seq) - 1]))[0]
            diff = (paged_logits[b, s] - ref).abs().max().item()
            # float32 paths differ only by summation order; bfloat16 rounds at every layer, so its
            # tolerance is relative to the size of the logits.
            tol = 1e-3 if float32 else 5e-2 * ref.abs().max().item()
            max_diff, worst_ratio = max(max_diff, diff), max(worst_ratio, diff / tol)
            chosen, best = generated[b, s].item(), ref.argmax().item()
            if chosen == best:
                agree += 1
            elif ref[best] - ref[chosen] <= tol:
                ties += 1  # a near-tie: both choices are within the tolerance of each other
    return max_diff, worst_ratio, agree, ties


def _mib(n):
    return f"{n / 2**20:.2f} MiB"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default as "(default: ...)", except where there is none to show
    (``None``, a flag's ``False``) or the help text already says it ("(default ...")."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "new_tokens", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)  # (main may run inside another program, e.g. the tests)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvkernels demo kernels",
                                description=__doc__.split("\n\n")[0].replace("``", ""),
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--batch", type=int, default=4, help="sequences generated together")
    p.add_argument("--prompt-len", type=int, default=37,
                   help="longest prompt; prompt i has prompt_len - 5*i tokens (at least 1)")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens generated per sequence")
    p.add_argument("--block-size", type=int, default=16, help="tokens per cache block")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of the weights and the cache")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads, as in python -m kvkernels demo (0: torch's default)")
    return p


def _run(args) -> int:
    dtype = getattr(torch, args.dtype)

    with torch.inference_mode():
        model = TinyLlama(args.seed).to(dtype).eval()
        gen = torch.Generator().manual_seed(args.seed + 1)
        # Different lengths, so the batch has partial last blocks and ragged varlen boundaries.
        lens = [max(1, args.prompt_len - 5 * i) for i in range(args.batch)]
        prompts = [torch.randint(VOCAB, (n,), generator=gen) for n in lens]

        generated, paged_logits, prefill_s, decode_s, alloc, kv = generate_paged(
            model, prompts, args.new_tokens, args.block_size, dtype, gen)
        start = time.perf_counter()
        max_diff, worst_ratio, agree, ties = check_against_reference(
            model, prompts, generated, paged_logits, dtype == torch.float32)
        ref_s = time.perf_counter() - start

    decode_tokens = args.batch * (args.new_tokens - 1)
    token_bytes = LAYERS * 2 * KV_HEADS * HEAD_DIM * kv.element_size()  # K and V of every layer
    used_blocks = sum(len(b) for b in alloc.blocks)
    cached = [n + args.new_tokens - 1 for n in lens]
    paged_bytes = used_blocks * args.block_size * token_bytes
    dense_bytes = args.batch * max(cached) * token_bytes
    total = generated.numel()
    ok = worst_ratio <= 1.0 and agree + ties == total
    tol_text = "1e-3" if dtype == torch.float32 else "5e-2 x max|logit|"

    print(f"kvkernels demo: tiny Llama ({LAYERS} layers, {HEADS} query / {KV_HEADS} kv heads, head_dim "
          f"{HEAD_DIM}, vocab {VOCAB}), {args.dtype}, {torch.get_num_threads()} threads, seed {args.seed}")
    print(f"  batch {args.batch}, prompt lengths {lens}, {args.new_tokens} new tokens each, "
          f"block size {args.block_size}")
    print(f"  prefill   : {sum(lens)} tokens in {prefill_s * 1e3:.1f} ms "
          f"({sum(lens) / prefill_s:,.0f} tok/s), one varlen call per layer")
    if decode_tokens:
        print(f"  decode    : {args.new_tokens - 1} steps x {args.batch} seqs in {decode_s * 1e3:.1f} ms "
              f"({decode_tokens / decode_s:,.0f} tok/s)")
    print(f"  KV cache  : {used_blocks} of {kv.shape[2]} blocks used, {sum(cached)} tokens; "
          f"{_mib(paged_bytes)} vs {_mib(dense_bytes)} for a dense [{args.batch}, {max(cached)}] cache "
          f"({100 * paged_bytes / dense_bytes:.0f}%)")
    print(f"              seq 0 pages (shuffled, non-contiguous): {alloc.blocks[0]}")
    print(f"  reference : full recompute, dense causal SDPA, in {ref_s * 1e3:.1f} ms")
    print(f"  seq 0     : {generated[0, :12].tolist()}{' ...' if args.new_tokens > 12 else ''}")
    print(f"  self-check: max |logit diff| {max_diff:.2e} (tol {tol_text}), greedy tokens {agree}/{total} "
          f"agree{f' + {ties} near-ties' if ties else ''} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1

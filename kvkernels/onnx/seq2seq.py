"""An encoder-decoder whose beam search runs in ONNX Runtime over a paged self-attention cache and a
cross-attention cache computed once (docs/onnx.md, "Encoder-decoder beam search").

The model (random weights; sizes of an on-device keyboard decoder: 4 layers, 8 heads x 32, source 150,
target <= 20) is exported as three graphs:

* ``encoder``: source tokens ``[S]`` -> memory ``[S, d_model]`` (standard ONNX ops);
* ``cross_kv``: memory -> each layer's cross-attention K and V as a one-block paged cache
  ``[1, S, H, D]`` (block size S): run once per input, shared by every beam through block tables that
  all point at block 0;
* ``decoder_step``: one token per beam -> log-probabilities ``[beams, vocab]``. Each layer writes the
  token's K/V into the paged self-attention cache (``kvkernels.ReshapeAndCache``, in place) and attends
  with ``kvkernels.PagedAttention`` over its own blocks and over the shared cross-attention block.

The beam search (``beam_search``) keeps its bookkeeping in a ``kvkernels.PagedKVCache``: beams are
forks (shared blocks), reorders permute block tables, and the first write into a shared partial block
copies that one block (copy-on-write); no step copies K/V otherwise. ``TorchStepper`` runs the same
model eagerly with the kvkernels torch ops, ``OrtStepper`` runs the exported graphs with
libkvkernels_ort.so; both drive the identical search, so their tokens can be compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import kvkernels.onnx as konnx
from kvkernels import ops
from kvkernels.cache import PagedKVCache


@dataclass(frozen=True)
class Seq2SeqConfig:
    vocab: int = 512
    layers: int = 4
    heads: int = 8
    head_dim: int = 32
    ffn: int = 1024
    src_len: int = 150
    max_tgt: int = 20
    block_size: int = 4  # self-attention cache blocks: 20 tokens are 5 whole blocks
    bos: int = 1

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim


class _EncoderLayer(nn.Module):
    def __init__(self, c: Seq2SeqConfig):
        super().__init__()
        self.c = c
        self.ln1, self.ln2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.o = nn.Linear(c.d_model, c.d_model)
        self.ff1, self.ff2 = nn.Linear(c.d_model, c.ffn), nn.Linear(c.ffn, c.d_model)

    def forward(self, x):  # x [S, d]
        s = x.shape[0]
        # [1, H, S, D] each: the 4-D form the ONNX exporter takes
        q, k, v = self.qkv(self.ln1(x)).view(s, 3, self.c.heads, self.c.head_dim).permute(1, 2, 0, 3)[:, None].unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.o(a[0].transpose(0, 1).reshape(s, -1))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class Encoder(nn.Module):
    def __init__(self, c: Seq2SeqConfig):
        super().__init__()
        self.emb = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.src_len, c.d_model)
        self.layers = nn.ModuleList(_EncoderLayer(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d_model)

    def forward(self, src):  # src int64 [S] -> memory [S, d]
        x = self.emb(src) + self.pos(torch.arange(src.shape[0], device=src.device))
        for layer in self.layers:
            x = layer(x)
        return self.ln(x)


class CrossKV(nn.Module):
    """Memory -> per layer (K, V) ``[1, S, H, D]``: one paged block of S slots (block size S)."""

    def __init__(self, c: Seq2SeqConfig):
        super().__init__()
        self.c = c
        self.kv = nn.ModuleList(nn.Linear(c.d_model, 2 * c.d_model) for _ in range(c.layers))

    def forward(self, memory):
        s = memory.shape[0]
        out = []
        for proj in self.kv:
            k, v = proj(memory).view(1, s, 2, self.c.heads, self.c.head_dim).unbind(2)
            out += [k.contiguous(), v.contiguous()]
        return tuple(out)


class _DecoderLayer(nn.Module):
    def __init__(self, c: Seq2SeqConfig):
        super().__init__()
        self.c = c
        self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(c.d_model) for _ in range(3))
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.o = nn.Linear(c.d_model, c.d_model)
        self.cq = nn.Linear(c.d_model, c.d_model)
        self.co = nn.Linear(c.d_model, c.d_model)
        self.ff1, self.ff2 = nn.Linear(c.d_model, c.ffn), nn.Linear(c.ffn, c.d_model)

    def forward(self, x, kc, vc, ck, cv, slots, tables, lens, cross_tables, cross_lens, functional: bool):
        b, h, d = x.shape[0], self.c.heads, self.c.head_dim
        q, k, v = self.qkv(self.ln1(x)).view(b, 3, h, d).unbind(1)
        if functional:  # export: the updated caches are new values (aliases of kc / vc in ORT)
            kc, vc = konnx.write_cache(k, v, kc, vc, slots)
        else:
            ops.reshape_and_cache(k, v, kc, vc, slots)
        a, _ = torch.ops.kvkernels.paged_attention(q, kc, vc, tables, lens)
        x = x + self.o(a.reshape(b, -1))
        # Cross-attention: every beam attends to the same source, so the beams' queries go in as the query
        # heads of ONE sequence whose kv head h serves query heads h * b ... h * b + b - 1 (GQA with the
        # beams as the group): each cached key/value row is read once for all beams, not once per beam.
        q = self.cq(self.ln2(x)).view(b, h, d).transpose(0, 1).reshape(1, h * b, d)
        a, _ = torch.ops.kvkernels.paged_attention(q, ck, cv, cross_tables, cross_lens)
        x = x + self.co(a.view(h, b, d).transpose(0, 1).reshape(b, -1))
        return x + self.ff2(F.gelu(self.ff1(self.ln3(x))))


class DecoderStep(nn.Module):
    """One token per beam -> log-probabilities. Inputs: ``tokens`` int64 [B], ``slot_mapping`` int64 [B],
    ``block_tables`` int32 [B, M], ``seq_lens`` int32 [B] (the new token included), ``cross_block_tables``
    int32 [1, 1] (the source's one block: 0), ``cross_seq_lens`` int32 [1] (the source length), then per layer the self-attention key and value caches
    ``[N, block_size, H, D]``, then per layer the cross-attention key and value blocks ``[1, S, H, D]``."""

    def __init__(self, c: Seq2SeqConfig):
        super().__init__()
        self.c = c
        self.emb = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.max_tgt + 1, c.d_model)
        self.layers = nn.ModuleList(_DecoderLayer(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.out = nn.Linear(c.d_model, c.vocab)
        self.functional = False  # True while exporting

    def forward(self, tokens, slot_mapping, block_tables, seq_lens, cross_block_tables, cross_seq_lens, *caches):
        n = self.c.layers
        self_caches, cross = caches[:2 * n], caches[2 * n:]
        x = self.emb(tokens) + self.pos((seq_lens - 1).long())
        for i, layer in enumerate(self.layers):
            x = layer(x, self_caches[2 * i], self_caches[2 * i + 1], cross[2 * i], cross[2 * i + 1], slot_mapping,
                      block_tables, seq_lens, cross_block_tables, cross_seq_lens, self.functional)
        return torch.log_softmax(self.out(self.ln(x)).float(), dim=-1)


class Seq2Seq(nn.Module):
    def __init__(self, c: Seq2SeqConfig = Seq2SeqConfig(), seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = c
        self.encoder, self.cross_kv, self.decoder = Encoder(c), CrossKV(c), DecoderStep(c)
        self.eval()


# ---- the cache and the search -------------------------------------------------------------------

def new_cache(c: Seq2SeqConfig, num_beams: int, num_blocks: Optional[int] = None) -> PagedKVCache:
    """Self-attention cache for one search of ``num_beams`` beams: room for every beam's whole target,
    blocks being shared copy-on-write, plus the null block."""
    blocks = num_blocks or num_beams * (math.ceil(c.max_tgt / c.block_size) + 1) + 1
    return PagedKVCache(c.layers, c.heads, c.head_dim, blocks, c.block_size, dtype=torch.float32,
                        enable_prefix_caching=False, max_sequences=2 * num_beams)


@dataclass
class BeamSearchResult:
    tokens: list  # per beam, best first: generated token ids (BOS excluded)
    scores: list  # per beam: summed log-probability
    self_blocks: int  # distinct self-attention blocks the final beams hold
    self_bytes: int  # their bytes (all layers, K and V)
    cross_bytes: int  # the cross-attention cache, held once
    cow_copies: int  # blocks copied on write during the search


def beam_search(stepper, src: np.ndarray, num_beams: int = 8, steps: Optional[int] = None,
                cache: Optional[PagedKVCache] = None) -> BeamSearchResult:
    """Fixed-length beam search (``steps`` tokens, default ``max_tgt``; no end token): each step scores
    every beam's continuations, keeps the ``num_beams`` best (ties: lower beam, then lower token id), and
    reorders the cache's block tables to the surviving beams."""
    c = stepper.config
    steps = c.max_tgt if steps is None else steps
    cache = cache or new_cache(c, num_beams)
    stepper.start(src, cache)
    seqs = [cache.add_sequence([])[0]]
    tokens = np.array([c.bos], dtype=np.int64)
    scores = np.zeros(1)
    history = [[]]
    for _ in range(steps):
        step = cache.append_decode(seqs, tokens)
        logp = stepper.step(tokens, step).astype(np.float64)  # [beams, vocab]
        cand = (scores[:, None] + logp).ravel()
        best = np.argsort(-cand, kind="stable")[:num_beams]
        src_beam, tokens = best // c.vocab, (best % c.vocab).astype(np.int64)
        while len(seqs) < len(best):  # the first step: every beam forks the single start sequence
            seqs.append(cache.fork(seqs[0]))
        cache.reorder(seqs, src_beam)
        scores = cand[best]
        history = [history[b] + [int(t)] for b, t in zip(src_beam, tokens)]
    tables, lens = cache.block_tables(seqs).numpy(), cache.seq_lens(seqs).numpy()
    blocks = {int(b) for t, n in zip(tables, lens) for b in t[:-(-int(n) // c.block_size)]}
    stats = cache.stats()
    result = BeamSearchResult(history, scores.tolist(), len(blocks), len(blocks) * cache.bytes_per_block,
                              stepper.cross_bytes, stats.cow_copies)
    for s in seqs:
        cache.free(s)
    return result


class TorchStepper:
    """The model in eager PyTorch with the kvkernels torch ops (the reference for the ORT run)."""

    def __init__(self, model: Seq2Seq):
        self.model, self.config = model, model.config

    @torch.inference_mode()
    def start(self, src, cache: PagedKVCache) -> None:
        self.cache = cache
        memory = self.model.encoder(torch.as_tensor(src, dtype=torch.int64))
        self.cross = self.model.cross_kv(memory)
        self.cross_bytes = sum(t.numel() * t.element_size() for t in self.cross)

    @torch.inference_mode()
    def step(self, tokens, step) -> np.ndarray:
        b, c = len(tokens), self.config
        caches = [t for layer in range(c.layers) for t in (self.cache.key_cache(layer), self.cache.value_cache(layer))]
        out = self.model.decoder(torch.as_tensor(tokens), step.slot_mapping, step.block_tables, step.seq_lens,
                                 torch.zeros(1, 1, dtype=torch.int32), torch.full((1,), c.src_len, dtype=torch.int32),
                                 *caches, *self.cross)
        return out.numpy()


# ---- export and the ONNX Runtime driver --------------------------------------------------------

def export(model: Seq2Seq, directory) -> dict:
    """Exports ``encoder.onnx``, ``cross_kv.onnx`` and ``decoder_step.onnx`` into ``directory``; returns
    their paths. Dynamic: the number of beams, of block-table columns and of cache blocks."""
    c, d = model.config, Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = {name: d / f"{name}.onnx" for name in ("encoder", "cross_kv", "decoder_step")}
    src = torch.randint(0, c.vocab, (c.src_len,))
    konnx.export(model.encoder, (src,), paths["encoder"], input_names=["src"], output_names=["memory"])
    memory = model.encoder(src)
    cross_names = [f"cross_{kind}_{i}" for i in range(c.layers) for kind in ("k", "v")]
    konnx.export(model.cross_kv, (memory.detach(),), paths["cross_kv"], input_names=["memory"],
                 output_names=cross_names)
    beams, cache = 3, new_cache(c, 3)
    step = cache.append_decode([cache.add_sequence([])[0] for _ in range(beams)], [c.bos] * beams)
    caches = [t for i in range(c.layers) for t in (cache.key_cache(i), cache.value_cache(i))]
    cross = [t.detach() for t in model.cross_kv(memory)]
    args = (torch.full((beams,), c.bos), step.slot_mapping, step.block_tables, step.seq_lens,
            torch.zeros(1, 1, dtype=torch.int32), torch.full((1,), c.src_len, dtype=torch.int32),
            *caches, *cross)
    b, m, n = torch.export.Dim("beams"), torch.export.Dim("max_blocks"), torch.export.Dim("num_blocks")
    # The varargs `*caches` are one entry of the signature: their dims go in one tuple.
    dyn = ({0: b}, {0: b}, {0: b, 1: m}, {0: b}, None, None,
           ({0: n},) * (2 * c.layers) + (None,) * (2 * c.layers))
    names = ["tokens", "slot_mapping", "block_tables", "seq_lens", "cross_block_tables", "cross_seq_lens"]
    names += [f"{kind}_cache_{i}" for i in range(c.layers) for kind in ("key", "value")] + cross_names
    model.decoder.functional = True
    try:
        konnx.export(model.decoder, args, paths["decoder_step"], input_names=names, output_names=["logprobs"],
                     dynamic_shapes=dyn)
    finally:
        model.decoder.functional = False
    return paths


class OrtStepper:
    """The three exported graphs in ONNX Runtime with libkvkernels_ort.so. The self-attention caches are
    the ``PagedKVCache``'s own memory, bound once (IOBinding) per search: ReshapeAndCache writes into
    them in place, and copy-on-write / reorders done by the cache are seen by the next step."""

    def __init__(self, config: Seq2SeqConfig, paths: dict, library=None, threads: Optional[int] = None):
        self.config = config
        self.sessions = {k: konnx.InferenceSession(p, library, threads=threads) for k, p in paths.items()}

    def start(self, src, cache: PagedKVCache) -> None:
        import onnxruntime as ort
        c = self.config
        memory = self.sessions["encoder"].run(None, {"src": np.asarray(src, dtype=np.int64)})[0]
        cross = self.sessions["cross_kv"].run(None, {"memory": memory})
        self.cross_bytes = sum(a.nbytes for a in cross)
        sess = self.sessions["decoder_step"]
        self.io = sess.io_binding()
        kv = cache.kv.numpy()  # [L, 2, N, B, H, D], the cache's own storage
        self._keep = []
        for i in range(c.layers):
            for j, kind in enumerate(("key", "value")):
                value = ort.OrtValue.ortvalue_from_numpy(kv[i, j])
                assert value.data_ptr() == kv[i, j].ctypes.data, "the cache must be bound, not copied"
                self.io.bind_ortvalue_input(f"{kind}_cache_{i}", value)
                self._keep.append(value)
                xv = ort.OrtValue.ortvalue_from_numpy(cross[2 * i + j])
                self.io.bind_ortvalue_input(f"cross_{'kv'[j]}_{i}", xv)
                self._keep.append(xv)

    def step(self, tokens, step) -> np.ndarray:
        b, c = len(tokens), self.config
        io = self.io
        feeds = {"tokens": np.ascontiguousarray(tokens, dtype=np.int64),
                 "slot_mapping": step.slot_mapping.numpy(),
                 "block_tables": np.ascontiguousarray(step.block_tables.numpy()),
                 "seq_lens": step.seq_lens.numpy(),
                 "cross_block_tables": np.zeros((1, 1), dtype=np.int32),  # the source: one block, all beams
                 "cross_seq_lens": np.full(1, c.src_len, dtype=np.int32)}
        for name, array in feeds.items():  # `feeds` keeps the arrays alive through the run
            io.bind_cpu_input(name, array)
        io.bind_output("logprobs")  # ORT allocates it: its shape follows the beam count
        self.sessions["decoder_step"].run_with_iobinding(io)
        return io.get_outputs()[0].numpy()


__all__ = ["Seq2SeqConfig", "Seq2Seq", "new_cache", "beam_search", "BeamSearchResult", "TorchStepper", "OrtStepper",
           "export"]

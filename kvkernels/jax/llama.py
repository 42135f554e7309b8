"""A small Llama in JAX on kvkernels' paged cache, with a JetStream-style two-phase generation loop.

* ``LlamaConfig``, ``init_params`` (random weights) and ``params_from_state_dict`` (the weights of a
  ``transformers`` ``LlamaForCausalLM`` state dict, as numpy arrays; nothing is downloaded here);
* ``prefill``: one jitted call over a batch of prompts (varlen: the prompts concatenated, padded to a
  length bucket), which writes every prompt token's K/V into the pages (``reshape_and_cache``) and attends
  with ``paged_attention(..., query_start_loc=...)``; returns each prompt's first generated token;
* ``decode_step``: one jitted step for the whole batch (one token per sequence), the cache donated so its
  pages are written in place; it compiles once (static shapes) and never reads anything back to the host;
* ``generate``: the loop. Pages are allocated on the host between steps (``PageManager``), which hands the
  step new block tables, lengths and slots; the generated tokens stay on the device until the end;
* ``reference_generate``: the same model with dense attention in plain JAX (no cache: every step recomputes
  the whole sequence), the oracle of the tests.

The model is the ``transformers`` Llama (RMSNorm, rotary embeddings with ``rotate_half``, GQA, SwiGLU MLP);
greedy decoding only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvkernels.jax.cache import PagedKVCache, PageManager

__all__ = ["LlamaConfig", "init_params", "params_from_state_dict", "prefill", "decode_step", "generate",
           "reference_generate"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config) -> "LlamaConfig":
        """The settings of a ``transformers`` ``LlamaConfig`` (read as attributes; transformers is not imported)."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"LlamaConfig.from_hf: rope_type {rope['rope_type']!r} is not supported (default only)")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
                   num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                   head_dim=head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=float(theta),
                   tie_word_embeddings=bool(config.tie_word_embeddings))


def init_params(config: LlamaConfig, key, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random weights (normal, ``std``; norms 1). Matrices are stored ``[in, out]``."""
    c = config
    keys = iter(jax.random.split(key, 2 + 7 * c.num_layers))

    def w(shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = [dict(attn_norm=jnp.ones(c.hidden_size, dtype), q=w((c.hidden_size, qd)), k=w((c.hidden_size, kvd)),
                   v=w((c.hidden_size, kvd)), o=w((qd, c.hidden_size)), mlp_norm=jnp.ones(c.hidden_size, dtype),
                   gate=w((c.hidden_size, c.intermediate_size)), up=w((c.hidden_size, c.intermediate_size)),
                   down=w((c.intermediate_size, c.hidden_size))) for _ in range(c.num_layers)]
    embed = w((c.vocab_size, c.hidden_size))
    return dict(embed=embed, layers=layers, norm=jnp.ones(c.hidden_size, dtype),
                lm_head=embed.T if c.tie_word_embeddings else w((c.hidden_size, c.vocab_size)))


def params_from_state_dict(config: LlamaConfig, state: Mapping[str, np.ndarray], dtype=jnp.float32) -> dict:
    """Weights from a ``LlamaForCausalLM`` state dict (``{name: numpy array}``; linear weights are
    ``[out, in]`` there)."""
    def get(name):
        return jnp.asarray(np.asarray(state[name]), dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layers.append(dict(
            attn_norm=get(p + "input_layernorm.weight"), q=get(p + "self_attn.q_proj.weight").T,
            k=get(p + "self_attn.k_proj.weight").T, v=get(p + "self_attn.v_proj.weight").T,
            o=get(p + "self_attn.o_proj.weight").T, mlp_norm=get(p + "post_attention_layernorm.weight"),
            gate=get(p + "mlp.gate_proj.weight").T, up=get(p + "mlp.up_proj.weight").T,
            down=get(p + "mlp.down_proj.weight").T))
    embed = get("model.embed_tokens.weight")
    head = embed if config.tie_word_embeddings or "lm_head.weight" not in state else get("lm_head.weight")
    return dict(embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=head.T)


# ---- the model ----------------------------------------------------------------------------------

def _rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _rope(x, positions, theta):
    """Rotary embedding of x [T, H, D] at ``positions`` [T] (transformers' rotate_half form, float32)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[:, None, :], jnp.sin(emb)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def _mlp(p, x):
    return (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]


def _qkv(config, p, x, positions):
    t = x.shape[0]
    q = (x @ p["q"]).reshape(t, config.num_heads, config.head_dim)
    k = (x @ p["k"]).reshape(t, config.num_kv_heads, config.head_dim)
    v = (x @ p["v"]).reshape(t, config.num_kv_heads, config.head_dim)
    return _rope(q, positions, config.rope_theta), _rope(k, positions, config.rope_theta), v


def _forward_paged(params, config, cache: PagedKVCache, tokens, positions, slot_mapping, *, block_tables, seq_lens,
                   query_start_loc=None):
    """Hidden states [T, hidden] of ``tokens`` [T] at ``positions``, their K/V written to ``slot_mapping``;
    attention over the pages through ``block_tables`` / ``seq_lens`` (one row per query sequence)."""
    h = params["embed"][tokens]
    for i, p in enumerate(params["layers"]):
        x = _rms_norm(h, p["attn_norm"], config.rms_norm_eps)
        q, k, v = _qkv(config, p, x, positions)
        cache = cache.write(i, k, v, slot_mapping)
        out, _ = cache.attend(i, q, seq_lens=seq_lens, query_start_loc=query_start_loc, block_tables=block_tables)
        h = h + out.reshape(h.shape[0], -1).astype(h.dtype) @ p["o"]
        h = h + _mlp(p, _rms_norm(h, p["mlp_norm"], config.rms_norm_eps))
    return _rms_norm(h, params["norm"], config.rms_norm_eps), cache


def _logits(params, h):
    return (h @ params["lm_head"]).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def prefill(params, config: LlamaConfig, cache: PagedKVCache, tokens, positions, slot_mapping, query_start_loc):
    """One call over a batch of prompts: ``tokens`` [P] (the prompts of batch slots 0..S-1 concatenated, then
    padding), ``positions`` [P], ``slot_mapping`` [P] (-1 for padding), ``query_start_loc`` int32 [S + 2] (the
    last entry, P, closes a padding "sequence" with no keys: its rows attend nothing). ``cache`` already
    holds the block tables and lengths (= prompt lengths) of the S slots. Returns the first generated token
    of each slot [S] and the cache, its pages written in place."""
    num_seqs = cache.block_tables.shape[0]
    block_tables = jnp.concatenate([cache.block_tables, jnp.zeros_like(cache.block_tables[:1])])
    seq_lens = jnp.concatenate([cache.seq_lens, jnp.zeros((1,), jnp.int32)])
    h, cache = _forward_paged(params, config, cache, tokens, positions, slot_mapping, block_tables=block_tables,
                              seq_lens=seq_lens, query_start_loc=query_start_loc)
    last = jnp.maximum(query_start_loc[1:num_seqs + 1] - 1, 0)
    return jnp.argmax(_logits(params, h[last]), axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def decode_step(params, config: LlamaConfig, cache: PagedKVCache, tokens, positions, slot_mapping):
    """One decode step of the batch: ``tokens`` [S] at ``positions`` [S] written to ``slot_mapping`` [S]
    (-1: an idle slot, nothing written); ``cache`` holds the block tables and lengths that include these
    tokens. Returns the next tokens [S] and the cache (pages written in place)."""
    h, cache = _forward_paged(params, config, cache, tokens, positions, slot_mapping,
                              block_tables=cache.block_tables, seq_lens=cache.seq_lens)
    return jnp.argmax(_logits(params, h), axis=-1).astype(jnp.int32), cache


def prefill_bucket(n: int, smallest: int = 16) -> int:
    """The padded length of a prefill of ``n`` tokens: the next power of two (at least ``smallest``), so a
    stream of prompts compiles a few prefill shapes, not one per total length (JetStream's buckets)."""
    size = smallest
    while size < n:
        size *= 2
    return size


def generate(params, config: LlamaConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             page_size: int = 16, num_pages: int | None = None, max_len: int | None = None, cache_dtype=None,
             k_scale=None, v_scale=None, stats: dict | None = None) -> np.ndarray:
    """Greedy generation of ``max_new_tokens`` tokens for each prompt: a batched prefill, then jitted decode
    steps, pages allocated on the host between steps. Returns int32 [len(prompts), max_new_tokens].
    ``max_len``: the longest sequence the block tables must hold (default: longest prompt + max_new_tokens);
    ``num_pages``: the pool (default: enough for every sequence at ``max_len``). ``cache_dtype`` (default: the
    weights' dtype) may be fp8, with per-layer ``k_scale`` / ``v_scale``. ``stats`` (a dict) receives the
    cache and the page manager at the end, to continue the loop by hand."""
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens: expected >= 1, got {max_new_tokens}")
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    if batch == 0 or min(lengths) < 1:
        raise ValueError("generate: prompts: expected at least one prompt, each of at least one token")
    longest = max(max(lengths) + max_new_tokens, max_len or 0)
    max_pages = -(-longest // page_size)
    num_pages = num_pages or 1 + batch * max_pages
    dtype = cache_dtype or params["embed"].dtype
    pm = PageManager(num_pages=num_pages, page_size=page_size, batch=batch, max_pages_per_seq=max_pages)
    cache = PagedKVCache.create(num_layers=config.num_layers, num_pages=num_pages, page_size=page_size,
                                num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, batch=batch,
                                max_pages_per_seq=max_pages, dtype=dtype, k_scale=k_scale, v_scale=v_scale)

    # Phase 1: every prompt in one prefill call.
    for i, n in enumerate(lengths):
        pm.reserve(i, n)
    total = sum(lengths)
    padded = prefill_bucket(total)
    tokens = np.zeros(padded, np.int32)
    positions = np.zeros(padded, np.int32)
    slots = np.full(padded, -1, np.int32)
    tokens[:total] = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    positions[:total] = np.concatenate([np.arange(n) for n in lengths])
    slots[:total] = np.concatenate([pm.slot_mapping(i, 0, n) for i, n in enumerate(lengths)])
    qsl = np.concatenate([[0], np.cumsum(lengths), [padded]]).astype(np.int32)
    cache = cache.with_tables(pm.block_tables(), pm.lengths)
    token, cache = prefill(params, config, cache, tokens, positions, slots, qsl)
    out = [token]

    # Phase 2: decode steps; the host only grows the page tables (it never waits for the device's tokens).
    for _ in range(max_new_tokens - 1):
        positions = pm.lengths.copy()
        for i in range(batch):
            pm.reserve(i, int(positions[i]) + 1)
        slots = np.array([pm.slot_mapping(i, int(positions[i]), 1)[0] for i in range(batch)], np.int32)
        cache = cache.with_tables(pm.block_tables(), pm.lengths)
        token, cache = decode_step(params, config, cache, token, positions, slots)
        out.append(token)
    if stats is not None:
        stats.update(cache=cache, pages=pm)
    return np.stack([np.asarray(t) for t in jax.device_get(out)], axis=1)


# ---- the dense reference ------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("config",))
def _dense_next(params, config: LlamaConfig, tokens, lengths):
    """Greedy next token of each row of ``tokens`` [S, L] (its first ``lengths[s]`` tokens), by a full forward
    with dense causal attention (no cache)."""
    s, L = tokens.shape
    pos = jnp.arange(L)
    mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lengths[:, None, None])  # [S, L, L]
    group = config.num_heads // config.num_kv_heads

    def one(tok, m):
        h = params["embed"][tok]
        for p in params["layers"]:
            x = _rms_norm(h, p["attn_norm"], config.rms_norm_eps)
            q, k, v = _qkv(config, p, x, pos)
            k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
            logits = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * config.head_dim ** -0.5
            logits = jnp.where(m[None], logits, -jnp.inf)
            w = jax.nn.softmax(logits, axis=-1)
            out = jnp.einsum("hqk,khd->qhd", w, v.astype(jnp.float32)).astype(h.dtype)
            h = h + out.reshape(L, -1) @ p["o"]
            h = h + _mlp(p, _rms_norm(h, p["mlp_norm"], config.rms_norm_eps))
        return _rms_norm(h, params["norm"], config.rms_norm_eps)

    h = jax.vmap(one)(tokens, mask)
    last = h[jnp.arange(s), lengths - 1]
    return jnp.argmax(_logits(params, last), axis=-1).astype(jnp.int32)


def reference_generate(params, config: LlamaConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int
                       ) -> np.ndarray:
    """``generate``'s tokens by dense attention in plain JAX (every step recomputes every sequence)."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(lengths.max()) + max_new_tokens
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    out = []
    for _ in range(max_new_tokens):
        nxt = np.asarray(_dense_next(params, config, tokens, lengths))
        tokens[np.arange(len(prompts)), lengths] = nxt
        lengths = lengths + 1
        out.append(nxt)
    return np.stack(out, axis=1)

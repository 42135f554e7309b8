"""MLA models (DeepSeek-V2/V3, AXK1, GLM-4-MoE-Lite, Youtu, MiniCPM3, Mistral-4, LongCat-Flash) on
``PagedCache``: the absorbed path is the one that runs (no expansion of cached latents through
``kv_b_proj``, no gather), the cache holds exactly ``kv_lora_rank + rope``
values per real token and layer — the latents the stock cache holds, padding left out — and the
``expand_kv`` wrapper changes nothing for calls without a ``PagedCache``. Token identity with the
stock cache is in test_transformers.py (the MLA models are in its matrix).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

import kvkernels
from kvkernels.integrations import transformers_mla
from kvkernels.integrations.transformers import PagedCache, cache_kwargs, register
from kvkernels.integrations.transformers_attention import PagedKV

from hf_models import MLA_MODELS, OpCounter, left_padded_batch, model_pair


class ProjCounter:
    """Counts ``kv_b_proj`` forwards of every layer and the rows (tokens) they multiply."""

    def __init__(self, model):
        self.calls = self.rows = 0
        # Every MLA attention module (LongCat-Flash has two per decoder layer).
        self._hooks = [m.kv_b_proj.register_forward_hook(self._count) for m in model.modules() if hasattr(m, "kv_b_proj")]

    def _count(self, module, args, output):
        self.calls += 1
        self.rows += args[0].numel() // args[0].shape[-1]

    def remove(self):
        for hook in self._hooks:
            hook.remove()


@pytest.mark.parametrize("name", MLA_MODELS)
def test_absorbed_path_runs_and_expands_nothing(name, monkeypatch):
    stock, paged = model_pair(name)
    ids, mask = left_padded_batch()
    ops = OpCounter(monkeypatch, "mla_paged_attention", "concat_and_cache_mla", "gather_kv", "mla_decompress",
                    "paged_attention", "reshape_and_cache")
    paged_proj, stock_proj = ProjCounter(paged), ProjCounter(stock)
    try:
        out = paged.generate(ids, attention_mask=mask, **cache_kwargs(paged.generate, PagedCache(paged.config, block_size=4)),
                             max_new_tokens=6, do_sample=False)
        ref = stock.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    finally:
        paged_proj.remove()
        stock_proj.remove()
    assert torch.equal(out, ref)
    layers = paged.config.num_hidden_layers
    # One write and one absorbed attention per layer and forward (1 prefill + 5 decode steps) ...
    assert ops.calls["mla_paged_attention"] == ops.calls["concat_and_cache_mla"] == 6 * layers
    # ... and nothing that builds per-head K/V: no gather, no decompression, no kv_b_proj forward
    # (the absorbed path reads its weight; the stock path runs it over every cached token each step).
    assert ops.calls["gather_kv"] == ops.calls["mla_decompress"] == 0
    assert ops.calls["paged_attention"] == ops.calls["reshape_and_cache"] == 0
    assert paged_proj.calls == 0
    assert stock_proj.calls == 6 * layers and stock_proj.rows > 6 * layers * ids.numel()


@pytest.mark.parametrize("name", MLA_MODELS)
def test_cache_holds_the_stock_latents_of_real_tokens_only(name):
    """Each sequence's rows are ``[latent ; rotary key]`` of its real tokens, equal to what the stock
    DynamicCache holds in those columns; ``kv_lora_rank + rope`` values per token and layer."""
    stock, paged = model_pair(name)
    text = paged.config
    rank, rope, layers = text.kv_lora_rank, text.qk_rope_head_dim, text.num_hidden_layers
    ids, mask = left_padded_batch()
    cache, dyn = PagedCache(text, block_size=4), DynamicCache(config=stock.config)
    with torch.no_grad():
        paged(ids, attention_mask=mask, **cache_kwargs(paged.forward, cache))
        stock(ids, attention_mask=mask, **cache_kwargs(stock.forward, dyn))
    store = cache.kv
    assert isinstance(store, kvkernels.MLAPagedCache)
    assert store.kv.shape[1:] == (store.num_blocks, 4, rank + rope)
    usage = cache.memory_usage()
    assert usage["stored_tokens"] == int(mask.sum())
    assert store.bytes_per_token == layers * (rank + rope) * 4  # float32, nothing per head
    assert usage["stored_bytes"] == int(mask.sum()) * layers * (rank + rope) * 4
    for r, seq in enumerate(cache.sequences):
        real = mask[r].bool()
        slots = store.slot_mapping(seq, 0, int(real.sum()))
        for layer in range(layers):
            rows = store.latent_cache(layer).flatten(0, 1)[slots]
            want = torch.cat([dyn.layers[layer].keys[r, 0], dyn.layers[layer].values[r, 0]], -1)[real]
            if layer == 0:  # the same embeddings through the same projection: bitwise
                assert torch.equal(rows, want)
            else:  # after one attention layer computed in another order: a few float32 ulps of the
                # largest value (Mistral-4's rows reach ~2.8 and land 1.4e-6 off; LongCat-Flash's
                # 1.6e-6 with transformers 5.16)
                atol = 2e-6 * max(1.0, float(want.abs().max()))
                torch.testing.assert_close(rows, want, rtol=1e-5, atol=atol)


def test_expand_kv_wrapper_passes_handles_only():
    register()
    classes = [getattr(importlib.import_module(module), name) for module, name in transformers_mla.MLA_ATTENTION_CLASSES]
    assert len(classes) == len(MLA_MODELS)  # each wrapped class has a tiny model in the token-identity tests
    for cls in classes:
        assert cls.expand_kv.__kvkernels_original__ is not None
        original = cls.expand_kv
        transformers_mla.wrap_expand_kv(cls)  # idempotent: wrapped once
        assert cls.expand_kv is original
    _, paged = model_pair("deepseek_v3")
    attn = paged.model.layers[0].self_attn
    handle = PagedKV(None, 0, None, None)
    assert attn.expand_kv(handle, handle) == (handle, handle)
    latent, rot = torch.randn(2, 1, 5, attn.kv_lora_rank), torch.randn(2, 1, 5, attn.qk_rope_head_dim)
    key, value = attn.expand_kv(latent, rot)
    want_key, want_value = DeepseekV3Attention.expand_kv.__kvkernels_original__(attn, latent, rot)
    assert torch.equal(key, want_key) and torch.equal(value, want_value)
    assert key.shape == (2, attn.num_heads, 5, attn.qk_head_dim)
    with pytest.raises(TypeError, match="expand_kv"):
        transformers_mla.wrap_expand_kv(torch.nn.Linear)


@pytest.mark.parametrize("name", MLA_MODELS)
def test_without_paged_cache_the_model_runs_as_stock(name):
    """No cache (and a stock cache): the wrapper hands tensors to the original expand_kv, the
    attention function runs SDPA."""
    stock, paged = model_pair(name)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        want = stock(ids, attention_mask=mask).logits
        got = paged(ids, attention_mask=mask).logits
        got_dyn = paged(ids, attention_mask=mask, **cache_kwargs(paged.forward, DynamicCache(config=paged.config))).logits
    real = mask.bool()
    assert torch.equal(got[real], want[real]) and torch.equal(got_dyn[real], want[real])


def test_bad_mla_input_is_refused():
    _, paged = model_pair("deepseek_v3")
    text = paged.config
    cache = PagedCache(text)
    with pytest.raises(ValueError, match=r"latent \[B, 1, q, R\]"):
        cache.update(torch.randn(2, 2, 3, text.kv_lora_rank), torch.randn(2, 1, 3, text.qk_rope_head_dim), 0)
    ids, mask = left_padded_batch()
    cache = PagedCache(text)
    with torch.no_grad():
        paged(ids, attention_mask=mask, **cache_kwargs(paged.forward, cache))
    attn = paged.model.layers[0].self_attn
    step = cache._make_step(None, torch.ones(3, dtype=torch.long).numpy(), torch.zeros((3, 1), dtype=torch.long).numpy())
    query = torch.randn(3, attn.num_heads, 1, attn.qk_head_dim)
    handle = PagedKV(cache, 0, None, None)
    with pytest.raises(TypeError, match="kv_b_proj"):
        transformers_mla.latent_attention(cache.kv, torch.nn.Module(), query, handle, step, attn.scaling)
    with pytest.raises(ValueError, match="query"):
        transformers_mla.latent_attention(cache.kv, attn, query[..., 1:], handle, step, attn.scaling)
    with pytest.raises(NotImplementedError, match="sliding window"):
        cache.attend(attn, query, handle, None, scale=attn.scaling, window_left=3, soft_cap=0.0, sinks=None)


def test_dsa_model_stops_on_paged_cache(monkeypatch):
    """DSA models (a top-k indexer masks keys; not in MLA_ATTENTION_CLASSES) never attend every key
    silently: unwrapped, the handle fails as a tensor; wrapped by hand, transformers' indexer finds no
    indexer key cache on a PagedCache layer."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention

    from hf_models import COMMON, build
    config = DeepseekV32Config(**{**COMMON, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32,
                                  "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
                                  "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                  "n_group": 1, "topk_group": 1, "index_topk": 4, "index_n_heads": 2,
                                  "index_head_dim": 16})
    model = build(config, "kvkernels")
    ids, mask = left_padded_batch()
    # transformers 5.16's DeepseekV32Attention hands update() per-head rows, which PagedCache refuses
    # as an MLA latent before expand_kv is reached: a clear error either way
    refused = (AttributeError, ValueError)
    with pytest.raises(refused, match="wrap_expand_kv|MLA update: expected the latent"), torch.no_grad():
        model(ids, attention_mask=mask, **cache_kwargs(model.forward, PagedCache(model.config)))
    monkeypatch.setattr(DeepseekV32Attention, "expand_kv", DeepseekV32Attention.expand_kv)  # undone after the test
    transformers_mla.wrap_expand_kv(DeepseekV32Attention)
    with pytest.raises(ValueError, match="indexer|MLA update: expected the latent"), torch.no_grad():
        model(ids, attention_mask=mask, **cache_kwargs(model.forward, PagedCache(model.config)))


def test_unwrapped_expand_kv_gets_a_clear_error(monkeypatch):
    """An MLA attention class whose expand_kv is not wrapped receives the handle as if it were a
    tensor: the error says what happened and what to call."""
    _, paged = model_pair("deepseek_v3")
    monkeypatch.setattr(DeepseekV3Attention, "expand_kv", DeepseekV3Attention.expand_kv.__kvkernels_original__)
    ids, mask = left_padded_batch()
    with pytest.raises(AttributeError, match="wrap_expand_kv"), torch.no_grad():
        paged(ids, attention_mask=mask, **cache_kwargs(paged.forward, PagedCache(paged.config)))

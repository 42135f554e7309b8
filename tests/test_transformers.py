"""kvkernels.integrations.transformers: ``model.generate()`` on ``PagedCache`` + the ``"kvkernels"``
attention function is token-identical to the stock cache with SDPA (eager for Gemma2 / GPT-OSS, which
transformers runs without SDPA) — greedy, seeded sampling and beam search, on left-padded batches —
for Llama (GQA), Qwen2 and Mistral (sliding windows), Gemma2 (soft cap, alternating windows), GPT-OSS
(sinks), the MLA models — DeepSeek-V2/V3, AXK1, GLM-4-MoE-Lite, Youtu, MiniCPM3, Mistral-4 (position-scaled
queries), LongCat-Flash (two attention sublayers per decoder layer) — (absorbed attention over paged latents)
and BART (cross-attention shared by beams). Tiny random-weight models (tests/hf_models.py); nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.masking_utils import AttentionMaskInterface

import kvkernels
from kvkernels.integrations import transformers_cache
from kvkernels.integrations.transformers import PagedCache, cache_kwargs, paged_attention_forward, register
from kvkernels.integrations.transformers_encdec import PagedEncoderDecoderCache

from hf_models import DECODER_MODELS, MISTRAL4_ROPE, MLA_MODELS, OpCounter, bart_config, bart_pair, build, config_for, left_padded_batch, model_pair

MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=20),
    "beam": dict(do_sample=False, num_beams=4, num_return_sequences=2),
}


def generate_both(stock, paged, ids, mask, mode, cache_args=None, **extra):
    """Stock generate() and generate() on a fresh PagedCache with the same seed."""
    kwargs = dict(MODES[mode], output_scores=True, return_dict_in_generate=True, **{"max_new_tokens": 10, **extra})
    torch.manual_seed(5)
    ref = stock.generate(ids, attention_mask=mask, **kwargs)
    cache = PagedCache(paged.config, **(cache_args or dict(block_size=4)))
    torch.manual_seed(5)
    out = paged.generate(ids, attention_mask=mask, **cache_kwargs(paged.generate, cache), **kwargs)
    return ref, out, cache


def assert_same_generation(ref, out, mode):
    assert torch.equal(out.sequences, ref.sequences), f"tokens differ:\n{ref.sequences}\n{out.sequences}"
    if mode == "beam":
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=1e-4, atol=1e-5)
    else:
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---- registration --------------------------------------------------------------------------------


def test_register():
    assert register() == "kvkernels" == register()  # idempotent
    assert AttentionInterface._global_mapping["kvkernels"] is paged_attention_forward
    assert "kvkernels" in AttentionMaskInterface._global_mapping


# ---- token identity ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", DECODER_MODELS)
def test_generate_matches_stock(name, mode, monkeypatch):
    stock, paged = model_pair(name)
    ids, mask = left_padded_batch()
    ops = OpCounter(monkeypatch, "paged_attention", "reshape_and_cache", "gather_kv", "mla_paged_attention",
                    "concat_and_cache_mla", "mla_decompress")
    ref, out, cache = generate_both(stock, paged, ids, mask, mode)
    assert_same_generation(ref, out, mode)
    rows = ids.shape[0] * MODES[mode].get("num_beams", 1)
    assert cache.batch_size == rows
    cache.kv.check_invariants()
    usage = cache.memory_usage()
    assert usage["stored_tokens"] > 0
    # Attention runs on the paged storage: no gather into dense K/V, no decompression.
    assert ops.calls["gather_kv"] == 0 and ops.calls["mla_decompress"] == 0
    if name in MLA_MODELS:  # absorbed MLA over the latent rows
        assert isinstance(cache.kv, kvkernels.MLAPagedCache)
        assert ops.calls["mla_paged_attention"] > 0 and ops.calls["paged_attention"] == 0
        assert ops.calls["mla_paged_attention"] == ops.calls["concat_and_cache_mla"]
    else:
        assert ops.calls["paged_attention"] > 0 and ops.calls["mla_paged_attention"] == 0
        assert ops.calls["paged_attention"] == ops.calls["reshape_and_cache"]
    if mode != "beam":  # padding never enters the cache: one token per real column
        assert usage["stored_tokens"] == int(mask.sum()) + rows * 10 - rows
    if mode == "beam":  # each prompt stored once for its beams, beams share their common history
        assert usage["stored_tokens"] < usage["unshared_tokens"] and cache.split_rows == 0


@pytest.mark.parametrize("mode", ["beam", "sample"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "gpt_oss", "mistral"])
def test_cascade_decode_matches_stock(name, mode, monkeypatch):
    """Rows that share their prompt's blocks (beams; num_return_sequences samples) attend those blocks
    once per group (kvkernels.cache.cascade) in every layer without a sliding window or sinks, and
    generate the stock tokens. cascade_min_tokens=4 so the 4-9 token prompts qualify."""
    stock, paged = model_pair(name)
    ids, mask = left_padded_batch()
    counter = OpCounter(monkeypatch, "merge_attention_states")
    plans = []
    original = kvkernels.PagedKVCache.cascade_plan
    monkeypatch.setattr(kvkernels.PagedKVCache, "cascade_plan",
                        lambda cache, *args, **kwargs: plans.append(1) or original(cache, *args, **kwargs))
    extra = {} if mode == "beam" else dict(num_return_sequences=3)
    ref, out, cache = generate_both(stock, paged, ids, mask, mode, dict(block_size=4, cascade_min_tokens=4), **extra)
    assert_same_generation(ref, out, mode)
    layers, steps = paged.config.num_hidden_layers, len(out.scores) - 1  # decode forwards
    plain = {"llama": 0, "qwen2": 1, "gemma2": 1, "gpt_oss": layers, "mistral": layers}[name]  # window / sinks
    assert counter.calls["merge_attention_states"] == (layers - plain) * steps
    assert len(plans) == (steps if plain < layers else 0)  # once per step, by a layer that can use it
    cache.kv.check_invariants()


def test_paged_cache_constructor_arguments():
    config = model_pair("llama")[1].config
    for kwargs, match in ((dict(cascade_min_tokens=0), "cascade_min_tokens: expected an int >= 1 or None"),
                          (dict(cascade_min_tokens=2.5), "cascade_min_tokens"),
                          (dict(num_blocks=1), "num_blocks: expected an int >= 2 or None"),
                          (dict(block_size=0), "block_size: expected an int >= 1")):
        with pytest.raises(ValueError, match=match):
            PagedCache(config, **kwargs)
    assert PagedCache(config, cascade_min_tokens=None).cascade_min_tokens is None


def test_paged_cache_takes_the_model_for_its_config():
    _, paged = model_pair("llama")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        out = [paged.generate(ids, attention_mask=mask, **cache_kwargs(paged.generate, cache), max_new_tokens=4,
                              do_sample=False) for cache in (PagedCache(paged), PagedCache(paged.config))]
    assert torch.equal(out[0], out[1])
    assert PagedCache(paged, block_size=4).config is paged.config
    _, bart = bart_pair()
    cache = PagedCache(bart)  # an encoder-decoder model: its config picks PagedEncoderDecoderCache
    assert isinstance(cache, PagedEncoderDecoderCache) and cache.cross_attention_cache.config is bart.config
    assert PagedEncoderDecoderCache(bart).self_attention_cache.config is bart.config
    for wrong in ("llama", None, paged.model.embed_tokens):
        with pytest.raises(TypeError, match=r"expected the model's config \(PagedCache\(model.config\)\) or the model"):
            PagedCache(wrong)


@pytest.mark.parametrize("name,feature", [
    ("mistral", dict(sliding_window=None)),
    ("qwen2", dict(sliding_window=64)),
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(sliding_window=64)),
    ("gpt_oss", "sinks"),
    ("mistral4", dict(rope_parameters=dict(MISTRAL4_ROPE, llama_4_scaling_beta=0.0))),  # position-scaled queries
])
def test_features_matter(name, feature):
    """The tiny configs are sensitive to the features the kernel implements: generating without the
    feature gives other tokens, so token identity above checks the feature."""
    stock, _ = model_pair(name)
    if feature == "sinks":
        config, attn, _ = config_for(name)

        def fix(model):
            for layer in model.model.layers:
                layer.self_attn.sinks.data.fill_(-1e4)  # a sink that takes no weight
    else:
        config, attn, fix = config_for(name, **feature)
    without = build(config, attn, fix)
    ids, mask = left_padded_batch()
    a = stock.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    b = without.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert not torch.equal(a, b)


def test_padding_changes_nothing():
    """A left-padded row generates what it generates alone (pads are not stored nor attended)."""
    _, paged = model_pair("llama")
    ids, mask = left_padded_batch()
    batch = paged.generate(ids, attention_mask=mask, **cache_kwargs(paged.generate, PagedCache(paged.config)), max_new_tokens=8,
                           do_sample=False)
    for r in range(ids.shape[0]):
        real = ids[r, mask[r].bool()][None]
        alone = paged.generate(real, **cache_kwargs(paged.generate, PagedCache(paged.config)), max_new_tokens=8, do_sample=False)
        assert torch.equal(alone[0, -8:], batch[r, -8:])


# ---- encoder-decoder -----------------------------------------------------------------------------


def source_batch():
    """Left and right padded sources (BART pads with 1)."""
    ids, mask = left_padded_batch(pad=1)
    ids[2], mask[2] = ids[0].clone(), mask[0].clone()
    ids[2, 6:], mask[2, 6:] = 1, 0
    return ids, mask


@pytest.mark.parametrize("mode", list(MODES))
def test_bart_generate_matches_stock(mode, monkeypatch):
    stock, paged = bart_pair()
    ids, mask = source_batch()
    ops = OpCounter(monkeypatch, "paged_attention", "gather_kv")
    ref, out, cache = generate_both(stock, paged, ids, mask, mode)
    assert_same_generation(ref, out, mode)
    assert isinstance(cache, PagedEncoderDecoderCache)
    assert ops.calls["gather_kv"] == 0 and ops.calls["paged_attention"] > 0
    cross = cache.cross_attention_cache
    # Computed once per input and held once: one group per input row, its real source tokens only,
    # whatever the number of beams; beam reorders moved the row -> group map, never the K/V.
    assert cross.num_groups == ids.shape[0]
    assert cross.memory_usage()["stored_tokens"] == int(mask.sum())
    assert cross.kv.stats().cow_copies == 0 and cross.ungrouped == 0
    cache.self_attention_cache.kv.check_invariants()


@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_bart_decoder_prompt_runs_noncausal_cross_attention(mode, monkeypatch):
    """A decoder prompt of four tokens: the first step's cross-attention has four queries per row, run as
    one varlen sequence per row with causal=False (every query sees the whole source); later steps are
    decode calls. Token-identical to the stock cache."""
    stock, paged = bart_pair()
    ids, mask = source_batch()
    dec = torch.tensor([[2, 0, 17, 9]]).expand(ids.shape[0], -1).contiguous()
    seen = []
    original = kvkernels.ops.paged_attention

    def spy(query, *args, **kwargs):
        qsl = args[4] if len(args) > 4 else kwargs.get("query_start_loc")
        seen.append((query.shape[0], qsl is not None, kwargs.get("causal", True)))
        return original(query, *args, **kwargs)
    monkeypatch.setattr(kvkernels.ops, "paged_attention", spy)
    ref, out, cache = generate_both(stock, paged, ids, mask, mode, decoder_input_ids=dec)
    assert_same_generation(ref, out, mode)
    rows = ids.shape[0] * (MODES[mode].get("num_beams", 1))
    # Cross-attention calls of the prompt step: 4 queries per row, varlen, not causal (one per layer).
    assert seen.count((4 * rows, True, False)) == paged.config.decoder_layers, seen[:8]


def test_bart_cross_rows_that_differ_later_get_their_own_copy():
    """Rows equal in the first decoder layer's cross K/V but not the second's (a hook perturbs one
    row there) are split, and the result still matches the stock cache."""
    stock, paged = (build(bart_config(), attn, seq2seq=True) for attn in ("sdpa", "kvkernels"))

    def perturb(module, args, output):
        output = output.clone()
        output[1] += 1e-3
        return output
    for model in (stock, paged):
        model.model.decoder.layers[1].encoder_attn.k_proj.register_forward_hook(perturb)
    ids, mask = source_batch()
    ids[1], mask[1] = ids[0], mask[0]  # rows 0 and 1: one input
    ref, out, cache = generate_both(stock, paged, ids, mask, "greedy")
    assert_same_generation(ref, out, "greedy")
    assert cache.cross_attention_cache.ungrouped == 1


# ---- beam search: no KV copies, memory -----------------------------------------------------------


def prefilled_cache(rows=4, block_size=4, name="llama"):
    _, paged = model_pair(name)
    ids, mask = left_padded_batch(rows=rows)
    cache = PagedCache(paged.config, block_size=block_size)
    with torch.no_grad():
        paged(ids, attention_mask=mask, **cache_kwargs(paged.forward, cache))
    return paged, cache


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_reorder_permutes_block_tables_without_copying(name, monkeypatch):
    _, cache = prefilled_cache(name=name)
    tables = cache.kv.block_tables(cache.sequences)
    lens = cache.kv.seq_lens(cache.sequences)
    storage = cache.kv.kv.clone()
    ops = OpCounter(monkeypatch, "copy_blocks", "swap_blocks", "reshape_and_cache", "concat_and_cache_mla")
    beam_idx = torch.tensor([2, 2, 0, 1])
    cache.reorder_cache(beam_idx)
    assert sum(ops.calls.values()) == 0
    # bitwise: blocks never written hold whatever torch.empty gave them, NaN patterns included
    assert torch.equal(cache.kv.kv.view(torch.uint8), storage.view(torch.uint8))
    assert torch.equal(cache.kv.block_tables(cache.sequences), tables[beam_idx])
    assert torch.equal(cache.kv.seq_lens(cache.sequences), lens[beam_idx])
    assert cache.kv.pool.refcount(int(tables[2, 0])) == 2  # row 2's blocks now serve rows 0 and 1
    cache.kv.check_invariants()


class BytesProbe(LogitsProcessor):
    """Runs after every forward (before the beam reorder): records the most bytes held."""

    def __init__(self, measure):
        self.measure, self.peak = measure, 0

    def __call__(self, input_ids, scores):
        self.peak = max(self.peak, self.measure())
        return scores


def test_eight_beams_peak_kv_bytes_at_most_a_quarter_of_stock():
    """generate() prefills the prompt once per beam; the paged cache notices the identical rows and
    keeps one copy, and beam reorders share blocks. Peak stored bytes (token-granular, shared blocks
    once) against the stock DynamicCache's tensors (benchmarks/hf_beam_memory.py has more cases)."""
    stock, paged = model_pair("llama")
    prompt = torch.randint(3, 128, (2, 128), generator=torch.Generator().manual_seed(3))
    gen = dict(num_beams=8, max_new_tokens=16, min_new_tokens=16, do_sample=False, early_stopping=False)
    with torch.no_grad():
        dyn = DynamicCache(config=stock.config)
        probe = BytesProbe(lambda: sum(t.nbytes for layer in dyn.layers for t in (layer.keys, layer.values)))
        ref = stock.generate(prompt, **cache_kwargs(stock.generate, dyn), logits_processor=LogitsProcessorList([probe]), **gen)
        cache = PagedCache(paged.config, block_size=8)
        paged_probe = BytesProbe(lambda: cache.memory_usage()["stored_bytes"])
        out = paged.generate(prompt, **cache_kwargs(paged.generate, cache), logits_processor=LogitsProcessorList([paged_probe]),
                             **gen)
    assert torch.equal(out, ref)
    assert cache.split_rows == 0
    ratio = paged_probe.peak / probe.peak
    assert ratio <= 0.25, f"peak KV bytes {paged_probe.peak} vs stock {probe.peak}: {ratio:.3f}"


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_prefill_stores_each_prompt_once(name):
    """generate() expands every prompt to num_beams rows before the prefill: stored once each."""
    stock, paged = model_pair(name)
    ids, mask = left_padded_batch()
    ids4, mask4 = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    cache = PagedCache(paged.config, block_size=4)
    with torch.no_grad():
        got = paged(ids4, attention_mask=mask4, **cache_kwargs(paged.forward, cache)).logits
        want = stock(ids4, attention_mask=mask4).logits
    real = mask4.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
    assert cache.memory_usage()["stored_tokens"] == int(mask.sum())
    assert cache.memory_usage()["unshared_tokens"] == 4 * int(mask.sum())
    cache.kv.check_invariants()


@pytest.mark.parametrize("name,proj", [("llama", "k_proj"), ("deepseek_v3", "kv_a_proj_with_mqa")])
def test_duplicate_rows_that_differ_later_get_their_own_blocks(name, proj):
    """Prefill rows equal in the first layer but not the second (a hook perturbs one row's keys
    (MLA: latents) there): the row forked from its duplicate gets its own blocks, layer 0 copied over."""
    config, attn, _ = config_for(name)
    stock, paged = build(config, attn), build(config, "kvkernels")

    def perturb(module, args, output):
        output = output.clone()
        output[1] += 1e-2
        return output
    for model in (stock, paged):
        getattr(model.model.layers[1].self_attn, proj).register_forward_hook(perturb)
    ids, mask = left_padded_batch()
    ids[1], mask[1] = ids[0], mask[0]
    ref, out, cache = generate_both(stock, paged, ids, mask, "greedy")
    assert_same_generation(ref, out, "greedy")
    assert cache.split_rows == 1
    cache.kv.check_invariants()


@pytest.mark.parametrize("name, op", [("llama", "paged_attention"), ("deepseek_v3", "mla_paged_attention")])
def test_beam_prefill_attends_each_prompt_once(monkeypatch, name, op):
    """generate() with beams prefills num_beams identical copies of each (left-padded) prompt; the
    copies are zero-copy forks and the prefill attention runs once per distinct prompt: the kernel
    gets the real query tokens of 2 rows, not 8. Generation stays token-identical. MLA models share
    the absorbed attention over the latent rows the same way."""
    stock, paged = model_pair(name)
    ids, mask = left_padded_batch()
    ids, mask = ids[:2], mask[:2]
    seen = []
    original = getattr(kvkernels.ops, op)

    def spy(query, *args, **kwargs):
        seen.append(query.shape[0])
        return original(query, *args, **kwargs)
    monkeypatch.setattr(kvkernels.ops, op, spy)
    ref, out, cache = generate_both(stock, paged, ids, mask, "beam")
    assert_same_generation(ref, out, "beam")
    layers = paged.config.num_hidden_layers
    assert seen[:layers] == [int(mask.sum())] * layers  # prefill: each prompt's real tokens once
    assert all(n == 2 * MODES["beam"]["num_beams"] for n in seen[layers:])  # decode: every beam
    assert cache.split_rows == 0


# ---- cache operations ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_storage_grows_and_keeps_sharing(name):
    """num_blocks=None: sized on first use, grown as needed (rebuilt; shared blocks stay shared)."""
    stock, paged = model_pair(name)
    ids, mask = left_padded_batch()
    for mode in ("greedy", "beam"):
        ref, out, cache = generate_both(stock, paged, ids, mask, mode, cache_args=dict(block_size=2),
                                        max_new_tokens=30, min_new_tokens=30)
        assert_same_generation(ref, out, mode)
        if mode == "greedy":
            assert cache.grow_count >= 1
    # The beams share most of their blocks; a growth keeps exactly that sharing.
    before = cache.memory_usage()
    assert before["sharing_ratio"] < 0.5
    blocks = cache.kv.num_blocks
    cache._grow(1)
    after = cache.memory_usage()
    assert cache.kv.num_blocks >= 2 * blocks
    for key in ("stored_bytes", "used_blocks", "unshared_bytes"):
        assert after[key] == before[key], key
    cache.kv.check_invariants()


def test_fixed_num_blocks_runs_out():
    _, paged = model_pair("llama")
    ids, mask = left_padded_batch()
    with pytest.raises(kvkernels.OutOfBlocksError):
        paged.generate(ids, attention_mask=mask, **cache_kwargs(paged.generate, PagedCache(paged.config, block_size=4, num_blocks=6)),
                       max_new_tokens=10)


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_prefill_once_then_branch(name):
    """The zero-copy "prefill once, then branch" pattern: batch_repeat_interleave forks."""
    stock, paged = model_pair(name)
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = PagedCache(paged.config, block_size=4)
    with torch.no_grad():
        paged(prompt[:, :-1], **cache_kwargs(paged.forward, cache))
    used = cache.kv.memory_usage()["used_blocks"]
    cache.batch_repeat_interleave(3)
    assert cache.batch_size == 3 and cache.kv.memory_usage()["used_blocks"] == used
    out = paged.generate(prompt, **cache_kwargs(paged.generate, cache), num_beams=3, max_new_tokens=6, do_sample=False)
    ref = stock.generate(prompt, num_beams=3, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_crop_select_and_reset(name):
    paged, cache = prefilled_cache(rows=3, name=name)
    n = cache.get_seq_length()
    lens = cache.kv.seq_lens(cache.sequences).tolist()
    cache.crop(-2)  # the last two columns are real in every row
    assert cache.get_seq_length() == n - 2
    assert cache.kv.seq_lens(cache.sequences).tolist() == [x - 2 for x in lens]
    cache.batch_select_indices(torch.tensor([2, 0, 0]))
    assert cache.batch_size == 3
    assert cache.kv.seq_lens(cache.sequences).tolist() == [lens[2] - 2, lens[0] - 2, lens[0] - 2]
    cache.kv.check_invariants()
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.batch_size == -1 and len(cache.kv) == 0
    ids, mask = left_padded_batch()  # the storage serves the next batch
    out = paged.generate(ids, attention_mask=mask, **cache_kwargs(paged.generate, cache), max_new_tokens=5, do_sample=False)
    ref = paged.generate(ids, attention_mask=mask, **cache_kwargs(paged.generate, PagedCache(paged.config)), max_new_tokens=5,
                         do_sample=False)
    assert torch.equal(out, ref)


def test_wrong_attention_implementation_is_refused():
    stock, _ = model_pair("llama")  # runs sdpa
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match="kvkernels"):
        stock.generate(ids, attention_mask=mask, **cache_kwargs(stock.generate, PagedCache(stock.config)), max_new_tokens=2)


def test_dense_fallback_without_paged_cache():
    """The "kvkernels" attention function also serves calls without a PagedCache (encoders, no
    cache, a stock cache): transformers' SDPA, or a plain twin when soft cap / sinks are needed."""
    for name in ("llama", "gemma2", "gpt_oss"):
        stock, paged = model_pair(name)
        ids, mask = left_padded_batch()
        with torch.no_grad():
            a = stock(ids, attention_mask=mask).logits
            b = paged(ids, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(b[real], a[real], rtol=1e-4, atol=1e-5)
        assert not b.isnan().any()


def test_duplicate_rows_helper():
    key = torch.randn(5, 2, 3, 4)
    key[3] = key[1]
    key[4] = key[1]
    value = key * 2
    real = np.ones((5, 3), dtype=bool)
    assert transformers_cache.duplicate_rows(key, value, None).tolist() == [0, 1, 2, 1, 1]
    real[4, 0] = False  # same K/V, other padding: not a duplicate
    assert transformers_cache.duplicate_rows(key, value, real).tolist() == [0, 1, 2, 1, 4]


def test_encoder_decoder_cache_depends_on_the_decoder_cache_one_way():
    """transformers_encdec builds on transformers_cache, never the reverse (no import cycle, not even a
    deferred one inside a function): the decoder cache learns of the encoder-decoder class when
    transformers_encdec is imported, which kvkernels.integrations.transformers does."""
    import ast
    import pathlib

    import kvkernels.integrations.transformers_cache as cache_module
    source = pathlib.Path(cache_module.__file__).read_text()
    imported = {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert not any("transformers_encdec" in name for name in imported), imported
    assert cache_module.PagedCache.encoder_decoder_cache is PagedEncoderDecoderCache

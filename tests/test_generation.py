"""kvkernels.generation: entropy-adaptive branching and parallel sampling on forks of one prefilled
prompt reproduce, path for path, plain implementations on the stock ``DynamicCache`` (SDPA) that
deep-copy the cache for every branch / run every sample on its own (the oracles below, written
independently of the module from its RNG protocol); the prompt is prefilled once; a branch stores
only its divergent tokens; beam search and shared-prefix batches through ``generate()`` are
token-identical to the stock cache. Tiny random-weight Llama (tests/hf_models.py), float32.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import DynamicCache

import kvkernels
from kvkernels.generation import (EntropyAdaptiveBranching, beam_search, draw_distinct, generate_shared_prefix,
                                  inverse_cdf, normalized_entropy, parallel_sample, prefill_once)
from kvkernels.integrations.transformers import PagedCache, cache_kwargs

from hf_models import bart_pair, build, config_for, left_padded_batch, model_pair

EOS = 2
# initializer_range 0.3: next-token entropies of this tiny model spread over ~0.0-0.75 (the default
# 0.02 gives ~0.99 everywhere), so a threshold branches at some steps and not at others.
_CONFIG = config_for("llama", initializer_range=0.3)


@pytest.fixture(scope="module")
def models():
    config, stock_attn, _ = _CONFIG
    return build(config, stock_attn), build(config, "kvkernels")


def prompt_ids(length=19, seed=7):
    return torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def dynamic_bytes(cache):
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


# ---- the oracles: the same protocol on DynamicCache, one forward per path, deep copies -------------


def draw(probs, u):
    """Inverse CDF: the first token whose cumulative probability exceeds u * total."""
    cdf = probs.cumsum(0)
    return int(torch.nonzero(cdf > u * cdf[-1])[0])


def forward_one(model, token, cache):
    with torch.no_grad():
        return model(torch.tensor([[token]]), **cache_kwargs(model.forward, cache)).logits[0, -1]


def prefill(model, prompt):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), **cache_kwargs(model.forward, cache)).logits[0, -1]
    return cache, logits


def eab_oracle(model, prompt, max_new_tokens, threshold, branch_factor, max_paths, temperature, seed, eos):
    gen = torch.Generator().manual_seed(seed)
    cache, logits = prefill(model, prompt)
    live = [dict(tokens=[], log_prob=0.0, cache=cache, logits=logits)]
    ended = []
    for step in range(max_new_tokens):
        if step:
            for path in live:
                path["logits"] = forward_one(model, path["tokens"][-1], path["cache"])
        u = torch.rand((len(live), branch_factor), generator=gen, dtype=torch.float64)
        cands = []
        for i, path in enumerate(live):
            logp = torch.log_softmax(path["logits"].float() / temperature, -1)
            probs = logp.double().exp()
            entropy = float(-(probs * logp.double()).sum() / math.log(probs.numel()))
            if branch_factor > 1 and entropy > threshold:
                left, tokens = probs.clone(), []
                for j in range(branch_factor):
                    if not (left > 0).any():
                        break
                    tokens.append(draw(left, float(u[i, j])))
                    left[tokens[-1]] = 0
            else:
                tokens = [draw(probs, float(u[i, 0]))]
            if len(tokens) == 1:
                path["tokens"].append(tokens[0])
                path["log_prob"] += float(logp[tokens[0]])
                cands.append(path)
            else:
                for t in tokens:  # every branch gets its own full copy of the cache
                    cands.append(dict(tokens=path["tokens"] + [t], log_prob=path["log_prob"] + float(logp[t]),
                                      cache=copy.deepcopy(path["cache"])))
        going = [j for j, c in enumerate(cands) if c["tokens"][-1] not in eos]
        if len(going) > max_paths:
            drop = set(sorted(going, key=lambda j: -cands[j]["log_prob"])[max_paths:])
            cands = [c for j, c in enumerate(cands) if j not in drop]
        live = []
        for c in cands:
            if c["tokens"][-1] in eos or step == max_new_tokens - 1:
                c["finished"] = c["tokens"][-1] in eos
                ended.append(c)
            else:
                live.append(c)
        if not live:
            break
    return ended


def sample_oracle(model, prompt, n, max_new_tokens, temperature, seed, eos):
    """n independent runs; run j uses column j of the one uniform matrix."""
    u = torch.rand((max_new_tokens, n), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    runs = []
    for j in range(n):
        cache, logits = prefill(model, prompt)
        tokens, log_prob = [], 0.0
        for step in range(max_new_tokens):
            if step:
                logits = forward_one(model, tokens[-1], cache)
            logp = torch.log_softmax(logits.float() / temperature, -1)
            tokens.append(draw(logp.double().exp(), float(u[step, j])))
            log_prob += float(logp[tokens[-1]])
            if tokens[-1] in eos:
                break
        runs.append(dict(tokens=tokens, log_prob=log_prob, finished=tokens[-1] in eos, cache=cache))
    return runs


def assert_same_paths(result, ref):
    assert [p.tokens for p in result.paths] == [r["tokens"] for r in ref]
    assert [p.finished for p in result.paths] == [r["finished"] for r in ref]
    for p, r in zip(result.paths, ref):
        assert p.log_prob == pytest.approx(r["log_prob"], abs=2e-4)


# ---- entropy-adaptive branching --------------------------------------------------------------------

# (seed, threshold, branch_factor, max_paths, temperature, eos, what the case must exercise)
EAB_CASES = [
    (1, 0.6, 3, 64, 0.8, (), {"branch"}),
    (0, 0.6, 3, 8, 1.0, (EOS,), {"branch", "prune", "eos"}),
    (1, 0.5, 3, 20, 1.0, (EOS,), {"branch", "prune", "eos"}),
    (2, 0.65, 2, 6, 1.0, (), {"branch", "prune"}),
    (4, 0.7, 3, 10, 1.3, (EOS,), {"branch", "prune", "eos"}),
    (5, 0.99, 3, 10, 1.0, (EOS,), set()),  # never branches: plain sampling of one path
]


@pytest.mark.parametrize("seed,threshold,factor,cap,temperature,eos,features", EAB_CASES)
def test_eab_matches_deep_copy_oracle(models, seed, threshold, factor, cap, temperature, eos, features):
    stock, paged = models
    prompt = prompt_ids()
    eab = EntropyAdaptiveBranching(paged, entropy_threshold=threshold, branch_factor=factor, max_paths=cap,
                                   temperature=temperature, block_size=4, eos_token_id=list(eos))
    result = eab.generate(prompt, 12, seed=seed)
    ref = eab_oracle(stock, prompt, 12, threshold, factor, cap, temperature, seed, set(eos))
    assert_same_paths(result, ref)
    # the case exercises what it says (so that agreement above covers it)
    assert (result.branch_events > 0) == ("branch" in features)
    assert (result.pruned > 0) == ("prune" in features)
    assert any(p.finished for p in result.paths) == ("eos" in features)
    assert result.max_live_paths <= cap
    # the deep-copy implementation holds one full cache per path; the paged one each shared block once
    assert result.memory["deep_copy_bytes"] == sum(dynamic_bytes(r["cache"]) for r in ref)
    if features:
        assert result.memory["stored_bytes"] < result.memory["deep_copy_bytes"] / 2
    result.cache.kv.check_invariants()
    result.release()
    assert len(result.cache.kv) == 0


def test_eab_max_paths_caps_the_live_paths_not_the_returned_ones(models):
    """max_paths bounds the paths decoded together (the memory); paths that end with an
    end-of-sequence token leave the live set and are returned besides, so len(paths) can exceed it."""
    _, paged = models
    eab = EntropyAdaptiveBranching(paged, entropy_threshold=0.3, branch_factor=3, max_paths=4, block_size=4,
                                   eos_token_id=list(range(3, 23)))  # many end-of-sequence tokens
    result = eab.generate(prompt_ids(), 12, seed=0)
    live = [len(step) for step in result.entropies]  # one entropy per live path per step
    assert len(live) == 12 and max(live) == result.max_live_paths == 4 and result.pruned > 0
    finished = [p for p in result.paths if p.finished]
    at_end = [p for p in result.paths if not p.finished]
    assert len(result.paths) > 4 and len(finished) > 4
    assert len(at_end) == live[-1] <= 4 and all(len(p.tokens) == 12 for p in at_end)  # live at the last step
    assert all(p.tokens[-1] in range(3, 23) and len(p.tokens) <= 12 for p in finished)
    result.release()


def test_eab_seed_changes_paths(models):
    _, paged = models
    eab = EntropyAdaptiveBranching(paged, entropy_threshold=0.6, max_paths=8, block_size=4)
    a, b, c = (eab.generate(prompt_ids(), 8, seed=s) for s in (0, 0, 1))
    assert [p.tokens for p in a.paths] == [p.tokens for p in b.paths]
    assert [p.tokens for p in a.paths] != [p.tokens for p in c.paths]


class InputSpy:
    """Shapes of the token batches the model's embedding sees (every forward, in order)."""

    def __init__(self, model):
        self.shapes = []
        self.handle = model.model.embed_tokens.register_forward_pre_hook(
            lambda module, args: self.shapes.append(tuple(args[0].shape)))

    def close(self):
        self.handle.remove()


def test_eab_prefills_the_prompt_once_and_steps_all_paths_together(models, monkeypatch):
    _, paged = models
    prompt = prompt_ids()
    written = []
    original = kvkernels.ops.reshape_and_cache

    def counted(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs):
        written.append(int((slot_mapping >= 0).sum()))
        return original(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs)
    monkeypatch.setattr(kvkernels.ops, "reshape_and_cache", counted)
    spy = InputSpy(paged)
    try:
        result = EntropyAdaptiveBranching(paged, entropy_threshold=0.6, max_paths=8, block_size=4,
                                          eos_token_id=[EOS]).generate(prompt, 12, seed=0)
    finally:
        spy.close()
    live = [len(e) for e in result.entropies]  # live paths at each step
    assert spy.shapes == [(1, len(prompt))] + [(n, 1) for n in live[1:]]  # one forward per step for all paths
    assert result.forward_calls == len(spy.shapes) and result.prefill_tokens == len(prompt)
    assert result.decode_tokens == sum(live[1:])
    layers = paged.config.num_hidden_layers
    assert sum(written) == layers * (len(prompt) + result.decode_tokens)  # the prompt's KV written once
    assert max(live) > 1


def test_branches_store_only_their_divergent_tokens(models):
    """No pruning, no end-of-sequence: every path's own tokens are the ones after its divergence
    point plus the partial block it diverged in (copied on write); the rest is shared."""
    _, paged = models
    bs = 4
    prompt = prompt_ids()  # 19 tokens: the prompt ends inside a block
    result = EntropyAdaptiveBranching(paged, entropy_threshold=0.6, branch_factor=3, max_paths=64, temperature=0.8,
                                      block_size=bs, eos_token_id=[]).generate(prompt, 12, seed=1)
    assert result.pruned == 0 and result.branch_events >= 5
    kv = result.cache.kv
    for path in result.paths:
        m = path.memory
        length = len(prompt) + len(path.tokens) - 1  # the last token is never fed back
        d = path.divergence_point
        assert m["sequence_length"] == length and m["divergence_point"] == d
        own = 0 if d == length else length - d + d % bs
        assert (m["own_tokens"], m["shared_tokens"]) == (own, length - own), (path.id, d)
        assert m["own_bytes"] == own * kv.bytes_per_token and m["total_bytes"] == length * kv.bytes_per_token
        assert len(prompt) <= d <= length and path.branch_steps and d == len(prompt) + path.branch_steps[-1]
    # the prompt's blocks are stored once for all paths
    assert kv.memory_usage()["stored_tokens"] < len(prompt) + sum(len(p.tokens) for p in result.paths)


def test_memory_report_fields(models):
    _, paged = models
    result = EntropyAdaptiveBranching(paged, entropy_threshold=0.6, max_paths=8, block_size=4).generate(
        prompt_ids(), 10, seed=0)
    kv = result.cache.kv
    for path in result.paths:
        m = path.memory
        assert m["total_bytes"] == m["own_bytes"] + m["shared_bytes"]
        assert m["own_memory_mb"] == m["own_bytes"] / 2**20 and m["parent_memory_mb"] == m["shared_bytes"] / 2**20
        assert m["total_memory_mb"] == pytest.approx(m["own_memory_mb"] + m["parent_memory_mb"])
        seed_names = kv.get_memory_usage(path.seq)  # the cache's own per-sequence report (MB names)
        assert seed_names["own_memory_mb"] == m["own_memory_mb"]
        assert seed_names["parent_memory_mb"] == m["parent_memory_mb"]
        assert seed_names["sequence_length"] == m["sequence_length"]
    mem = result.memory
    for key in ("stored_bytes", "deep_copy_bytes", "allocated_bytes", "peak_stored_bytes", "cow_copies", "forks"):
        assert mem[key] > 0, key
    assert mem["stored_bytes"] <= mem["peak_stored_bytes"] and mem["stored_bytes"] <= mem["allocated_bytes"]


# ---- parallel sampling -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed,temperature", [(3, 1.0), (8, 0.7)])
def test_parallel_sample_matches_independent_stock_runs(models, seed, temperature):
    stock, paged = models
    prompt = prompt_ids()
    spy = InputSpy(paged)
    try:
        result = parallel_sample(paged, prompt, 5, 10, temperature=temperature, seed=seed, block_size=4,
                                 eos_token_id=EOS)
    finally:
        spy.close()
    ref = sample_oracle(stock, prompt, 5, 10, temperature, seed, {EOS})
    assert_same_paths(result, ref)
    assert len({tuple(p.tokens) for p in result.paths}) == 5
    assert spy.shapes[0] == (1, len(prompt)) and all(s[1] == 1 for s in spy.shapes[1:])  # prefilled once
    assert result.prefill_tokens == len(prompt)
    assert result.memory["deep_copy_bytes"] == sum(dynamic_bytes(r["cache"]) for r in ref)
    for path in result.paths:  # the prompt (but its partial block) shared, the samples' tokens their own
        length = len(prompt) + len(path.tokens) - 1
        assert path.divergence_point == len(prompt)
        assert path.memory["own_tokens"] == length - len(prompt) + len(prompt) % 4


def test_parallel_sample_n1_is_plain_sampling(models):
    stock, paged = models
    result = parallel_sample(paged, prompt_ids(), 1, 8, seed=2, eos_token_id=[])
    ref = sample_oracle(stock, prompt_ids(), 1, 8, 1.0, 2, set())
    assert_same_paths(result, ref)
    assert result.paths[0].memory["shared_bytes"] == 0


# ---- generate() after one prefill ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_beam_search_prefills_once_and_matches_stock(name):
    stock, paged = model_pair(name)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        ref = stock.generate(ids, attention_mask=mask, num_beams=4, max_new_tokens=8, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    spy = InputSpy(paged)
    try:
        result = beam_search(paged, ids, 4, 8, attention_mask=mask, block_size=4, output_scores=True,
                             return_dict_in_generate=True)
    finally:
        spy.close()
    assert torch.equal(result.sequences, ref.sequences)
    torch.testing.assert_close(result.output.sequences_scores, ref.sequences_scores, rtol=1e-4, atol=1e-5)
    rows = ids.shape[0]
    assert spy.shapes[0] == (rows, ids.shape[1] - 1)  # one row per prompt
    assert all(s == (4 * rows, 1) for s in spy.shapes[1:])  # then one token per beam
    assert result.prefill_tokens == int(mask[:, :-1].sum())
    mem = result.memory
    assert mem["stored_bytes"] < mem["unshared_bytes"] / 2 and mem["split_rows"] == 0
    result.cache.kv.check_invariants()


PREFILL_ONCE_MODES = {
    "beam": dict(do_sample=False, num_beams=4, num_return_sequences=2),
    "sample": dict(do_sample=True, top_k=20, num_return_sequences=3),
    "beam_sample": dict(do_sample=True, num_beams=3),
}


@pytest.mark.parametrize("mode", list(PREFILL_ONCE_MODES))
@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss", "deepseek_v3"])
def test_generate_with_prefill_once_matches_stock(name, mode):
    """generate(custom_generate=prefill_once): the same tokens and scores as stock generate(), the
    prompt (all but its last token) computed once per input, then one token per expanded row."""
    stock, paged = model_pair(name)
    ids, mask = left_padded_batch()
    kwargs = dict(PREFILL_ONCE_MODES[mode], max_new_tokens=8, output_scores=True, return_dict_in_generate=True)
    torch.manual_seed(3)
    with torch.no_grad():
        ref = stock.generate(ids, attention_mask=mask, **kwargs)
    cache = PagedCache(paged.config, block_size=4)
    spy = InputSpy(paged)
    try:
        torch.manual_seed(3)
        with torch.no_grad():
            out = paged.generate(ids, attention_mask=mask, **cache_kwargs(paged.generate, cache), custom_generate=prefill_once,
                                 **kwargs)
    finally:
        spy.close()
    assert torch.equal(out.sequences, ref.sequences)
    if "num_beams" in kwargs:
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=1e-4, atol=1e-5)
    else:
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    rows, expand = ids.shape[0], max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1))
    assert spy.shapes[0] == (rows, ids.shape[1] - 1)
    assert all(s == (rows * expand, 1) for s in spy.shapes[1:]) and len(spy.shapes) == 9
    usage = cache.memory_usage()
    assert usage["stored_tokens"] < usage["unshared_tokens"] and cache.split_rows == 0
    cache.kv.check_invariants()


def test_prefill_once_without_copies_is_plain_generate():
    """One row per input (greedy): nothing to share, the decoding loop runs as it is."""
    stock, paged = model_pair("llama")
    ids, mask = left_padded_batch()
    spy = InputSpy(paged)
    try:
        with torch.no_grad():
            out = paged.generate(ids, attention_mask=mask, **cache_kwargs(paged.generate, PagedCache(paged.config)),
                                 custom_generate=prefill_once, max_new_tokens=5, do_sample=False)
    finally:
        spy.close()
    with torch.no_grad():
        ref = stock.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref) and spy.shapes[0] == tuple(ids.shape)


def test_prefill_once_encoder_decoder_runs_generate_as_it_is():
    """BART: generate() runs the encoder once per input and PagedEncoderDecoderCache shares the
    cross-attention K/V among the beams; the decoder prompt is one token: nothing to do."""
    stock, paged = bart_pair()
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ref = stock.generate(ids, **beams)
        out = paged.generate(ids, **cache_kwargs(paged.generate, PagedCache(paged.config)), custom_generate=prefill_once, **beams)
    assert torch.equal(out, ref)


def test_prefill_once_argument_checks():
    stock, paged = model_pair("llama")
    ids = torch.tensor([[3, 4, 5, 6]])
    beams = dict(num_beams=2, max_new_tokens=2, do_sample=False, custom_generate=prefill_once)
    with torch.no_grad():
        with pytest.raises(ValueError, match="(cache|past_key_values): expected a PagedCache"):
            paged.generate(ids, **beams)  # generate() made a DynamicCache
        with pytest.raises(ValueError, match="(cache|past_key_values): expected an empty PagedCache"):
            paged.generate(ids, **cache_kwargs(paged.generate, _non_empty_cache(paged)), **beams)
        with pytest.raises(ValueError, match="attn_implementation"):
            stock.generate(ids, **cache_kwargs(stock.generate, PagedCache(stock.config)), **beams)
        with pytest.raises(NotImplementedError, match="inputs_embeds"):
            paged.generate(inputs_embeds=paged.model.embed_tokens(ids), **cache_kwargs(paged.generate, PagedCache(paged.config)),
                           **beams)


@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(do_sample=False, num_beams=3)])
def test_shared_prefix_batch_matches_stock_and_each_request_alone(mode):
    stock, paged = model_pair("llama")
    prefix = prompt_ids(20)
    suffixes = [[5, 6, 7], [9] * 7, [11, 12], [40]]
    spy = InputSpy(paged)
    try:
        result = generate_shared_prefix(paged, prefix, suffixes, 8, block_size=4, **mode)
    finally:
        spy.close()
    with torch.no_grad():
        ref = stock.generate(result.input_ids, attention_mask=result.attention_mask, max_new_tokens=8, **mode)
    assert torch.equal(result.sequences, ref)
    expand = mode.get("num_beams", 1)
    assert spy.shapes[:2] == [(1, 20), (4 * expand, 7)]  # the prefix once, then only the suffixes
    assert result.prompt_tokens == 4 * 20 + 13 and result.prefix_hit_tokens == 3 * 20
    assert result.prefix_hit_rate == pytest.approx(60 / 93)
    if expand == 1:
        for r, suffix in enumerate(suffixes):  # the padded layout means prefix + suffix
            with torch.no_grad():
                alone = stock.generate(torch.tensor([prefix + suffix]), max_new_tokens=8, do_sample=False)
            alone = alone[0, len(prefix) + len(suffix):].tolist()  # may stop early (end of sequence)
            assert result.new_tokens[r] == alone + [0] * (8 - len(alone))  # then padding
        # the prefix (5 whole blocks) stored once; every request's own tokens after it
        stored = result.cache.kv.memory_usage()["stored_tokens"]
        assert stored == 20 + 13 + 4 * (8 - 1)
    result.cache.kv.check_invariants()


def _word_tokenizer():
    """A word-level tokenizer over a few words (ids < the test models' vocabulary) that adds [BOS]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    words = "you are a terse assistant answer what is paging why fork blocks".split()
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
                                   unk_token="[UNK]")


def test_shared_prefix_takes_tensors_and_text_like_the_other_strategies():
    _, paged = model_pair("llama")
    prefix, suffixes = prompt_ids(20), [[5, 6, 7], [9] * 7, [11, 12]]

    def run(p, s, **kwargs):
        result = generate_shared_prefix(paged, p, s, 4, block_size=4, do_sample=False, **kwargs)
        result.cache.kv.check_invariants()
        return result.sequences
    expected = run(prefix, suffixes)
    # a [1, L] prefix (what a tokenizer returns), 1-D and [1, L] suffixes
    assert torch.equal(run(torch.tensor([prefix]), [torch.tensor(suffixes[0]), torch.tensor([suffixes[1]]),
                                                    suffixes[2]]), expected)
    assert torch.equal(run(torch.tensor(prefix), torch.tensor([[5, 6], [7, 8]])), run(prefix, [[5, 6], [7, 8]]))
    # text with a tokenizer: the prefix gets the tokenizer's BOS, the suffixes no second one
    tokenizer = _word_tokenizer()
    system, users = "you are a terse assistant", [" what is paging", " why fork blocks"]
    ids = [tokenizer(system)["input_ids"], *(tokenizer(u, add_special_tokens=False)["input_ids"] for u in users)]
    assert ids[0][0] == 1 and all(1 not in u for u in ids[1:])
    assert torch.equal(run(system, users, tokenizer=tokenizer), run(ids[0], ids[1:]))
    assert torch.equal(run(system, users[0], tokenizer=tokenizer), run(ids[0], [ids[1]]))  # one request
    with pytest.raises(ValueError, match="prefix: text needs a tokenizer"):
        run(system, users)
    with pytest.raises(ValueError, match=r"suffixes: expected a list of requests .* shape \(3,\)"):
        run(prefix, torch.tensor([5, 6, 7]))
    with pytest.raises(ValueError, match=r"suffixes\[1\]: expected one sequence, got shape \(2, 2\)"):
        run(prefix, [[5], torch.ones(2, 2, dtype=torch.long)])


# ---- primitives and argument checks ----------------------------------------------------------------


def test_sampling_primitives():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25], dtype=torch.float64)
    assert inverse_cdf(probs, 0.0) == 1  # a zero-probability token is never drawn
    assert inverse_cdf(probs, 0.2499) == 1 and inverse_cdf(probs, 0.25) == 3 and inverse_cdf(probs, 0.9999) == 4
    assert inverse_cdf(probs * 3, 0.5) == 3  # need not sum to 1
    assert draw_distinct(probs, [0.9, 0.9, 0.9, 0.9]) == [4, 3, 1]  # distinct; stops when none is left
    assert normalized_entropy(torch.full((2, 8), -math.log(8))).tolist() == pytest.approx([1.0, 1.0])
    one_hot = torch.log_softmax(torch.tensor([[0.0, -math.inf, -math.inf]]), -1)
    assert normalized_entropy(one_hot).tolist() == [0.0]


def test_argument_checks(models):
    stock, paged = models
    with pytest.raises(ValueError, match="attn_implementation"):
        EntropyAdaptiveBranching(stock).generate(prompt_ids(), 4)
    with pytest.raises(ValueError, match="temperature"):
        parallel_sample(paged, prompt_ids(), 2, 4, temperature=0.0)
    with pytest.raises(ValueError, match="tokenizer"):
        EntropyAdaptiveBranching(paged).generate("text", 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        parallel_sample(paged, prompt_ids(), 2, 0)
    with pytest.raises(ValueError, match="branch_factor"):
        EntropyAdaptiveBranching(paged, branch_factor=0)
    with pytest.raises(ValueError, match="empty PagedCache"):
        beam_search(paged, torch.tensor([[3, 4, 5]]), 2, 2, cache=_non_empty_cache(paged))
    with pytest.raises(ValueError, match="suffix"):
        generate_shared_prefix(paged, [3, 4], [[5], []], 2)


def _non_empty_cache(model):
    cache = PagedCache(model.config)
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5]]), **cache_kwargs(model.forward, cache))
    return cache


def test_held_rows_survive_storage_growth():
    """PagedCache.hold_row (how finished paths are parked): the held sequence keeps its KV when a
    storage growth rebuilds everything into a larger allocation, and still shares with its row."""
    _, paged = model_pair("llama")
    cache = PagedCache(paged.config, block_size=2)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))

    def kv_of(seq):
        kv = cache.kv
        return kv.kv.flatten(2, 3)[:, :, kv.slot_mapping(seq, 0, kv.seq_lens([seq]).item())].clone()
    with torch.no_grad():
        paged(ids, **cache_kwargs(paged.forward, cache))
        handle = cache.hold_row(1)
        before = kv_of(cache.held_sequence(handle))
        grows, forks = cache.grow_count, cache.kv.stats().forks
        for _ in range(12):
            paged(torch.tensor([[7], [8]]), **cache_kwargs(paged.forward, cache))
    assert cache.grow_count > grows
    assert cache.kv.stats().forks == forks  # the counters survive the growth (its rebuild forks are not counted)
    held = cache.held_sequence(handle)
    assert torch.equal(kv_of(held), before)
    assert cache.kv.memory_usage(held)["shared_tokens"] == 4  # two whole blocks still shared with row 1
    cache.kv.check_invariants()
    cache.release_held()
    assert len(cache.kv) == 2
    with pytest.raises(ValueError, match="released"):
        cache.held_sequence(handle)

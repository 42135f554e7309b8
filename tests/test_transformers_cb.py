"""kvkernels.integrations.transformers_flash: kvkernels as transformers' flash-attention kernel module.

The three flash functions against a dense float64 attention written here (bottom-right causal, windows,
soft cap, sinks, GQA, padding rows), the overlapping K/V page views of transformers' continuous-batching
cache, the argument errors; then transformers itself: ``generate_batch`` (continuous batching) on a tiny
random Llama (GQA) with kvkernels' kernel, token-identical to the SDPA continuous-batching run and to
per-prompt ``generate()``, for mixed prompt lengths with a shared prefix and chunked prefill, with the
kernel's calls counted; Mistral's sliding windows and Gemma2's soft cap the same way; the block-table decode path transformers takes on CUDA, forced here on the CPU;
and ``generate()`` with the kernel on a stock cache. Nothing is downloaded.

Runs on every transformers the package supports (``make test-compat``: 5.16.1 and 5.24.0; also run on
5.18.0, 5.20.0, 5.21.1, 5.22.2, 5.23.0). transformers' continuous batching sizes its CPU cache with
``psutil`` (before 5.21 it fails without it; the development venv has it, pinned).
"""

from __future__ import annotations

import math

import inspect

import pytest
import torch
import transformers

import kvkernels
from kvkernels.integrations import transformers_flash as flash
from kvkernels.integrations.transformers_flash import (KERNEL_NAME, flash_attn_func, flash_attn_varlen_func,
                                                       flash_attn_with_kvcache)

from hf_models import OpCounter, build, config_for



# ---- the flash functions against a dense reference ------------------------------------------------------


def dense_attention(q, k, v, *, scale=None, causal=True, window_left=-1, soft_cap=0.0, sinks=None):
    """One sequence, float64: q [Sq, Hq, D], k / v [Sk, Hkv, D]; queries aligned to the last keys."""
    q, k, v = q.double(), k.double(), v.double()
    sq, hq, d = q.shape
    sk, hkv = k.shape[:2]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * (scale if scale is not None else d ** -0.5)
    if soft_cap:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    pos = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible &= j <= pos
    if window_left >= 0:
        visible &= j >= pos - window_left
    logits = logits.masked_fill(~visible, -math.inf)
    if sinks is not None:
        logits = torch.cat([logits, sinks.double()[:, None, None].expand(hq, sq, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)[..., :sk]
    return torch.einsum("hqk,khd->qhd", probs, v)


HQ, HKV, D = 4, 2, 16
OPTIONS = {
    "causal": (dict(causal=True), dict(causal=True)),
    "window": (dict(causal=True, window_size=(2, 2)), dict(causal=True, window_left=2)),
    "softcap": (dict(causal=True, softcap=0.5, softmax_scale=0.7), dict(causal=True, soft_cap=0.5, scale=0.7)),
    "sinks": (dict(causal=True, s_aux="sinks"), dict(causal=True, sinks="sinks")),
    "bidirectional": (dict(causal=False), dict(causal=False)),
    "bidirectional_window": (dict(causal=False, window_size=(1, -1)), dict(causal=False, window_left=1)),
}


def with_sinks(kwargs: dict, sinks: torch.Tensor) -> dict:
    return {key: (sinks if value == "sinks" else value) for key, value in kwargs.items()}


def close(a, b):
    torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("max_seqlen_k", [None, 32])
def test_varlen_matches_dense(option, max_seqlen_k, monkeypatch):
    q_lens, k_lens = [3, 1, 5, 0], [3, 4, 7, 2]  # prefill, decode, chunk after 2 cached tokens, no query
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(q_lens), HQ, D, generator=g)
    k, v = (torch.randn(sum(k_lens), HKV, D, generator=g) for _ in range(2))
    sinks = torch.randn(HQ, generator=g)
    cu_q = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens]).cumsum(0)  # int64: converted
    call, ref = (with_sinks(o, sinks) for o in OPTIONS[option])
    calls = OpCounter(monkeypatch, "paged_attention")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=max(q_lens), max_seqlen_k=max_seqlen_k, **call)
    assert calls.calls["paged_attention"] == 1 and out.shape == q.shape and out.dtype == q.dtype
    for i in range(len(q_lens)):
        close(out[cu_q[i]:cu_q[i + 1]], dense_attention(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]],
                                                        v[cu_k[i]:cu_k[i + 1]], **ref))


@pytest.mark.parametrize("option", ["causal", "window", "sinks", "bidirectional"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_flash_attn_func_matches_dense(option, q_len):
    g = torch.Generator().manual_seed(1)
    batch, k_len = 3, 6
    q = torch.randn(batch, q_len, HQ, D, generator=g)
    # keys as transformers hands them over: [B, Hkv, S, D] transposed to [B, S, Hkv, D] (not contiguous)
    k, v = (torch.randn(batch, HKV, k_len, D, generator=g).transpose(1, 2) for _ in range(2))
    sinks = torch.randn(HQ, generator=g)
    call, ref = (with_sinks(o, sinks) for o in OPTIONS[option])
    out = flash_attn_func(q, k, v, **call)
    assert out.shape == q.shape
    for b in range(batch):
        close(out[b], dense_attention(q[b], k[b], v[b], **ref))


def test_dtypes_follow_the_query():
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(2, 3, HQ, D, generator=g).to(dtype)
        k, v = (torch.randn(2, 3, HKV, D, generator=g).to(dtype) for _ in range(2))
        out = flash_attn_func(q, k, v, causal=True)
        assert out.dtype == dtype
        for b in range(2):
            torch.testing.assert_close(out[b].double(), dense_attention(q[b], k[b], v[b]), rtol=2e-2, atol=2e-2)


def test_kvcache_dense_cache_appends_then_attends():
    g = torch.Generator().manual_seed(3)
    batch, capacity = 3, 8
    k_cache, v_cache = (torch.randn(batch, capacity, HKV, D, generator=g) for _ in range(2))
    before_k = k_cache.clone()
    lens = torch.tensor([3, 0, 5], dtype=torch.int32)
    q = torch.randn(batch, 2, HQ, D, generator=g)
    k, v = (torch.randn(batch, 2, HKV, D, generator=g) for _ in range(2))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)
    for b in range(batch):
        n = int(lens[b])
        assert torch.equal(k_cache[b, n:n + 2], k[b]) and torch.equal(v_cache[b, n:n + 2], v[b])
        assert torch.equal(k_cache[b, :n], before_k[b, :n]) and torch.equal(k_cache[b, n + 2:], before_k[b, n + 2:])
        close(out[b], dense_attention(q[b], k_cache[b, :n + 2], v_cache[b, :n + 2]))
    # without new tokens: attend what is there
    out = flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=4)
    for b in range(batch):
        close(out[b], dense_attention(q[b, :1], k_cache[b, :4], v_cache[b, :4]))


def transformers_page_views(layers: int, num_blocks: int, page: int, g: torch.Generator):
    """transformers' continuous-batching cache of one attention group (cache_allocators/full_attention.py):
    per block the pages K0 V0 K1 V1 ... of every layer; layer i's views are the flat token rows starting at
    page 2i (keys) and 2i + 1 (values), viewed as pages and truncated to equal length, so V page j is K
    page j + 1; a block's entry in the kernel's block table is block * 2 * layers."""
    flat = torch.randn(num_blocks * 2 * layers * page, HKV, D, generator=g)
    views = []
    for i in range(layers):
        k_pages = flat[2 * i * page:].view(-1, page, HKV, D)
        v_pages = flat[(2 * i + 1) * page:].view(-1, page, HKV, D)
        n = min(k_pages.shape[0], v_pages.shape[0])
        views.append((k_pages[:n], v_pages[:n]))
    return flat, views


def test_kvcache_on_transformers_overlapping_page_views(monkeypatch):
    g = torch.Generator().manual_seed(4)
    layers, num_blocks, page = 2, 6, 4
    flat, views = transformers_page_views(layers, num_blocks, page, g)
    k_cache, v_cache = views[1]
    assert v_cache.data_ptr() - k_cache.data_ptr() == k_cache.stride(0) * 4  # V page j is K page j + 1
    blocks = [[4, 1], [2, 0], [-1, -1]]  # row 2: a padding row (transformers pads batches for CUDA graphs)
    table = torch.tensor([[b * 2 * layers if b >= 0 else -1 for b in row] for row in blocks], dtype=torch.int32)
    lens = torch.tensor([5, 3, -1], dtype=torch.int32)
    q = torch.randn(3, 1, HQ, D, generator=g)
    k, v = (torch.randn(3, 1, HKV, D, generator=g) for _ in range(2))
    before = flat.clone()
    calls = OpCounter(monkeypatch, "reshape_and_cache", "paged_attention")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table, causal=True)
    assert calls.calls == {"reshape_and_cache": 1, "paged_attention": 1}

    def rows(block: int, kind: int) -> slice:  # flat rows of (block, layer 1, K = 0 / V = 1)
        start = (block * 2 * layers + 2 * 1 + kind) * page
        return slice(start, start + page)

    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    for r, n in ((0, 5), (1, 3)):
        block, offset = blocks[r][n // page], n % page
        for kind, new in ((0, k), (1, v)):
            row = rows(block, kind).start + offset
            assert torch.equal(flat[row], new[r, 0])
            written[row] = True
        keys = torch.cat([flat[rows(b, 0)] for b in blocks[r]])[:n + 1]
        values = torch.cat([flat[rows(b, 1)] for b in blocks[r]])[:n + 1]
        close(out[r], dense_attention(q[r], keys, values))
    assert torch.equal(flat[~written], before[~written])  # nothing else moved: other layer, padding row
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # the padding row sees nothing

    # what the remapping avoids: reshape_and_cache refuses to write through the overlapping views
    with pytest.raises(RuntimeError, match="value_cache: shares memory with key_cache"):
        kvkernels.ops.reshape_and_cache(k[:1, 0], v[:1, 0], k_cache, v_cache, torch.tensor([0]))
    # an odd block-table entry cannot be told apart from a V page: refused
    odd = table.clone()
    odd[0, 0] += 1
    with pytest.raises(ValueError, match="every block-table entry in use is even"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=odd, causal=True)


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v, cu: flash_attn_varlen_func(q, k, v, cu, cu, dropout_p=0.1), "dropout"),
    (lambda q, k, v, cu: flash_attn_varlen_func(q, k, v, cu, cu, window_size=(2, 0)), "keeps only a left bound"),
    (lambda q, k, v, cu: flash_attn_varlen_func(q, k, v, cu, cu[:-1]), r"cu_seqlens_q and cu_seqlens_k must both"),
    (lambda q, k, v, cu: flash_attn_varlen_func(q, k, v, cu, cu, causal=1), "causal must be a bool"),
    (lambda q, k, v, cu: flash_attn_varlen_func(q, k, v, cu, cu, window_size=3), "window_size must be a pair"),
    (lambda q, k, v, cu: flash_attn_varlen_func(q[None], k, v, cu, cu), "q must have 3 dimensions"),
    (lambda q, k, v, cu: flash_attn_func(q[None], k[None], v[None, :2]), "must share the batch size"),
    (lambda q, k, v, cu: flash_attn_with_kvcache(q[None], k[None], v[None], k=k[None]), "pass both k and v"),
    (lambda q, k, v, cu: flash_attn_with_kvcache(q[None], k[None], v[None]), "cache_seqlens is required"),
    (lambda q, k, v, cu: flash_attn_with_kvcache(q[None], k[None], v[None], cache_seqlens=torch.ones(2)),
     "cache_seqlens must be an integer tensor"),
    (lambda q, k, v, cu: flash_attn_with_kvcache(q[None], k[None], v[None], k[None, :1], v[None, :1],
                                                 cache_seqlens=4, block_table=torch.zeros(1, 1, dtype=torch.int32)),
     "exceed a block_table row"),
])
def test_bad_arguments_raise_clear_errors(call, match):
    q, k, v = torch.randn(4, HQ, D), torch.randn(4, HKV, D), torch.randn(4, HKV, D)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, k, v, cu)


def test_op_errors_come_through():
    """Shapes the op refuses (a head dim that is not a multiple of 8) give the op's error."""
    q, k, v = torch.randn(4, HQ, 12), torch.randn(4, HKV, 12), torch.randn(4, HKV, 12)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="kvkernels.paged_attention"):
        flash_attn_varlen_func(q, k, v, cu, cu, causal=True)


def test_call_log(tmp_path, monkeypatch):
    monkeypatch.setenv("KVKERNELS_FLASH_CALL_LOG", str(tmp_path))
    q, k, v = torch.randn(5, HQ, D), torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    flash_attn_varlen_func(q, k, v, torch.tensor([0, 2, 5]), torch.tensor([0, 2, 5]), causal=True)
    flash_attn_func(q[None], k[None], v[None], causal=True)
    (log,) = tmp_path.iterdir()
    assert log.read_text().splitlines() == ["flash_attn_varlen_func 2 5", "flash_attn_func 1 5"]


# ---- inside transformers ---------------------------------------------------------------------------------

# Mixed lengths sharing an 8-token prefix (two pages of 4: continuous batching may share the blocks), a
# one-token prompt, and a 21-token prompt that max_batch_tokens=16 prefills in chunks.
PREFIX = [9, 17, 33, 41, 57, 65, 81, 89]
PROMPTS = [PREFIX + [10, 11, 12], PREFIX + [20, 21], PREFIX, [40], PREFIX + list(range(100, 113)), [7, 8, 9, 10, 11]]
NEW_TOKENS = 10


def cb_config(**extra):
    # Small explicit sizes: the default sizes the cache from the machine's free memory (seconds on a CPU).
    # The page size is `block_size` in transformers 5.16 (`page_size` by 5.18).
    fields = inspect.signature(transformers.ContinuousBatchingConfig).parameters
    page = "page_size" if "page_size" in fields else "block_size"
    return transformers.ContinuousBatchingConfig(**{page: 4}, num_blocks=96, max_batch_tokens=16, **extra)


def generation_config():
    return transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)


@pytest.fixture(scope="module")
def llama_pair():
    """(SDPA Llama, the same weights on kvkernels' flash kernel); GQA: 4 query heads, 2 kv heads."""
    name = flash.continuous_batching_kernel()
    config, _, _ = config_for("llama")
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 2
    return build(config, "sdpa"), build(config, name)


def generate_batch(model, **config):
    out = model.generate_batch(PROMPTS, generation_config=generation_config(), continuous_batching_config=cb_config(
        **config))
    assert len(out) == len(PROMPTS)
    by_prompt = {tuple(o.prompt_ids): o.generated_tokens for o in out.values()}
    return [by_prompt[tuple(p)] for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(llama_pair):
    """Per-prompt generate() with SDPA and the stock cache."""
    sdpa, _ = llama_pair
    config = generation_config()
    return [sdpa.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in PROMPTS]


def test_registration_resolves_the_name_and_leaves_other_kernels_alone():
    from transformers.integrations import hub_kernels
    from transformers.modeling_flash_attention_utils import lazy_import_flash_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert flash.continuous_batching_kernel() == KERNEL_NAME == flash.register_flash_kernel()  # idempotent
    loader = hub_kernels.load_and_register_attn_kernel
    assert loader.kvkernels_original is not None and not hasattr(loader.kvkernels_original, "kvkernels_original")
    functions = lazy_import_flash_attention(KERNEL_NAME)[0]
    assert functions[:2] == (flash_attn_func, flash_attn_varlen_func)
    # transformers 5.20 and later wrap it in torch.compiler.disable (5.16 and 5.18 do not)
    assert getattr(functions[2], "__wrapped__", functions[2]) is flash_attn_with_kvcache
    assert KERNEL_NAME in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert transformers.utils.generic.is_flash_attention_requested(requested_attention_implementation=KERNEL_NAME)
    # every other Hub-style name still goes to transformers' own loader
    with pytest.raises((ImportError, ValueError), match="kernels"):
        loader("someone/other-kernel")


def test_generate_batch_matches_sdpa_and_generate(llama_pair, expected, monkeypatch):
    sdpa, ours = llama_pair
    calls = OpCounter(monkeypatch, "paged_attention", "reshape_and_cache")
    reference = generate_batch(sdpa)
    assert calls.calls["paged_attention"] == 0
    assert reference == expected
    tokens = generate_batch(ours)
    assert tokens == expected
    assert all(len(t) == NEW_TOKENS for t in tokens) and len({tuple(t) for t in tokens}) == len(tokens)
    # one paged_attention call per layer and forward: at least the decode steps of every request
    layers = ours.config.num_hidden_layers
    assert calls.calls["paged_attention"] % layers == 0 and calls.calls["paged_attention"] >= layers * NEW_TOKENS
    assert calls.calls["reshape_and_cache"] == 0  # on the CPU transformers writes and gathers its cache itself
    assert ours.config._attn_implementation == KERNEL_NAME


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_generate_batch_windows_and_soft_cap(name, monkeypatch):
    """Sliding windows (Mistral: window 4 in every layer; Gemma2: alternating) and Gemma2's soft cap reach the kernel
    through transformers' flash wrapper (window_size, softcap): generate_batch on kvkernels is token-identical
    to per-prompt generate() with the stock implementation (tests/test_transformers.py::test_features_matter
    shows these settings change the tokens)."""
    config, stock_attn, fix = config_for(name)
    stock = build(config, stock_attn, fix)
    ours = build(config, flash.continuous_batching_kernel(), fix)
    gen = generation_config()
    expected = [stock.generate(torch.tensor([p]), generation_config=gen)[0, len(p):].tolist() for p in PROMPTS]
    calls = OpCounter(monkeypatch, "paged_attention")
    assert generate_batch(ours) == expected
    assert calls.calls["paged_attention"] >= ours.config.num_hidden_layers * NEW_TOKENS


def test_generate_batch_block_table_path(llama_pair, expected, monkeypatch):
    """transformers takes the block-table decode path (flash_attn_with_kvcache on its own paged cache,
    overlapping K/V page views) only on CUDA / XPU; here it is forced on the CPU by keeping the requested
    max_blocks_per_request (the device check in resolve_continuous_batching_config is skipped)."""
    from transformers.generation.continuous_batching import initialization

    _, ours = llama_pair
    monkeypatch.setattr(initialization, "ensure_decode_fast_path_is_available", lambda config, cb, requested: None)
    calls = OpCounter(monkeypatch, "paged_attention", "reshape_and_cache")
    assert generate_batch(ours, max_blocks_per_request=16) == expected
    layers = ours.config.num_hidden_layers
    # every decode step of every layer wrote its token into transformers' pages and attended them there
    assert calls.calls["reshape_and_cache"] >= layers * (NEW_TOKENS - 1)
    assert calls.calls["paged_attention"] > calls.calls["reshape_and_cache"]  # + the prefill forwards (varlen)


def test_generate_with_the_kernel_on_a_stock_cache(llama_pair, monkeypatch):
    """Plain generate() (what `transformers serve` runs without continuous batching) on the same name:
    left-padded rows go through flash_attn_varlen_func, an unpadded batch through flash_attn_func."""
    from hf_models import left_padded_batch

    sdpa, ours = llama_pair
    ids, mask = left_padded_batch()
    calls = OpCounter(monkeypatch, "paged_attention")
    for kwargs in (dict(input_ids=ids, attention_mask=mask), dict(input_ids=ids[:1])):
        ref = sdpa.generate(**kwargs, max_new_tokens=8, do_sample=False)
        before = calls.calls["paged_attention"]
        out = ours.generate(**kwargs, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, ref)
        assert calls.calls["paged_attention"] - before == 8 * ours.config.num_hidden_layers

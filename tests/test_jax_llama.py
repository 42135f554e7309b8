"""The JAX Llama on kvkernels.jax's paged cache (kvkernels/jax/llama.py): a batched prefill that writes every
prompt token's K/V, then jitted decode steps with the cache donated, pages allocated on the host between
steps. Its greedy tokens must equal a dense-attention JAX reference and the PyTorch model with the same
weights (tests/hf_models.py's tiny random Llama, nothing downloaded) generating through kvkernels'
transformers ``PagedCache`` (torch ops).

Skips (with the reason) only when jax is not installed.
"""

import re

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (the JAX tests need jax and jaxlib from "
                                        "requirements/lock.txt: pip install -c requirements/lock.txt jax jaxlib)")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from hf_models import build, config_for  # noqa: E402
from kvkernels.integrations.transformers import PagedCache, cache_kwargs  # noqa: E402
from kvkernels.jax import PagedKVCache, PageManager, llama  # noqa: E402
from kvkernels.jax.cache import OutOfPagesError  # noqa: E402

NEW_TOKENS = 12
PAGE = 4  # small pages: prompts and generations cross many page boundaries


@pytest.fixture(scope="module", autouse=True)
def jax_library(jax_library_path):
    return jax_library_path


@pytest.fixture(scope="module")
def model():
    """(torch model on kvkernels attention, its LlamaConfig, JAX params with the same weights)."""
    config, _, _ = config_for("llama")
    hf = build(config, "kvkernels", seed=0)
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    cfg = llama.LlamaConfig.from_hf(hf.config)
    return hf, cfg, llama.params_from_state_dict(cfg, state)


def prompts():
    rng = np.random.default_rng(7)
    return [[5, 9, 33, 7], rng.integers(3, 128, 27).tolist(), [100], rng.integers(3, 128, 9).tolist()]


def until_eos(tokens, eos):
    tokens = list(tokens)
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def test_greedy_tokens_equal_dense_reference_and_torch(model):
    hf, cfg, params = model
    ps = prompts()
    paged = llama.generate(params, cfg, ps, NEW_TOKENS, page_size=PAGE)
    dense = llama.reference_generate(params, cfg, ps, NEW_TOKENS)
    np.testing.assert_array_equal(paged, dense)
    assert len({tuple(r) for r in paged}) == len(ps) and len(set(paged.ravel().tolist())) > 8, paged
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        for i, p in enumerate(ps):
            cache = PagedCache(hf.config, block_size=PAGE)
            out = hf.generate(torch.tensor([p]), **cache_kwargs(hf.generate, cache), max_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(p):].tolist()
            # transformers stops a sequence at its EOS token; the JAX loop keeps going.
            assert out == until_eos(paged[i], eos), (i, out, paged[i])


def test_positions_matter(model):
    """The comparison above can fail: the same weights with another rope theta give other tokens."""
    _, cfg, params = model
    other = llama.reference_generate(params, llama.LlamaConfig(**{**cfg.__dict__, "rope_theta": 10.0}), prompts(),
                                     NEW_TOKENS)
    assert not np.array_equal(other, llama.generate(params, cfg, prompts(), NEW_TOKENS, page_size=PAGE))


def test_each_prompt_alone_gives_its_batch_tokens(model):
    _, cfg, params = model
    ps = prompts()
    batch = llama.generate(params, cfg, ps, 4, page_size=PAGE)
    for i in (1, 2):  # the longest prompt and the one-token one (each alone compiles its own shapes)
        np.testing.assert_array_equal(llama.generate(params, cfg, [ps[i]], 4, page_size=PAGE)[0], batch[i])


def test_decode_loop_compiles_once_and_writes_pages_in_place(model):
    """The loop by hand: after the prefill, each decode step gets the donated cache and returns pages at the
    same addresses (every layer, K and V), the step compiles once, and the lengths grow by one a step."""
    _, cfg, params = model
    ps = prompts()
    stats = {}
    first = llama.generate(params, cfg, ps, 2, page_size=PAGE, max_len=40, stats=stats)
    cache, pm = stats["cache"], stats["pages"]
    ptrs = [x.unsafe_buffer_pointer() for x in (*cache.k, *cache.v)]
    token = jnp.asarray(first[:, -1])
    compiled_before = llama.decode_step._cache_size()
    for _ in range(5):
        positions = pm.lengths.copy()
        for i in range(len(ps)):
            pm.reserve(i, int(positions[i]) + 1)
        slots = np.array([pm.slot_mapping(i, int(positions[i]), 1)[0] for i in range(len(ps))], np.int32)
        cache = cache.with_tables(pm.block_tables(), pm.lengths)
        token, cache = llama.decode_step(params, cfg, cache, token, positions, slots)
        assert [x.unsafe_buffer_pointer() for x in (*cache.k, *cache.v)] == ptrs
    assert llama.decode_step._cache_size() == compiled_before  # no new compilation as sequences grow
    np.testing.assert_array_equal(np.asarray(cache.seq_lens), [len(p) + 1 + 5 for p in ps])
    hlo = llama.decode_step.lower(params, cfg, cache, token, positions, slots).compile().as_text()
    assert set(re.findall(r'custom_call_target="([^"]+)"', hlo)) == {"kvkernels_reshape_and_cache",
                                                                   "kvkernels_paged_attention"}
    assert "callback" not in hlo


def test_fp8_pages(model):
    """The loop on e4m3 pages (per-tensor scales per layer): the prefill and decode run on quantized K/V; the
    first tokens (decided mostly by the prompt) agree with the float pages'."""
    _, cfg, params = model
    ps = prompts()
    scales = [jnp.full((1,), 0.01, jnp.float32)] * cfg.num_layers
    fp8 = llama.generate(params, cfg, ps, 4, page_size=PAGE, cache_dtype=jnp.float8_e4m3fn, k_scale=scales,
                         v_scale=scales)
    ref = llama.reference_generate(params, cfg, ps, 4)
    assert fp8.shape == ref.shape and (fp8[:, 0] == ref[:, 0]).mean() >= 0.75, (fp8, ref)


# ---- the page manager ---------------------------------------------------------------------------

def test_page_manager():
    pm = PageManager(num_pages=6, page_size=4, batch=2, max_pages_per_seq=3)
    assert pm.free_pages == 5  # page 0 pads the block tables
    pm.reserve(0, 5)
    assert pm.pages(0) == [1, 2] and pm.lengths[0] == 5
    pm.reserve(1, 4)
    pm.reserve(0, 8)  # still two pages
    assert pm.pages(0) == [1, 2] and pm.free_pages == 2
    np.testing.assert_array_equal(pm.block_tables(), [[1, 2, 0], [3, 0, 0]])
    np.testing.assert_array_equal(pm.slot_mapping(0, 3, 3), [7, 8, 9])
    with pytest.raises(ValueError, match="tokens up to 8 of slot 1 have no page"):
        pm.slot_mapping(1, 2, 7)
    with pytest.raises(ValueError, match="need 4 pages, a block table row holds 3"):
        pm.reserve(0, 13)
    pm.reserve(0, 12)
    with pytest.raises(OutOfPagesError, match="2 more pages needed, 1 free"):
        pm.reserve(1, 12)
    assert pm.pages(1) == [3] and pm.lengths[1] == 4 and pm.free_pages == 1  # the failed call changed nothing
    with pytest.raises(ValueError, match="below the slot's length"):
        pm.reserve(1, 2)
    pm.release(0)
    assert pm.free_pages == 4 and pm.lengths[0] == 0
    pm.reserve(1, 12)
    assert pm.pages(1) == [3, 1, 2]


def test_paged_kv_cache_is_a_pytree():
    cache = PagedKVCache.create(num_layers=2, num_pages=5, page_size=4, num_kv_heads=1, head_dim=8, batch=2,
                                max_pages_per_seq=3, dtype=jnp.float8_e5m2, k_scale=jnp.ones(1),
                                v_scale=[jnp.ones(1), jnp.full((1,), 2.0)])
    leaves, tree = jax.tree_util.tree_flatten(cache)
    assert len(leaves) == 2 + 2 + 2 + 2 + 2  # k, v per layer, tables, lengths, scales per layer
    again = jax.tree_util.tree_unflatten(tree, leaves)
    assert again.num_layers == 2 and again.page_size == 4 and float(again.v_scale[1][0]) == 2.0
    with pytest.raises(ValueError, match="k_scale, v_scale: required for an fp8 dtype"):
        PagedKVCache.create(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1, head_dim=8, batch=1,
                            max_pages_per_seq=1, dtype=jnp.float8_e4m3fn)
    # A write through the pytree's helper lands in that layer only.
    x = jnp.ones((1, 1, 8), jnp.bfloat16)
    new = PagedKVCache.create(num_layers=2, num_pages=3, page_size=2, num_kv_heads=1, head_dim=8, batch=1,
                              max_pages_per_seq=2, dtype=jnp.bfloat16).write(1, x, x, jnp.asarray([3], jnp.int32))
    assert float(new.k[1][1, 1].astype(jnp.float32).sum()) == 8 and float(new.k[0].astype(jnp.float32).sum()) == 0


def test_with_tables_copies_the_host_arrays():
    """JAX on the CPU may use a numpy array's memory without copying it (about every other array here, by
    its alignment), and the page manager updates its lengths in place for the next step while the last
    one may still be running: with_tables copies. (Without the copy the loop's prefill read the next
    step's lengths now and then: tokens of the short prompts differed from the dense reference.)"""
    cache = PagedKVCache.create(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8, batch=4,
                                max_pages_per_seq=3)
    for _ in range(64):
        lengths, tables = np.full(4, 5, np.int32), np.ones((4, 3), np.int32)
        new = cache.with_tables(tables, lengths)
        lengths[0], tables[0, 0] = 99, 77
        assert int(new.seq_lens[0]) == 5 and int(new.block_tables[0, 0]) == 1

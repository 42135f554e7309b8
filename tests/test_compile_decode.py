"""Compiled decoding of a transformers model on ``PagedCache``: ``PagedDecoder`` runs the model's
decode step under ``torch.compile(fullgraph=True)`` — zero graph breaks, one compile for 64 steps while
the sequences grow across many blocks (``fail_on_recompile`` after the first step), logits equal to the
eager path (the cache doing its own bookkeeping from the attention mask). DeepSeek-V3 runs the absorbed
MLA path over its paged latent rows. On CUDA, ``mode="reduce-overhead"`` must capture the step in a
CUDA graph.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from kvkernels.integrations.transformers import PagedCache, PagedDecoder, cache_kwargs

from hf_models import build, left_padded_batch, model_pair

STEPS = 64


def prefill(model, ids, mask, block_size=4):
    cache = PagedCache(model.config, block_size=block_size)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model.forward, cache)).logits[:, -1]
    return cache, logits, pos


def eager_decode(model, ids, mask, steps):
    """Reference: plain forwards, the cache reading padding off the mask (as in generate())."""
    cache, logits, pos = prefill(model, ids, mask)
    out, pos = [], pos[:, -1:]
    for _ in range(steps):
        token = logits.argmax(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        pos = pos + 1
        logits = model(token[:, None], attention_mask=mask, position_ids=pos, **cache_kwargs(model.forward, cache)).logits[:, -1]
        out.append(logits)
    return torch.stack(out, 1)


@pytest.mark.parametrize("name,backend", [("llama", "inductor"), ("gemma2", "aot_eager"), ("gpt_oss", "aot_eager"),
                                          ("deepseek_v3", "aot_eager")])
def test_compiled_decode_no_graph_breaks_no_recompiles(name, backend):
    _, model = model_pair(name)
    ids, mask = left_padded_batch()
    torch._dynamo.reset()
    counters.clear()
    compiler = CompileCounterWithBackend(backend)
    with torch.no_grad():
        expected = eager_decode(model, ids, mask, STEPS)
        cache, logits, _ = prefill(model, ids, mask)
        decoder = PagedDecoder(model, cache, max_length=128, max_new_tokens=STEPS, backend=compiler)
        got = []
        try:
            for step in range(STEPS):
                got.append(decoder(logits.argmax(-1)))
                logits = got[-1]
                if step == 0:
                    torch.compiler.set_stance("fail_on_recompile")
        finally:
            torch.compiler.set_stance("default")
    got = torch.stack(got, 1)
    assert compiler.frame_count == 1, "one graph for all steps"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert cache.kv.seq_lens(cache.sequences).tolist() == (mask.sum(1) + STEPS).tolist()
    assert cache.get_seq_length() == ids.shape[1] + STEPS
    if backend == "aot_eager":
        assert torch.equal(got, expected)
    else:  # inductor fuses the model's own ops differently
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_decoder_needs_no_no_grad():
    """Inference only: a step runs under no_grad itself. Called in grad mode (as after a prefill
    outside no_grad), the compiled step used to have AOTAutograd trace a backward through
    paged_attention, which warned that no autograd kernel was registered."""
    _, model = model_pair("llama")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        expected = eager_decode(model, ids, mask, 3)
    torch._dynamo.reset()
    cache, logits, _ = prefill(model, ids, mask)  # grad mode, as a user may write it
    assert logits.requires_grad
    decoder = PagedDecoder(model, cache, max_length=64, backend="aot_eager")
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            logits = decoder(logits.argmax(-1))
            got.append(logits)
    assert not [w for w in caught if "autograd kernel was not registered" in str(w.message)]
    assert not any(t.requires_grad for t in got)
    assert torch.equal(torch.stack(got, 1), expected)


def test_decoder_eager_mode_and_limits():
    _, model = model_pair("llama")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        expected = eager_decode(model, ids, mask, 6)
        cache, logits, _ = prefill(model, ids, mask)
        decoder = PagedDecoder(model, cache, max_length=16, compile=False)
        got = []
        for _ in range(6):
            logits = decoder(logits.argmax(-1))
            got.append(logits)
        assert torch.equal(torch.stack(got, 1), expected)
        with pytest.raises(ValueError, match="rows"):
            decoder(torch.zeros(2, dtype=torch.long))
        with pytest.raises(ValueError, match="max_length"):
            for _ in range(16):
                decoder(logits.argmax(-1))
    with pytest.raises(ValueError, match="prefilled"):
        PagedDecoder(model, PagedCache(model.config))


def _cuda_kernels() -> bool:
    return torch.cuda.is_available() and all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"kvkernels::{op}", "CUDA")
        for op in ("paged_attention", "reshape_and_cache"))


@pytest.mark.skipif(not _cuda_kernels(),
                    reason="needs a CUDA device and kvkernels built with its CUDA kernels: checks that "
                           "mode='reduce-overhead' captures the decode step in a CUDA graph")
def test_reduce_overhead_captures_cuda_graph():
    _, cpu_model = model_pair("llama")
    model = build(cpu_model.config, "kvkernels").cuda()
    model.load_state_dict(cpu_model.state_dict())
    ids, mask = (t.cuda() for t in left_padded_batch())
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        expected = eager_decode(model, ids, mask, 16)
        cache, logits, _ = prefill(model, ids, mask)
        decoder = PagedDecoder(model, cache, max_length=128, max_new_tokens=16, mode="reduce-overhead")
        got = []
        for step in range(16):
            logits = decoder(logits.argmax(-1)).clone()  # a CUDA-graph output is overwritten by the next replay
            got.append(logits)
            if step == 2:  # warm-up and recording done
                torch.compiler.set_stance("fail_on_recompile")
        torch.compiler.set_stance("default")
    assert counters["inductor"]["cudagraph_skips"] == 0, "the step was not captured in a CUDA graph"
    assert not counters["graph_break"]
    torch.testing.assert_close(torch.stack(got, 1), expected, rtol=1e-4, atol=1e-4)


def test_reduce_overhead_marks_the_storage_in_use():
    """mode='reduce-overhead' marks static the storage the compiled step mutates: CUDA graphs skip a
    graph whose mutated input is not static. The storage in use changes twice here — the
    ``max_new_tokens`` reservation grows it at construction (the H200 run of 2026-11-26 found the old
    storage marked instead) and a later growth — and each is marked. Runs on CPU: the step itself is
    run eagerly (only the marks are under test)."""
    _, model = model_pair("llama")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        cache, logits, _ = prefill(model, ids, mask)
        before = cache.kv.kv
        decoder = PagedDecoder(model, cache, max_length=128, max_new_tokens=16, mode="reduce-overhead")
        assert cache.kv.kv is not before, "the reservation was meant to grow the storage"
        assert hasattr(cache.kv.kv, "_dynamo_static_input_type")
        assert not hasattr(before, "_dynamo_static_input_type")
        for t in (decoder._slots, decoder._seq_lens, decoder._tables):
            assert hasattr(t, "_dynamo_static_input_type")
        decoder._forward = decoder._run  # eager steps: no compile on CPU
        grown = cache.grow_count
        for _ in range(40):
            logits = decoder(logits.argmax(-1))
            if cache.grow_count > grown:
                break
        assert cache.grow_count > grown, "40 steps past the reservation were meant to grow the storage"
        assert hasattr(cache.kv.kv, "_dynamo_static_input_type")
    eager = PagedDecoder(model, prefill(model, ids, mask)[0], compile=False, max_new_tokens=16)
    assert not hasattr(eager.cache.kv.kv, "_dynamo_static_input_type")  # nothing marked without graphs

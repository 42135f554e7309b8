"""kvkernels.jax on CUDA (csrc/jax/ops_cuda.cpp): the CUDA kernels of the torch extension as XLA FFI custom
calls on XLA's stream, against kvkernels.reference, as tests/test_jax_ops.py does on the CPU.

Needs jax with a CUDA backend (skips, saying so, without one: every machine of this project's CI) and builds
build-jax/libkvkernels_jax_cuda.so first (a failed build fails the tests). scripts/gpu_validate.sh runs it on
the GPU machine (step j_cuda). Not run yet on a GPU: written and compiled only (docs/jax.md).
"""

import os
import re
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (the JAX tests need jax and jaxlib from "
                                        "requirements/lock.txt: pip install -c requirements/lock.txt jax jaxlib)")


def _cuda_devices():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


pytestmark = pytest.mark.skipif(not _cuda_devices(),
                                reason="needs a CUDA device (jax.devices('cuda') is empty: jax without CUDA)")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import jax_ops  # noqa: E402
import kvkernels.jax as kj  # noqa: E402
import test_jax_ops as cpu_tests  # noqa: E402
from helpers import generator, make_paged_kv, make_query  # noqa: E402
from kvkernels.jax import llama  # noqa: E402
from test_attention import make_case, run_paged_attention  # noqa: E402
from test_cache_ops import check_copy_blocks_stacked, check_gather_kv, check_reshape_and_cache  # noqa: E402
from test_causal import BINDING_CASES, check_binding_case  # noqa: E402

f32, bf16 = torch.float32, torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def on_cuda():
    kj.build_library(cuda=True)
    from kvkernels.jax import _library
    _library.load()
    assert _library.cuda_library() is not None, "the CUDA library was built but not registered"
    jax_ops.DEVICE = _cuda_devices()[0]
    yield
    jax_ops.DEVICE = None


CUDA_ATTENTION = {k: v for k, v in cpu_tests.ATTENTION.items() if v[6] <= 256}  # CUDA: head dims up to 256


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CUDA_ATTENTION.values(), ids=CUDA_ATTENTION.keys())
def test_paged_attention(case, jit, monkeypatch):
    monkeypatch.setattr(jax_ops, "JIT", jit)
    mode, dtype, fp8, per_head, hq, hkv, d, b, layout, extra = case
    seq_lens = cpu_tests.SEQ_LENS if mode == "decode" else [n for n in cpu_tests.SEQ_LENS if n]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head, seed=3)
    run_paged_attention(kv, query, qsl, op=jax_ops.paged_attention, **extra)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("case", BINDING_CASES.values(), ids=BINDING_CASES.keys())
def test_paged_attention_causal_and_more_queries_than_keys(case, causal):
    check_binding_case(jax_ops.paged_attention, case, causal)


@pytest.mark.parametrize("splits", ["1", "8", "64"])
def test_split_partials_in_the_hidden_scratch(splits, monkeypatch):
    """KV splits (KVKERNELS_CUDA_ATTN_SPLITS) use the scratch result the CUDA lowering adds; a long context
    at batch 1 (the planner's own splits) too."""
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", splits)
    monkeypatch.setattr(jax_ops, "JIT", True)
    kv, query, _ = make_case("decode", [3000, 17], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=128,
                             block_size=16, seed=int(splits))
    run_paged_attention(kv, query, None, op=jax_ops.paged_attention)


def test_more_splits_at_run_time_than_the_scratch_holds(monkeypatch):
    """Lowered with 1 split (no scratch), run with 32 requested: the handler lowers the split count to what
    the scratch holds instead of writing past it; the result is still the reference's."""
    kv, query, _ = make_case("decode", [2000, 5], dtype=bf16, num_heads=4, num_kv_heads=1, head_dim=64,
                             block_size=16, seed=9)
    args = [jax_ops.to_jax(t) for t in (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)]
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", "1")
    f = jax.jit(kj.paged_attention)
    compiled = f.lower(*args).compile()
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", "32")
    out, lse = compiled(*args)
    monkeypatch.delenv("KVKERNELS_CUDA_ATTN_SPLITS")
    ref, ref_lse = jax.jit(kj.paged_attention)(*args)  # lowered again: planner's splits, scratch to match
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-4)


def test_head_dim_above_256_is_refused_on_cuda():
    kv = make_paged_kv(seq_lens=[5], num_kv_heads=1, head_dim=512, block_size=16, dtype=bf16)
    q = make_query(1, 2, 512, bf16, generator(0))
    with pytest.raises(ValueError, match=re.escape("kvkernels.paged_attention: key_cache: head_dim 512 is not "
                                                   "supported on CUDA (at most 256")):
        jax_ops.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)


@pytest.mark.parametrize("case", cpu_tests.WRITE.values(), ids=cpu_tests.WRITE.keys())
def test_reshape_and_cache(case):
    """int32 slot mappings (widened on the device into the scratch result)."""
    check_reshape_and_cache(case, op=jax_ops.reshape_and_cache)


def test_int64_index_arrays_under_x64():
    with jax.enable_x64(True):
        check_reshape_and_cache((bf16, "e4m3", True, "NHD"), op=jax_ops.reshape_and_cache)
        check_copy_blocks_stacked(f32, 2, op=jax_ops.copy_blocks)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", cpu_tests.GATHER.values(), ids=cpu_tests.GATHER.keys())
def test_gather_kv(case, jit, monkeypatch):
    monkeypatch.setattr(jax_ops, "JIT", jit)
    check_gather_kv(case, op=jax_ops.gather_kv)


@pytest.mark.parametrize("dtype", [f32, bf16, torch.float8_e4m3fn, torch.uint8], ids=str)
def test_copy_blocks_stacked(dtype):
    check_copy_blocks_stacked(dtype, 2, op=jax_ops.copy_blocks)


def test_vmap_and_donation_on_cuda():
    """The batch-dim loop of the CUDA handlers, and the donated caches written in place on the device."""
    dev = _cuda_devices()[0]
    batch = [[jax.device_put(x, dev) for x in cpu_tests._decode_inputs(seed)] for seed in (0, 10)]
    stacked = [jnp.stack(x) for x in zip(*batch)]
    out, lse = jax.jit(jax.vmap(kj.paged_attention))(*stacked)
    for i, args in enumerate(batch):
        o, _ = kj.paged_attention(*args)
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(o))
    q, kc, vc, bt, sl = batch[0]
    step = jax.jit(cpu_tests._decode_step, donate_argnums=(3, 4))
    ptrs = kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()
    slots = jax.device_put(jnp.asarray([7, 30, 40], jnp.int32), dev)
    _, kc2, vc2 = step(q, q[:, :2], q[:, :2], kc, vc, bt, sl, slots)
    assert (kc2.unsafe_buffer_pointer(), vc2.unsafe_buffer_pointer()) == ptrs


def test_out_of_range_ids_are_skipped_not_a_crash():
    """As the torch CUDA ops outside KVKERNELS_DEBUG: a bad block id or slot is not checked on the host (that
    would need a device-to-host copy); the kernels skip it, nothing is read or written out of bounds."""
    q, kc, vc, bt, sl = [jax.device_put(x, _cuda_devices()[0]) for x in cpu_tests._decode_inputs()]
    out, _ = kj.paged_attention(q, kc, vc, bt.at[1, 0].set(10**6), sl)
    jax.block_until_ready(out)
    new_kc, _ = kj.reshape_and_cache(q[:, :2], q[:, :2], kc, vc, jnp.asarray([10**8, -1, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(new_kc)[0, 3], np.asarray(q[2, :2]))


def test_decode_step_in_a_cuda_graph(tmp_path):
    """The handlers are command-buffer compatible: with XLA told to put custom calls into CUDA graphs, a
    jitted decode step (write + attend, repeated) gives the same results as without graphs."""
    code = f"""
import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
import numpy as np, jax, jax.numpy as jnp
import kvkernels.jax as kj, test_jax_ops as t
q, kc, vc, bt, sl = t._decode_inputs()
step = jax.jit(t._decode_step)
outs = []
for i in range(4):
    out, kc, vc = step(q, q[:, :2] * (i + 1), q[:, :2], kc, vc, bt, sl, jnp.asarray([7, 30, 40], jnp.int32))
    outs.append(np.asarray(out))
np.save(sys.argv[1], np.stack(outs))
"""
    results = []
    for flags in ("", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"):
        path = tmp_path / f"out{len(results)}.npy"
        env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                           cwd=os.path.dirname(os.path.dirname(__file__)))
        assert r.returncode == 0, r.stderr[-3000:]
        results.append(np.load(path))
    np.testing.assert_array_equal(results[0], results[1])


def test_llama_loop_on_cuda():
    """The prefill / decode loop on the GPU (jit places it there): the dense reference's tokens."""
    cfg = llama.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=16)
    with jax.default_device(_cuda_devices()[0]):
        params = llama.init_params(cfg, jax.random.key(0), std=0.2)
        prompts = [[5, 9, 33, 7], list(range(3, 30)), [100]]
        np.testing.assert_array_equal(llama.generate(params, cfg, prompts, 10, page_size=4),
                                      llama.reference_generate(params, cfg, prompts, 10))

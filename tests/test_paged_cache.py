"""kvkernels.PagedKVCache: a stateful model test over random operations (structure and data), a
threaded stress test, every bad-use case with state unchanged, and the behaviour of each feature
(prefix hits, copy-on-write batching, zero-copy fork, sparse policies, offload, beam reorder,
memory accounting, the alternative method names)."""

import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvkernels
from kvkernels import ops
from kvkernels.cache import (KeepRecentRatio, OutOfBlocksError, PagedKVCache, SinkRecentWindow, SparsePolicy,
                             UnknownSequenceError)

from helpers import dense_attention

LAYERS, HEADS, DIM = 2, 1, 2


def make_cache(num_blocks=32, block_size=4, **kwargs):
    cache = PagedKVCache(LAYERS, HEADS, DIM, num_blocks, block_size=block_size, dtype=torch.float32, **kwargs)
    cache.kv.fill_(float("nan"))  # a slot read before it is written shows up as NaN
    return cache


class Codes:
    """The K/V a sequence writes for each token: a number determined by the token prefix (and the
    extra keys), as in a real model, so a prefix hit must find exactly what the sequence would
    have written itself. Distinct prefixes get distinct numbers (exact in float32)."""

    def __init__(self):
        self.table = {}

    def code(self, extra, prefix) -> float:
        return float(self.table.setdefault((extra, tuple(prefix)), len(self.table) + 1))

    def kv(self, codes: list[float], layer: int):
        c = torch.tensor(codes, dtype=torch.float32).reshape(-1, 1, 1).expand(-1, HEADS, DIM)
        return c + 0.25 * layer, -c - 0.25 * layer


def write(cache: PagedKVCache, codes: Codes, slots: torch.Tensor, values: list[float]) -> None:
    for layer in range(LAYERS):
        k, v = codes.kv(values, layer)
        ops.reshape_and_cache(k.contiguous(), v.contiguous(), cache.key_cache(layer), cache.value_cache(layer),
                              slots)


def read(cache: PagedKVCache, seqs: list[int]) -> list[list[tuple]]:
    """What each sequence's block table shows, per layer: (key code, value code) per KV token."""
    if not seqs:
        return []
    tables, lens = cache.block_tables(seqs), cache.seq_lens(seqs)
    out = [[] for _ in seqs]
    for layer in range(LAYERS):
        k, v = ops.gather_kv(cache.key_cache(layer), cache.value_cache(layer), tables, lens)
        assert (k == k[:, :1, :1]).all() and (v == v[:, :1, :1]).all()  # one number per token
        start = 0
        for i, n in enumerate(lens.tolist()):
            out[i].append(list(zip(k[start:start + n, 0, 0].tolist(), v[start:start + n, 0, 0].tolist())))
            start += n
    return out


def snapshot(cache: PagedKVCache):
    """Everything a failed call must leave unchanged."""
    seqs = sorted(cache.sequences)
    resident = [s for s in seqs if not cache.is_offloaded(s)]
    return (cache.stats(), list(cache.pool.policy), cache.pool.ref.tolist(),
            cache.block_tables(resident).tolist(), cache.seq_lens(resident).tolist(),
            [cache.num_tokens(s) for s in seqs], [cache.token_ids(s) for s in seqs],
            [cache.is_offloaded(s) for s in seqs], cache.kv.clone())


def assert_unchanged(cache, before):
    after = snapshot(cache)
    for i, (a, b) in enumerate(zip(after[:-1], before[:-1])):
        assert a == b, f"state field {i} changed"
    assert torch.equal(after[-1].nan_to_num(7.0), before[-1].nan_to_num(7.0)), "K/V storage changed"


def check_structure(cache: PagedKVCache) -> None:
    """Independent of the cache's own check: refcounts equal the number of block tables holding a
    block (from the public block_tables), no block both free and used, the null block in neither."""
    cache.check_invariants()
    pool = cache.pool
    resident = [s for s in cache.sequences if not cache.is_offloaded(s)]
    counts = np.zeros(cache.num_blocks, dtype=np.int64)
    if resident:
        tables, lens = cache.block_tables(resident), cache.seq_lens(resident)
        for row, n in zip(tables.tolist(), lens.tolist()):
            used = row[:math.ceil(n / cache.block_size)]
            assert len(set(used)) == len(used) and 0 not in used
            assert all(b == 0 for b in row[len(used):]), "padding must be the null block"
            np.add.at(counts, used, 1)
    assert counts.tolist() == pool.ref.tolist()
    free = list(pool.policy)
    assert len(free) == len(set(free)) == cache.stats().num_free_blocks
    assert set(free) == {b for b in range(1, cache.num_blocks) if counts[b] == 0}


# ---- the stateful model test -----------------------------------------------------------------------

BS, NUM_BLOCKS = 4, 12
BASES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35])
SPARSE = KeepRecentRatio(threshold_tokens=2 * BS, keep_ratio=0.5)


class Seq:
    """The model of one sequence: its tokens, extra key, and which logical positions its KV shows."""

    def __init__(self, tokens, extra, visible=None, sparse=False):
        self.tokens, self.extra = list(tokens), extra
        self.visible = list(range(len(tokens))) if visible is None else list(visible)
        self.sparse = sparse

    def copy(self):
        return Seq(self.tokens, self.extra, self.visible, self.sparse)


def model_keeps(policy, num_tokens: int, block: int) -> bool:
    """The model's own version of each sparse policy: is logical ``block`` kept?"""
    if isinstance(policy, KeepRecentRatio):
        if num_tokens <= policy.threshold_tokens:
            return True
        total = math.ceil(num_tokens / BS)
        return block >= total - max(1, math.ceil(policy.keep_ratio * total))
    if num_tokens <= policy.sink_tokens + policy.window_tokens:
        return True
    return block < math.ceil(policy.sink_tokens / BS) or block >= (num_tokens - policy.window_tokens) // BS


def model_sparsify(seq: "Seq", policy, protect_from: int) -> int:
    """Apply ``policy`` to the model sequence; blocks from ``protect_from`` and the last block stay.
    Returns the number of blocks dropped."""
    n = len(seq.tokens)
    last = (n - 1) // BS
    keep = [p for p in seq.visible if model_keeps(policy, n, p // BS) or p // BS >= min(last, protect_from)]
    dropped = (len(seq.visible) - len(keep)) // BS
    seq.sparse |= dropped > 0
    seq.visible = keep
    return dropped


class CacheMachine(RuleBasedStateMachine):
    AUTO_POLICY = None  # the cache's sparse_policy, applied whenever a sequence gets a new block

    def __init__(self):
        super().__init__()
        self.cache = make_cache(NUM_BLOCKS, BS, sparse_policy=self.AUTO_POLICY)
        self.codes = Codes()
        self.model: dict[int, Seq] = {}
        self.offloaded: set[int] = set()

    # -- helpers --

    def resident(self):
        return sorted(s for s in self.model if s not in self.offloaded)

    def values(self, seq: Seq, positions):
        return [self.codes.code(seq.extra, seq.tokens[:p + 1]) for p in positions]

    def extend(self, sid, new_tokens, slots):
        seq = self.model[sid]
        start = len(seq.tokens)
        seq.tokens += list(new_tokens)
        positions = range(start, len(seq.tokens))
        seq.visible += list(positions)
        write(self.cache, self.codes, slots, self.values(seq, positions))
        if self.AUTO_POLICY is not None and math.ceil(len(seq.tokens) / BS) > math.ceil(start / BS):
            model_sparsify(seq, self.AUTO_POLICY, protect_from=start // BS)  # blocks just written stay

    def expect_unchanged_on_oob(self, call):
        before = snapshot(self.cache)
        try:
            return call()
        except OutOfBlocksError:
            assert_unchanged(self.cache, before)
            return None

    # -- rules --

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 11), suffix=st.lists(st.integers(40, 43), max_size=5),
          extra=st.sampled_from([None, "tenant-b"]))
    def add(self, base, cut, suffix, extra):
        prompt = BASES[base][:cut] + suffix
        sid, cached = self.cache.add_sequence(prompt, extra_keys=extra)
        assert cached % BS == 0 and cached <= max(len(prompt) - 1, 0)
        key = None if extra is None else repr((extra,)).encode()
        self.model[sid] = Seq(prompt[:cached], key)
        slots = self.expect_unchanged_on_oob(lambda: self.cache.append(sid, prompt[cached:]))
        if slots is not None:
            self.extend(sid, prompt[cached:], slots)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), new=st.lists(st.integers(0, 5), min_size=1, max_size=2 * BS))
    def append(self, data, new):
        sid = data.draw(st.sampled_from(self.resident()))
        slots = self.expect_unchanged_on_oob(lambda: self.cache.append(sid, new))
        if slots is not None:
            self.extend(sid, new, slots)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def decode(self, data):
        sids = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, unique=True))
        toks = data.draw(st.lists(st.integers(0, 3), min_size=len(sids), max_size=len(sids)))
        step = self.expect_unchanged_on_oob(lambda: self.cache.append_decode(sids, toks))
        if step is None:
            return
        for i, sid in enumerate(sids):
            self.extend(sid, [toks[i]], step.slot_mapping[i:i + 1])
        assert step.block_tables.dtype == torch.int32 and step.seq_lens.dtype == torch.int32
        assert torch.equal(step.block_tables, self.cache.block_tables(sids))
        assert step.seq_lens.tolist() == [len(self.model[s].visible) for s in sids]

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), truncate=st.booleans())
    def fork(self, data, truncate):
        sid = data.draw(st.sampled_from(self.resident()))
        parent = self.model[sid]
        n = None
        if truncate and not parent.sparse:
            n = data.draw(st.integers(0, len(parent.tokens)))
        free_before = self.cache.stats().num_free_blocks
        child = self.cache.fork(sid, n)
        assert self.cache.stats().num_free_blocks == free_before  # zero-copy
        seq = parent.copy()
        if n is not None:
            seq.tokens, seq.visible = seq.tokens[:n], seq.visible[:n]
        self.model[child] = seq

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(sid)
        del self.model[sid]
        self.offloaded.discard(sid)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def offload(self, data):
        sid = data.draw(st.sampled_from(self.resident()))
        self.cache.offload(sid)
        self.offloaded.add(sid)

    @precondition(lambda self: self.offloaded)
    @rule(data=st.data())
    def restore(self, data):
        sid = data.draw(st.sampled_from(sorted(self.offloaded)))
        if self.expect_unchanged_on_oob(lambda: self.cache.restore(sid)) is not None:
            self.offloaded.discard(sid)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def sparsify(self, data):
        sid = data.draw(st.sampled_from(self.resident()))
        dropped = self.cache.sparsify(sid, SPARSE)
        assert dropped == model_sparsify(self.model[sid], SPARSE, protect_from=10**9)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), count=st.integers(1, 2))
    def share(self, data, count):
        src = data.draw(st.sampled_from(self.resident()))
        seq = self.model[src]
        n = len(seq.tokens) if seq.sparse else data.draw(st.integers(0, len(seq.tokens)))
        dsts = [self.cache.add_sequence([])[0] for _ in range(count)]
        self.cache.share_prompt_blocks(src, dsts, n)
        for dst in dsts:
            child = seq.copy()
            child.tokens, child.visible = child.tokens[:n], child.visible[:len(child.visible) - (len(seq.tokens) - n)]
            self.model[dst] = child

    @precondition(lambda self: len(self.resident()) >= 2)
    @rule(data=st.data())
    def reorder(self, data):
        sids = data.draw(st.lists(st.sampled_from(self.resident()), min_size=2, unique=True))
        idx = data.draw(st.lists(st.integers(0, len(sids) - 1), min_size=len(sids), max_size=len(sids)))
        self.cache.reorder(sids, idx)
        old = [self.model[s] for s in sids]
        for sid, i in zip(sids, idx):
            self.model[sid] = old[i].copy()

    # -- checks after every step --

    @invariant()
    def structure(self):
        check_structure(self.cache)
        assert sorted(self.cache.sequences) == sorted(self.model)
        for sid, seq in self.model.items():
            assert self.cache.num_tokens(sid) == len(seq.tokens)
            assert self.cache.token_ids(sid) == seq.tokens
            assert self.cache.is_offloaded(sid) == (sid in self.offloaded)

    @invariant()
    def data(self):
        sids = self.resident()
        for sid, seen in zip(sids, read(self.cache, sids)):
            seq = self.model[sid]
            codes = self.values(seq, seq.visible)
            for layer, pairs in enumerate(seen):
                expected = [(c + 0.25 * layer, -c - 0.25 * layer) for c in codes]
                assert pairs == expected, f"sequence {sid} layer {layer}: KV differs from what it wrote"

    def teardown(self):
        for sid in list(self.model):
            self.cache.free(sid)
        s = self.cache.stats()
        assert s.num_free_blocks == NUM_BLOCKS - 1 and s.num_sequences == 0 and not self.cache.pool.ref.any()


class SparseCacheMachine(CacheMachine):
    """The same operations with a sink + recent-window policy applied on every new block."""
    AUTO_POLICY = SinkRecentWindow(sink_tokens=3, window_tokens=6)


MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
CacheMachine.TestCase.settings = MACHINE_SETTINGS
SparseCacheMachine.TestCase.settings = MACHINE_SETTINGS
test_cache_state_machine = CacheMachine.TestCase
test_cache_state_machine_with_sparse_policy = SparseCacheMachine.TestCase


# ---- threads -----------------------------------------------------------------------------------

def test_concurrent_add_append_fork_free_offload():
    cache = make_cache(num_blocks=96, block_size=4)
    codes = Codes()
    errors, kept = [], {}
    lock_for_codes = threading.Lock()

    def worker(tid):
        rng = np.random.default_rng(tid)
        extra = repr((f"thread-{tid}",)).encode()  # private prefixes: each thread checks its own data
        mine: dict[int, list] = {}  # seq -> tokens

        def put(sid, new, slots):
            start = len(mine[sid])
            mine[sid] += new
            with lock_for_codes:
                values = [codes.code(extra, mine[sid][:p + 1]) for p in range(start, len(mine[sid]))]
            write(cache, codes, slots, values)

        try:
            for _ in range(150):
                op = int(rng.integers(7))
                sids = list(mine)
                try:
                    if op == 0 or not sids:
                        prompt = [1, 2, 3, 4, 5, 6] + rng.integers(0, 3, size=int(rng.integers(0, 6))).tolist()
                        sid, cached = cache.add_sequence(prompt, extra_keys=f"thread-{tid}")
                        mine[sid] = prompt[:cached]
                        put(sid, prompt[cached:], cache.append(sid, prompt[cached:]))
                        cache.add_sequence(prompt, extra_keys="shared")  # contention on shared hashes
                    elif op == 1:
                        sid = sids[int(rng.integers(len(sids)))]
                        new = rng.integers(0, 4, size=int(rng.integers(1, 6))).tolist()
                        put(sid, new, cache.append(sid, new))
                    elif op == 2:
                        batch = sids[:4]
                        toks = rng.integers(0, 4, size=len(batch)).tolist()
                        step = cache.append_decode(batch, toks)
                        for i, sid in enumerate(batch):
                            put(sid, [toks[i]], step.slot_mapping[i:i + 1])
                    elif op == 3:
                        sid = sids[int(rng.integers(len(sids)))]
                        mine[cache.fork(sid)] = list(mine[sid])
                    elif op == 4 and len(sids) > 1:
                        sid = sids[int(rng.integers(len(sids)))]
                        cache.free(sid)
                        del mine[sid]
                    elif op == 5:
                        sid = sids[int(rng.integers(len(sids)))]
                        cache.offload(sid)
                        try:
                            cache.restore(sid)
                        except OutOfBlocksError:
                            cache.free(sid)
                            del mine[sid]
                            raise
                    elif op == 6 and len(sids) >= 2:
                        cache.reorder(sids[:2], [1, 1])
                        mine[sids[0]] = list(mine[sids[1]])
                except OutOfBlocksError:
                    for sid in list(mine)[:-1]:  # preempt: free all but the newest
                        cache.free(sid)
                        del mine[sid]
            kept[tid] = (extra, mine)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    check_structure(cache)
    for extra, mine in kept.values():
        sids = [s for s in mine if not cache.is_offloaded(s)]
        for sid, seen in zip(sids, read(cache, sids)):
            expected = [codes.code(extra, mine[sid][:p + 1]) for p in range(len(mine[sid]))]
            assert [k for k, _ in seen[0]] == expected, f"sequence {sid}: KV differs"
    assert sum(len(mine) for _, mine in kept.values()) >= 4
    for sid in cache.sequences:  # the threads' sequences and the empty 'shared' ones
        cache.free(sid)
    assert cache.stats().num_free_blocks == 95 and not cache.pool.ref.any()


# ---- bad use: a clear exception and nothing changed ---------------------------------------------


@pytest.fixture
def busy_cache():
    """A cache with a prompt, a fork, an offloaded sequence and a freed one."""
    cache = make_cache(num_blocks=12, block_size=4)
    a, _ = cache.add_sequence(list(range(10)))
    cache.append(a, list(range(10)))
    b = cache.fork(a)
    off, _ = cache.add_sequence([50, 51])
    cache.append(off, [50, 51])
    cache.offload(off)
    gone, _ = cache.add_sequence([7])
    cache.free(gone)
    return cache, dict(a=a, b=b, off=off, gone=gone)


BAD_USE = [
    # (call, exception, message); ids are filled in from busy_cache
    ("append", ("gone", [1]), UnknownSequenceError, "sequence {gone} was freed"),
    ("append", (12345, [1]), UnknownSequenceError, "unknown sequence 12345"),
    ("append", ("x", [1]), UnknownSequenceError, "unknown sequence 'x'"),
    ("free", ("gone",), UnknownSequenceError, r"free: sequence {gone} was freed"),
    ("fork", ("gone",), UnknownSequenceError, "fork: sequence {gone} was freed"),
    ("fork", ("a", 11), ValueError, "num_tokens: 11 > the sequence's 10 tokens"),
    ("fork", ("a", -1), ValueError, "num_tokens: expected an int >= 0"),
    ("append", ("off", [1]), RuntimeError, "sequence {off} is offloaded; restore"),
    ("fork", ("off",), RuntimeError, "sequence {off} is offloaded"),
    ("offload", ("off",), RuntimeError, "sequence {off} is offloaded"),
    ("restore", ("a",), RuntimeError, "sequence {a} is not offloaded"),
    ("block_tables", (["a", "off"],), RuntimeError, "sequence {off} is offloaded"),
    ("seq_lens", (["a", "gone"],), UnknownSequenceError, "sequence {gone} was freed"),
    ("append", ("a", [1.0, 2.0]), TypeError, "expected int token ids, got float64"),
    ("append", ("a", [1, 2.5]), TypeError, "expected int token ids"),
    ("append", ("a", [[1, 2]]), TypeError, "expected a flat sequence of int token ids, got 2-D"),
    ("append", ("a", [[1, 2], [3]]), TypeError, "expected a flat sequence of int token ids"),
    ("append", ("a", [True]), TypeError, "expected int token ids, got bool"),
    ("append", ("a", "abc"), TypeError, "got str"),
    ("append", ("a", 5), TypeError, "got int"),
    ("append", ("a", torch.tensor([1.0])), TypeError, "got a torch.float32 tensor"),
    ("append", ("a", torch.tensor([[1]])), TypeError, "1-D tensor of token ids, got 2-D"),
    ("append", ("a", np.array([1.5])), TypeError, "got float64 values"),
    ("append", ("a", [-3]), ValueError, "token ids must be >= 0, got -3"),
    ("add_sequence", ([1.5],), TypeError, "add_sequence: token_ids: expected int token ids"),
    ("append_decode", (["a", "a"], [1, 2]), ValueError, "a sequence appears more than once"),
    ("append_decode", (["a", "b"], [1]), ValueError, "1 tokens for 2 sequences"),
    ("append_decode", (["a", "gone"], [1, 2]), UnknownSequenceError, "sequence {gone} was freed"),
    ("append_decode", (["a", "b"], [1.0, 2.0]), TypeError, "expected int token ids"),
    ("append_decode", ("ab", [1, 2]), TypeError, "expected a list of sequence ids"),
    ("reorder", (["a", "b"], [0, 2]), ValueError, r"expected 2 indices in \[0, 2\)"),
    ("reorder", (["a", "b"], [0, -1]), ValueError, "indices must be >= 0"),
    ("share_prompt_blocks", ("a", ["b"], 4), ValueError, "sequence {b} already holds tokens"),
    ("sparsify", ("a",), TypeError, "no sparse_policy"),
    ("memory_usage", ("gone",), UnknownSequenceError, "sequence {gone} was freed"),
]


@pytest.mark.parametrize("call, args, error, message", BAD_USE, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_USE)])
def test_bad_use_raises_and_changes_nothing(busy_cache, call, args, error, message):
    cache, ids = busy_cache

    def fill(x):
        if isinstance(x, str) and x in ids:
            return ids[x]
        if isinstance(x, list) and all(isinstance(i, str) and i in ids for i in x) and x:
            return [ids[i] for i in x]
        return x

    args = tuple(fill(a) for a in args)
    before = snapshot(cache)
    with pytest.raises(error, match=message.format(**ids)):
        getattr(cache, call)(*args)
    assert_unchanged(cache, before)


def test_bad_extra_keys_and_constructor_arguments():
    cache = make_cache()
    before = snapshot(cache)
    with pytest.raises(TypeError, match="extra_keys: expected str, int or bytes"):
        cache.add_sequence([1, 2], extra_keys=object())
    with pytest.raises(TypeError, match="extra_keys"):
        cache.add_sequence([1, 2], extra_keys=(1.5,))
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="num_blocks: expected an int >= 2"):
        PagedKVCache(1, 1, 8, 1)
    with pytest.raises(ValueError, match="head_dim: expected an int >= 1"):
        PagedKVCache(1, 1, 0, 8)
    with pytest.raises(TypeError, match="dtype: expected a floating torch.dtype"):
        PagedKVCache(1, 1, 8, 8, dtype=torch.int32)
    with pytest.raises(IndexError, match=r"layer 2 out of range \[0, 2\)"):
        cache.key_cache(2)


@pytest.mark.parametrize("what", ["append", "append_decode", "cow", "restore"])
def test_out_of_blocks_raises_before_any_change(what):
    cache = make_cache(num_blocks=7, block_size=4)  # 6 usable blocks
    a, _ = cache.add_sequence(list(range(6)))
    cache.append(a, list(range(6)))  # 2 blocks, the second partial
    b = cache.fork(a)
    c, _ = cache.add_sequence([9] * 12)
    cache.append(c, [9] * 11)  # 3 blocks: 1 free left
    if what == "append":
        call = lambda: cache.append(c, [1] * 9)  # needs 2 new blocks (+1 to finish the partial one)
        need = 2
    elif what == "append_decode":
        cache.append(c, [9])  # c full: its next token needs a new block
        call = lambda: cache.append_decode([a, b, c], [1, 2, 3])  # CoW of a's block (1) + c's new block (1)
        need = 2
    elif what == "cow":
        call = lambda: cache.append(a, [1] * 3)  # a copy of the shared partial block + 1 new block
        need = 2
    else:
        cache.offload(c)  # frees 3 blocks: 4 free
        d, _ = cache.add_sequence([8] * 8)
        cache.append(d, [8] * 8)  # 2 blocks, 2 free
        call = lambda: cache.restore(c)
        need = 3
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError, match=f"need {need}, {cache.stats().num_free_blocks} free") as info:
        call()
    assert isinstance(info.value, RuntimeError)
    assert_unchanged(cache, before)
    check_structure(cache)


# ---- features --------------------------------------------------------------------------------------


def test_exports_and_core_calls_of_the_design():
    assert kvkernels.PagedKVCache is PagedKVCache
    cache = kvkernels.PagedKVCache(2, 2, 8, 32, block_size=4, dtype=torch.bfloat16, device="cpu",
                                   enable_prefix_caching=True)
    assert cache.key_cache(1).shape == (32, 4, 2, 8) and cache.value_cache(0).dtype == torch.bfloat16
    assert cache.key_cache(1).data_ptr() == cache.kv[1, 0].data_ptr()
    prompt = list(range(11))
    seq, num_cached = cache.add_sequence(prompt)
    slots = cache.append(seq, prompt[num_cached:])
    assert num_cached == 0 and slots.dtype == torch.int64 and slots.shape == (11,)
    assert len(set(slots.tolist())) == 11 and min(slots.tolist()) >= 4  # never in the null block
    child = cache.fork(seq)
    tables, lens = cache.block_tables([seq, child]), cache.seq_lens([seq, child])
    assert tables.dtype == torch.int32 and lens.tolist() == [11, 11] and torch.equal(tables[0], tables[1])
    s = cache.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens, s.cow_copies, s.num_shared_blocks) == (11, 0, 0, 3)
    seq2, cached2 = cache.add_sequence(prompt)
    assert cached2 == 8  # two full blocks; the third is partial
    m = cache.memory_usage(seq)
    assert {"own_bytes", "shared_bytes", "num_tokens"} <= set(m) and m["num_tokens"] == 11
    cache.free(seq)
    cache.free(child)
    cache.free(seq2)
    assert cache.stats().num_free_blocks == 31


def test_prefix_hit_reuses_blocks_and_never_the_last_token():
    cache = make_cache(block_size=4)
    codes = Codes()
    prompt = list(range(12))
    a, cached = cache.add_sequence(prompt)
    write(cache, codes, cache.append(a, prompt), [codes.code(None, prompt[:p + 1]) for p in range(12)])
    b, cached_b = cache.add_sequence(prompt)  # 12 tokens = 3 full blocks, but the last token stays
    assert cached_b == 8 and cache.block_tables([b])[0, :2].tolist() == cache.block_tables([a])[0, :2].tolist()
    c, cached_c = cache.add_sequence(prompt + [99])
    assert cached_c == 12
    s = cache.stats()
    assert (s.prefix_queries, s.prefix_hits, s.prefix_query_tokens, s.prefix_hit_tokens) == (3, 2, 37, 20)
    assert s.prefix_hit_rate == pytest.approx(20 / 37)
    # The hit blocks hold a's KV: c sees it without writing anything.
    (seen,) = read(cache, [c])
    assert [k for k, _ in seen[0]] == [codes.code(None, prompt[:p + 1]) for p in range(12)]


def test_prefix_caching_off_and_extra_keys():
    off = make_cache(enable_prefix_caching=False)
    a, _ = off.add_sequence(list(range(9)))
    off.append(a, list(range(9)))
    assert off.add_sequence(list(range(9)))[1] == 0 and off.stats().num_cached_blocks == 0
    cache = make_cache()
    a, _ = cache.add_sequence(list(range(9)), extra_keys=("lora-1", 7))
    cache.append(a, list(range(9)))
    assert cache.add_sequence(list(range(9)))[1] == 0
    assert cache.add_sequence(list(range(9)), extra_keys=("lora-2", 7))[1] == 0
    assert cache.add_sequence(list(range(9)), extra_keys=("lora-1", 7))[1] == 8


def test_cached_block_is_evicted_only_when_reused():
    cache = make_cache(num_blocks=5, block_size=4)  # 4 usable
    a, _ = cache.add_sequence(list(range(9)))
    cache.append(a, list(range(9)))  # 3 blocks, two full (cached)
    cache.free(a)
    assert cache.stats().num_free_blocks == 4 and cache.stats().num_cached_blocks == 2
    b, cached = cache.add_sequence(list(range(9)))
    assert cached == 8  # still there after the free
    cache.free(b)
    c, _ = cache.add_sequence([50] * 16)
    cache.append(c, [50] * 16)  # needs all 4 blocks: both cached ones are reused
    s = cache.stats()
    assert s.evictions == 2 and s.evicted_tokens == 8
    assert cache.add_sequence(list(range(9)))[1] == 0


def test_copy_on_write_of_one_step_is_one_copy_blocks_call(monkeypatch):
    cache = make_cache(num_blocks=40, block_size=4)
    codes = Codes()
    prompt = list(range(6))
    a, _ = cache.add_sequence(prompt)
    write(cache, codes, cache.append(a, prompt), [codes.code(None, prompt[:p + 1]) for p in range(6)])
    kids = [cache.fork(a) for _ in range(4)]  # the partial second block has 5 references
    calls = []
    real = ops.copy_blocks
    monkeypatch.setattr(ops, "copy_blocks", lambda *args, **kw: (calls.append(args[1].clone()), real(*args, **kw)))
    step = cache.append_decode([a] + kids, [10, 11, 12, 13, 14])
    assert len(calls) == 1 and calls[0].shape == (4, 2)  # 5 writers, the last one owns the block
    s = cache.stats()
    assert s.cow_copies == 4 and s.cow_copied_tokens == 8  # each copied block held 2 tokens
    assert len(set(step.slot_mapping.tolist())) == 5
    for i, sid in enumerate([a] + kids):
        write(cache, codes, step.slot_mapping[i:i + 1], [codes.code(None, prompt + [10 + i])])
    seen = read(cache, [a] + kids)
    for i, per_layer in enumerate(seen):
        assert [k for k, _ in per_layer[0]] == [codes.code(None, prompt[:p + 1]) for p in range(6)] + \
            [codes.code(None, prompt + [10 + i])]
    calls.clear()
    cache.append_decode([a] + kids, [1] * 5)  # everyone owns its block now
    assert not calls and cache.stats().cow_copies == 4
    check_structure(cache)


def test_a_failing_block_copy_leaves_tables_and_pool_as_they_were(monkeypatch):
    cache = make_cache(num_blocks=20, block_size=4)
    a, _ = cache.add_sequence(list(range(6)))
    cache.append(a, list(range(6)))
    b = cache.fork(a)
    c, _ = cache.add_sequence([9] * 5)
    cache.append(c, [9] * 5)
    cache.offload(c)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")
    monkeypatch.setattr(ops, "copy_blocks", broken)
    monkeypatch.setattr(ops, "swap_blocks", broken)
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="device lost"):
        cache.append_decode([a, b], [1, 2])  # a must copy the shared partial block
    with pytest.raises(RuntimeError, match="device lost"):
        cache.restore(c)
    after = snapshot(cache)
    assert after[3:8] == before[3:8] and after[0].num_free_blocks == before[0].num_free_blocks
    check_structure(cache)


def test_fork_copies_no_kv_and_takes_no_block(monkeypatch):
    cache = make_cache(num_blocks=64, block_size=4)
    a, _ = cache.add_sequence(list(range(50)))
    cache.append(a, list(range(50)))
    for name in ("copy_blocks", "swap_blocks"):
        monkeypatch.setattr(ops, name, lambda *args, **kw: pytest.fail("fork copied KV"))
    free = cache.stats().num_free_blocks
    kv = cache.kv.clone()
    child = cache.fork(a)
    assert cache.stats().num_free_blocks == free and cache.stats().forks == 1
    assert torch.equal(cache.block_tables([child]), cache.block_tables([a]))
    assert torch.equal(cache.kv.nan_to_num(3.0), kv.nan_to_num(3.0))
    assert cache.memory_usage(child)["shared_tokens"] == 50 and cache.memory_usage(child)["own_tokens"] == 0


def test_truncated_fork_copies_the_cached_block_it_writes_into():
    cache = make_cache(num_blocks=40, block_size=4)
    codes = Codes()
    prompt = list(range(10))
    a, _ = cache.add_sequence(prompt)
    write(cache, codes, cache.append(a, prompt), [codes.code(None, prompt[:p + 1]) for p in range(10)])
    child = cache.fork(a, num_tokens=6)  # inside a's second (full, cached) block
    assert cache.token_ids(child) == prompt[:6] and cache.seq_lens([child]).tolist() == [6]
    cache.free(a)  # the child is now the block's only holder, but the block is still cached
    slots = cache.append(child, [77])
    assert cache.stats().cow_copies == 1
    write(cache, codes, slots, [codes.code(None, prompt[:6] + [77])])
    d, cached = cache.add_sequence(prompt)
    assert cached == 8
    (seen,) = read(cache, [d])
    assert [k for k, _ in seen[0]] == [codes.code(None, prompt[:p + 1]) for p in range(8)]


def test_block_tables_and_seq_lens_drive_paged_attention():
    torch.manual_seed(0)
    cache = PagedKVCache(1, 2, 16, 64, block_size=4, dtype=torch.float32)
    keys, values = {}, {}

    def put(seq, slots):
        k, v = torch.randn(len(slots), 2, 16), torch.randn(len(slots), 2, 16)
        ops.reshape_and_cache(k, v, cache.key_cache(0), cache.value_cache(0), slots)
        keys[seq] = torch.cat([keys.get(seq, k[:0]), k])
        values[seq] = torch.cat([values.get(seq, v[:0]), v])

    a, _ = cache.add_sequence(list(range(13)))
    put(a, cache.append(a, list(range(13))))
    b, hit = cache.add_sequence(list(range(9)) + [5, 5])
    keys[b], values[b] = keys[a][:hit].clone(), values[a][:hit].clone()
    put(b, cache.append(b, [8, 5, 5]))
    c = cache.fork(a)
    keys[c], values[c] = keys[a].clone(), values[a].clone()
    seqs = [a, b, c]
    for _ in range(6):
        step = cache.append_decode(seqs, [1, 2, 3])
        for i, s in enumerate(seqs):
            put(s, step.slot_mapping[i:i + 1])
    q = torch.randn(3, 4, 16)
    out, _ = ops.paged_attention(q, cache.key_cache(0), cache.value_cache(0), step.block_tables, step.seq_lens)
    for i, s in enumerate(seqs):
        kk = keys[s].repeat_interleave(2, dim=1)
        vv = values[s].repeat_interleave(2, dim=1)
        ref, _ = dense_attention(q[i:i + 1], kk, vv, 16 ** -0.5)
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=1e-5, atol=1e-5)
    assert cache.stats().cow_copies == 1 and hit == 8


def test_decode_step_equals_token_by_token_append():
    tokens = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    batched, single = make_cache(block_size=4), make_cache(block_size=4)
    ids = []
    for cache in (batched, single):
        seqs = []
        for t in tokens:
            s, _ = cache.add_sequence(t)
            cache.append(s, t)
            seqs.append(s)
        seqs.append(cache.fork(seqs[0]))
        ids.append(seqs)
    for step in range(9):
        new = [step, step + 1, step + 2, step + 3]
        got = batched.append_decode(ids[0], new)
        want = torch.cat([single.append(s, [t]) for s, t in zip(ids[1], new)])
        assert torch.equal(got.slot_mapping, want)
        assert torch.equal(got.block_tables, single.block_tables(ids[1]))
        assert torch.equal(got.seq_lens, single.seq_lens(ids[1]))
    assert batched.stats() == single.stats()
    assert [batched.token_ids(s) for s in ids[0]] == [single.token_ids(s) for s in ids[1]]


def test_memory_usage_counts_tokens_not_blocks():
    cache = make_cache(num_blocks=32, block_size=4)
    bpt = LAYERS * 2 * HEADS * DIM * 4
    a, _ = cache.add_sequence(list(range(5)))
    cache.append(a, list(range(5)))  # one full block and one with 1 token
    m = cache.memory_usage(a)
    assert (m["own_tokens"], m["own_bytes"], m["num_blocks"], m["allocated_own_bytes"]) == (5, 5 * bpt, 2, 8 * bpt)
    b = cache.fork(a)
    cache.append(b, [9, 9])  # copies the partial block: own 3 tokens, shares the full block
    mb = cache.memory_usage(b)
    assert (mb["own_tokens"], mb["shared_tokens"], mb["divergence_point"]) == (3, 4, 5)
    total = cache.memory_usage()
    assert total["stored_tokens"] == 4 + 1 + 3 and total["unshared_tokens"] == 5 + 7
    assert total["allocated_bytes"] == 3 * 4 * bpt and total["stored_bytes"] == 8 * bpt
    g = cache.get_memory_usage(b)
    assert g["own_memory_mb"] == pytest.approx(3 * bpt / 2**20) and g["parent_memory_mb"] == pytest.approx(4 * bpt / 2**20)
    assert g["divergence_point"] == 5 and g["sequence_length"] == 7


def test_sixteen_beams_sharing_a_prompt_take_under_a_tenth_of_private_copies():
    prompt = list(np.random.default_rng(0).integers(0, 1000, size=2048))
    shared = PagedKVCache(1, 1, 8, 4096, block_size=16, dtype=torch.bfloat16)
    root, _ = shared.add_sequence(prompt)
    shared.append(root, prompt)
    beams = [shared.fork(root) for _ in range(16)]
    shared.free(root)
    for step in range(64):
        shared.append_decode(beams, [(step * 16 + i) % 1000 for i in range(16)])
    private = PagedKVCache(1, 1, 8, 4096, block_size=16, dtype=torch.bfloat16, enable_prefix_caching=False)
    for i in range(16):
        s, _ = private.add_sequence(prompt)
        private.append(s, prompt + [i] * 64)
    ratio = shared.memory_usage()["allocated_bytes"] / private.memory_usage()["allocated_bytes"]
    assert ratio <= 0.1 and shared.memory_usage()["sharing_ratio"] == pytest.approx(ratio)


class DropAll(SparsePolicy):
    min_tokens = 0

    def select(self, num_tokens, block_size, logical_blocks):
        return np.zeros(len(logical_blocks), dtype=bool)


def test_sparse_policy_never_drops_the_block_being_written():
    cache = make_cache(num_blocks=20, block_size=4)
    a, _ = cache.add_sequence(list(range(9)))
    cache.append(a, list(range(9)))
    assert cache.sparsify(a, DropAll()) == 2
    assert cache.seq_lens([a]).tolist() == [1] and cache.num_tokens(a) == 9
    b, _ = cache.add_sequence(list(range(20, 28)))
    cache.append(b, list(range(20, 28)))  # two full blocks: the second is still the last one
    assert cache.sparsify(b, DropAll()) == 1 and cache.seq_lens([b]).tolist() == [4]
    check_structure(cache)


def test_keep_recent_ratio_drops_old_blocks_and_keeps_data():
    cache = make_cache(num_blocks=40, block_size=4)
    codes = Codes()
    toks = list(range(30))  # 8 logical blocks
    a, _ = cache.add_sequence(toks)
    write(cache, codes, cache.append(a, toks), [codes.code(None, toks[:p + 1]) for p in range(30)])
    free = cache.stats().num_free_blocks
    assert cache.sparsify(a, KeepRecentRatio(threshold_tokens=40)) == 0  # below the threshold
    assert cache.sparsify(a, KeepRecentRatio(threshold_tokens=16, keep_ratio=0.5)) == 4
    assert cache.seq_lens([a]).tolist() == [14] and cache.num_tokens(a) == 30
    (seen,) = read(cache, [a])
    assert [k for k, _ in seen[0]] == [codes.code(None, toks[:p + 1]) for p in range(16, 30)]
    st_ = cache.sparse_stats(a)
    assert (st_["sparse_mode_active"], st_["active_blocks"], st_["total_logical_blocks"]) == (True, 4, 8)
    assert st_["bytes_saved"] == 4 * cache.bytes_per_block
    s = cache.stats()
    assert (s.sparse_evicted_blocks, s.sparse_freed_blocks, s.num_free_blocks) == (4, 4, free + 4)
    # A sparse sequence registers no new block: its KV would not match a full prefill.
    cached_before = s.num_cached_blocks
    cache.append(a, [1, 2])
    assert cache.stats().num_cached_blocks == cached_before
    with pytest.raises(ValueError, match="dropped blocks"):
        cache.fork(a, num_tokens=3)
    check_structure(cache)


def test_sink_and_recent_window_policy_applied_while_decoding():
    policy = SinkRecentWindow(sink_tokens=2, window_tokens=8)
    cache = make_cache(num_blocks=40, block_size=4, sparse_policy=policy)
    codes = Codes()
    a, _ = cache.add_sequence([0])
    write(cache, codes, cache.append(a, [0]), [codes.code(None, [0])])
    toks, dropped = [0], set()
    for t in range(1, 40):
        step = cache.append_decode([a], [t % 5])
        toks.append(t % 5)
        write(cache, codes, step.slot_mapping, [codes.code(None, toks)])
        n = len(toks)
        if (n - 1) % 4 == 0 and n > 10:  # a new block was opened: the policy ran
            dropped |= {b for b in range(1, (n - 8) // 4)}
        expected = [p for p in range(n) if p // 4 not in dropped]
        assert step.seq_lens.tolist() == [len(expected)], t
        (seen,) = read(cache, [a])
        assert [k for k, _ in seen[0]] == [codes.code(None, toks[:p + 1]) for p in expected], t
    # The policy last ran when token 36 opened block 9 (window 29..36): blocks 0, 7, 8, 9 remain.
    assert cache.stats().sparse_evicted_blocks == len(dropped) == 6


def test_offload_restore_moves_kv_and_reuses_cached_blocks(monkeypatch):
    cache = make_cache(num_blocks=20, block_size=4)
    codes = Codes()
    toks = list(range(10))
    a, _ = cache.add_sequence(toks)
    write(cache, codes, cache.append(a, toks), [codes.code(None, toks[:p + 1]) for p in range(10)])
    calls = []
    real = ops.swap_blocks
    monkeypatch.setattr(ops, "swap_blocks", lambda *args, **kw: (calls.append(args[2].clone()), real(*args, **kw)))
    free = cache.stats().num_free_blocks
    assert cache.offload(a) == 3 * cache.bytes_per_block and cache.is_offloaded(a)
    assert cache.stats().num_free_blocks == free + 3 and cache.memory_usage(a)["host_bytes"] == 3 * cache.bytes_per_block
    hog, _ = cache.add_sequence([99] * 20)  # overwrite the free uncached block
    cache.append(hog, [99] * 20)
    moved = cache.restore(a)
    assert cache.stats().restore_cache_hit_blocks == 2 and moved == cache.bytes_per_block  # only the partial one
    assert len(calls) == 2 and calls[1].shape == (1, 2)
    (seen,) = read(cache, [a])
    assert [k for k, _ in seen[0]] == [codes.code(None, toks[:p + 1]) for p in range(10)]
    check_structure(cache)


def test_reorder_is_beam_select_without_kv_copies(monkeypatch):
    cache = make_cache(num_blocks=40, block_size=4)
    codes = Codes()
    beams, toks = [], []
    for i in range(3):
        t = [1, 2, 3, 4, 5, 10 + i]
        s, cached = cache.add_sequence(t)
        write(cache, codes, cache.append(s, t[cached:]), [codes.code(None, t[:p + 1]) for p in range(cached, 6)])
        beams.append(s)
        toks.append(t)
    monkeypatch.setattr(ops, "copy_blocks", lambda *a, **k: pytest.fail("reorder copied KV"))
    cache.reorder(beams, [2, 2, 0])
    assert cache.beam_select == cache.reorder
    assert [cache.token_ids(s) for s in beams] == [toks[2], toks[2], toks[0]]
    check_structure(cache)
    monkeypatch.undo()
    step = cache.append_decode(beams, [7, 8, 9])
    assert cache.stats().cow_copies == 1  # beams 0 and 1 share a partial block
    toks = [toks[2] + [7], toks[2] + [8], toks[0] + [9]]
    for i in range(3):
        write(cache, codes, step.slot_mapping[i:i + 1], [codes.code(None, toks[i])])
    for i, per_layer in enumerate(read(cache, beams)):
        assert [k for k, _ in per_layer[0]] == [codes.code(None, toks[i][:p + 1]) for p in range(7)]


def test_share_prompt_blocks_and_seed_names():
    cache = make_cache(num_blocks=40, block_size=4)
    src, _ = cache.add_sequence_with_prompt(list(range(10)))
    cache.append(src, list(range(10)))
    dsts = [cache.add_sequence([])[0] for _ in range(3)]
    cache.share_prompt_blocks(src, dsts, num_prefix_tokens=6)
    assert all(cache.token_ids(d) == list(range(6)) for d in dsts)
    assert cache.block_tables(dsts)[:, :2].tolist() == [cache.block_tables([src])[0, :2].tolist()] * 3
    s = cache.get_stats()
    assert s.shared_prompt_blocks == 2 and s.prompt_cache_hits == 0 and s.cow_operations == 0
    cache.append_decode(dsts, [1, 2, 3])  # each copies the shared (cached, full in src) block
    assert cache.get_stats().cow_operations == 3
    child = cache.branch(src)
    sibling = cache.fork_sequence(src)
    assert cache.token_ids(child) == cache.token_ids(sibling) == list(range(10))
    assert cache.get_memory_usage(child)["divergence_point"] == 10
    assert cache.add_sequence_with_prompt(list(range(10)))[1] == 8
    assert cache.stats().prompt_cache_hits == 1 and cache.stats().as_dict()["prefix_hit_tokens"] == 8

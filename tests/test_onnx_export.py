"""kvkernels.onnx: schema registration, torch.onnx.export(dynamo=True) of modules that call the kvkernels
ops, and the exported encoder-decoder's beam search in ONNX Runtime against the same search in PyTorch.

The library is built by the ``ort_library_path`` fixture (conftest.py); a failed build fails these tests.
"""

import numpy as np
import onnx
import pytest
import torch

import kvkernels.onnx as konnx
import kvkernels.onnx.seq2seq as s2s
from helpers import assert_close, generator, make_paged_kv, make_query, randn

f32 = torch.float32


def test_schemas_registered():
    konnx.register_schemas()
    konnx.register_schemas()  # idempotent
    for name in ("PagedAttention", "ReshapeAndCache", "CopyBlocks", "GatherKV"):
        schema = onnx.defs.get_schema(name, konnx.VERSION, konnx.DOMAIN)
        assert schema.domain == "kvkernels"


class WriteAttendGather(torch.nn.Module):
    """Every exported op in one graph: a block copy, a cache write, attention with the options, a gather."""

    def forward(self, q, k, v, kc, vc, slots, tables, lens, mapping, sinks):
        kc = konnx.copy_cache_blocks(kc, mapping)
        vc = konnx.copy_cache_blocks(vc, mapping)
        kc, vc = konnx.write_cache(k, v, kc, vc, slots)
        out, lse = torch.ops.kvkernels.paged_attention(q, kc, vc, tables, lens, None, 0.2, 6, 4.0, None, sinks)
        gk, gv = torch.ops.kvkernels.gather_kv(kc, vc, tables, lens)
        return out, lse, gk, gv


def _export_case(num_seqs, seed):
    kv = make_paged_kv(seq_lens=[9 + 4 * i for i in range(num_seqs)], num_kv_heads=2, head_dim=32, block_size=4,
                       seed=seed)
    gen = generator(seed)
    for cache in (kv.key_cache, kv.value_cache):  # unused slots are NaN in the helper: make them finite
        cache.nan_to_num_(0.0)
    lens = kv.seq_lens + 1  # the new token of each sequence goes into its next slot (lengths are 1 mod 4:
    slots = torch.tensor([kv.blocks[i][int(n) // 4] * 4 + int(n) % 4  # always inside the last block)
                          for i, n in enumerate(kv.seq_lens)])
    spare = [b for b in range(kv.num_blocks) if all(b not in bl for bl in kv.blocks)]
    mapping = torch.tensor([[kv.blocks[0][0], spare[0]]])
    return (make_query(num_seqs, 4, 32, f32, gen), randn(num_seqs, 2, 32, gen=gen), randn(num_seqs, 2, 32, gen=gen),
            kv.key_cache, kv.value_cache, slots, kv.block_tables, lens.to(torch.int32), mapping,
            torch.linspace(-1, 1, 4))


def test_export_runs_in_ort_like_eager(tmp_path, ort_library_path):
    args = _export_case(3, seed=1)
    names = ["q", "k", "v", "kc", "vc", "slots", "tables", "lens", "mapping", "sinks"]
    s, w, n = torch.export.Dim("seqs"), torch.export.Dim("width"), torch.export.Dim("blocks")
    dyn = ({0: s}, {0: s}, {0: s}, {0: n}, {0: n}, {0: s}, {0: s, 1: w}, {0: s}, None, None)
    model = konnx.export(WriteAttendGather(), args, tmp_path / "m.onnx", input_names=names,
                         output_names=["out", "lse", "key", "value"], dynamic_shapes=dyn)
    onnx.checker.check_model(model)
    ops = [(n.domain, n.op_type) for n in model.graph.node if n.domain == "kvkernels"]
    assert sorted(set(ops)) == [("kvkernels", op) for op in ("CopyBlocks", "GatherKV", "PagedAttention",
                                                             "ReshapeAndCache")]
    q_dims = model.graph.input[0].type.tensor_type.shape.dim
    assert q_dims[0].dim_param and not q_dims[0].dim_value, "the sequence dimension must stay symbolic"

    sess = konnx.InferenceSession(tmp_path / "m.onnx", ort_library_path)
    for num_seqs, seed in ((3, 2), (5, 3)):  # another batch size than the one exported: dynamic dims work
        args = _export_case(num_seqs, seed)
        expected = WriteAttendGather()(*[a.clone() for a in args])
        feeds = {n: a.numpy() for n, a in zip(names, args)}
        got = sess.run(None, feeds)
        for name, g, e in zip(["out", "lse", "key", "value"], got, expected):
            assert_close(torch.from_numpy(g), e, f32, msg=name)
        # The caches fed as numpy arrays are updated in place (the ops' outputs alias them).
        kc = args[3].clone()
        torch.ops.kvkernels.copy_blocks(kc, args[8])
        torch.ops.kvkernels.reshape_and_cache(args[1], args[2], kc, args[4].clone(), args[5])
        assert torch.equal(torch.from_numpy(feeds["kc"]), kc)


class NonCausalAttention(torch.nn.Module):
    """Varlen attention with ``causal=False`` (encoder self-attention / cross-attention shape) next to the
    default causal call on the same inputs."""

    def forward(self, q, kc, vc, tables, lens, qsl):
        out_nc, lse_nc = torch.ops.kvkernels.paged_attention(q, kc, vc, tables, lens, qsl, None, 3, 0.0, None, None,
                                                             None, None, False)
        out_c, lse_c = torch.ops.kvkernels.paged_attention(q, kc, vc, tables, lens, qsl)
        return out_nc, lse_nc, out_c, lse_c


def test_export_noncausal_attribute(tmp_path, ort_library_path):
    """paged_attention's ``causal`` becomes PagedAttention's ``causal`` attribute (0 / 1), and ORT gives
    the eager results (q_len > seq_len rows included)."""
    q_lens = [5, 12, 3]
    kv = make_paged_kv(seq_lens=[9, 7, 20], num_kv_heads=2, head_dim=32, block_size=4, seed=4)
    for cache in (kv.key_cache, kv.value_cache):
        cache.nan_to_num_(0.0)
    qsl = torch.tensor([0, 5, 17, 20], dtype=torch.int32)
    args = (make_query(sum(q_lens), 4, 32, f32, generator(5)), kv.key_cache, kv.value_cache, kv.block_tables,
            kv.seq_lens, qsl)
    model = konnx.export(NonCausalAttention(), args, tmp_path / "nc.onnx",
                         input_names=["q", "kc", "vc", "tables", "lens", "qsl"],
                         output_names=["out_nc", "lse_nc", "out_c", "lse_c"])
    onnx.checker.check_model(model)
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    causal = sorted(next(a.i for a in n.attribute if a.name == "causal") for n in nodes)
    assert causal == [0, 1]
    sess = konnx.InferenceSession(tmp_path / "nc.onnx", ort_library_path)
    got = sess.run(None, {n: a.numpy() for n, a in zip(["q", "kc", "vc", "tables", "lens", "qsl"], args)})
    expected = NonCausalAttention()(*args)
    for name, g, e in zip(["out_nc", "lse_nc", "out_c", "lse_c"], got, expected):
        assert_close(torch.from_numpy(g), e, f32, msg=name)
    assert not torch.equal(expected[0], expected[2])


def test_export_without_schemas_is_an_error(monkeypatch):
    """The translation needs the op schemas (translation_table() registers them; here it may not)."""
    import onnx.defs
    konnx.register_schemas()
    for schema in konnx._schemas():
        onnx.defs.deregister_schema(schema.name, schema.since_version, schema.domain)
    monkeypatch.setattr(konnx, "register_schemas", lambda: None)
    try:
        with pytest.raises(Exception, match="[Ss]chema"):
            konnx.export(WriteAttendGather(), _export_case(2, 0))
    finally:
        monkeypatch.undo()
        konnx.register_schemas()
    assert onnx.defs.has("PagedAttention", konnx.DOMAIN)


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory, ort_library_path):
    model = s2s.Seq2Seq(seed=0)
    paths = s2s.export(model, tmp_path_factory.mktemp("seq2seq"))
    stepper = s2s.OrtStepper(model.config, paths, ort_library_path, threads=2)
    stepper.paths = paths
    return model, stepper


def test_seq2seq_graphs(seq2seq):
    _, stepper = seq2seq
    step = stepper.sessions["decoder_step"]
    names = [i.name for i in step.get_inputs()]
    assert names[:6] == ["tokens", "slot_mapping", "block_tables", "seq_lens", "cross_block_tables",
                         "cross_seq_lens"]
    kinds = {n.op_type for n in onnx.load(stepper.paths["decoder_step"]).graph.node if n.domain == "kvkernels"}
    assert kinds == {"ReshapeAndCache", "PagedAttention"}
    for name in ("encoder", "cross_kv"):  # standard ONNX ops only
        assert all(n.domain in ("", "ai.onnx") for n in onnx.load(stepper.paths[name]).graph.node)
    # Beams, block-table width and cache size are symbolic: one export serves every search.
    dims = {i.name: i.shape for i in step.get_inputs()}
    assert isinstance(dims["tokens"][0], str) and isinstance(dims["block_tables"][1], str)
    assert isinstance(dims["key_cache_0"][0], str)


@pytest.mark.parametrize("num_beams,steps,seed", [(8, 20, 0), (3, 9, 1)])
def test_seq2seq_beam_search_token_identical(seq2seq, num_beams, steps, seed):
    """The ORT beam search (exported graphs, paged self-attention cache, cross-attention K/V once) gives
    the PyTorch beam search's tokens for every beam, and scores within float32 rounding."""
    model, stepper = seq2seq
    src = np.random.default_rng(seed).integers(0, model.config.vocab, model.config.src_len)
    torch_result = s2s.beam_search(s2s.TorchStepper(model), src, num_beams=num_beams, steps=steps)
    ort_result = s2s.beam_search(stepper, src, num_beams=num_beams, steps=steps)
    assert ort_result.tokens == torch_result.tokens
    assert len(ort_result.tokens) == num_beams and all(len(t) == steps for t in ort_result.tokens)
    np.testing.assert_allclose(ort_result.scores, torch_result.scores, rtol=1e-5, atol=1e-4)
    # The cross-attention K/V exists once (4 layers x K, V x 150 x 8 x 32 float32 = 1.23 MB), whatever the beams.
    assert ort_result.cross_bytes == 4 * 2 * 150 * 8 * 32 * 4
    assert ort_result.self_blocks <= num_beams * -(-steps // model.config.block_size)


def test_seq2seq_cache_is_bound_not_copied(seq2seq):
    """A decode step writes the new K/V into the PagedKVCache's own storage (no per-step cache copy)."""
    model, stepper = seq2seq
    c = model.config
    cache = s2s.new_cache(c, 2)
    src = np.arange(c.src_len) % c.vocab
    stepper.start(src, cache)
    seqs = [cache.add_sequence([])[0] for _ in range(2)]
    step = cache.append_decode(seqs, [c.bos, 7])
    before = cache.kv.clone()
    stepper.step(np.array([c.bos, 7]), step)
    changed = (cache.kv != before).flatten(start_dim=2).any(-1)  # [layers, K/V, blocks]
    assert changed.all(), "every layer's K and V must have been written in place"
    slots = step.slot_mapping.tolist()
    blocks = sorted({s // c.block_size for s in slots})
    diff = (cache.kv != before).any(-1).any(-1)  # [layers, 2, blocks, slots]
    assert diff.nonzero()[:, 2].unique().tolist() == blocks, "only the new tokens' blocks change"


def test_functional_write_ops_opcheck():
    """The export forms of the cache writes are torch custom ops too: schema, fake kernel, no aliasing."""
    gen = generator(9)
    kc, vc = randn(6, 4, 2, 16, gen=gen), randn(6, 4, 2, 16, gen=gen)
    key, value = randn(3, 2, 16, gen=gen), randn(3, 2, 16, gen=gen)
    slots = torch.tensor([0, 13, -1])
    torch.library.opcheck(torch.ops.kvkernels_onnx.write_cache.default, (key, value, kc, vc, slots))
    torch.library.opcheck(torch.ops.kvkernels_onnx.copy_cache_blocks.default, (kc, torch.tensor([[1, 4]]), 0))
    new_k, new_v = konnx.write_cache(key, value, kc, vc, slots)
    expected = kc.clone()
    torch.ops.kvkernels.reshape_and_cache(key, value, expected, vc.clone(), slots)
    assert torch.equal(new_k, expected) and not torch.equal(kc, expected), "eager form returns a new cache"

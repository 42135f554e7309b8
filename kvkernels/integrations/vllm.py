"""vLLM on kvkernels: a vLLM attention backend, enabled through vLLM's own switch.

Use::

    from vllm import LLM
    llm = LLM(model=path, attention_backend="KVKERNELS")      # or "CUSTOM"
    # vllm serve PATH --attention-backend KVKERNELS [--tensor-parallel-size 2 ...]

Installing kvkernels in vLLM's environment is all the set-up: ``pyproject.toml`` declares
``register`` below under the ``vllm.general_plugins`` entry point group, which vLLM loads in every
process it starts (the front end, the engine core, each tensor/pipeline-parallel worker), so the
backend is there on every rank. Users who do not ask for it get exactly vLLM's behaviour: the plugin
only adds a name and a branch that is taken when the backend is selected. (``VLLM_PLUGINS`` can
exclude the plugin, by its name ``kvkernels``.)

How the name works. vLLM keeps attention backends in ``AttentionBackendEnum``; a third-party backend
goes into its placeholder member ``CUSTOM`` (``register_backend(AttentionBackendEnum.CUSTOM, path)``).
A *new* member (``AttentionBackendEnum.register("KVKERNELS", ...)``) does not work with vLLM 0.32: the
engine core is a spawned process that unpickles the configuration before it loads any plugin, and an
enum member added by a plugin is not there yet (``'<class path>' is not a valid AttentionBackendEnum``).
So ``register()`` makes ``KVKERNELS`` an *alias* of ``CUSTOM`` in the enum's name table: the string
"KVKERNELS" (``LLM(attention_backend=...)``, ``--attention-backend``, ``attention_config``) parses to
the ``CUSTOM`` member, which pickles by value and exists in every process. ``CUSTOM`` names the same
backend.

Selection. vLLM asks its platform for each attention layer's backend
(``Platform.get_attn_backend_cls``). vLLM's CPU platform answers CPU_ATTN for every non-MLA layer
whatever was asked for, and the CUDA platform raises for a selected backend that cannot serve a
layer. ``register()`` therefore wraps that classmethod of the current platform: when ``CUSTOM`` is
selected and points to this backend, a layer the backend can serve gets it, and any other layer
(MLA, sparse, per-head fp8 scales, a KV connector, batch invariance, a head size or dtype the kernels
do not take, a sliding window on a non-causal layer) gets what the platform picks on its own, with the
reason logged. Every other call goes to the platform's own method unchanged.

Layer types served (``kvkernels.integrations.vllm_backend``): decoder self-attention (``DECODER``, causal,
or ``causal=False`` when the step's metadata says so); encoder self-attention (``ENCODER_ONLY`` — BERT-style
pooling models, decoders configured ``is_causal=False`` — and ``ENCODER``): bidirectional over the step's
own keys/values, no cache; cross-attention (``ENCODER_DECODER``, e.g. Whisper's decoder) over the
encoder keys/values vLLM writes once per request. Falling back: windowed non-causal layers (the ops'
non-causal window bounds only the left side, vLLM's bidirectional windows both).
"""

from __future__ import annotations

import logging

ALIAS = "KVKERNELS"
BACKEND_PATH = "kvkernels.integrations.vllm_backend.KVKernelsBackend"

logger = logging.getLogger("vllm.kvkernels")

_WRAPPED_ATTR = "_kvkernels_original_get_attn_backend_cls"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the backend under ``CUSTOM`` (and the alias
    ``KVKERNELS``) and let the platform's backend selection honour it. Safe to call more than once."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
        logger.warning("kvkernels: AttentionBackendEnum.CUSTOM is already registered to %s; the kvkernels "
                       "backend is not registered (select that backend as CUSTOM, or uninstall one of them)",
                       custom.get_path())
        return
    register_backend(custom, BACKEND_PATH)
    members = AttentionBackendEnum._member_map_
    if members.get(ALIAS) is not custom:
        if ALIAS in members:
            logger.warning("kvkernels: AttentionBackendEnum already has a member %s; select the kvkernels "
                           "backend as CUSTOM", ALIAS)
        else:
            members[ALIAS] = custom  # an alias: AttentionBackendEnum["KVKERNELS"] is CUSTOM
    _hook_platform()


def _hook_platform() -> None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    if _WRAPPED_ATTR in platform_cls.__dict__:
        return
    original = platform_cls.get_attn_backend_cls  # bound to platform_cls

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if _selected(selected_backend):
            from kvkernels.integrations.vllm_backend import KVKernelsBackend

            reasons = KVKernelsBackend.unsupported_reasons(attn_selector_config, _device_capability())
            if not reasons:
                logger.info("kvkernels: using the kvkernels attention backend (%s)", _describe(attn_selector_config))
                return BACKEND_PATH
            logger.info("kvkernels: a layer (%s) goes to vLLM's own backend: %s",
                        _describe(attn_selector_config), "; ".join(reasons))
            return original(None, attn_selector_config, num_heads)
        return original(selected_backend, attn_selector_config, num_heads)

    setattr(platform_cls, _WRAPPED_ATTR, original)
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _selected(selected_backend) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    return selected_backend is custom and custom.is_overridden() and custom.get_path() == BACKEND_PATH


def _device_capability():
    from vllm.platforms import current_platform

    try:
        return current_platform.get_device_capability()
    except Exception:  # CPU: no capability
        return None


def _describe(c) -> str:
    return (f"{getattr(c.attn_type, 'value', c.attn_type)}, head_size {c.head_size}, {c.dtype}, kv cache {c.kv_cache_dtype or 'auto'}"
            + (", sliding window" if c.has_sliding_window else "") + (", sinks" if c.has_sink else "")
            + (", MLA" if c.use_mla else ""))


def is_active(vllm_config=None) -> bool:
    """Whether the current (or given) vLLM configuration selects the kvkernels backend."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
    return _selected(vllm_config.attention_config.backend)


__all__ = ["ALIAS", "BACKEND_PATH", "is_active", "register"]

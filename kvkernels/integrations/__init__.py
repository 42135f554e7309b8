"""Integrations of the kvkernels caches and kernels with model libraries.

``kvkernels.integrations.transformers``: Hugging Face ``transformers`` (5.x) — an attention function
registered as ``"kvkernels"`` and ``PagedCache``, a ``transformers`` ``Cache`` backed by
``kvkernels.PagedKVCache``; ``transformers_flash``: kvkernels as a flash-attention kernel module for
transformers' continuous batching and ``transformers serve``. ``kvkernels.integrations.vllm``: a vLLM attention backend
(``attention_backend="KVKERNELS"``), registered by the ``vllm.general_plugins`` entry point; only vLLM
imports it. Nothing is imported here, so ``kvkernels`` itself never needs ``transformers`` or ``vllm``.
"""

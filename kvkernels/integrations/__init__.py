"""Integrations of the kvkernels caches and kernels with model libraries.

``kvkernels.integrations.transformers``: Hugging Face ``transformers`` (5.x) — an attention function
registered as ``"kvkernels"`` and ``PagedCache``, a ``transformers`` ``Cache`` backed by
``kvkernels.PagedKVCache``. Nothing is imported here, so ``kvkernels`` itself never needs
``transformers``.
"""

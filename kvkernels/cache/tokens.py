"""Argument checks shared by the cache classes: token ids and counts."""

from __future__ import annotations

import numpy as np
import torch

_INT64_MAX = np.iinfo(np.int64).max


def check_count(what: str, value, low: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"kvkernels.{what}: expected an int >= {low}, got {value!r}")
    return int(value)


def as_token_array(token_ids, what: str, noun: str = "token ids") -> np.ndarray:
    """``token_ids`` as a 1-D int64 numpy array, or TypeError/ValueError naming ``what``.

    Accepts a list / tuple / range of ints, a 1-D integer numpy array or torch tensor. Refuses
    floats (even integral ones), bools, strings, nested or ragged lists, scalars, and negative ids.
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise TypeError(f"kvkernels.{what}: expected integer token ids, got a {token_ids.dtype} tensor")
        if token_ids.dim() != 1:
            raise TypeError(f"kvkernels.{what}: expected a 1-D tensor of token ids, got {token_ids.dim()}-D")
        arr = token_ids.detach().to("cpu", torch.int64).numpy()
    elif isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, (list, tuple, range)):
        if len(token_ids) == 0:
            return np.zeros(0, dtype=np.int64)
        try:
            arr = np.asarray(token_ids)
        except (ValueError, TypeError, OverflowError):  # ragged nesting, objects numpy cannot size
            raise TypeError(f"kvkernels.{what}: expected a flat sequence of int token ids") from None
    else:
        raise TypeError(f"kvkernels.{what}: expected a list, array or 1-D tensor of int token ids, got "
                        f"{type(token_ids).__name__}")
    if arr.ndim != 1:
        raise TypeError(f"kvkernels.{what}: expected a flat sequence of int token ids, got {arr.ndim}-D")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"kvkernels.{what}: expected int token ids, got {arr.dtype} values")
    if arr.size:
        if arr.dtype.kind == "u" and arr.max() > _INT64_MAX:
            raise ValueError(f"kvkernels.{what}: token id {int(arr.max())} does not fit in int64")
        if arr.dtype.kind == "i" and arr.min() < 0:
            raise ValueError(f"kvkernels.{what}: {noun} must be >= 0, got {int(arr.min())}")
    return arr.astype(np.int64, copy=False)

"""The name of the cache argument, on both sides of transformers' rename.

transformers 5.24 renamed the cache argument of ``generate()`` and of every model's ``forward`` from
``past_key_values`` to ``cache`` (the old name still works there, with a FutureWarning, until its
removal). kvkernels supports releases from before and after the rename, so it never spells the name
itself: ``cache_kwargs(fn, cache)`` gives the keyword the installed ``fn`` takes, and ``pop_cache``
accepts a cache that a caller passed under either name.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

NAMES = ("cache", "past_key_values")  # the current name first
_names: dict = {}


def generate_cache_name() -> str:
    """The key under which ``generate()`` keeps the cache (in its ``model_kwargs``) and takes it:
    ``generate()`` takes it through ``**kwargs``, so its signature does not tell; the list of cache
    names ``generate()`` looks for does."""
    from transformers.generation import utils
    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def cache_name(fn: Callable) -> str:
    """The name ``fn`` (a model's ``forward`` or ``generate``, bound or not) takes the cache under:
    ``"cache"`` after the rename, else ``"past_key_values"``. A ``forward`` says it in its signature
    (``inspect.signature`` follows transformers' ``deprecate_kwarg`` wrappers to the function they
    wrap); anything else follows ``generate()``. Cached per function."""
    fn = getattr(fn, "__func__", fn)
    name = _names.get(fn)
    if name is None:
        params = inspect.signature(fn).parameters
        name = next((n for n in NAMES if n in params), None) or generate_cache_name()
        _names[fn] = name
    return name


def cache_kwargs(fn: Callable, cache: Any) -> dict:
    """``{name: cache}`` for a call of ``fn``: ``model(ids, **cache_kwargs(model.forward, cache))``."""
    return {cache_name(fn): cache}


def pop_cache(kwargs: dict, where: str, given: Any = None) -> Any:
    """The cache a caller passed: ``given`` (a function's own ``cache`` parameter) or a value under
    either name in ``kwargs``, which are removed from ``kwargs``; ``None`` when there is none. More
    than one is an error naming ``where``."""
    found = [] if given is None else [given]
    for n in NAMES:
        value = kwargs.pop(n, None)
        if value is not None:
            found.append(value)
    if len(found) > 1:
        raise ValueError(f"{where}: the cache was given twice (cache= and past_key_values= name the same argument)")
    return found[0] if found else None

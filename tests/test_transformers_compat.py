"""kvkernels.integrations.transformers_compat: the cache argument's name on both sides of
transformers' past_key_values -> cache rename."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kvkernels.integrations import transformers_compat as compat  # noqa: E402


def test_cache_name_follows_the_signature():
    def new_forward(self, input_ids=None, cache=None, **kwargs):
        pass

    def old_forward(self, input_ids=None, past_key_values=None, **kwargs):
        pass

    def opaque(*args, **kwargs):
        pass

    assert compat.cache_kwargs(new_forward, 1) == {"cache": 1}
    assert compat.cache_kwargs(old_forward, 1) == {"past_key_values": 1}
    assert compat.cache_name(opaque) == compat.generate_cache_name()  # no say of its own: generate()'s


def test_generate_name_matches_the_installed_transformers():
    from transformers.generation import utils
    assert compat.generate_cache_name() in utils.ALL_CACHE_NAMES


def test_pop_cache_takes_either_name_once():
    kwargs = {"past_key_values": "c", "max_new_tokens": 3}
    assert compat.pop_cache(kwargs, "where") == "c" and kwargs == {"max_new_tokens": 3}
    kwargs = {"cache": "c"}
    assert compat.pop_cache(kwargs, "where") == "c" and kwargs == {}
    assert compat.pop_cache({}, "where") is None
    assert compat.pop_cache({}, "where", "own") == "own"
    with pytest.raises(ValueError, match="where: the cache was given twice"):
        compat.pop_cache({"cache": 1, "past_key_values": 2}, "where")
    with pytest.raises(ValueError, match="where: the cache was given twice"):
        compat.pop_cache({"past_key_values": 2}, "where", 1)

"""Tiny random-weight transformers models for the integration tests (nothing is downloaded).

``model_pair(name)`` builds the stock model (SDPA, or eager where transformers has no SDPA path:
Gemma2's soft cap, GPT-OSS's sinks) and the same weights with ``attn_implementation="kvkernels"``,
each from its own copy of the config (``from_config`` stores the attention implementation on the
config object it is given). Settings are chosen so that each feature changes the generated tokens
(see test_transformers.py::test_features_matter): a test that passed with the feature ignored
would prove nothing.
"""

from __future__ import annotations

import copy
import functools

import torch
import transformers as tf

import kvkernels
from kvkernels.integrations.transformers import register

VOCAB, PAD = 128, 0
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)


def _gpt_oss_sinks(model) -> None:
    # The default init leaves the sinks near 0, where they barely move the softmax: make them count.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, layer.self_attn.sinks.numel()))


# The MLA shape of deepseek_v3 (query LoRA, latent 16, rope 8) and a tiny MoE, for the other MLA models.
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16)
_MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2)
# Mistral-4 scales its queries by 1 + beta * log(1 + floor(position / original_max_position_embeddings))
# before attention: a short original length makes that factor change within the tests' sequences (and
# initializer_range=0.1 makes the change show in the tokens, see test_features_matter).
MISTRAL4_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=64.0, original_max_position_embeddings=4,
                     beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5)

# name -> (config class, its settings beyond COMMON, stock attention implementation, weight fix-up)
_MODELS = {
    "llama": (tf.LlamaConfig, {}, "sdpa", None),
    "qwen2": (tf.Qwen2Config, dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), "sdpa", None),
    "mistral": (tf.MistralConfig, dict(sliding_window=4), "sdpa", None),
    "gemma2": (tf.Gemma2Config, dict(initializer_range=0.1, attn_logit_softcapping=0.5, sliding_window=4, head_dim=16,
                                     final_logit_softcapping=30.0, query_pre_attn_scalar=16), "eager", None),
    "gpt_oss": (tf.GptOssConfig, dict(intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
                "eager", _gpt_oss_sinks),
    "deepseek_v3": (tf.DeepseekV3Config, dict(num_key_value_heads=4, moe_intermediate_size=32, kv_lora_rank=16,
                                              q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                              n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                              n_group=1, topk_group=1), "sdpa", None),
    # V2 without a query LoRA (q_proj), V3 with one (q_a_proj / q_b_proj): both MLA query paths.
    "deepseek_v2": (tf.DeepseekV2Config, dict(num_key_value_heads=4, moe_intermediate_size=32, kv_lora_rank=16,
                                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                              v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                              first_k_dense_replace=1, n_shared_experts=1), "sdpa", None),
    **{name: (cls, dict(_MLA, **extra), "sdpa", None) for name, cls, extra in (
        ("axk1", tf.AXK1Config, dict(_MOE, first_k_dense_replace=1, n_group=1, topk_group=1)),
        ("glm4_moe_lite", tf.Glm4MoeLiteConfig, _MOE),
        ("youtu", tf.YoutuConfig, {}),
        ("minicpm3", tf.MiniCPM3Config, {}),
        ("mistral4", tf.Mistral4Config, dict(_MOE, first_k_dense_replace=1, initializer_range=0.1,
                                             rope_parameters=MISTRAL4_ROPE)),
        ("longcat_flash", tf.LongcatFlashConfig, dict(head_dim=8, ffn_hidden_size=128, expert_ffn_hidden_size=32,
                                                      n_routed_experts=4, zero_expert_num=2, moe_topk=2)),
    )},
}


def config_for(name: str, **overrides):
    """(config, stock attention implementation, weight fix-up or None) of model ``name``."""
    cls, settings, attn, fix = _MODELS[name]
    return cls(**{**COMMON, **settings, **overrides}), attn, fix


DECODER_MODELS = list(_MODELS)
MLA_MODELS = ("deepseek_v3", "deepseek_v2", "axk1", "glm4_moe_lite", "youtu", "minicpm3", "mistral4",
              "longcat_flash")  # configs with kv_lora_rank: latent cache, absorbed attention


# Causal-LM classes AutoModelForCausalLM does not map in transformers 5.23 (it maps Mistral4Config
# only for pretraining and image-text-to-text).
_CAUSAL_LM = {tf.Mistral4Config: tf.Mistral4ForCausalLM}


def build(config, attn: str, fix=None, seed: int = 0, seq2seq: bool = False):
    register()  # "kvkernels" must be known when the model is created
    torch.manual_seed(seed)
    if type(config) in _CAUSAL_LM:
        model = _CAUSAL_LM[type(config)]._from_config(copy.deepcopy(config), attn_implementation=attn).eval()
    else:
        auto = tf.AutoModelForSeq2SeqLM if seq2seq else tf.AutoModelForCausalLM
        model = auto.from_config(copy.deepcopy(config), attn_implementation=attn).eval()
    if fix is not None:
        fix(model)
    assert model.config._attn_implementation == attn
    return model


@functools.lru_cache(maxsize=None)
def model_pair(name: str):
    """(stock model, kvkernels model) with the same weights."""
    config, stock_attn, fix = config_for(name)
    return build(config, stock_attn, fix), build(config, "kvkernels", fix)


def bart_config():
    return tf.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                         max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                         decoder_start_token_id=2, forced_eos_token_id=None)


@functools.lru_cache(maxsize=None)
def bart_pair():
    return build(bart_config(), "sdpa", seq2seq=True), build(bart_config(), "kvkernels", seq2seq=True)


def left_padded_batch(rows: int = 3, length: int = 9, seed: int = 1, pad: int = PAD):
    """``(input_ids, attention_mask)``: row 0 full, the others left-padded by 3, 5, ... tokens."""
    ids = torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for r in range(1, rows):
        n = min(1 + 2 * r, length - 1)
        mask[r, :n] = 0
        ids[r, :n] = pad
    return ids, mask


class OpCounter:
    """Counts calls of kvkernels.ops functions (the integration looks them up on the module)."""

    def __init__(self, monkeypatch, *names):
        self.calls = {name: 0 for name in names}
        for name in names:
            original = getattr(kvkernels.ops, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] += 1
                return _original(*args, **kwargs)
            monkeypatch.setattr(kvkernels.ops, name, counted)


def chat_tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary, with a chat template, built offline: ids 0-3
    are ``<pad> <s> </s> <unk>``, 4-7 ``user assistant system :``, and id i >= 8 is the word ``w<i>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", "system", ":"] + [f"w{i}" for i in range(8, VOCAB)]
    assert words[PAD] == "<pad>" and words[COMMON["eos_token_id"]] == "</s>"
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                           pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                               "{% if add_generation_prompt %}<s> assistant : {% endif %}")
    return tokenizer


def save_chat_model(path, name: str = "llama", seed: int = 0):
    """A model directory ``transformers serve`` can load without the Hub: model ``name``'s random weights
    (``build(..., seed)``), its generation config and ``chat_tokenizer()``. Returns ``path``."""
    config, stock_attn, fix = config_for(name)
    model = build(config, stock_attn, fix, seed=seed)
    model.save_pretrained(path)
    chat_tokenizer().save_pretrained(path)
    return path

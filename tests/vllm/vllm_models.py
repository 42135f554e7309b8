"""Tiny random-weight models saved with ``save_pretrained`` for the vLLM tests (nothing downloaded).

``save_model(kind, dest, dtype)`` writes a checkpoint vLLM can load (``LLM(model=dest,
skip_tokenizer_init=True)``, token-id prompts) and returns its directory; ``transformers_greedy``
generates from the same checkpoint with transformers (eager attention, the stock cache) for the
reference tokens. Head size 32 everywhere: vLLM's CPU backend (the other reference) takes 32 and not 16.
"""

from __future__ import annotations

import os

import torch
import transformers as tf

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False, initializer_range=0.1)


def _gpt_oss_sinks(model) -> None:
    # The default init leaves the sinks near 0, where they barely move the softmax: make them count.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, layer.self_attn.sinks.numel()))


# kind -> (config class, settings beyond COMMON, weight fix-up). Windows of 8 (vLLM's sliding_window W:
# a query sees itself and the W - 1 keys before it) are far shorter than the prompts, so a backend that
# ignored the window would produce other tokens.
MODELS = {
    "llama": (tf.LlamaConfig, {}, None),
    "mistral": (tf.MistralConfig, dict(sliding_window=8), None),
    # vLLM 0.32's Qwen2 takes one layer type for all layers (it asserts max_window_layers == layers).
    "qwen2": (tf.Qwen2Config, dict(use_sliding_window=True, sliding_window=8, max_window_layers=2,
                                   layer_types=["sliding_attention", "sliding_attention"]), None),
    # vLLM's Gemma2 always ties its output embedding to the input one.
    "gemma2": (tf.Gemma2Config, dict(tie_word_embeddings=True, attn_logit_softcapping=0.5, sliding_window=8,
                                     final_logit_softcapping=30.0, query_pre_attn_scalar=32), None),
    "gpt_oss": (tf.GptOssConfig, dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
                _gpt_oss_sinks),
}


def build_model(kind: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    cls, extra, fixup = MODELS[kind]
    config = cls(**{**COMMON, **extra, **overrides})
    config.torch_dtype = dtype
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    if fixup is not None:
        fixup(model)
    return model.to(dtype)


def save_model(kind: str, dest: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> str:
    """Save the tiny ``kind`` model (weights in ``dtype``) to ``dest`` (once: reused when present)."""
    if not os.path.exists(os.path.join(dest, "config.json")):
        build_model(kind, dtype, seed, **overrides).save_pretrained(dest)
    return dest


@torch.no_grad()
def transformers_greedy(path: str, prompts: list[list[int]], max_new_tokens: int,
                        dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Greedy continuations of each prompt (one at a time: no padding) with transformers."""
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    # vLLM runs with ignore_eos: no end-of-sequence token here either (min_new_tokens would instead
    # forbid the eos token, which vLLM may pick).
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def prompts(n: int, length: int, seed: int = 1, shared: int = 0) -> list[list[int]]:
    """``n`` random prompts of ``length`` token ids in [3, VOCAB); the first ``shared`` ids common to all."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(3, VOCAB, (shared,), generator=g).tolist()
    return [common + torch.randint(3, VOCAB, (length - shared,), generator=g).tolist() for _ in range(n)]


# ---- a tokenizer with a chat template, for the OpenAI server's /v1/chat/completions ------------------

# Token id i < 8 is one of CHAT_SPECIALS (0 pad, 1 bos, 2 eos as in COMMON), id i >= 8 the word f"w{i}":
# VOCAB entries in all, one token per whitespace-separated word, so a text made of words is exactly the
# token ids it names and any id the model generates decodes.
CHAT_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def words(ids) -> str:
    """The text that the chat tokenizer encodes to exactly ``ids`` (each id >= len(CHAT_SPECIALS))."""
    assert all(i >= len(CHAT_SPECIALS) for i in ids)
    return " ".join(f"w{i}" for i in ids)


def save_chat_tokenizer(dest: str) -> None:
    """A word-level tokenizer over VOCAB ids with CHAT_TEMPLATE, built with ``tokenizers`` (nothing
    downloaded) and saved next to a model so vLLM's server loads it and serves chat completions."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(CHAT_SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(CHAT_SPECIALS), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in CHAT_SPECIALS])
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                               unk_token="<unk>", chat_template=CHAT_TEMPLATE).save_pretrained(dest)


def save_chat_model(dest: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> str:
    """The tiny Llama of ``save_model("llama")`` with the chat tokenizer (once: reused when present)."""
    if not os.path.exists(os.path.join(dest, "tokenizer.json")):
        save_model("llama", dest, dtype, seed)
        save_chat_tokenizer(dest)
    return dest


# ---- encoder-only (pooling) models -------------------------------------------------------------------

# BERT (multi-head, learned positions) and a Llama whose config says is_causal=False (vLLM builds its
# attention as ENCODER_ONLY: bidirectional, GQA 4 / 2 heads). Both are loaded by vLLM with
# runner="pooling"; pooling needs a tokenizer even for token-id prompts, so a word-piece tokenizer over a
# made-up vocabulary of VOCAB entries is saved with each.
ENCODERS = {
    "bert": (tf.BertConfig, dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=256, max_position_embeddings=512, initializer_range=0.1),
             tf.BertModel),
    "llama_bidirectional": (tf.LlamaConfig, dict(COMMON, is_causal=False), tf.LlamaModel),
}


def _save_tokenizer(dest: str) -> None:
    import tempfile

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "vocab.txt"), "w") as f:
            f.write("\n".join(vocab) + "\n")
        tf.BertTokenizer(os.path.join(tmp, "vocab.txt")).save_pretrained(dest)


def save_encoder(kind: str, dest: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> str:
    """Save the tiny encoder-only ``kind`` model (ENCODERS) with its tokenizer to ``dest`` (once)."""
    if not os.path.exists(os.path.join(dest, "config.json")):
        config_cls, settings, model_cls = ENCODERS[kind]
        config = config_cls(**settings)
        config.torch_dtype = dtype
        torch.manual_seed(seed)
        model_cls(config).eval().to(dtype).save_pretrained(dest)
        _save_tokenizer(dest)
    return dest


@torch.no_grad()
def transformers_hidden_states(path: str, prompts: list[list[int]], dtype: torch.dtype = torch.float32):
    """The last hidden state ``[len, hidden]`` of each prompt (one at a time: no padding) from
    transformers' own model class for the checkpoint (eager attention)."""
    model = tf.AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


# ---- an encoder-decoder model: Whisper -----------------------------------------------------------------

WHISPER_SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>",
                    "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]


def save_whisper(dest: str, seed: int = 0) -> dict:
    """A tiny random Whisper (2 + 2 layers, 4 heads of 32) with a byte-level tokenizer (256 byte tokens and
    Whisper's special tokens, no merges) and the stock 80-bin feature extractor, saved to ``dest`` (once);
    returns the special tokens' ids. vLLM runs its encoder with its own multimodal-encoder attention and
    its decoder's self-attention (DECODER) and cross-attention (ENCODER_DECODER) on the attention backend."""
    import json
    import tempfile

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    for s in WHISPER_SPECIALS:
        vocab[s] = len(vocab)
    ids = {s: vocab[s] for s in WHISPER_SPECIALS}
    if os.path.exists(os.path.join(dest, "config.json")):
        return ids
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "vocab.json"), "w") as f:
            json.dump(vocab, f)
        with open(os.path.join(tmp, "merges.txt"), "w") as f:
            f.write("#version: 0.2\n")
        tokenizer = tf.WhisperTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"),
                                        additional_special_tokens=WHISPER_SPECIALS[1:])
    tf.WhisperProcessor(feature_extractor=tf.WhisperFeatureExtractor(feature_size=80),
                        tokenizer=tokenizer).save_pretrained(dest)
    eot = ids["<|endoftext|>"]
    config = tf.WhisperConfig(
        vocab_size=len(vocab), num_mel_bins=80, d_model=128, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256,
        max_source_positions=1500, max_target_positions=128, eos_token_id=eot, bos_token_id=eot, pad_token_id=eot,
        decoder_start_token_id=ids["<|startoftranscript|>"], init_std=0.1)
    torch.manual_seed(seed)
    model = tf.WhisperForConditionalGeneration(config).eval()
    model.generation_config.forced_decoder_ids = None
    model.save_pretrained(dest)
    return ids

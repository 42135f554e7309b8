"""``python -m kvkernels demo`` (README's first command) end to end, in-process: the default run
passes its self-checks and reports what it must; a broken kernel makes it fail loudly; a local
checkpoint with a tokenizer (``--model``) works; ``demo kernels`` is the ops-level demo."""

from __future__ import annotations

import re

import pytest
import torch

import kvkernels
from kvkernels import demo

SMALL = ["--quiet", "--requests", "3", "--system-tokens", "40", "--new-tokens", "6", "--beams", "3",
         "--beam-tokens", "5", "--branch-tokens", "6", "--max-paths", "5"]


def test_default_run_passes_and_reports(capsys):
    assert demo.main(["--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("self-check: OK")
    assert out.count("-> OK") == 3 and "MISMATCH" not in out
    for part in ("1. Shared system prompt", "2. Beam search", "3. Entropy-adaptive branching"):
        assert part in out
    # tokens/s of both caches (parts 1 and 2), KV memory against the stock cache, below 100%
    assert len(re.findall(r"kvkernels [\d,]+ tok/s, stock [\d,]+ tok/s", out)) == 2
    shares = [int(x) for x in re.findall(r"MiB \((\d+)%\)", out)]
    assert len(shares) == 3 and all(0 < x < 100 for x in shares)
    hit = re.search(r"prefix hits  ([\d.]+)% of prompt tokens \((\d+) of (\d+)\)", out)
    assert hit and int(hit.group(2)) == 5 * 150 and float(hit.group(1)) > 50  # 6 requests, 150-token prompt
    cow = [int(x) for x in re.findall(r"copy-on-write (\d+) block copies", out)]
    assert cow[0] == 6 - 1  # the system prompt's partial block, once per request but the last writer
    assert len(cow) == 3 and cow[1] > 0 and cow[2] > 0
    branching = re.search(r"(\d+) returned \((\d+) ended by end-of-sequence \+ (\d+) live at the last step\), "
                          r"(\d+) branchings, (\d+) pruned by cumulative log-prob, at most (\d+) live "
                          r"\(--max-paths caps live paths only\)", out)
    returned, ended, at_end, branchings, pruned, live = map(int, branching.groups())
    assert returned == ended + at_end and ended == 0  # the random model has no end-of-sequence token
    assert branchings > 0 and pruned > 0 and at_end <= live <= 12  # the default --max-paths


def test_a_wrong_kernel_fails_loudly(monkeypatch, capsys):
    original = kvkernels.ops.paged_attention

    def broken(*args, **kwargs):
        out, lse = original(*args, **kwargs)
        return out * 1.5, lse
    monkeypatch.setattr(kvkernels.ops, "paged_attention", broken)
    assert demo.main(SMALL) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and out.rstrip().splitlines()[-1].startswith("self-check: MISMATCH in")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = sorted(set(re.findall(r"\w+|[^\w\s]", " ".join([demo.SYSTEM_TEXT, *demo.USER_TEXTS]))))
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
                                   unk_token="[UNK]")


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_local_checkpoint(tmp_path, capsys, with_tokenizer):
    import transformers as tf
    tokenizer = _tokenizer()
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path)
    if with_tokenizer:
        tokenizer.save_pretrained(tmp_path)
    assert demo.main(["--model", str(tmp_path), *SMALL]) == 0
    out = capsys.readouterr().out
    assert f"LlamaForCausalLM from {tmp_path}" in out and "self-check: OK" in out
    assert ("request 0    '" in out) == with_tokenizer  # decoded text with a tokenizer


def test_ops_level_demo_subcommand(capsys):
    assert demo.main(["kernels", "--batch", "2", "--prompt-len", "9", "--new-tokens", "4"]) == 0
    assert "-> OK" in capsys.readouterr().out


def test_thread_count_restored():
    before = torch.get_num_threads()
    assert demo.main([*SMALL, "--threads", "1"]) == 0
    assert torch.get_num_threads() == before

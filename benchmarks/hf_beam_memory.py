"""Peak KV bytes of 8-beam search: transformers' DynamicCache vs kvkernels' PagedCache.

    PYTHONPATH=. python benchmarks/hf_beam_memory.py [--prompt 64,256] [--new 32] [--beams 8] [--batch 2]
                                                     [--block-size 8,16]

Every combination of the comma-separated --prompt and --block-size values is run.

A tiny random-weight Llama (GQA, 4 layers, 8 query / 2 KV heads, head_dim 32, float32) generates with
beam search three ways, all token-identical (checked):

* stock:       ``generate(num_beams=B)`` on a DynamicCache (the default): every beam holds a private
               copy of the prompt and of its history; the cache's tensors' bytes are sampled after
               every forward (before the beam reorder, which briefly holds two copies on top).
* paged:       the same call on a PagedCache: generate() prefills the prompt once per beam, then
               beam reorders share blocks (tables + refcounts, no KV copy).
* paged+fork:  prefill the prompt once per input, ``cache.batch_repeat_interleave(B)`` (zero-copy
               forks), then the same generate() call (it computes only the last prompt token).

For the paged caches: ``stored`` = ``PagedKVCache.memory_usage()["stored_bytes"]`` (token
granular, a shared block counted once) sampled after every forward, and ``allocated`` = the most
whole blocks held at any time (``PagedCache.memory_usage()["peak_allocated_bytes"]``).
"""

import argparse
import datetime
import json
import platform

import torch
import transformers as tf
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from kvkernels.integrations.transformers import PagedCache, cache_kwargs, register


class Probe(LogitsProcessor):
    """Runs after every forward (before the beam reorder) and records the cache's bytes."""

    def __init__(self, measure):
        self.measure, self.peak = measure, 0

    def __call__(self, input_ids, scores):
        self.peak = max(self.peak, self.measure())
        return scores


def dynamic_bytes(cache):
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def run(model, stock_model, vocab, batch, prompt_len, new, beams, block_size):
    prompt = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    gen = dict(num_beams=beams, num_return_sequences=1, max_new_tokens=new, min_new_tokens=new, do_sample=False,
               early_stopping=False)
    results = {}
    with torch.no_grad():
        dyn = DynamicCache(config=stock_model.config)
        probe = Probe(lambda: dynamic_bytes(dyn))
        ref = stock_model.generate(prompt, **cache_kwargs(stock_model.generate, dyn),
                                   logits_processor=LogitsProcessorList([probe]), **gen)
        results["stock"] = {"peak_bytes": probe.peak}
        for name in ("paged", "paged+fork"):
            cache = PagedCache(model.config, block_size=block_size)
            if name == "paged+fork":
                model(prompt[:, :-1], **cache_kwargs(model.forward, cache))
                cache.batch_repeat_interleave(beams)
            probe = Probe(lambda: cache.memory_usage()["stored_bytes"])
            out = model.generate(prompt, **cache_kwargs(model.generate, cache),
                                 logits_processor=LogitsProcessorList([probe]), **gen)
            assert torch.equal(out, ref), f"{name}: tokens differ from the stock cache"
            results[name] = {"peak_bytes": probe.peak,
                             "peak_allocated_bytes": cache.memory_usage()["peak_allocated_bytes"]}
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", default="64,256", help="prompt lengths, comma-separated")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--beams", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--block-size", default="8,16", help="block sizes, comma-separated")
    args = ap.parse_args()
    register()
    cfg = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    stock_model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**cfg), attn_implementation="sdpa").eval()
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**cfg), attn_implementation="kvkernels").eval()
    model.load_state_dict(stock_model.state_dict())
    print(f"Llama 4 layers, 2 KV heads x 32, float32, random weights; batch {args.batch}, {args.new} new tokens, "
          f"{args.beams} beams (torch {torch.__version__}, transformers {tf.__version__}, "
          f"{platform.processor() or platform.machine()}, {datetime.date.today()})")
    print("peak KV bytes (ratio to the stock DynamicCache): stored = token-granular, allocated = whole blocks")
    print(f"{'prompt':>6} {'block':>5} {'stock':>11} {'paged stored':>20} {'paged allocated':>20} "
          f"{'fork stored':>20} {'fork allocated':>20}")
    rows = []
    for prompt_len in map(int, args.prompt.split(",")):
        for block_size in map(int, args.block_size.split(",")):
            r = run(model, stock_model, cfg["vocab_size"], args.batch, prompt_len, args.new, args.beams, block_size)
            stock = r["stock"]["peak_bytes"]
            cells = []
            for name in ("paged", "paged+fork"):
                for key in ("peak_bytes", "peak_allocated_bytes"):
                    cells.append(f"{r[name][key]:>11,} ({r[name][key] / stock:.3f})")
            print(f"{prompt_len:>6} {block_size:>5} {stock:>11,} " + " ".join(f"{c:>20}" for c in cells))
            rows.append({"prompt": prompt_len, "block_size": block_size, **r})
    print(json.dumps({"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()

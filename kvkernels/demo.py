"""``python -m kvkernels demo``: a Llama-architecture ``transformers`` model generating on the paged
KV cache, against the stock cache.

A small Llama (random weights from a fixed seed; ``--model PATH`` loads a local checkpoint and its
tokenizer instead) runs three workloads with ``attn_implementation="kvkernels"`` on a ``PagedCache``
and, for comparison, with the stock ``DynamicCache`` + SDPA (the same model object, attention
switched with ``set_attn_implementation``):

1. a batch of requests that share a system prompt: the prompt is prefilled once and forked for
   every request (``kvkernels.generation.generate_shared_prefix``), greedy;
2. beam search (``kvkernels.generation.beam_search``: one prefill, beams as forks, reorders permute
   block tables);
3. entropy-adaptive branching (``kvkernels.generation.EntropyAdaptiveBranching``): paths branch where
   the next-token entropy is high, share their common history, and are pruned to ``--max-paths``.

It prints tokens/s of both caches, KV memory used against the stock cache, the prefix hit rate,
copy-on-write copies and the branching paths' own / shared memory, with a progress bar on stderr.
Self-checks (exit code 1 and ``MISMATCH`` when one fails): greedy and beam tokens identical to the
stock cache's, and every branching path's cumulative log-probability equal (to 1e-3, fp32) to a
dense no-cache recompute of its tokens. ``python -m kvkernels demo kernels`` runs the ops-level demo
(a hand-written decoder on ``reshape_and_cache`` + ``paged_attention``, no ``transformers``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

MIB = 2 ** 20
CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
              eos_token_id=None, tie_word_embeddings=False,
              # 0.2 instead of Llama's 0.02: the random model's next-token distributions then range from
              # peaked to flat (normalized entropy ~0.25-0.65), so branching has something to adapt to
              # and greedy choices are clear (not decided by rounding)
              initializer_range=0.2)
SYSTEM_TEXT = ("You are a concise assistant for a team that maintains a library of KV-cache kernels. Answer in "
               "at most three sentences, cite the function names you rely on, and say when you are unsure.")
USER_TEXTS = ["What does copy-on-write mean for a paged cache?", "Why does beam search copy the KV cache?",
              "Explain prefix caching in one sentence.", "How large is the KV cache of a 7B model at 4k tokens?",
              "What is a block table?", "When should I use fp8 KV?"]


class Report:
    """Lines of the final report, and the self-check results."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.failures: list[str] = []

    def add(self, text: str = "") -> None:
        self.lines.append(text)

    def check(self, ok: bool, what: str, detail: str) -> None:
        self.add(f"   self-check   {what}: {detail} -> {'OK' if ok else 'MISMATCH'}")
        if not ok:
            self.failures.append(what)


class Bar:
    """The progress bar on stderr: one phase after another, redrawn on a terminal (one line per
    phase otherwise); ``tick(done, total)`` is the generation's progress callback."""

    def __init__(self, phases: int, quiet: bool) -> None:
        from kvkernels.bench.cli import Progress
        self.progress = None if quiet else Progress(phases)

    @contextlib.contextmanager
    def phase(self, label: str):
        if self.progress is not None:
            self.progress.begin(label)
        try:
            yield
        finally:
            if self.progress is not None:
                self.progress.end()

    def tick(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress.step(f"token {done}/{total}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


def mib(n: float) -> str:
    return f"{n / MIB:.2f} MiB"


def rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.0f} tok/s"


def build_model(args):
    """(model, tokenizer or None, description)."""
    import transformers as tf
    from kvkernels.integrations.transformers import register
    register()
    dtype = getattr(torch, args.dtype)
    if args.model:
        model = tf.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="kvkernels", dtype=dtype)
        tokenizer = None
        try:
            tokenizer = tf.AutoTokenizer.from_pretrained(args.model)
        except Exception as err:  # a checkpoint without a tokenizer: random token ids
            print(f"no tokenizer in {args.model} ({type(err).__name__}); prompts are random token ids",
                  file=sys.stderr)
        what = f"{type(model).__name__} from {args.model}"
    else:
        torch.manual_seed(args.seed)
        config = tf.LlamaConfig(**CONFIG)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="kvkernels").to(dtype)
        tokenizer = None
        what = "Llama-architecture model with random weights (seed {})".format(args.seed)
    model = model.to(args.device).eval()
    c = model.config.get_text_config(decoder=True)
    heads, kv_heads = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    params = sum(p.numel() for p in model.parameters())
    what += (f": {c.num_hidden_layers} layers, hidden {c.hidden_size}, {heads} query / {kv_heads} KV heads, "
             f"vocab {c.vocab_size}, {params / 1e6:.1f}M parameters")
    return model, tokenizer, what


def make_prompts(model, tokenizer, args):
    """(system prompt ids, list of request ids)."""
    if tokenizer is not None:
        system = tokenizer(SYSTEM_TEXT)["input_ids"]
        users = [tokenizer(" " + text, add_special_tokens=False)["input_ids"] for text in USER_TEXTS]
        return system, (users * ((args.requests + len(users) - 1) // len(users)))[:args.requests]
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    system = torch.randint(3, vocab, (args.system_tokens,), generator=gen).tolist()
    lengths = [7 + (11 * i) % 24 for i in range(args.requests)]  # 7..30 tokens
    return system, [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def dynamic_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def stock_generate(model, bar: Bar, input_ids, attention_mask, max_new_tokens: int, **kwargs):
    """``generate()`` on a ``DynamicCache`` with SDPA: (sequences, seconds, peak KV bytes, KV bytes
    at each forward but the last: what the beam reorders that follow them copy)."""
    from kvkernels.integrations.transformers import attention_implementation, cache_kwargs
    from transformers import DynamicCache, LogitsProcessorList
    cache = DynamicCache(config=model.config)
    peak, calls, sizes = [0], [0], []

    def probe(ids, scores):  # after every forward (before a beam reorder)
        sizes.append(dynamic_bytes(cache))
        peak[0] = max(peak[0], sizes[-1])
        calls[0] += 1
        bar.tick(min(calls[0], max_new_tokens), max_new_tokens)
        return scores
    with attention_implementation(model, "sdpa"), torch.no_grad():
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention_mask, **cache_kwargs(model.generate, cache),
                             max_new_tokens=max_new_tokens, logits_processor=LogitsProcessorList([probe]), **kwargs)
        seconds = time.perf_counter() - start
    return out, seconds, peak[0], sum(sizes[:-1])


def decode(tokenizer, ids) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=True).replace("\n", " ")
    return text if len(text) <= 90 else text[:87] + "..."


def part_shared_prefix(model, tokenizer, bar: Bar, report: Report, system, users, args) -> None:
    from kvkernels.generation import generate_shared_prefix
    n, new = len(users), args.new_tokens
    report.add(f"1. Shared system prompt: {n} requests = one {len(system)}-token system prompt + "
               f"{min(map(len, users))}-{max(map(len, users))} tokens each, greedy, {new} new tokens")
    with bar.phase("1/3 shared prompt: kvkernels"):
        res = generate_shared_prefix(model, system, users, new, block_size=args.block_size, do_sample=False,
                                     progress=bar.tick)
    with bar.phase("1/3 shared prompt: stock cache"):
        ref, stock_s, stock_peak, _ = stock_generate(model, bar, res.input_ids, res.attention_mask, new,
                                                     do_sample=False)
    m = res.memory
    tokens = n * new
    report.add(f"   tokens/s     kvkernels {rate(tokens, res.seconds)}, stock {rate(tokens, stock_s)} "
               f"({stock_s / res.seconds:.2f}x)")
    report.add(f"   KV memory    kvkernels {mib(m['peak_allocated_bytes'])} in blocks held at peak "
               f"({mib(m['peak_stored_bytes'])} of token slots), stock {mib(stock_peak)} "
               f"({100 * m['peak_allocated_bytes'] / stock_peak:.0f}%)")
    report.add(f"   prefix hits  {100 * res.prefix_hit_rate:.1f}% of prompt tokens ({res.prefix_hit_tokens} of "
               f"{res.prompt_tokens}): the system prompt is prefilled once and forked {n} times; "
               f"{res.prefill_tokens} prompt tokens computed")
    report.add(f"   copy-on-write {m['cow_copies']} block copies ({m['cow_copied_tokens']} tokens: the system "
               f"prompt's partial last block, once per request)")
    if tokenizer is not None:
        report.add(f"   request 0    {decode(tokenizer, res.new_tokens[0])!r}")
    same = [torch.equal(a, b) for a, b in zip(res.sequences, ref)]
    report.check(all(same) and res.sequences.shape == ref.shape, "greedy tokens vs stock cache",
                 f"{sum(same)}/{n} rows identical")


def part_beams(model, tokenizer, bar: Bar, report: Report, prompt, args) -> None:
    from kvkernels.generation import beam_search
    beams, new = args.beams, args.beam_tokens
    ids = torch.tensor([prompt], device=model.device)
    report.add(f"2. Beam search: {beams} beams, a {len(prompt)}-token prompt, {new} new tokens")
    spy = CopySpy()
    with bar.phase("2/3 beam search: kvkernels"), spy:
        res = beam_search(model, ids, beams, new, block_size=args.block_size, progress=bar.tick,
                          early_stopping=False)
    with bar.phase("2/3 beam search: stock cache"):
        ref, stock_s, stock_peak, stock_copied = stock_generate(model, bar, ids, None, new, num_beams=beams,
                                                                do_sample=False, early_stopping=False)
    m = res.memory
    tokens = beams * new
    report.add(f"   tokens/s     kvkernels {rate(tokens, res.seconds)}, stock {rate(tokens, stock_s)} "
               f"({stock_s / res.seconds:.2f}x; {beams} beams x {new} steps)")
    report.add(f"   KV memory    kvkernels {mib(m['peak_allocated_bytes'])} in blocks held at peak "
               f"({mib(m['peak_stored_bytes'])} of token slots), stock {mib(stock_peak)} "
               f"({100 * m['peak_allocated_bytes'] / stock_peak:.0f}%)")
    report.add(f"   sharing      the prompt prefilled once ({res.prefill_tokens} tokens) for {beams} beams; "
               f"{spy.reorders} beam reorders permuted block tables (no KV copied)")
    report.add(f"   copy-on-write {m['cow_copies']} block copies in {spy.copy_calls} copy_blocks calls "
               f"({m['cow_copied_tokens']} tokens, {mib(m['cow_copied_tokens'] * m['bytes_per_token'])}: beams "
               f"writing into a partial block they share); the stock cache's reorders copied {mib(stock_copied)}")
    if tokenizer is not None:
        report.add(f"   best beam    {decode(tokenizer, res.sequences[0, len(prompt):].tolist())!r}")
    report.check(torch.equal(res.sequences, ref), "beam tokens vs stock cache",
                 "identical" if torch.equal(res.sequences, ref) else "differ")


class CopySpy:
    """Counts ``ops.copy_blocks`` calls and ``PagedKVCache.reorder`` calls while active."""

    def __enter__(self):
        from kvkernels import ops
        from kvkernels.cache import PagedKVCache
        self.copy_calls = self.reorders = 0
        self._ops, self._cls = ops, PagedKVCache
        self._copy, self._reorder = ops.copy_blocks, PagedKVCache.reorder

        def copy_blocks(*a, **k):
            self.copy_calls += 1
            return self._copy(*a, **k)

        def reorder(cache, *a, **k):
            self.reorders += 1
            return self._reorder(cache, *a, **k)
        ops.copy_blocks, PagedKVCache.reorder = copy_blocks, reorder
        return self

    def __exit__(self, *exc):
        self._ops.copy_blocks, self._cls.reorder = self._copy, self._reorder


def dense_log_probs(model, prompt, paths, temperature: float) -> list[float]:
    """Each path's cumulative log-probability recomputed without a cache (SDPA over the whole
    sequence, paths right-padded: padding after a token never affects it under causal attention)."""
    from kvkernels.integrations.transformers import attention_implementation
    width = len(prompt) + max(len(p.tokens) for p in paths)
    ids = torch.zeros(len(paths), width, dtype=torch.long)
    for r, p in enumerate(paths):
        ids[r, :len(prompt) + len(p.tokens)] = torch.tensor(prompt + p.tokens)
    with attention_implementation(model, "sdpa"), torch.no_grad():
        logits = model(ids.to(model.device)).logits.float().cpu()
    logp = torch.log_softmax(logits / temperature, -1)
    out = []
    for r, p in enumerate(paths):
        pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(p.tokens))
        out.append(float(logp[r, pos, torch.tensor(p.tokens)].sum()))
    return out


def part_eab(model, tokenizer, bar: Bar, report: Report, prompt, args) -> None:
    from kvkernels.generation import EntropyAdaptiveBranching
    threshold = args.threshold if args.threshold is not None else (0.055 if args.model else 0.6)
    new = args.branch_tokens
    eab = EntropyAdaptiveBranching(model, tokenizer, entropy_threshold=threshold, branch_factor=args.branch_factor,
                                   max_paths=args.max_paths, temperature=args.temperature,
                                   block_size=args.block_size)
    report.add(f"3. Entropy-adaptive branching: a {len(prompt)}-token prompt, {new} new tokens, branch into "
               f"{args.branch_factor} where normalized entropy > {threshold}, at most {args.max_paths} paths, "
               f"temperature {args.temperature}, seed {args.seed}")
    with bar.phase("3/3 branching: kvkernels"):
        res = eab.generate(prompt, new, seed=args.seed, progress=bar.tick)
    with bar.phase("self-check: dense recompute of every path"):
        dense = dense_log_probs(model, prompt, res.paths, args.temperature)
    m = res.memory
    flat = [e for step in res.entropies for e in step]
    ended = sum(p.finished for p in res.paths)
    report.add(f"   paths        {len(res.paths)} returned ({ended} ended by end-of-sequence + {len(res.paths) - ended} "
               f"live at the last step), {res.branch_events} branchings, {res.pruned} pruned by cumulative log-prob, "
               f"at most {res.max_live_paths} live (--max-paths caps live paths only); "
               f"entropy {min(flat):.2f}-{max(flat):.2f}")
    report.add(f"   tokens/s     kvkernels {rate(res.decode_tokens, res.seconds)} ({res.decode_tokens} tokens "
               f"decoded in {res.forward_calls} forwards: the prompt once, then one per step for all live paths)")
    report.add(f"   KV memory    kvkernels {mib(m['stored_bytes'])} stored for all paths at the end (peak "
               f"{mib(m['peak_stored_bytes'])}); a deep copy of the cache per path "
               f"(the plain implementation of branching) holds {mib(m['deep_copy_bytes'])} ({100 * m['stored_bytes'] / m['deep_copy_bytes']:.0f}%)")
    report.add(f"   copy-on-write {m['cow_copies']} block copies ({m['cow_copied_tokens']} tokens), {m['forks']} forks")
    report.add("   path  parent  diverged at  own KiB  shared KiB  log-prob  tokens (most likely paths first)")
    for p in sorted(res.paths, key=lambda p: -p.log_prob)[:args.show_paths]:  # the most likely first
        mem = p.memory
        text = (decode(tokenizer, p.tokens) if tokenizer is not None
                else "... " + " ".join(map(str, p.tokens[-8:])))  # the paths differ at the end
        parent = "-" if p.parent_id is None else str(p.parent_id)
        report.add(f"   {p.id:>4}  {parent:>6}  {mem['divergence_point']:>11}  {mem['own_bytes'] / 1024:>7.1f}  "
                   f"{mem['shared_bytes'] / 1024:>10.1f}  {p.log_prob:>8.2f}  {text}")
    if len(res.paths) > args.show_paths:
        report.add(f"   ... {len(res.paths) - args.show_paths} more")
    tol = 1e-3 if model.dtype == torch.float32 else 0.5
    worst = max(abs(a - p.log_prob) for a, p in zip(dense, res.paths))
    report.check(worst <= tol, "branching paths vs dense recompute",
                 f"max |log-prob diff| {worst:.1e} over {len(res.paths)} paths (tol {tol:g})")
    res.release()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["kernels"]:
        from kvkernels.demo_kernels import main as kernels
        return kernels(argv[1:])
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("requests", "system_tokens", "new_tokens", "beams", "beam_tokens", "branch_tokens", "block_size",
                 "branch_factor", "max_paths"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install 'kvkernels[transformers]'); running the ops-level demo "
              "instead: python -m kvkernels demo kernels", file=sys.stderr)
        from kvkernels.demo_kernels import main as kernels
        return kernels([])
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = run(args, transformers.__version__)
    finally:
        torch.set_num_threads(threads)  # (main may run inside another program, e.g. the tests)
    print("\n".join(report.lines))
    return 0 if not report.failures else 1


def build_parser() -> argparse.ArgumentParser:
    from kvkernels.demo_kernels import DefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="python -m kvkernels demo",
                                description=__doc__.split("\n\n")[0].replace("``", ""),
                                epilog="python -m kvkernels demo kernels --help: the ops-level demo",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", help="local transformers checkpoint (loaded with attn_implementation='kvkernels'; "
                                   "its tokenizer too, if present) (default: a small random-weight Llama)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, prompts and sampling")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of the model and the caches")
    p.add_argument("--device", default="cpu", help="torch device of the model and the caches")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads; 0: torch's default. One by default: at the demo's small shapes "
                        "more threads mostly add synchronization, and on a machine whose cores are busy with other "
                        "work each parallel region waits for a descheduled thread (measured: 51 s instead of 4 s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per PagedCache block")
    p.add_argument("--requests", type=int, default=6, help="requests sharing the system prompt (part 1)")
    p.add_argument("--system-tokens", type=int, default=150, help="system prompt length (random-weight model)")
    p.add_argument("--new-tokens", type=int, default=48, help="new tokens per request (part 1)")
    p.add_argument("--beams", type=int, default=8, help="beams of beam search (part 2)")
    p.add_argument("--beam-tokens", type=int, default=32, help="new tokens of beam search (part 2)")
    p.add_argument("--branch-tokens", type=int, default=32, help="new tokens of branching (part 3)")
    p.add_argument("--threshold", type=float, help="normalized-entropy threshold of branching "
                                                   "(default: 0.6 for the random model, 0.055 with --model)")
    p.add_argument("--branch-factor", type=int, default=3, help="paths a branching path becomes (part 3)")
    p.add_argument("--max-paths", type=int, default=12,
                   help="most paths live at once in branching (part 3); paths that end with an end-of-sequence "
                        "token leave the live set, so more can be returned")
    p.add_argument("--temperature", type=float, default=1.0, help="of branching's sampling distribution (part 3)")
    p.add_argument("--show-paths", type=int, default=6, help="paths listed in the report")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def run(args, transformers_version: str) -> Report:
    start = time.perf_counter()
    bar = Bar(7, args.quiet)
    report = Report()
    with bar.phase("load model, warm up"):
        model, tokenizer, what = build_model(args)
        system, users = make_prompts(model, tokenizer, args)
        warm = torch.tensor([system[:8]], device=model.device)
        with torch.no_grad():  # first-call costs (thread pools, allocator) out of the timings
            from kvkernels.integrations.transformers import PagedCache, attention_implementation, cache_kwargs
            model.generate(warm, **cache_kwargs(model.generate, PagedCache(model.config)), max_new_tokens=2,
                           do_sample=False)
            with attention_implementation(model, "sdpa"):
                model.generate(warm, max_new_tokens=2, do_sample=False)
    report.add(f"kvkernels demo: {what}")
    report.add(f"  {args.dtype} on {args.device}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
               f"transformers {transformers_version}; kvkernels = PagedCache (block {args.block_size}) + "
               f"paged_attention, stock = DynamicCache + SDPA; same weights")
    part_shared_prefix(model, tokenizer, bar, report, system, users, args)
    part_beams(model, tokenizer, bar, report, system + users[0], args)
    part_eab(model, tokenizer, bar, report, system + users[1 % len(users)], args)
    bar.close()
    total = time.perf_counter() - start
    verdict = "OK" if not report.failures else "MISMATCH in " + ", ".join(report.failures)
    report.add(f"self-check: {verdict}; {total:.1f} s in all")
    return report

"""``python -m kvkernels bench --suite generate``: ``model.generate()`` tokens/s on the paged cache
against the stock cache (benchmarks/README.md, "generate()").

A Llama-like model with random weights (``MODEL``: 8 layers, hidden 512, 8 query / 2 KV heads of 64,
GQA, vocab 8192, float32 — see the README for why) generates, with the same weights and inputs:

* greedy: batch 8 x prompt 512 x 128 new tokens;
* 8-beam search: one 512-token prompt, 128 new tokens.

Implementations: ``stock`` (``DynamicCache`` + ``attn_implementation="sdpa"``), ``kvkernels``
(``PagedCache`` + ``"kvkernels"`` attention, the same ``generate()`` call) and, for beams,
``kvkernels prefill-once`` (the same ``generate()`` call with
``custom_generate=kvkernels.generation.prefill_once``: the prompt computed once and forked, where
plain ``generate()`` computes it once per beam) and its stock twin ``stock prefill-once`` (the same
pattern on ``DynamicCache``: prefill, ``batch_repeat_interleave`` — which copies the prompt's KV per
beam — then ``generate()``). Each kvkernels way is compared with the stock run of the same pattern
("vs twin") and with plain stock; each kvkernels ``generate()`` call is held to the target against
plain stock ``generate()``. Each is timed ``--reps``
times, interleaved, after a warm-up; the median is reported. Tokens must be identical to stock.

Per implementation also: the decode phase alone (time from the first to the last forward, from a
logits processor), KV copies per forward counted by spies (stock: ``DynamicLayer.update``'s
``torch.cat`` and ``reorder_cache``'s ``index_select``, which copy the whole cache; kvkernels:
``copy_blocks`` calls / blocks (copy-on-write) and ``PagedKVCache.reorder`` calls), peak KV bytes,
and one extra run with timers around the components (attention, cache update / bookkeeping,
reorders, the rest of the forward, generate()'s own work).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import kvkernels
from kvkernels.bench import machine, report

MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=None,
             tie_word_embeddings=False, initializer_range=0.2)
QUICK_MODEL = dict(MODEL, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


@dataclass(frozen=True)
class Shapes:
    batch: int
    prompt: int
    new: int
    beams: int
    beam_prompt: int
    beam_new: int
    reps: int
    model: dict


FULL = Shapes(8, 512, 128, 8, 512, 128, 3, MODEL)
QUICK = Shapes(2, 32, 8, 2, 32, 8, 1, QUICK_MODEL)
TARGETS = {"greedy": 1.0, "beam": 1.5}  # kvkernels tokens/s over stock
# Each kvkernels implementation against the stock run of the same generate() pattern.
# Reported ("vs twin"), not a target: the targets are the plain generate() calls (TARGETS).
COUNTERPART = {"kvkernels": "stock", "kvkernels prefill-once": "stock prefill-once"}


# ---- spies ------------------------------------------------------------------------------------------


class Patch:
    """Replaces attributes for the duration of a ``with`` block."""

    def __init__(self) -> None:
        self.undo: list[tuple[object, str, object]] = []

    def set(self, owner, name: str, value) -> None:
        self.undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in reversed(self.undo):
            setattr(owner, name, value)


class CopySpy(Patch):
    """KV copies: stock ``DynamicLayer.update`` (``torch.cat``: the layer's whole K/V rewritten) and
    ``DynamicLayer.reorder_cache`` (``index_select``); kvkernels ``ops.copy_blocks`` (copy-on-write,
    blocks and bytes), ``ops.swap_blocks``, ``ops.gather_kv`` and ``PagedKVCache.reorder``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"stock_cat_calls": 0, "stock_cat_bytes": 0, "stock_reorder_calls": 0,
                       "stock_reorder_bytes": 0, "copy_blocks_calls": 0, "copy_blocks_blocks": 0,
                       "copy_blocks_bytes": 0, "swap_blocks_calls": 0, "gather_kv_calls": 0, "table_reorders": 0}

    def __enter__(self):
        from transformers.cache_utils import DynamicLayer

        from kvkernels import ops
        from kvkernels.cache import PagedKVCache
        c = self.counts
        update, reorder = DynamicLayer.update, DynamicLayer.reorder_cache

        def spy_update(layer, key_states, value_states, *args, **kwargs):
            out = update(layer, key_states, value_states, *args, **kwargs)
            c["stock_cat_calls"] += 1
            c["stock_cat_bytes"] += layer.keys.nbytes + layer.values.nbytes
            return out

        def spy_reorder(layer, beam_idx):
            if layer.keys is not None and layer.keys.numel():
                c["stock_reorder_calls"] += 1
                c["stock_reorder_bytes"] += layer.keys.nbytes + layer.values.nbytes
            return reorder(layer, beam_idx)
        self.set(DynamicLayer, "update", spy_update)
        self.set(DynamicLayer, "reorder_cache", spy_reorder)
        copy_blocks, swap_blocks, gather_kv = ops.copy_blocks, ops.swap_blocks, ops.gather_kv

        def spy_copy(cache, mapping, *args, **kwargs):
            c["copy_blocks_calls"] += 1
            c["copy_blocks_blocks"] += int(mapping.shape[0])
            block_dim = kwargs.get("block_dim", 2)
            c["copy_blocks_bytes"] += int(mapping.shape[0]) * cache.nbytes // cache.shape[block_dim]
            return copy_blocks(cache, mapping, *args, **kwargs)

        def spy_swap(*args, **kwargs):
            c["swap_blocks_calls"] += 1
            return swap_blocks(*args, **kwargs)

        def spy_gather(*args, **kwargs):
            c["gather_kv_calls"] += 1
            return gather_kv(*args, **kwargs)
        self.set(ops, "copy_blocks", spy_copy)
        self.set(ops, "swap_blocks", spy_swap)
        self.set(ops, "gather_kv", spy_gather)
        table_reorder = PagedKVCache.reorder

        def spy_table(cache, *args, **kwargs):
            c["table_reorders"] += 1
            return table_reorder(cache, *args, **kwargs)
        self.set(PagedKVCache, "reorder", spy_table)
        return self


class Timers(Patch):
    """Wall time spent inside selected functions, each call's nested timed calls subtracted (so the
    labels add up to at most the total)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[float] = []  # time spent in timed callees of each open call
        self.phase = "prefill"  # set to "decode" after generate()'s first forward (StepClock)

    def _timed(self, fn, label: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                inner = self._stack.pop()
                key = f"{self.phase}: {label}"
                self.seconds[key] = self.seconds.get(key, 0.0) + spent - inner
                self.calls[key] = self.calls.get(key, 0) + 1
                if self._stack:
                    self._stack[-1] += spent
        return timed

    def wrap(self, owner, name: str, label: str) -> None:
        self.set(owner, name, self._timed(getattr(owner, name), label))

    def __enter__(self):
        from transformers import AttentionInterface
        from transformers.cache_utils import DynamicLayer

        from kvkernels import ops
        from kvkernels.cache import PagedKVCache
        from kvkernels.integrations.transformers_cache import PagedCache
        mapping = AttentionInterface._global_mapping  # models look their attention function up per call
        for name in ("sdpa", "kvkernels"):
            self._mapping_undo = getattr(self, "_mapping_undo", []) + [(name, mapping[name])]
            mapping[name] = self._timed(mapping[name], f"attention function ({name})")
        self.wrap(DynamicLayer, "update", "stock cache update (torch.cat)")
        self.wrap(DynamicLayer, "reorder_cache", "stock beam reorder (index_select)")
        self.wrap(PagedCache, "update", "paged cache update (handle)")
        self.wrap(PagedCache, "_append", "paged bookkeeping (append, tables)")
        self.wrap(PagedCache, "reorder_cache", "paged beam reorder (tables)")
        self.wrap(PagedCache, "_grow", "paged storage growth")
        self.wrap(ops, "reshape_and_cache", "kernel reshape_and_cache")
        self.wrap(ops, "paged_attention", "kernel paged_attention")
        self.wrap(ops, "copy_blocks", "kernel copy_blocks (copy-on-write)")
        self.wrap(PagedKVCache, "memory_usage", "memory_usage (peak tracking)")
        return self

    def __exit__(self, *exc) -> None:
        from transformers import AttentionInterface
        for name, fn in getattr(self, "_mapping_undo", []):
            AttentionInterface._global_mapping[name] = fn
        super().__exit__(*exc)


# ---- one run ----------------------------------------------------------------------------------------


class StepClock:
    """A logits processor: the time of every forward's end (first = prefill) and, if ``measure`` is
    given (not in timed runs), the peak of a KV-bytes measure."""

    def __init__(self, measure: Optional[Callable[[], int]], timers: Optional["Timers"] = None) -> None:
        self.measure, self.timers, self.times, self.peak = measure, timers, [], 0

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        if self.timers is not None:
            self.timers.phase = "decode"
        if self.measure is not None:
            self.peak = max(self.peak, self.measure())
        return scores


def dynamic_bytes(cache) -> int:
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def run_once(model, impl: str, ids: torch.Tensor, new: int, beams: int, measure: bool = False,
             timers: Optional[Timers] = None) -> dict:
    """One generation: wall time, decode-phase time, the tokens; with ``measure``, peak KV bytes
    (sampled after every forward, which costs time)."""
    from transformers import DynamicCache, LogitsProcessorList

    from kvkernels.generation import prefill_once
    from kvkernels.integrations.transformers import PagedCache, attention_implementation, cache_kwargs
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if beams > 1:
        gen.update(num_beams=beams, early_stopping=False)
    with torch.no_grad():
        if impl == "stock":
            cache = DynamicCache(config=model.config)
            clock = StepClock((lambda: dynamic_bytes(cache)) if measure else None, timers)
            with attention_implementation(model, "sdpa"):
                start = time.perf_counter()
                out = model.generate(ids, **cache_kwargs(model.generate, cache),
                                     logits_processor=LogitsProcessorList([clock]), **gen)
                seconds = time.perf_counter() - start
        elif impl == "stock prefill-once":  # the same pattern on DynamicCache: its expansion copies the KV
            cache = DynamicCache(config=model.config)
            clock = StepClock((lambda: dynamic_bytes(cache)) if measure else None, timers)
            with attention_implementation(model, "sdpa"):
                start = time.perf_counter()
                model(input_ids=ids[:, :-1], **cache_kwargs(model.forward, cache), use_cache=True, logits_to_keep=1)
                cache.batch_repeat_interleave(beams)
                out = model.generate(ids, **cache_kwargs(model.generate, cache),
                                     logits_processor=LogitsProcessorList([clock]), **gen)
                seconds = time.perf_counter() - start
        else:  # "kvkernels", and "kvkernels prefill-once": the same call with custom_generate=prefill_once
            if impl == "kvkernels prefill-once":
                gen["custom_generate"] = prefill_once
            cache = PagedCache(model.config)
            clock = StepClock((lambda: cache.memory_usage()["stored_bytes"]) if measure else None, timers)
            start = time.perf_counter()
            out = model.generate(ids, **cache_kwargs(model.generate, cache),
                                 logits_processor=LogitsProcessorList([clock]), **gen)
            seconds = time.perf_counter() - start
    times = clock.times
    record = {"seconds": seconds, "decode_seconds": times[-1] - times[0], "decode_steps": len(times) - 1,
              "prefill_seconds": times[0] - start, "peak_kv_bytes": clock.peak, "tokens": out}
    if not impl.startswith("stock"):
        usage = cache.memory_usage()
        record.update(peak_allocated_bytes=usage["peak_allocated_bytes"], grow_count=cache.grow_count,
                      cow_copies=cache.kv.stats().cow_copies, storage_bytes=cache.kv.kv.nbytes)
    return record


def run_case(model, name: str, impls: list, ids: torch.Tensor, new: int, beams: int, reps: int,
             progress: Callable[[str], None]) -> dict:
    """Warm-up, ``reps`` interleaved timed runs per implementation, then one run with copy spies
    and one with component timers."""
    rows = ids.shape[0] * beams
    for impl in impls:  # warm-up: the same shapes, a few tokens
        progress(f"{name}: warm-up {impl}")
        run_once(model, impl, ids, 4, beams)
    runs: dict[str, list] = {impl: [] for impl in impls}
    for rep in range(reps):
        for impl in impls:
            progress(f"{name}: {impl} run {rep + 1}/{reps}")
            runs[impl].append(run_once(model, impl, ids, new, beams))
    ref = runs["stock"][0]["tokens"]
    result = {"name": name, "batch": ids.shape[0], "prompt_tokens": ids.shape[1], "new_tokens": new,
              "beams": beams, "rows": rows, "reps": reps, "impls": {}}
    for impl in impls:
        rs = runs[impl]
        med = statistics.median(r["seconds"] for r in rs)
        dec = statistics.median(r["decode_seconds"] for r in rs)
        steps = rs[0]["decode_steps"]
        entry = {"seconds": [r["seconds"] for r in rs], "median_s": med, "min_s": min(r["seconds"] for r in rs),
                 "tokens_per_s": rows * new / med, "median_prefill_s": statistics.median(r["prefill_seconds"]
                                                                                        for r in rs),
                 "median_decode_s": dec, "decode_steps": steps,
                 "decode_tokens_per_s": rows * steps / dec if dec > 0 else None,
                 "decode_ms_per_step": 1e3 * dec / steps if steps else None,
                 "tokens_identical_to_stock": all(torch.equal(r["tokens"], ref) for r in rs)}
        progress(f"{name}: {impl} with copy spies")
        with CopySpy() as spy:
            measured = run_once(model, impl, ids, new, beams, measure=True)
        entry["peak_kv_bytes"] = measured["peak_kv_bytes"]
        for key in ("peak_allocated_bytes", "grow_count", "cow_copies", "storage_bytes"):
            if key in measured:
                entry[key] = measured[key]
        entry["copies"] = dict(spy.counts)
        entry["copies_per_forward"] = {k: v / (steps + 1) for k, v in spy.counts.items()}
        progress(f"{name}: {impl} with component timers")
        with Timers() as timers:
            timed = run_once(model, impl, ids, new, beams, timers=timers)
        breakdown = {"total (timed run)": timed["seconds"]}
        for phase, total in (("prefill", timed["prefill_seconds"]), ("decode", timed["decode_seconds"])):
            parts = {k: v for k, v in sorted(timers.seconds.items()) if k.startswith(phase + ":")}
            breakdown[f"{phase}: total"] = total
            breakdown.update(parts)
            breakdown[f"{phase}: rest (model without attention: matmuls, norms...; generate())"] = \
                total - sum(parts.values())
        entry["breakdown_s"] = {k: round(v, 4) for k, v in breakdown.items()}
        entry["breakdown_calls"] = dict(timers.calls)
        result["impls"][impl] = entry
    stock = result["impls"]["stock"]
    for impl, entry in result["impls"].items():
        entry["speedup_vs_stock"] = stock["median_s"] / entry["median_s"]
        twin = result["impls"].get(COUNTERPART.get(impl))  # the stock run of the same pattern
        entry["speedup_vs_counterpart"] = twin["median_s"] / entry["median_s"] if twin else None
        entry["decode_speedup_vs_stock"] = (stock["median_decode_s"] / entry["median_decode_s"]
                                            if entry["median_decode_s"] else None)
    return result


# ---- driver -----------------------------------------------------------------------------------------


def build_model(config: dict, seed: int = 0):
    import transformers as tf

    from kvkernels.integrations.transformers import register
    register()
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**config), attn_implementation="kvkernels").eval()


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f} MiB"


def format_text(record: dict) -> str:
    m = record["model"]
    lines = [f"kvkernels {record['kvkernels_version']} generate() benchmark, {record['date']}",
             f"machine: {record['machine']['cpu_model']}, {record['machine']['usable_cpus']} usable CPUs, "
             f"{record['machine']['threads']} torch threads, flush denormals {record['flush_denormal']}, load "
             f"average at start {record['load_average']}, at end {record['load_average_end']}; torch "
             f"{record['torch_version']}, transformers {record['transformers_version']}",
             f"model: Llama-like, random weights, {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
             f"{m['num_attention_heads']} query / {m['num_key_value_heads']} KV heads of "
             f"{m['hidden_size'] // m['num_attention_heads']}, FFN {m['intermediate_size']}, vocab "
             f"{m['vocab_size']}, {record['parameters'] / 1e6:.1f}M parameters, {record['dtype']}; "
             f"KV {record['kv_bytes_per_token']:,} bytes per token", ""]
    for case in record["cases"]:
        lines.append(f"{case['name']}: batch {case['batch']} x prompt {case['prompt_tokens']} x {case['new_tokens']} "
                     f"new tokens" + (f", {case['beams']} beams" if case["beams"] > 1 else "")
                     + f"; median of {case['reps']} runs; target {case['target']}x")
        lines.append(f"   {'implementation':<24} {'total s':>8} {'tok/s':>8} {'vs stock':>8} {'vs twin':>8} "
                     f"{'decode ms/step':>15} {'decode vs stock':>16} {'peak KV':>10}  identical")
        for impl, e in case["impls"].items():
            twin = e.get("speedup_vs_counterpart")
            lines.append(f"   {impl:<24} {e['median_s']:>8.2f} {e['tokens_per_s']:>8.1f} "
                         f"{e['speedup_vs_stock']:>7.2f}x {f'{twin:.2f}x' if twin else '-':>8} "
                         f"{e['decode_ms_per_step']:>15.1f} "
                         f"{e['decode_speedup_vs_stock']:>15.2f}x "
                         f"{_mib(e['peak_kv_bytes']):>10}  {e['tokens_identical_to_stock']}")
        for impl, e in case["impls"].items():
            c = e["copies_per_forward"]
            if impl.startswith("stock"):
                lines.append(f"   KV copies per forward, {impl}: {c.get('stock_cat_calls', 0):.1f} torch.cat "
                             f"({_mib(c.get('stock_cat_bytes', 0))}), {c.get('stock_reorder_calls', 0):.1f} "
                             f"index_select reorders ({_mib(c.get('stock_reorder_bytes', 0))})")
            else:
                lines.append(f"   KV copies per forward, {impl}: {c.get('copy_blocks_calls', 0):.2f} copy_blocks "
                             f"calls, {c.get('copy_blocks_blocks', 0):.2f} blocks "
                             f"({_mib(c.get('copy_blocks_bytes', 0))}); {c.get('table_reorders', 0):.2f} "
                             f"block-table reorders; gather_kv {e['copies']['gather_kv_calls']}")
        for impl, e in case["impls"].items():
            b = e["breakdown_s"]
            lines.append(f"   time in components, {impl} (seconds; one run with timers, "
                         f"{b['total (timed run)']:.2f} s)")
            for phase in ("prefill", "decode"):
                parts = ", ".join(f"{k.split(': ', 1)[1]} {v:.3f}" for k, v in b.items()
                                  if k.startswith(phase + ":") and k != f"{phase}: total" and v >= 0.0005)
                lines.append(f"      {phase} {b[phase + ': total']:.3f}: {parts}")
        lines.append("")
    lines.append("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in record["targets_met"].items()))
    return "\n".join(lines)


def run(args: argparse.Namespace, argv: list) -> int:
    import transformers
    started = datetime.datetime.now().astimezone()
    if args.threads:
        torch.set_num_threads(args.threads)
    flush = bool(getattr(args, "flush_denormal", False))
    if flush and not torch.set_flush_denormal(True):
        print("torch.set_flush_denormal(True) is not supported on this CPU; running without", file=sys.stderr)
        flush = False
    shapes = QUICK if args.quick else FULL
    reps = args.reps if getattr(args, "reps", None) else shapes.reps
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    model = build_model(shapes.model)
    vocab = shapes.model["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    greedy_ids = torch.randint(3, vocab, (shapes.batch, shapes.prompt), generator=gen)
    beam_ids = torch.randint(3, vocab, (1, shapes.beam_prompt), generator=gen)
    cases_plan = [("greedy", ["stock", "kvkernels"], greedy_ids, shapes.new, 1),
                  ("beam", ["stock", "kvkernels", "stock prefill-once", "kvkernels prefill-once"], beam_ids,
                   shapes.beam_new, shapes.beams)]
    cases_plan = [c for c in cases_plan if c[0] in args.generate_cases]
    count = [0]

    def progress(label: str) -> None:
        count[0] += 1
        print(f"[{count[0]}] {label} (elapsed {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    cases = []
    for name, impls, ids, new, beams in cases_plan:
        case = run_case(model, name, impls, ids, new, beams, reps, progress)
        case["target"] = TARGETS[name]
        cases.append(case)
    cfg = model.config
    kv_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    targets = {}
    for case in cases:  # the targets: generate() on PagedCache against plain stock generate()
        for impl in ("kvkernels", "kvkernels prefill-once"):
            if impl in case["impls"]:
                targets[f"{case['name']}: {impl} vs stock"] = case["impls"][impl]["speedup_vs_stock"] >= case["target"]
    record = {"suite": "generate", "machine": machine.machine_info(machine.llc_bytes()),
              "torch_version": torch.__version__, "transformers_version": transformers.__version__,
              "kvkernels_version": kvkernels.__version__, "python_version": platform.python_version(),
              "date": started.isoformat(timespec="seconds"), "command_line": shlex.join([sys.executable, *sys.argv]),
              "bench_args": argv, "quick": args.quick, "load_average": [round(x, 2) for x in load] if load else None,
              "load_average_end": [round(x, 2) for x in os.getloadavg()] if load else None,
              "model": {k: v for k, v in shapes.model.items()}, "dtype": "float32", "flush_denormal": flush,
              "parameters": sum(p.numel() for p in model.parameters()), "kv_bytes_per_token": kv_bytes,
              "cases": cases, "targets_met": targets}
    for case in cases:
        for entry in case["impls"].values():
            entry.pop("tokens", None)
    if args.quick:
        record["note"] = report.SMOKE_NOTE
    text = format_text(record)
    if args.quick:
        text = f"{report.SMOKE_BANNER}\n{text}"
    stem = machine.write_result(report.output_dir(args), "generate", record, text,
                                cpu=record["machine"]["cpu_model"], when=started)
    print(text)
    print(f"JSON: {stem.with_suffix('.json')}\nTXT: {stem.with_suffix('.txt')}")
    if flush:
        torch.set_flush_denormal(False)
    identical = all(e["tokens_identical_to_stock"] for case in cases for e in case["impls"].values())
    if not identical:
        print("!!! FAILED: tokens differ from the stock cache", file=sys.stderr)
        return 1
    return 0 if args.quick or all(targets.values()) else 1

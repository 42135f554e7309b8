"""Generation strategies that exploit KV sharing, for ``transformers`` models on a ``PagedCache``.

The model must run ``attn_implementation="kvkernels"`` (``kvkernels.integrations.transformers``:
``register()`` first). Every strategy prefills a prompt once and lets its continuations share the
prompt's blocks (zero-copy forks of ``PagedKVCache``); a continuation stores only the tokens it
adds, plus a copy of the partly filled block it diverged in (copy-on-write).

* ``EntropyAdaptiveBranching``: sample one token per path, except where the
  next-token distribution is uncertain: where its normalized entropy exceeds ``entropy_threshold``
  the path branches into ``branch_factor`` paths (distinct tokens). At most ``max_paths`` paths are
  live (decoding: the memory bound); beyond that the candidates with the lowest cumulative
  log-probability are pruned. A path that ends with an end-of-sequence token leaves the live set, so
  the paths returned (those ended so, plus those live at the last step) can outnumber ``max_paths``.
* ``parallel_sample``: ``n`` independent samples of one prompt, prefilled once.
* ``prefill_once``: a ``custom_generate`` callable for ``model.generate()`` (beam search, or
  ``num_return_sequences`` samples): each prompt is computed once and its rows fork it, where plain
  ``generate()`` computes it once per row. ``beam_search`` is ``generate(num_beams=...)`` with it;
  beam reorders permute block tables (see the integration).
* ``generate_shared_prefix``: a batch of requests that start with one shared prefix (a system
  prompt): the prefix is prefilled once and every request forks it, then ``model.generate()``.

Each step of ``EntropyAdaptiveBranching`` and ``parallel_sample`` is one forward over all live paths
(one token per path); between steps ``PagedCache.batch_select_indices`` keeps, forks (branching)
and frees (pruned, finished) rows without copying KV.

RNG protocol (so that a run is reproducible, and an implementation without sharing reproduces it
exactly — the tests keep one on ``DynamicCache`` + ``copy.deepcopy`` as the oracle):

* A distribution is ``log_softmax(logits.float() / temperature)`` of the last position; the
  probabilities used for sampling are ``exp`` of those log-probabilities in float64.
* A token is drawn from a uniform ``u`` in [0, 1) by inverse CDF: the first token whose cumulative
  probability (float64 ``cumsum``) exceeds ``u * total``. ``k`` distinct tokens are drawn one after
  the other, each from the probabilities left after zeroing the tokens already drawn.
* ``EntropyAdaptiveBranching``: one ``torch.Generator`` (``seed``); every step draws
  ``torch.rand((live_paths, branch_factor), generator=g, dtype=torch.float64)``. Row ``i`` belongs to
  the ``i``-th live path (paths in order); a path that does not branch uses column 0, a path that
  branches into ``k`` paths columns ``0..k-1``.
* ``parallel_sample``: ``torch.rand((max_new_tokens, n), generator=g, dtype=torch.float64)`` is drawn
  once; sample ``j`` uses ``u[step, j]`` (so each sample is what an independent run with that column
  would produce).
* Candidate order: the children of a path, in draw order, replace it; paths keep their order.
  Pruning keeps the ``max_paths`` candidates with the highest cumulative log-probability (ties: the
  earlier candidate), in candidate order. A path that draws an end-of-sequence token is finished:
  it leaves the live set (and is not counted by ``max_paths``).

Memory reports (``GenerationPath.memory``) come from ``PagedKVCache.memory_usage(seq)`` taken at the
end, while every returned path still holds its blocks, with these entries:
``own_memory_mb`` (blocks only this path references), ``parent_memory_mb`` (blocks shared with
other paths: the prompt and common history), ``total_memory_mb``, ``divergence_point`` and
``sequence_length`` (KV tokens: prompt + generated tokens but the last, which is never fed back).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor
from transformers.generation.utils import GENERATION_MODES_MAPPING

from kvkernels.integrations.transformers import PagedCache, register
from kvkernels.integrations.transformers_compat import cache_kwargs, cache_name, pop_cache

__all__ = ["EntropyAdaptiveBranching", "GenerationPath", "GenerationResult", "BeamSearchResult",
           "SharedPrefixResult", "parallel_sample", "prefill_once", "beam_search", "generate_shared_prefix",
           "shared_prefix_batch", "normalized_entropy", "inverse_cdf", "draw_distinct"]

MB = 2 ** 20
Progress = Optional[Callable[[int, int], None]]  # progress(steps done, steps in all)


# ---- sampling primitives (the RNG protocol) -------------------------------------------------------


def normalized_entropy(logprobs: Tensor) -> Tensor:
    """Entropy of each row's distribution over the last dimension divided by ``log(vocab)``: 0 for
    a certain token, 1 for the uniform distribution. ``logprobs``: log-probabilities."""
    probs = logprobs.exp()
    terms = torch.where(probs > 0, probs * logprobs, torch.zeros_like(probs))
    return -terms.sum(-1) / math.log(logprobs.shape[-1])


def inverse_cdf(probs: Tensor, u: float) -> int:
    """The token drawn by uniform ``u`` in [0, 1): the first whose cumulative probability exceeds
    ``u * total`` (``probs``: float64 ``[vocab]``, need not sum to 1; a zero-probability token is
    never drawn)."""
    cdf = torch.cumsum(probs, 0)
    target = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype)
    return min(int(torch.searchsorted(cdf, target, right=True)), probs.numel() - 1)


def draw_distinct(probs: Tensor, us: Sequence[float]) -> list[int]:
    """``len(us)`` distinct tokens: each drawn by ``inverse_cdf`` from the probabilities left after
    zeroing the ones drawn before it. Stops early when no token with probability > 0 is left."""
    left = probs.clone()
    tokens: list[int] = []
    for u in us:
        if not bool((left > 0).any()):
            break
        token = inverse_cdf(left, float(u))
        tokens.append(token)
        left[token] = 0.0
    return tokens


# ---- results --------------------------------------------------------------------------------------


@dataclass
class GenerationPath:
    """One continuation. ``tokens``: generated token ids (prompt excluded); ``log_prob``: their
    cumulative log-probability under the sampling distribution; ``finished``: ended with an
    end-of-sequence token; ``divergence_point``: KV tokens it shared with its siblings when its
    lineage last branched (0: never branched); ``branch_steps``: generation steps (0 = the first
    new token) at which its lineage branched; ``seq``: its ``PagedKVCache`` sequence (valid until
    ``GenerationResult.release()``); ``memory``: see the module docs; ``text`` with a tokenizer."""
    id: int
    parent_id: Optional[int]
    tokens: list[int]
    log_prob: float
    finished: bool = False
    divergence_point: int = 0
    branch_steps: list[int] = field(default_factory=list)
    seq: Optional[int] = None
    memory: dict = field(default_factory=dict)
    text: Optional[str] = None


@dataclass
class GenerationResult:
    """What ``EntropyAdaptiveBranching.generate`` / ``parallel_sample`` return.

    ``paths``: in the order they ended (an end-of-sequence token or ``max_new_tokens``), within a
    step in candidate order (``parallel_sample``: sample order). ``EntropyAdaptiveBranching``: the
    paths that ended with an end-of-sequence token at any step (``finished``; not capped) plus those
    live at the last step (at most ``max_paths``), so ``len(paths)`` can exceed ``max_paths``, which
    caps the paths decoded together (``max_live_paths``). ``prefill_tokens``: tokens of the
    one prompt forward; ``decode_tokens``: one per live path per later step; ``forward_calls``:
    model forwards (the prompt's, then one per later step); ``steps``: most tokens generated by a
    path; ``branch_events``: paths that branched (summed over steps); ``pruned``: candidates dropped
    by ``max_paths``; ``max_live_paths``. ``memory``: totals at the end — ``stored_bytes`` (each
    shared block once, token granular), ``deep_copy_bytes`` (every path holding a private copy of
    its KV, what a deep-copy implementation holds), ``allocated_bytes`` (whole blocks),
    ``peak_stored_bytes`` (after any forward), ``cow_copies`` / ``cow_copied_tokens`` (partial
    blocks copied on write), ``forks``. ``seconds``: wall time of the whole call. ``cache``: the
    ``PagedCache`` (its storage holds every path's sequence until ``release()``); ``entropies``:
    the normalized entropy of every live path at every step.
    """
    prompt: list[int]
    paths: list[GenerationPath]
    prefill_tokens: int
    decode_tokens: int
    forward_calls: int
    steps: int
    branch_events: int
    pruned: int
    max_live_paths: int
    memory: dict
    seconds: float
    cache: Any = None
    entropies: list[list[float]] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return sum(len(p.tokens) for p in self.paths)

    def release(self) -> None:
        """Free every path's sequence (``cache.reset()``; the storage is kept for reuse)."""
        if self.cache is not None:
            self.cache.reset()
        for path in self.paths:
            path.seq = None


# ---- shared machinery -----------------------------------------------------------------------------


def _as_prompt(prompt, tokenizer, what: str = "prompt", special_tokens: bool = True) -> list[int]:
    """Token ids of one sequence given as text (tokenized by ``tokenizer``, with its special tokens
    unless ``special_tokens=False``: a suffix must not get a second BOS), a ``[L]`` or ``[1, L]``
    tensor, or a sequence of ids. ``what`` names the argument in errors."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"kvkernels.generation: {what}: text needs a tokenizer (tokenizer=...)")
        return list(tokenizer(prompt, add_special_tokens=special_tokens)["input_ids"])
    if isinstance(prompt, Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise ValueError(f"kvkernels.generation: {what}: expected one sequence, got shape {tuple(prompt.shape)}")
        return [int(t) for t in prompt.tolist()]
    return [int(t) for t in prompt]


def _eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, (int, np.integer)):
        return {int(eos_token_id)}
    return {int(t) for t in eos_token_id}


def _check_model(model) -> None:
    name = getattr(model.config, "_attn_implementation", None)
    if name != register():
        raise ValueError(f"kvkernels.generation: the model runs attn_implementation={name!r}; load or build it with "
                         f"attn_implementation='kvkernels' (after kvkernels.integrations.transformers.register())")


def _new_cache(model, cache: Optional[PagedCache], block_size: int) -> PagedCache:
    if cache is None:
        return PagedCache(model.config, block_size=block_size)
    if not isinstance(cache, PagedCache) or cache.sequences:
        raise ValueError("kvkernels.generation: cache: expected an empty PagedCache")
    return cache


class _Runner:
    """One prompt's paths as the rows of a ``PagedCache``: prefill, batched steps, row selection."""

    def __init__(self, model, cache: PagedCache, temperature: float) -> None:
        if not temperature > 0:
            raise ValueError(f"kvkernels.generation: temperature must be > 0, got {temperature!r}")
        self.model, self.cache, self.temperature = model, cache, float(temperature)
        self.cache_arg = cache_kwargs(model.forward, cache)
        self.device = model.device
        self.forward_calls = self.prefill_tokens = self.decode_tokens = 0
        self.peak_stored = 0

    def _logprobs(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits.float() / self.temperature, dim=-1).cpu()

    def _track(self) -> None:
        self.peak_stored = max(self.peak_stored, self.cache.kv.memory_usage()["stored_bytes"])

    def prefill(self, prompt: list[int]) -> Tensor:
        """The prompt's one forward (one row); log-probabilities of the first new token ``[1, V]``."""
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, **self.cache_arg, use_cache=True, logits_to_keep=1)
        self.forward_calls += 1
        self.prefill_tokens += len(prompt)
        self._track()
        return self._logprobs(out.logits[:, -1])

    def step(self, tokens: list[int]) -> Tensor:
        """One token per row, one forward: log-probabilities ``[rows, V]``."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).view(-1, 1)
        out = self.model(input_ids=ids, **self.cache_arg, use_cache=True)
        self.forward_calls += 1
        self.decode_tokens += len(tokens)
        self._track()
        return self._logprobs(out.logits[:, -1])

    def keep(self, row: int) -> int:
        """Keep row ``row``'s KV after the row leaves the batch (``PagedCache.hold_row``: a fork
        that survives storage growth); returns the handle."""
        return self.cache.hold_row(row)

    def select(self, rows: list[int]) -> None:
        """The next step's rows: ``rows[i]`` is the current row whose KV row ``i`` continues (a row
        named twice is forked, a row not named is freed)."""
        if rows != list(range(len(self.cache.sequences))):
            self.cache.batch_select_indices(torch.tensor(rows, dtype=torch.long))

    def finish(self, prompt, paths, branch_events, pruned, max_live, start, entropies, tokenizer) -> GenerationResult:
        """Free the batch rows (every returned path holds its own fork), then the memory reports."""
        if self.cache.sequences:
            self.cache.batch_select_indices(torch.empty(0, dtype=torch.long))
        kv = self.cache.kv
        for path in paths:
            path.seq = self.cache.held_sequence(path.seq)
            m = kv.memory_usage(path.seq)
            own, shared = m["own_bytes"], m["shared_bytes"]
            path.memory = {"own_bytes": own, "shared_bytes": shared, "total_bytes": own + shared,
                           "own_memory_mb": own / MB, "parent_memory_mb": shared / MB,
                           "total_memory_mb": (own + shared) / MB, "divergence_point": path.divergence_point,
                           "sequence_length": m["kv_tokens"], "own_tokens": m["own_tokens"],
                           "shared_tokens": m["shared_tokens"]}
            if tokenizer is not None:
                path.text = tokenizer.decode(path.tokens)
        total = kv.memory_usage()
        stats = kv.stats()
        memory = {"stored_bytes": total["stored_bytes"], "deep_copy_bytes": total["unshared_bytes"],
                  "allocated_bytes": total["allocated_bytes"], "peak_stored_bytes": self.peak_stored,
                  "bytes_per_token": kv.bytes_per_token, "cow_copies": stats.cow_copies,
                  "cow_copied_tokens": stats.cow_copied_tokens, "forks": stats.forks}
        return GenerationResult(prompt=list(prompt), paths=paths, prefill_tokens=self.prefill_tokens,
                                decode_tokens=self.decode_tokens, forward_calls=self.forward_calls,
                                steps=max((len(p.tokens) for p in paths), default=0), branch_events=branch_events,
                                pruned=pruned, max_live_paths=max_live, memory=memory,
                                seconds=time.perf_counter() - start, cache=self.cache, entropies=entropies)


# ---- entropy-adaptive branching -------------------------------------------------------------------


class EntropyAdaptiveBranching:
    """Entropy-adaptive branching on a paged cache.

    Args:
        model: a ``transformers`` causal LM running ``attn_implementation="kvkernels"``, or a path /
            hub name to load that way (with its tokenizer).
        tokenizer: optional; needed for text prompts, fills ``GenerationPath.text``.
        entropy_threshold: a path branches where the normalized entropy (``normalized_entropy``,
            in [0, 1]) of its next-token distribution exceeds this.
        branch_factor: paths a branching path becomes (distinct tokens).
        max_paths: most paths live (decoded together, holding their own blocks) at any step; the
            candidates beyond it with the lowest cumulative log-probability are pruned. Not a cap on
            the paths returned: a path that ends with an end-of-sequence token leaves the live set
            and is returned, so a result holds those (any number) plus the paths live at the last
            step (at most ``max_paths``).
        temperature: of the sampling distribution (entropy and log-probabilities are of it too).
        block_size: of the ``PagedCache`` built per call.
        eos_token_id: int or ints ending a path; default the model's ``generation_config``; ``[]``: none.

    ``generate(prompt, max_new_tokens)`` returns a ``GenerationResult``; the RNG protocol is in the
    module docs.
    """

    def __init__(self, model, tokenizer=None, *, entropy_threshold: float = 0.055, branch_factor: int = 3,
                 max_paths: int = 20, temperature: float = 1.0, block_size: int = 16, eos_token_id=None) -> None:
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM, AutoTokenizer
            register()
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model, attn_implementation="kvkernels").eval()
        if not (isinstance(branch_factor, int) and branch_factor >= 1):
            raise ValueError(f"kvkernels.generation: branch_factor must be an int >= 1, got {branch_factor!r}")
        if not (isinstance(max_paths, int) and max_paths >= 1):
            raise ValueError(f"kvkernels.generation: max_paths must be an int >= 1, got {max_paths!r}")
        self.model, self.tokenizer = model, tokenizer
        self.entropy_threshold, self.branch_factor, self.max_paths = float(entropy_threshold), branch_factor, max_paths
        self.temperature, self.block_size, self.eos_token_id = temperature, block_size, eos_token_id

    def generate(self, prompt, max_new_tokens: int = 50, *, temperature: Optional[float] = None, seed: int = 0,
                 generator: Optional[torch.Generator] = None, cache: Optional[PagedCache] = None,
                 progress: Progress = None, past_key_values: Optional[PagedCache] = None) -> GenerationResult:
        """Branching generation from ``prompt`` (text, token ids, or a ``[1, L]`` tensor).
        ``generator`` (CPU) overrides ``seed``; ``cache`` (or ``past_key_values``, its name in
        transformers before 5.24): an empty ``PagedCache`` to use."""
        start = time.perf_counter()
        cache = pop_cache({"past_key_values": past_key_values}, "kvkernels.generation.EntropyAdaptiveBranching", cache)
        prompt_ids, gen, eos, run = _setup(self.model, prompt, self.tokenizer, max_new_tokens, seed, generator,
                                           self.eos_token_id, cache, self.block_size,
                                           self.temperature if temperature is None else temperature)
        bf, cap, threshold, plen = self.branch_factor, self.max_paths, self.entropy_threshold, len(prompt_ids)
        next_id = 1
        live = [GenerationPath(id=0, parent_id=None, tokens=[], log_prob=0.0)]
        done: list[GenerationPath] = []
        branch_events = pruned = 0
        max_live = 1
        entropies: list[list[float]] = []
        with torch.no_grad():
            logprobs = run.prefill(prompt_ids)
            for step in range(max_new_tokens):
                if step:
                    logprobs = run.step([p.tokens[-1] for p in live])
                ent = normalized_entropy(logprobs).tolist()
                entropies.append(ent)
                u = torch.rand((len(live), bf), generator=gen, dtype=torch.float64).tolist()
                probs = logprobs.double().exp()
                # (row, path, token, cumulative log-probability) of every candidate, in candidate order
                cands: list[tuple[int, GenerationPath, int, float]] = []
                for i, path in enumerate(live):
                    if bf > 1 and ent[i] > threshold:
                        tokens = draw_distinct(probs[i], u[i])
                    else:
                        tokens = [inverse_cdf(probs[i], u[i][0])]
                    if len(tokens) == 1:  # the path goes on
                        path.log_prob += float(logprobs[i, tokens[0]])
                        path.tokens.append(tokens[0])
                        cands.append((i, path, tokens[0], path.log_prob))
                        continue
                    branch_events += 1
                    for token in tokens:
                        child = GenerationPath(id=next_id, parent_id=path.id, tokens=path.tokens + [token],
                                               log_prob=path.log_prob + float(logprobs[i, token]),
                                               divergence_point=plen + step, branch_steps=path.branch_steps + [step])
                        next_id += 1
                        cands.append((i, child, token, child.log_prob))
                # max_paths caps the candidates that stay live (a finished path leaves the live set)
                going = [j for j, c in enumerate(cands) if c[2] not in eos]
                if len(going) > cap:
                    ranked = sorted(going, key=lambda j: -cands[j][3])  # stable: the earlier wins a tie
                    drop = set(ranked[cap:])
                    pruned += len(drop)
                    cands = [c for j, c in enumerate(cands) if j not in drop]
                last = step == max_new_tokens - 1
                rows, live = [], []
                for i, path, token, _ in cands:
                    if token in eos or last:
                        path.finished = token in eos
                        path.seq = run.keep(i)
                        done.append(path)
                    else:
                        rows.append(i)
                        live.append(path)
                if progress is not None:
                    progress(step + 1, max_new_tokens)
                if not live:
                    break
                run.select(rows)
                max_live = max(max_live, len(live))
        return run.finish(prompt_ids, done, branch_events, pruned, max_live, start, entropies, self.tokenizer)


def _setup(model, prompt, tokenizer, max_new_tokens, seed, generator, eos_token_id, cache, block_size, temperature):
    _check_model(model)
    prompt_ids = _as_prompt(prompt, tokenizer)
    if not prompt_ids:
        raise ValueError("kvkernels.generation: empty prompt")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"kvkernels.generation: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    run = _Runner(model, _new_cache(model, cache, block_size), temperature)
    return prompt_ids, gen, _eos_ids(model, eos_token_id), run


# ---- parallel sampling ----------------------------------------------------------------------------


def parallel_sample(model, prompt, n: int, max_new_tokens: int = 50, *, temperature: float = 1.0, seed: int = 0,
                    generator: Optional[torch.Generator] = None, eos_token_id=None, tokenizer=None,
                    block_size: int = 16, cache: Optional[PagedCache] = None,
                    progress: Progress = None, past_key_values: Optional[PagedCache] = None) -> GenerationResult:
    """``n`` samples of ``prompt``, prefilled once: the samples are forks of the prompt's row and each
    stores only its own tokens. One forward per step for all live samples. ``paths`` in sample
    order (``paths[j]`` drew ``u[:, j]``, see the module docs). ``cache`` (or ``past_key_values``):
    an empty ``PagedCache`` to use."""
    start = time.perf_counter()
    cache = pop_cache({"past_key_values": past_key_values}, "kvkernels.generation.parallel_sample", cache)
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"kvkernels.generation: n must be an int >= 1, got {n!r}")
    prompt_ids, gen, eos, run = _setup(model, prompt, tokenizer, max_new_tokens, seed, generator, eos_token_id,
                                       cache, block_size, temperature)
    plen = len(prompt_ids)
    u = torch.rand((max_new_tokens, n), generator=gen, dtype=torch.float64).tolist()
    paths = [GenerationPath(id=j, parent_id=None, tokens=[], log_prob=0.0, divergence_point=plen if n > 1 else 0,
                            branch_steps=[0] if n > 1 else []) for j in range(n)]
    live = list(range(n))  # sample index of each row
    with torch.no_grad():
        logprobs = run.prefill(prompt_ids)
        for step in range(max_new_tokens):
            if step:
                logprobs = run.step([paths[j].tokens[-1] for j in live])
            probs = logprobs.double().exp()
            last = step == max_new_tokens - 1
            rows, going = [], []
            for r, j in enumerate(live):
                row = r if step else 0  # the first token: every sample draws from the prompt's row
                token = inverse_cdf(probs[row], u[step][j])
                path = paths[j]
                path.tokens.append(token)
                path.log_prob += float(logprobs[row, token])
                if token in eos or last:
                    path.finished = token in eos
                    path.seq = run.keep(row)
                else:
                    rows.append(row)
                    going.append(j)
            live = going
            if progress is not None:
                progress(step + 1, max_new_tokens)
            if not live:
                break
            run.select(rows)
    return run.finish(prompt_ids, paths, n - 1, 0, n, start, [], tokenizer)


# ---- generate() after one prefill -----------------------------------------------------------------


class _Probe:
    """A logits processor (runs after every forward of ``generate()``): the most bytes stored, and
    the caller's progress callback."""

    def __init__(self, cache: PagedCache, total: int, progress: Progress) -> None:
        self.cache, self.total, self.progress = cache, total, progress
        self.peak_stored = self.calls = 0

    def __call__(self, input_ids, scores):
        self.peak_stored = max(self.peak_stored, self.cache.memory_usage()["stored_bytes"])
        self.calls += 1
        if self.progress is not None:
            self.progress(min(self.calls, self.total), self.total)
        return scores


def _generate(model, cache: PagedCache, input_ids: Tensor, attention_mask: Optional[Tensor], max_new_tokens: int,
              progress: Progress, generate_kwargs: dict):
    from transformers import LogitsProcessorList
    probe = _Probe(cache, max_new_tokens, progress)
    processors = LogitsProcessorList(list(generate_kwargs.pop("logits_processor", None) or []) + [probe])
    out = model.generate(input_ids, attention_mask=attention_mask, **cache_kwargs(model.generate, cache),
                         max_new_tokens=max_new_tokens, logits_processor=processors, **generate_kwargs)
    return out, probe


def _memory_report(cache: PagedCache, probe: _Probe) -> dict:
    usage, stats = cache.memory_usage(), cache.kv.stats()
    return {"stored_bytes": usage["stored_bytes"], "unshared_bytes": usage["unshared_bytes"],
            "allocated_bytes": usage["allocated_bytes"], "peak_stored_bytes": probe.peak_stored,
            "peak_allocated_bytes": usage["peak_allocated_bytes"], "bytes_per_token": cache.kv.bytes_per_token,
            "cow_copies": stats.cow_copies, "cow_copied_tokens": stats.cow_copied_tokens, "forks": stats.forks,
            "split_rows": cache.split_rows}


def _sequences(out) -> Tensor:
    return out if isinstance(out, Tensor) else out.sequences


@dataclass
class BeamSearchResult:
    """``sequences``: ``generate()``'s token ids (prompt included); ``output``: what it returned;
    ``prefill_tokens``: prompt tokens computed by the one prefill (all but the last of each prompt,
    padding excluded; ``generate()`` then computes the last one per beam); ``memory``: totals after
    generation (``stored_bytes``, ``unshared_bytes``: every beam a private copy, ``peak_stored_bytes``
    after any forward, ``peak_allocated_bytes``, ``cow_copies``...); ``seconds``; ``cache``."""
    sequences: Tensor
    output: Any
    prefill_tokens: int
    memory: dict
    seconds: float
    cache: Any = None


def _positions(mask: Optional[Tensor], batch: int, length: int, device) -> Tensor:
    """Position ids as ``generate()`` derives them from a padding mask (padding does not count)."""
    if mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def prefill_once(model, input_ids: Tensor, logits_processor, stopping_criteria, generation_config,
                 synced_gpus: bool = False, streamer=None, **model_kwargs):
    """A ``custom_generate`` callable for ``model.generate()``: the prompt is computed once per input
    instead of once per beam / returned sequence.

    ``model.generate(ids, cache=PagedCache(model.config), num_beams=8,
    custom_generate=kvkernels.generation.prefill_once)`` (``past_key_values=`` before transformers
    5.24) returns what the same call without
    ``custom_generate`` returns. ``generate()`` has already expanded each input to ``num_beams``
    (or ``num_return_sequences``) identical rows when it calls this; this runs the model once on one
    row per input over all prompt tokens but the last, forks that row for its copies
    (``batch_repeat_interleave``: zero-copy, the prompt's blocks shared), and hands over to
    ``generate()``'s own decoding loop (``_beam_search`` / ``_sample``), whose first forward then
    computes only the last prompt token of each row. Nothing to share (one row per input, a
    one-token prompt, or an encoder-decoder model, whose encoder ``generate()`` already runs once
    per input and whose cross-attention K/V ``PagedEncoderDecoderCache`` already shares): the
    decoding loop runs as it is. transformers drops ``streamer`` for
    ``custom_generate`` callables; it is not used. With ``output_hidden_states`` the first step's
    hidden states cover only the last prompt token (the prefill's outputs are not returned)."""
    name = cache_name(model.generate)  # generate() hands the cache over under its own name
    cache = model_kwargs.get(name)
    decoder = getattr(cache, "self_attention_cache", cache)  # PagedEncoderDecoderCache: its decoder half
    if not isinstance(decoder, PagedCache):
        raise ValueError(f"kvkernels.generation.prefill_once: {name}: expected a PagedCache "
                         f"(generate(..., {name}=PagedCache(model.config))), got {type(cache).__name__}")
    if decoder.sequences:
        raise ValueError(f"kvkernels.generation.prefill_once: {name}: expected an empty PagedCache")
    _check_model(model)
    method = GENERATION_MODES_MAPPING.get(generation_config.get_generation_mode())
    if method not in ("_sample", "_beam_search"):
        raise NotImplementedError(f"kvkernels.generation.prefill_once: generation mode "
                                  f"{generation_config.get_generation_mode()!r} (greedy, sampling and beam "
                                  f"search only)")
    if model_kwargs.get("inputs_embeds") is not None:
        raise NotImplementedError("kvkernels.generation.prefill_once: inputs_embeds (pass input_ids)")
    expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    rows, length = input_ids.shape
    if expand > 1 and length > 1 and not model.config.is_encoder_decoder:
        mask = model_kwargs.get("attention_mask")
        ids = input_ids[::expand]
        same = torch.equal(input_ids, ids.repeat_interleave(expand, 0))
        if mask is not None:
            mask = mask[::expand]
            same = same and torch.equal(model_kwargs["attention_mask"], mask.repeat_interleave(expand, 0))
        if rows % expand or not same:
            raise ValueError(f"kvkernels.generation.prefill_once: input_ids: expected groups of {expand} identical "
                             f"rows (generate()'s expansion), got {rows} rows that are not")
        mask = None if mask is None else mask[:, :-1]
        with torch.no_grad():
            model(input_ids=ids[:, :-1], attention_mask=mask, **cache_kwargs(model.forward, cache), use_cache=True,
                  position_ids=_positions(mask, ids.shape[0], length - 1, input_ids.device), logits_to_keep=1)
        cache.batch_repeat_interleave(expand)
        cache.reserve(generation_config.max_length - length + 1)
    extra = {"streamer": streamer} if method == "_sample" else {}
    return getattr(type(model), method)(model, input_ids, logits_processor=logits_processor,
                                        stopping_criteria=stopping_criteria, generation_config=generation_config,
                                        synced_gpus=synced_gpus, **extra, **model_kwargs)


def beam_search(model, input_ids: Tensor, num_beams: int = 4, max_new_tokens: int = 32, *,
                attention_mask: Optional[Tensor] = None, cache: Optional[PagedCache] = None, block_size: int = 16,
                progress: Progress = None, **generate_kwargs) -> BeamSearchResult:
    """``model.generate(input_ids, num_beams=num_beams, custom_generate=prefill_once, ...)`` on a
    ``PagedCache``: each prompt prefilled once, its beams forks of it. ``input_ids`` ``[batch, L]``
    (left padding with ``attention_mask``); other keyword arguments go to ``generate()``
    (``do_sample=False`` unless given). Returns the tokens with the memory report."""
    start = time.perf_counter()
    _check_model(model)
    cache = _new_cache(model, pop_cache(generate_kwargs, "kvkernels.generation.beam_search", cache), block_size)
    if input_ids.dim() != 2:
        raise ValueError("kvkernels.generation.beam_search: input_ids: expected [batch, length]")
    batch, length = input_ids.shape
    generate_kwargs.setdefault("do_sample", False)
    prefill = 0
    if length > 1 and num_beams > 1 and not model.config.is_encoder_decoder:  # what prefill_once computes
        prefill = batch * (length - 1) if attention_mask is None else int(attention_mask[:, :-1].sum())
    with torch.no_grad():
        out, probe = _generate(model, cache, input_ids, attention_mask, max_new_tokens, progress,
                               dict(generate_kwargs, num_beams=num_beams, custom_generate=prefill_once))
    return BeamSearchResult(_sequences(out), out, prefill, _memory_report(cache, probe), time.perf_counter() - start,
                            cache)


@dataclass
class SharedPrefixResult:
    """``sequences``: ``generate()``'s output ids ``[rows, prefix + longest suffix + new]`` (row ``r``:
    prefix, padding, suffix ``r``, new tokens); ``input_ids`` / ``attention_mask``: the batch it
    got; ``new_tokens``: each row's generated tokens; ``output``: what ``generate()`` returned.
    Prefix reuse: ``prompt_tokens`` = all prompt tokens of all requests, ``prefix_hit_tokens`` =
    those not computed because another request computed them (every request but the first reuses
    the prefix), ``prefix_hit_rate`` = their ratio, ``prefill_tokens`` = prompt tokens computed.
    ``memory``: as ``BeamSearchResult.memory``."""
    sequences: Tensor
    input_ids: Tensor
    attention_mask: Tensor
    new_tokens: list[list[int]]
    output: Any
    prompt_tokens: int
    prefill_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    memory: dict
    seconds: float
    cache: Any = None


def shared_prefix_batch(prefix: Sequence[int], suffixes: Sequence[Sequence[int]], pad_token_id: int = 0,
                        device=None) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)`` ``[len(suffixes), len(prefix) + longest suffix]``: row ``r`` is
    the prefix, then padding, then suffix ``r`` (so every prefix token sits at the same column and
    position, and each suffix ends at the last column). ``generate()`` takes the positions from the
    mask (padding is not counted): each row means ``prefix + suffix``."""
    width = max(len(s) for s in suffixes)
    rows = len(suffixes)
    ids = torch.full((rows, len(prefix) + width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:, :len(prefix)] = torch.tensor(list(prefix), dtype=torch.long)
    mask[:, :len(prefix)] = 1
    for r, suffix in enumerate(suffixes):
        if len(suffix):
            ids[r, -len(suffix):] = torch.tensor(list(suffix), dtype=torch.long)
            mask[r, -len(suffix):] = 1
    return ids.to(device), mask.to(device)


def generate_shared_prefix(model, prefix, suffixes, max_new_tokens: int = 32, *, tokenizer=None,
                           cache: Optional[PagedCache] = None, block_size: int = 16,
                           pad_token_id: Optional[int] = None, progress: Progress = None,
                           **generate_kwargs) -> SharedPrefixResult:
    """A batch of requests ``prefix + suffixes[r]`` (a shared system prompt, then each request's own
    tokens): the prefix is prefilled once, on one row, which every request's row forks
    (``batch_repeat_interleave``); then ``model.generate()`` on ``shared_prefix_batch(...)``
    computes only the suffixes. Keyword arguments go to ``generate()`` (``num_beams`` /
    ``num_return_sequences`` work: the prefix row is forked for every expanded row).

    ``prefix`` and each suffix: token ids, a ``[L]`` or ``[1, L]`` tensor, or text with
    ``tokenizer`` (the prefix with the tokenizer's special tokens, e.g. BOS, the suffixes without);
    ``suffixes`` may also be one text or a ``[requests, L]`` tensor. ``pad_token_id``: default the
    model's ``generation_config``'s, else the tokenizer's, else 0."""
    start = time.perf_counter()
    _check_model(model)
    name = "kvkernels.generation.generate_shared_prefix"
    prefix = _as_prompt(prefix, tokenizer, "prefix")
    if isinstance(suffixes, str):
        suffixes = [suffixes]  # one request
    elif isinstance(suffixes, Tensor) and suffixes.dim() != 2:
        raise ValueError(f"{name}: suffixes: expected a list of requests (token ids, tensors or text) or a "
                         f"[requests, length] tensor, got a tensor of shape {tuple(suffixes.shape)}")
    suffixes = [_as_prompt(s, tokenizer, f"suffixes[{r}]", special_tokens=False) for r, s in enumerate(suffixes)]
    if not prefix or not suffixes or any(len(s) == 0 for s in suffixes):
        raise ValueError(f"{name}: needs a non-empty prefix and at least one token in every suffix")
    cache = _new_cache(model, pop_cache(generate_kwargs, name, cache), block_size)
    if pad_token_id is None:
        pad_token_id = getattr(model.generation_config, "pad_token_id", None)
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = 0
    ids, mask = shared_prefix_batch(prefix, suffixes, int(pad_token_id), model.device)
    beams = int(generate_kwargs.get("num_beams") or 1)
    expand = beams if beams > 1 else int(generate_kwargs.get("num_return_sequences") or 1)
    with torch.no_grad():
        pre = torch.tensor([prefix], dtype=torch.long, device=model.device)
        model(input_ids=pre, **cache_kwargs(model.forward, cache), use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(len(suffixes) * expand)
        cache.reserve(max(len(s) for s in suffixes) + max_new_tokens)
        out, probe = _generate(model, cache, ids, mask, max_new_tokens, progress, generate_kwargs)
    seqs = _sequences(out)
    suffix_tokens = sum(len(s) for s in suffixes)
    prompt_tokens = len(suffixes) * len(prefix) + suffix_tokens
    hits = (len(suffixes) - 1) * len(prefix)
    return SharedPrefixResult(seqs, ids, mask, seqs[:, ids.shape[1]:].tolist(), out, prompt_tokens,
                              len(prefix) + suffix_tokens, hits, hits / prompt_tokens, _memory_report(cache, probe),
                              time.perf_counter() - start, cache)

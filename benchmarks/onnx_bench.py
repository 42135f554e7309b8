"""The encoder-decoder of kvkernels.onnx.seq2seq in ONNX Runtime: decode-step time and beam memory.

    PYTHONPATH=. python benchmarks/onnx_bench.py [--threads 1] [--beams 8] [--reps 30]
    (needs build-ort/libkvkernels_ort.so: make ort)

Writes benchmarks/results/onnx-<cpu>-<date>.json and .txt. Measured, all float32, one decoder step of
``--beams`` beams (one token each) after ``pos`` target tokens:

* ``ort_paged``:   the exported decoder_step graph in ORT with libkvkernels_ort.so (paged self-attention
                   cache bound in place, cross-attention K/V one shared block);
* ``torch_eager``: the same model and weights in eager PyTorch with the kvkernels torch ops;
* ``ort_contiguous``: the same weights exported with plain contiguous past K/V (standard ONNX ops only:
                   past_k/past_v [beams, H, pos, D] per layer in, present (past + new token, a Concat) out;
                   cross K/V [1, H, S, D] per layer, broadcast over beams). Its beam reorder also copies
                   every beam's past (``reorder_ms``, a numpy gather of the selected rows), which the
                   paged cache does by permuting block tables.
* ``cache size sweep``: ``ort_paged`` with the self-attention cache allocated at 64 ... 8192 blocks: a
                   step's time must not grow with the cache (the cache is written in place, never copied).
* memory: a full beam search (20 steps), bytes of the self-attention blocks the final beams hold and of
  the cross-attention K/V, against the origin document's estimate (1.4 MB per beam, 11.2 MB for 8).

Each time is the median (and the minimum) of ``--reps`` runs after a warm-up, the variants of a row
interleaved run by run; the machine's load average is recorded, as the runs share the CPU with whatever
else runs (on a loaded machine the minimum is the steadier figure).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

import kvkernels
import kvkernels.onnx as konnx
import kvkernels.onnx.seq2seq as s2s
from kvkernels.bench.machine import cpu_model, write_result

ORIGIN_PER_BEAM = 1.4e6  # bytes: the origin document's estimate (self 163 KB + cross 1.23 MB, per beam)


class ContiguousStep(nn.Module):
    """The decoder step of ``s2s.DecoderStep`` (same weights) over contiguous past K/V."""

    def __init__(self, dec: s2s.DecoderStep):
        super().__init__()
        self.dec, self.c = dec, dec.c

    def forward(self, tokens, pos, cross, past):
        c, b = self.c, tokens.shape[0]
        h, d = c.heads, c.head_dim
        x = self.dec.emb(tokens) + self.dec.pos(pos)
        present = []
        for i, layer in enumerate(self.dec.layers):
            q, k, v = layer.qkv(layer.ln1(x)).view(b, 3, h, d).unbind(1)
            pk = torch.cat([past[2 * i], k[:, :, None]], dim=2)  # [b, h, t + 1, d]
            pv = torch.cat([past[2 * i + 1], v[:, :, None]], dim=2)
            present += [pk, pv]
            a = torch.softmax(q[:, :, None] @ pk.transpose(-1, -2) * d ** -0.5, dim=-1) @ pv  # [b, h, 1, d]
            x = x + layer.o(a.reshape(b, -1))
            q = layer.cq(layer.ln2(x)).view(b, h, 1, d)
            ck, cv = cross[2 * i], cross[2 * i + 1]  # [1, h, S, d]: broadcast over the beams
            a = torch.softmax(q @ ck.transpose(-1, -2) * d ** -0.5, dim=-1) @ cv
            x = x + layer.co(a.reshape(b, -1))
            x = x + layer.ff2(F.gelu(layer.ff1(layer.ln3(x))))
        return (torch.log_softmax(self.dec.out(self.dec.ln(x)).float(), dim=-1), *present)


def timed(fns: dict, reps: int) -> dict:
    """Median and minimum of each function's time, the functions interleaved (ABCABC...): on a shared
    machine a load change then hits every variant alike instead of whichever ran at the time."""
    for fn in fns.values():
        fn()
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: {"median_ms": statistics.median(x) * 1e3, "min_ms": min(x) * 1e3} for name, x in times.items()}


def paged_state(c, beams, pos, num_blocks=None, seed=0):
    """A cache whose ``beams`` sequences hold ``pos`` tokens each (private blocks), and the next step."""
    cache = s2s.new_cache(c, beams, num_blocks)
    rng = np.random.default_rng(seed)
    seqs = [cache.add_sequence([])[0] for _ in range(beams)]
    for _ in range(pos):
        cache.append_decode(seqs, rng.integers(0, c.vocab, beams))
    tokens = rng.integers(0, c.vocab, beams)
    return cache, seqs, tokens, cache.append_decode(seqs, tokens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--beams", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = s2s.Seq2Seq(seed=0)
    c, beams = model.config, args.beams
    src = np.random.default_rng(1).integers(0, c.vocab, c.src_len)
    work = Path(tempfile.mkdtemp(prefix="kvk-onnx-bench-"))
    paths = s2s.export(model, work)
    ort_step = s2s.OrtStepper(c, paths, threads=args.threads)
    torch_step = s2s.TorchStepper(model)

    # The contiguous-past baseline, exported with standard ops only.
    memory = model.encoder(torch.as_tensor(src))
    cross = [t.detach() for t in model.cross_kv(memory)]
    cross_hsd = [t[0].permute(1, 0, 2)[None].contiguous() for t in cross]  # [1, H, S, D]
    past = [torch.randn(beams, c.heads, 3, c.head_dim) for _ in range(2 * c.layers)]
    b, t = torch.export.Dim("beams"), torch.export.Dim("past", min=1, max=c.max_tgt)
    contiguous_path = work / "contiguous_step.onnx"
    torch.onnx.export(ContiguousStep(model.decoder), (torch.zeros(beams, dtype=torch.int64),
                                                       torch.zeros(beams, dtype=torch.int64), cross_hsd, past),
                      contiguous_path, dynamo=True, dynamic_shapes=({0: b}, {0: b}, [None] * len(cross_hsd),
                                                                     [{0: b, 2: t}] * len(past)))
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    contiguous = ort.InferenceSession(str(contiguous_path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in contiguous.get_inputs()]

    rows = []
    for pos in (1, 10, 19):
        cache, _, tokens, step = paged_state(c, beams, pos)
        ort_step.start(src, cache)
        torch_cache, _, _, torch_step_args = paged_state(c, beams, pos)
        torch_step.start(src, torch_cache)
        feeds = dict(zip(names, [tokens.astype(np.int64), np.full(beams, pos, np.int64)] +
                         [x.numpy() for x in cross_hsd] +
                         [np.random.default_rng(pos).standard_normal((beams, c.heads, pos, c.head_dim),
                                                                     dtype=np.float32)
                          for _ in range(2 * c.layers)]))
        src_beam = np.random.default_rng(pos).integers(0, beams, beams)
        pasts = [feeds[n] for n in names[2 + len(cross_hsd):]]
        r = {"pos": pos, **timed({"ort_paged": lambda: ort_step.step(tokens, step),
                                  "torch_eager": lambda: torch_step.step(tokens, torch_step_args),
                                  "ort_contiguous": lambda: contiguous.run(None, feeds),
                                  "reorder": lambda: [p[src_beam] for p in pasts]}, args.reps)}
        r["ort_contiguous"]["reorder_ms"] = r.pop("reorder")["median_ms"]
        rows.append(r)

    # One stepper per cache size, timed interleaved (each binds its own cache).
    sizes = (64, 512, 4096, 8192)
    steppers, states = {}, {}
    for blocks in sizes:
        states[blocks] = paged_state(c, beams, 10, num_blocks=blocks)
        steppers[blocks] = s2s.OrtStepper(c, paths, threads=args.threads)
        steppers[blocks].start(src, states[blocks][0])
    times = timed({blocks: (lambda b=blocks: steppers[b].step(states[b][2], states[b][3])) for blocks in sizes},
                  args.reps)
    sweep = [{"num_blocks": b, "cache_bytes": states[b][0].kv.numel() * 4, **times[b]} for b in sizes]
    del steppers, states

    result = s2s.beam_search(ort_step, src, num_beams=beams)
    per_beam = (result.self_bytes + result.cross_bytes) / beams
    unshared_self = beams * -(-c.max_tgt // c.block_size) * c.block_size * c.layers * 2 * c.heads * c.head_dim * 4
    mem = {"beams": beams, "steps": c.max_tgt, "self_blocks_held": result.self_blocks,
           "self_bytes": result.self_bytes, "self_bytes_if_unshared": unshared_self,
           "cross_bytes_once": result.cross_bytes, "total_bytes": result.self_bytes + result.cross_bytes,
           "per_beam_bytes": per_beam, "origin_per_beam_bytes": ORIGIN_PER_BEAM,
           "origin_total_bytes": ORIGIN_PER_BEAM * beams, "cow_copies": result.cow_copies}

    now = datetime.datetime.now(datetime.timezone.utc)
    report = {"date": now.isoformat(timespec="seconds"), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
              "load_average": os.getloadavg(), "threads": args.threads, "torch": torch.__version__,
              "onnxruntime": ort.__version__, "kvkernels_cpu_isa": kvkernels.cpu_isa(),
              "platform": platform.platform(), "config": vars(c) if hasattr(c, "__dict__") else str(c),
              "beams": beams, "reps": args.reps, "decode_step": rows, "cache_size_sweep": sweep, "memory": mem}
    lines = [f"kvkernels.onnx.seq2seq decode step, {beams} beams, float32, {args.threads} thread(s); "
             f"{cpu_model()}; torch {torch.__version__}, onnxruntime {ort.__version__}; {report['date']}; "
             f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
             "", "pos  ort_paged ms  torch_eager ms  ort_contiguous ms (+ reorder copy ms)   [median / min]"]
    for r in rows:
        lines.append(f"{r['pos']:>3}  {r['ort_paged']['median_ms']:6.2f} / {r['ort_paged']['min_ms']:5.2f}"
                     f"   {r['torch_eager']['median_ms']:6.2f} / {r['torch_eager']['min_ms']:5.2f}"
                     f"   {r['ort_contiguous']['median_ms']:6.2f} / {r['ort_contiguous']['min_ms']:5.2f}"
                     f" (+ {r['ort_contiguous']['reorder_ms']:.3f})")
    lines += ["", "ort_paged step vs self-attention cache size (pos 10):"]
    for s in sweep:
        lines.append(f"  {s['num_blocks']:>5} blocks ({s['cache_bytes'] / 2**20:7.1f} MiB): "
                     f"{s['median_ms']:6.2f} ms median, {s['min_ms']:6.2f} ms min")
    lines += ["", f"memory after a {c.max_tgt}-step search of {beams} beams:",
              f"  self-attention: {result.self_blocks} blocks held = {mem['self_bytes'] / 1e3:.1f} KB "
              f"(every beam private, whole blocks: {unshared_self / 1e3:.1f} KB); copy-on-write copies "
              f"{result.cow_copies}",
              f"  cross-attention: {mem['cross_bytes_once'] / 1e6:.3f} MB, once for all beams",
              f"  total {mem['total_bytes'] / 1e6:.3f} MB = {per_beam / 1e6:.3f} MB per beam; origin estimate "
              f"{ORIGIN_PER_BEAM / 1e6:.1f} MB per beam, {ORIGIN_PER_BEAM * beams / 1e6:.1f} MB for {beams}"]
    text = "\n".join(lines)
    print(text)
    write_result(args.out, "onnx", report, text, when=now)


if __name__ == "__main__":
    main()

"""``python -m kvkernels bench``: options, the list of cases, the progress line, and the outputs."""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TextIO

import torch

import kvkernels
from kvkernels.bench import attention, cache_ops, machine, report
from kvkernels.bench.core import DTYPES, GIB, CaseResult, Settings, finalize
CASE_GROUPS = ("decode", "prefill", "copy", "extra", "swap")  # swap: CUDA only (host <-> device)


@dataclass(frozen=True)
class Shapes:
    batches: tuple
    contexts: tuple
    prefill: tuple  # (query chunk, context)
    copy: tuple  # (layers, blocks, pairs)
    reshape_tokens: int
    gather: tuple  # (batch, context)
    merge_tokens: int
    mla: tuple  # (batch, context)
    cascade: tuple  # (beams, shared prompt tokens, own tokens per beam)
    bandwidth_bytes: Optional[int]  # None: max(4 x LLC, 1 GiB)
    min_time: float


FULL = Shapes((1, 8, 32), (512, 4096, 16384), (512, 4096), (32, 2048, 256), 4096, (8, 4096), 8192, (8, 4096),
              (8, 4096, 40), None, 0.5)
QUICK = Shapes((1, 2), (64, 256), (64, 256), (4, 64, 16), 256, (2, 256), 512, (2, 256), (2, 64, 8), 64 << 20,
               0.01)

Job = tuple[str, Callable[[Settings, torch.Generator], CaseResult]]


def _csv(convert: Callable[[str], object], allowed: Optional[tuple] = None) -> Callable[[str], list]:
    def parse(text: str) -> list:
        items = [convert(item) for item in text.split(",") if item]
        bad = [item for item in items if allowed is not None and item not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list"
                                             + (f" of {','.join(allowed)}" if allowed else ""))
        return items
    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvkernels bench",
                                description="CPU benchmark of the kvkernels ops against PyTorch baselines, "
                                            "with memory bandwidth measured in the same run "
                                            "(details: benchmarks/README.md).")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default) or cuda: the CUDA kernels against torch on the GPU, timed with CUDA "
                        "events, bandwidth measured on the device (kvkernels/bench/cuda.py)")
    p.add_argument("--suite", choices=("kernels", "cache", "generate"), default="kernels",
                   help="kernels: the ops against PyTorch (default); cache: the Python cache manager "
                        "(fork, beam memory, prefix hits, decode-step overhead); generate: transformers "
                        "generate() tokens/s on PagedCache vs DynamicCache + SDPA (greedy, 8 beams); "
                        "see benchmarks/README.md")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, no layer rotation, 64 MiB bandwidth buffers, min-time 0.01: a smoke test, "
                        "not a measurement (its outputs say so, and go to a temporary directory unless --out)")
    p.add_argument("--cases", type=_csv(str, CASE_GROUPS), default=list(CASE_GROUPS),
                   help="comma-separated subset of: " + ",".join(CASE_GROUPS) + " (swap: --device cuda only)")
    p.add_argument("--dtypes", type=_csv(str, tuple(DTYPES)), default=list(DTYPES),
                   help="decode cache dtypes (default: all of " + ",".join(DTYPES) + ")")
    p.add_argument("--batches", type=_csv(int), help="decode batch sizes (default 1,8,32; quick 1,2)")
    p.add_argument("--contexts", type=_csv(int), help="decode context lengths (default 512,4096,16384)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for the JSON and PNG / text (default: ./benchmarks/results; with --quick a new "
                        "temporary directory: a smoke run is not a measurement)")
    p.add_argument("--min-time", type=float, help="seconds of timed calls per measurement (default 0.5)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: all)")
    p.add_argument("--no-baselines", action="store_true", help="time kvkernels only")
    p.add_argument("--max-baseline-seconds", type=float, default=3.0,
                   help="a baseline whose call takes (or is predicted to take) longer is timed once or "
                        "skipped, with the reason recorded (default 3)")
    p.add_argument("--max-memory-gib", type=float, default=None,
                   help="memory one case may hold, baselines included (default 16 on the CPU; on CUDA 85%% of "
                        "the device memory free at the start)")
    p.add_argument("--reps", type=int, help="generate suite: timed runs per implementation (default 3; quick 1)")
    p.add_argument("--flush-denormal", action="store_true",
                   help="generate suite: torch.set_flush_denormal(True) for every implementation (the CPU "
                        "paged_attention kernel slows down when exp() underflows into denormals)")
    p.add_argument("--generate-cases", type=_csv(str, ("greedy", "beam")), default=["greedy", "beam"],
                   help="generate suite: comma-separated subset of greedy,beam")
    p.add_argument("--isa", choices=("avx512amx", "avx512bf16", "avx512vbmi", "avx512", "avx2", "portable"),
                   help="sets KVKERNELS_CPU_ISA for the kernels' runtime dispatch")
    return p.parse_args(argv)


def plan(args: argparse.Namespace, shapes: Shapes) -> list[Job]:
    """Every case of the run, in order, as (progress label, function of (settings, generator)
    that builds and times it)."""
    jobs: list[Job] = []
    if "decode" in args.cases:
        for name in args.dtypes:
            for batch in args.batches or shapes.batches:
                for context in args.contexts or shapes.contexts:
                    jobs.append((f"decode {name} b{batch} ctx{context}", functools.partial(
                        attention.decode_case, name, DTYPES[name], batch, context)))
    if "prefill" in args.cases:
        for name in ("float32", "bfloat16"):
            jobs.append((f"prefill {name}", functools.partial(
                attention.prefill_case, name, DTYPES[name], *shapes.prefill)))
    if "copy" in args.cases:
        for name in ("bfloat16", "float32"):
            jobs.append((f"copy_blocks {name}", functools.partial(
                cache_ops.copy_blocks_case, name, DTYPES[name], *shapes.copy)))
    if "extra" in args.cases:
        for name in ("bfloat16", "fp8_e4m3"):
            jobs.append((f"reshape_and_cache {name}", functools.partial(
                cache_ops.reshape_and_cache_case, name, DTYPES[name], shapes.reshape_tokens)))
        jobs.append(("gather_kv", functools.partial(cache_ops.gather_kv_case, *shapes.gather)))
        jobs.append(("merge_attention_states", functools.partial(cache_ops.merge_case,
                                                                 shapes.merge_tokens)))
        jobs.append(("mla_paged_attention", functools.partial(attention.mla_case, *shapes.mla)))
        for name in ("bfloat16", "float32"):
            jobs.append((f"cascade_decode {name}", functools.partial(attention.cascade_case, name, DTYPES[name],
                                                                     *shapes.cascade)))
    return jobs


class Progress:
    """One status line on stderr (done/total, current case and implementation, elapsed time),
    redrawn in place on a terminal; on a pipe or log file, one plain line per case."""

    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.live = stream.isatty()
        self.start = time.perf_counter()
        self.case = ""

    def _elapsed(self) -> str:
        return str(datetime.timedelta(seconds=int(time.perf_counter() - self.start)))

    def _draw(self, label: str) -> None:
        filled = 20 * self.done // self.total
        line = f"[{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} {self._elapsed()}  {label}"
        width = shutil.get_terminal_size().columns - 1
        self.stream.write("\r" + line[:width].ljust(width))
        self.stream.flush()

    def begin(self, case: str) -> None:
        self.case = case
        if self.live:
            self._draw(case)
        else:
            print(f"[{self.done + 1}/{self.total}] {case} (elapsed {self._elapsed()})", file=self.stream,
                  flush=True)

    def step(self, impl: str) -> None:
        if self.live:
            self._draw(f"{self.case}: {impl}")

    def end(self) -> None:
        self.done += 1

    def close(self) -> None:
        if self.live:
            self._draw("done")
            self.stream.write("\n")
        else:
            print(f"[{self.total}/{self.total}] done in {self._elapsed()}", file=self.stream, flush=True)


def run_cases(args: argparse.Namespace, shapes: Shapes, settings: Settings, llc: int) -> tuple[dict, list]:
    """Measure the bandwidth, then every case, with the progress line on stderr."""
    jobs = plan(args, shapes)
    progress = Progress(1 + len(jobs))
    settings.step = progress.step
    progress.begin("memory bandwidth")
    bandwidth = machine.measure_bandwidth(shapes.bandwidth_bytes or max(4 * llc, GIB), settings.min_time)
    progress.end()
    cases = []
    for label, job in jobs:
        progress.begin(label)
        case = job(settings, torch.Generator().manual_seed(0))
        finalize(case, bandwidth)
        cases.append(case)
        progress.end()
    progress.close()
    return bandwidth, cases


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.suite == "cache":
        from kvkernels.bench import cache_manager
        return cache_manager.run(args, argv)
    if args.suite == "generate":
        from kvkernels.bench import generate
        return generate.run(args, argv)
    if args.device == "cuda":
        from kvkernels.bench import cuda
        return cuda.run(args, argv)
    started = datetime.datetime.now().astimezone()
    if args.isa:
        os.environ["KVKERNELS_CPU_ISA"] = args.isa  # read by the kernels on each call
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = QUICK if args.quick else FULL
    llc = machine.llc_bytes()
    settings = Settings(min_time=shapes.min_time if args.min_time is None else args.min_time,
                        rotate_bytes=0 if args.quick else 2 * (llc or machine.LLC_FALLBACK),
                        memory_budget=int((16.0 if args.max_memory_gib is None else args.max_memory_gib) * GIB),
                        baselines=not args.no_baselines,
                        max_baseline_seconds=args.max_baseline_seconds)
    bandwidth, cases = run_cases(args, shapes, settings, llc or machine.LLC_FALLBACK)

    info = machine.machine_info(llc)
    header = {
        "machine": info, "torch_version": torch.__version__, "kvkernels_version": kvkernels.__version__,
        "python_version": platform.python_version(), "date": started.isoformat(timespec="seconds"),
        "command_line": shlex.join([sys.executable, *sys.argv]), "bench_args": argv,
        "settings": {"quick": args.quick, "min_time_s": settings.min_time, "rotate_bytes": settings.rotate_bytes,
                     "memory_budget_bytes": settings.memory_budget, "baselines": settings.baselines,
                     "max_baseline_seconds": settings.max_baseline_seconds},
    }
    title = (f"kvkernels {kvkernels.__version__} on {info['cpu_model']}, {info['threads']} threads, "
             f"ISA {info['kvkernels_cpu_isa']}")
    if args.quick:
        header["note"] = report.SMOKE_NOTE
        title = f"{report.SMOKE_BANNER}\n{title}"
    stem = report.output_dir(args) / f"cpu-{machine.slug(info['cpu_model'])}-{started:%Y%m%d-%H%M%S}"
    json_path, png_path = stem.with_suffix(".json"), stem.with_suffix(".png")
    report.write_json(json_path, header, bandwidth, cases)
    no_png = report.write_plot(png_path, cases, bandwidth, title)
    if no_png is not None:
        print(f"no PNG written: {no_png}", file=sys.stderr)
    table = report.format_table(cases, bandwidth, f"JSON: {json_path}\n"
                                + (f"PNG: {png_path}" if no_png is None else f"PNG: not written ({no_png})"))
    print(f"{report.SMOKE_BANNER}\n{table}\n{report.SMOKE_BANNER}" if args.quick else table)
    failed = any(r.checked is False for case in cases for r in case.impls.values())
    return 1 if failed else 0

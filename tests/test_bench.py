"""``python -m kvkernels bench`` end to end on tiny shapes (--quick), in-process: exit code, the JSON
record's fields and numbers, the baseline time limit, and the PNG; a --quick run says it is a smoke
run in every output and, without --out, writes to a temporary directory."""

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch  # noqa: F401  (libtorch before the kvkernels extension)

from kvkernels import bench
from kvkernels.bench import report

SMOKE = "quick smoke run — not a measurement"

QUICK = ["--quick", "--dtypes", "bfloat16,fp8_e4m3"]
KINDS = {"decode", "prefill", "copy_blocks", "reshape_and_cache", "gather_kv", "merge", "mla_decode", "cascade_decode"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = bench.main([*QUICK, "--out", str(out)])
    (json_path,) = out.glob("cpu-*.json")
    return code, out, json.loads(json_path.read_text())


def test_quick_run_writes_a_complete_record(quick_run):
    code, _, record = quick_run
    assert code == 0
    machine = record["machine"]
    for key in ("cpu_model", "cores", "threads", "llc_bytes", "kvkernels_cpu_isa"):
        assert machine[key] not in (None, ""), key
    for key in ("torch_version", "kvkernels_version", "python_version", "date", "command_line"):
        assert record[key], key
    assert record["note"] == SMOKE and record["settings"]["quick"] is True
    assert record["bandwidth_gbps"]["read"] > 0 and record["bandwidth_gbps"]["copy"] > 0
    cases = record["cases"]
    assert {case["kind"] for case in cases} == KINDS
    assert {case["dtype"] for case in cases if case["kind"] == "decode"} == {"bfloat16", "fp8_e4m3"}
    for case in cases:
        assert case["bytes"] > 0, case["name"]
        if case["kind"] == "decode":
            assert set(case["impls"]) == {"kvkernels", "gather+sdpa", "sdpa-contiguous"}
        timed = {name: r for name, r in case["impls"].items() if r["skipped"] is None}
        assert "kvkernels" in timed and len(timed) >= 2, case["name"]
        for name, r in timed.items():
            where = f"{case['name']} / {name}"
            assert 0 < r["min_s"] <= r["median_s"] and r["reps"] >= 3 and r["layers"] == 1, where
            assert r["checked"] is True and r["max_abs_diff"] <= r["tolerance"], where
            if case["bandwidth_ref"] is not None:
                assert r["gbps"] > 0 and r["fraction"] > 0, where
            if case["flops"] is not None:
                assert r["tflops"] > 0, where
        ours = timed["kvkernels"]
        assert set(ours["speedup_vs"]) == set(timed) - {"kvkernels"}
        assert all(ratio > 0 for ratio in ours["speedup_vs"].values())


def test_quick_run_writes_a_png(quick_run):
    pytest.importorskip("matplotlib")
    _, out, _ = quick_run
    (png,) = out.glob("cpu-*.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image  # matplotlib's own dependency
    with Image.open(png) as image:
        title = image.text["Title"]  # the figure's title, also stored in the PNG's metadata
    assert title.startswith(f"*** {SMOKE}") and "kvkernels" in title


def test_slow_baselines_are_cut_short_or_skipped_with_a_reason(tmp_path, capsys):
    # A 0 s limit: the first case's baselines run one call only; later cases predict from it and skip.
    code = bench.main(["--quick", "--cases", "decode", "--dtypes", "bfloat16", "--max-baseline-seconds", "0",
                       "--out", str(tmp_path)])
    assert code == 0
    (json_path,) = tmp_path.glob("cpu-*.json")
    first, *rest = json.loads(json_path.read_text())["cases"]
    for name in ("gather+sdpa", "sdpa-contiguous"):
        assert first["impls"][name]["reps"] == 1 and "1 call only" in first["impls"][name]["note"]
        for case in rest:
            assert case["impls"][name]["skipped"].startswith("predicted"), case["name"]
    assert all(case["impls"]["kvkernels"]["checked"] for case in rest)  # kvkernels has no limit
    out = capsys.readouterr().out
    assert "skipped (predicted" in out
    assert out.startswith(report.SMOKE_BANNER) and out.rstrip().endswith(report.SMOKE_BANNER)


def test_quick_runs_write_to_a_temporary_directory_full_runs_to_benchmarks_results(tmp_path, monkeypatch):
    from kvkernels.bench import cli
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert report.output_dir(cli.parse_args(["--out", "here"])) == Path("here") and Path("here").is_dir()
    assert report.output_dir(cli.parse_args([])) == Path("benchmarks/results")
    quick = report.output_dir(cli.parse_args(["--quick"]))
    assert quick.is_dir() and not list(quick.iterdir())
    assert quick.parent == tmp_path / "tmp" and quick.name.startswith("kvkernels-bench-quick-")
    assert report.output_dir(cli.parse_args(["--quick"])) != quick  # a new one per run


def test_cache_suite_quick_run_writes_json_and_text(tmp_path, monkeypatch, capsys):
    # No --out: a quick run goes to a new temporary directory, not to ./benchmarks/results.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    code = bench.main(["--suite", "cache", "--quick"])
    assert code == 0
    assert not (tmp_path / "benchmarks").exists()
    (json_path,) = tmp_path.glob("tmp/kvkernels-bench-quick-*/cache-*.json")
    (txt_path,) = tmp_path.glob("tmp/kvkernels-bench-quick-*/cache-*.txt")
    out = capsys.readouterr().out
    assert out.startswith(report.SMOKE_BANNER) and f"JSON: {json_path}" in out
    assert txt_path.read_text().startswith(report.SMOKE_BANNER)
    record = json.loads(json_path.read_text())
    assert record["note"] == SMOKE
    for key in ("machine", "torch_version", "date", "command_line", "fork", "beams", "prefix", "decode"):
        assert record[key], key
    assert all(row["fork_kv_bytes_copied"] == 0 and row["fork_us"] > 0 for row in record["fork"]["rows"])
    assert all(row["first_write_copy_bytes"] > 0 for row in record["fork"]["rows"])  # the partial block
    assert record["beams"]["ratio_allocated"] < 0.2 and record["beams_unaligned"]["cow_copies"] == 15
    assert 0 < record["prefix"]["hit_rate"] < 1
    assert all(run["median_us_per_seq"] > 0 for run in record["decode"]["runs"])
    assert "decode-step overhead" in txt_path.read_text()
    m = record["mla_memory"]  # 2 layers x 512 tokens, sparse above 256: half the blocks kept
    assert m["latent_bytes"] == 512 * m["latent_bytes_per_token"] and m["sparse_bytes"] == m["latent_bytes"] // 2
    assert m["standard_bytes_per_token"] * 576 == m["latent_bytes_per_token"] * 16 * 320  # 16 heads x (192 + 128)
    assert "MLA latent cache" in txt_path.read_text()


def test_cuda_suite_dry_run_on_the_cpu(tmp_path):
    """The CUDA benchmark's cases, checks and records, run on CPU tensors with --quick shapes (its GPU
    timing and pinned-memory cases need a GPU: those are recorded as skipped here)."""
    from kvkernels.bench import cli, cuda
    argv = ["--device", "cuda", "--quick", "--out", str(tmp_path)]
    code = cuda.run(cli.parse_args(argv), argv, device=torch.device("cpu"))
    assert code == 0
    (json_path,) = tmp_path.glob("cuda-*.json")
    (txt_path,) = tmp_path.glob("cuda-*.txt")
    record = json.loads(json_path.read_text())
    for key in ("machine", "torch_version", "date", "command_line", "bandwidth_gbps", "cases"):
        assert record[key], key
    assert "cuda_version" in record and record["note"] == SMOKE
    assert txt_path.read_text().startswith(report.SMOKE_BANNER)
    kinds = {case["kind"] for case in record["cases"]}
    assert {"copy_blocks", "reshape_and_cache", "gather_kv", "merge", "swap_blocks", "decode", "prefill"} <= kinds
    for case in record["cases"]:
        ours = case["impls"]["kvkernels"]
        if case["kind"] in ("copy_blocks", "reshape_and_cache", "gather_kv", "merge"):
            assert ours["checked"] is True and ours["gbps"] > 0, case["name"]
        else:  # needs a GPU, or the attention cases of cuda_attention.py
            assert ours["skipped"], case["name"]
    assert "copy_blocks" in txt_path.read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_suite_without_a_gpu_says_so(capsys):
    assert bench.main(["--device", "cuda", "--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_generate_suite_quick_run_writes_json_and_text(tmp_path):
    pytest.importorskip("transformers")
    code = bench.main(["--suite", "generate", "--quick", "--out", str(tmp_path)])
    assert code == 0
    (json_path,) = tmp_path.glob("generate-*.json")
    (txt_path,) = tmp_path.glob("generate-*.txt")
    record = json.loads(json_path.read_text())
    for key in ("machine", "torch_version", "transformers_version", "date", "command_line", "model", "dtype"):
        assert record[key], key
    assert record["note"] == SMOKE and txt_path.read_text().startswith(report.SMOKE_BANNER)
    cases = {case["name"]: case for case in record["cases"]}
    assert set(cases) == {"greedy", "beam"}
    assert set(cases["beam"]["impls"]) == {"stock", "kvkernels", "stock prefill-once", "kvkernels prefill-once"}
    for case in cases.values():
        for name, e in case["impls"].items():
            assert e["tokens_identical_to_stock"] and e["tokens_per_s"] > 0 and e["median_decode_s"] > 0, name
            assert e["breakdown_s"]["decode: total"] > 0 and e["peak_kv_bytes"] > 0, name
            if not name.startswith("stock"):  # attention on the paged storage: no gather, no torch.cat
                assert e["copies"]["gather_kv_calls"] == 0 and e["copies"]["stock_cat_calls"] == 0, name
    beam = cases["beam"]["impls"]
    forwards = cases["beam"]["new_tokens"]
    # stock: every layer's K/V rewritten by torch.cat and by the reorder's index_select at every step;
    # kvkernels: block tables permuted, KV copied only as copy-on-write of shared partial blocks
    assert beam["stock"]["copies"]["stock_reorder_calls"] > 0 and beam["stock"]["copies"]["stock_cat_calls"] > 0
    assert beam["kvkernels"]["copies"]["stock_reorder_calls"] == 0
    assert beam["kvkernels"]["copies"]["table_reorders"] >= forwards - 1
    assert beam["kvkernels"]["copies"]["copy_blocks_bytes"] < beam["stock"]["copies"]["stock_reorder_bytes"]
    assert "targets:" in txt_path.read_text()


def test_cuda_attention_decode_variants_options_and_report(capsys, monkeypatch):
    """kvkernels.bench.cuda_attention --decode-variants (the GPU script's b_variants step): the names are
    checked when parsed; the environment variable each variant's batches run under is restored after them;
    the report gives each variant's targets and their comparison from rows (synthetic here: timing needs a
    GPU); without a GPU the run says so."""
    import argparse

    from kvkernels.bench import cuda_attention as ca

    parser = argparse.ArgumentParser()
    ca.add_arguments(parser)
    assert parser.parse_args(["--decode-variants", "wide,deep"]).decode_variants == ["wide", "deep"]
    assert parser.parse_args(["--decode-variants", "deep,deep-s1,wide-s33"]).decode_variants == [
        "deep", "deep-s1", "wide-s33"]
    assert parser.parse_args(["--decode-variants", "wide,fp8smem"]).decode_variants == ["wide", "fp8smem"]
    graphed = parser.parse_args(["--decode-variants", "wide,occ3,occ3-s1,fused,persistent", "--graph"])
    assert graphed.decode_variants == ["wide", "occ3", "occ3-s1", "fused", "persistent"] and graphed.graph
    assert ca.DECODE_VARIANTS["persistent"] == "mma-decode-persistent"
    assert not parser.parse_args([]).graph
    assert parser.parse_args(["--prefill-variants", "wide,deep,tall"]).prefill_variants == ["wide", "deep", "tall"]
    assert parser.parse_args([]).decode_variants == []
    for bad in ("wide,wdie", "deep,deep", "deep-s0", "deep-s", "deep-sx", "deep-s1,deep-s1", "s1", "tall"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--decode-variants", bad])
    with pytest.raises(SystemExit):  # a decode-only name
        parser.parse_args(["--prefill-variants", "wide,fp8smem"])
    capsys.readouterr()

    # A -s<N> variant runs with the split count forced, a plain one with the planner's (the variable unset
    # inside, whatever it was outside); both restored after.
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", "7")
    with ca.variant_env("deep-s3", ca.DECODE_VARIANTS):
        assert ca.os.environ["KVKERNELS_CUDA_ATTN_SPLITS"] == "3"
        assert ca.os.environ["KVKERNELS_CUDA_ATTN_PATH"] == "mma-decode-deep"
    with ca.variant_env("fp8smem", ca.DECODE_VARIANTS):
        assert ca.os.environ["KVKERNELS_CUDA_ATTN_PATH"] == "mma-decode-fp8-smem"
    with ca.variant_env("occ3-s1", ca.DECODE_VARIANTS):
        assert ca.os.environ["KVKERNELS_CUDA_ATTN_PATH"] == "mma-decode-occ3"
        assert ca.os.environ["KVKERNELS_CUDA_ATTN_SPLITS"] == "1"
    with ca.variant_env("fused", ca.DECODE_VARIANTS):
        assert ca.os.environ["KVKERNELS_CUDA_ATTN_PATH"] == "mma-decode-fused"
    with ca.variant_env("wide", ca.DECODE_VARIANTS):
        assert "KVKERNELS_CUDA_ATTN_SPLITS" not in ca.os.environ
        assert ca.os.environ["KVKERNELS_CUDA_ATTN_PATH"] == "mma-decode-wide"
    assert ca.os.environ["KVKERNELS_CUDA_ATTN_SPLITS"] == "7" and "KVKERNELS_CUDA_ATTN_PATH" not in ca.os.environ
    monkeypatch.delenv("KVKERNELS_CUDA_ATTN_SPLITS")
    assert ca.variant_setting("deep-s3", ca.DECODE_VARIANTS) == (
        "KVKERNELS_CUDA_ATTN_PATH=mma-decode-deep KVKERNELS_CUDA_ATTN_SPLITS=3")

    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", "simt")
    with ca.attn_path_env("mma-decode-wide"):
        assert ca.os.environ["KVKERNELS_CUDA_ATTN_PATH"] == "mma-decode-wide"
    assert ca.os.environ["KVKERNELS_CUDA_ATTN_PATH"] == "simt"
    monkeypatch.delenv("KVKERNELS_CUDA_ATTN_PATH")
    with ca.attn_path_env("mma-decode-deep"):
        pass
    assert "KVKERNELS_CUDA_ATTN_PATH" not in ca.os.environ

    def row(case, dtype, impl, ms, frac, checked=True):
        return dict(case=case, kind="decode", dtype=dtype, impl=impl, ms=ms, fraction_of_copy_bw=frac,
                    checked=checked, speedup_vs={}, skipped=None)

    b, f = "decode bfloat16 b64 ctx4096", "decode fp8_e4m3 b64 ctx4096"
    rows = [row(b, "bfloat16", "kvkernels-wide", 0.6, 0.4), row(b, "bfloat16", "kvkernels-deep", 0.3, 0.8),
            row(f, "fp8_e4m3", "kvkernels-wide", 0.6, 0.2), row(f, "fp8_e4m3", "kvkernels-deep", 0.15, 0.8, False)]
    deep = ca.targets(rows, "kvkernels-deep")
    assert deep[0] == f"{b}: 0.80 of copy bandwidth (target 0.9)"
    assert deep[1] == "decode bfloat16 b1 ctx32768: missing of copy bandwidth (target 0.9)"
    assert deep[2] == f"{f}: fp8 2.00x bfloat16 (target 1.8)"
    assert ca.targets(rows, "kvkernels-wide")[2] == f"{f}: fp8 1.00x bfloat16 (target 1.8)"
    # each decode target says how its row was timed (eager calls carry ~40 us of host time)
    rows[1]["timing"], rows[3]["timing"] = "CUDA graph of 3 calls, replayed", "eager"
    deep = ca.targets(rows, "kvkernels-deep")
    assert deep[0].endswith("(target 0.9) [graph]") and deep[2].endswith("(target 1.8) [eager]")
    lines = ca.variant_lines(rows, ["wide", "deep"])
    assert lines == [f"{b}: wide 0.6000 ms (0.40 of copy), deep 0.3000 ms (0.80 of copy) = 2.00x wide",
                     f"{f}: wide 0.6000 ms (0.20 of copy), deep 0.1500 ms (0.80 of copy) = 4.00x wide MISMATCH"]
    rows[0]["ms"], rows[0]["skipped"] = None, "RuntimeError: boom"
    assert ca.variant_lines(rows, ["wide", "deep"])[0] == (
        f"{b}: wide skipped: RuntimeError: boom, deep 0.3000 ms (0.80 of copy)")

    if not torch.cuda.is_available():
        assert ca.main(["--decode-variants", "wide,deep", "--attn-shapes", "64x4096", "--no-baselines"]) == 0
        assert "no CUDA device" in capsys.readouterr().out


def test_cuda_attention_graph_timing_of_any_row(monkeypatch):
    """--graph times every decode row (ours and the peers) as a replayed CUDA graph of its rotation of data
    copies, per call; a row whose capture fails is timed eager and says why; an implementation that fails
    its call is skipped (timing replaced by fakes: no GPU here)."""
    from kvkernels.bench import cuda_attention as ca

    monkeypatch.setattr(ca.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(ca.torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(ca, "time_cuda", lambda call, reps, min_ms: float(call(7)))
    captured = []

    def graph_of(call, copies):
        captured.append(copies)
        return lambda i: 12.0  # one replay = `copies` calls

    monkeypatch.setattr(ca, "graph_of", graph_of)
    check = lambda out: (0.0, 1.0)  # noqa: E731
    row = ca._row("decode bfloat16 b1 ctx32768", "decode", "bfloat16", 1, 32768, "x")
    ca.attempt(row, lambda i: 5.0, 3, 1.0, check, graph_copies=4)
    assert captured == [4] and row["ms"] == 3.0 and row["timing"] == "CUDA graph of 4 calls, replayed"
    assert ca.targets([dict(row, fraction_of_copy_bw=0.95)], "x")[1].endswith("(target 0.9) [graph]")

    def no_capture(call, copies):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(ca, "graph_of", no_capture)
    row = ca._row("decode bfloat16 b1 ctx32768", "decode", "bfloat16", 1, 32768, "x")
    ca.attempt(row, lambda i: 5.0, 3, 1.0, check, graph_copies=4)
    assert row["ms"] == 5.0 and row["timing"].startswith("eager: CUDA graph capture failed (RuntimeError: operation")
    row = ca._row("decode bfloat16 b1 ctx32768", "decode", "bfloat16", 1, 32768, "x")
    ca.attempt(row, lambda i: 5.0, 3, 1.0, check)
    assert row["ms"] == 5.0 and row["timing"] == "eager"

    def broken(i):
        raise ValueError("bad call")

    row = ca._row("decode bfloat16 b1 ctx32768", "decode", "bfloat16", 1, 32768, "x")
    ca.attempt(row, broken, 3, 1.0, check, graph_copies=4)
    assert row["skipped"].startswith("ValueError: bad call") and not row["ms"]


def test_cuda_attention_peer_rows_and_lines(monkeypatch):
    """The peers of the CUDA attention benchmark: FlashInfer's rows (kvkernels.bench.flashinfer_peer) are
    skipped rows naming the reason where FlashInfer cannot be imported (this machine: not installed) or a call
    cannot be planned, never missing rows; ``peer_lines`` gives our fastest row against each peer, from
    synthetic rows (timing needs a GPU)."""
    import argparse
    import builtins

    from kvkernels.bench import cuda_attention as ca
    from kvkernels.bench import flashinfer_peer as fi

    parser = argparse.ArgumentParser()
    ca.add_arguments(parser)
    assert parser.parse_args(["--no-flashinfer"]).no_flashinfer and not parser.parse_args([]).no_flashinfer

    real_import = builtins.__import__

    def no_flashinfer(name, *args, **kwargs):
        if name == "flashinfer" or name.startswith("flashinfer."):
            raise ModuleNotFoundError("No module named 'flashinfer'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flashinfer)
    monkeypatch.setattr(ca.torch.cuda, "get_device_name", lambda *a: "test device")
    made = []
    rows = ca.flashinfer_rows("decode bfloat16 b1 ctx32768", "decode", "bfloat16", 1, 32768, None, None,
                              lambda module, tc: made.append(tc))
    assert [r["impl"] for r in rows] == ["flashinfer-paged", "flashinfer-paged-cuda-cores"] and not made
    assert all(r["ms"] is None and "FlashInfer not importable (ModuleNotFoundError" in r["skipped"] and
               "flashinfer_bundle.sh" in r["skipped"] for r in rows)
    monkeypatch.setattr(builtins, "__import__", real_import)

    # importable, but the call cannot be built (e.g. a module missing from the bundle): skipped, with the error
    monkeypatch.setattr(fi, "import_error", lambda: None)
    monkeypatch.setattr(fi, "version", lambda: "9.9")
    monkeypatch.setattr(ca.torch.cuda, "synchronize", lambda *a: None)

    def unplannable(module, tensor_cores):
        raise RuntimeError("MissingJITCacheError: batch_prefill_fa3 not in the cache")

    rows = ca.flashinfer_rows("prefill bfloat16 q4096 ctx4096", "prefill", "bfloat16", 1, 4096, None, None,
                              unplannable)
    assert [r["impl"] for r in rows] == ["flashinfer-fa3-paged"]
    assert rows[0]["skipped"] == "RuntimeError: MissingJITCacheError: batch_prefill_fa3 not in the cache"
    assert "flashinfer 9.9" in rows[0]["note"]

    def row(case, impl, ms, skipped=None):
        return dict(case=case, kind="decode", dtype="bfloat16", impl=impl, ms=ms, skipped=skipped)

    c = "decode bfloat16 b1 ctx32768"
    lines = ca.peer_lines([row(c, "kvkernels-wide", 0.05), row(c, "kvkernels-deep", 0.04),
                           row(c, "sdpa-flash-contiguous", 0.052), row(c, "flashinfer-paged", 0.02),
                           row(c, "flex-paged", None, "InductorError: no"), row("decode x", "kvkernels", 1.0)])
    assert lines == [f"{c}: kvkernels-deep 0.0400 ms; sdpa-flash-contiguous 0.0520 ms (ours 1.30x faster), "
                     "flashinfer-paged 0.0200 ms (ours 0.50x faster), flex-paged skipped (InductorError: no)"]


def test_cuda_attention_prefill_variants_options_and_report(capsys):
    """kvkernels.bench.cuda_attention --prefill-variants / --attn-prefill-dtypes (the GPU script's b_pvariants
    step): names checked when parsed; each prefill variant's target line and the A/B line against each other
    and SDPA flash, from synthetic rows (timing needs a GPU); without a GPU the run says so."""
    import argparse

    from kvkernels.bench import cuda_attention as ca

    parser = argparse.ArgumentParser()
    ca.add_arguments(parser)
    args = parser.parse_args(["--prefill-variants", "wide,deep", "--attn-prefill-dtypes", "bfloat16,fp8_e4m3"])
    assert args.prefill_variants == ["wide", "deep"] and args.attn_prefill_dtypes == ["bfloat16", "fp8_e4m3"]
    assert parser.parse_args([]).prefill_variants == [] and parser.parse_args([]).attn_prefill_dtypes == ["bfloat16"]
    for option, bad in (("--prefill-variants", "wide,wdie"), ("--prefill-variants", "deep,deep"),
                        ("--attn-prefill-dtypes", "fp8_e5m2"), ("--attn-prefill-dtypes", "")):
        with pytest.raises(SystemExit):
            parser.parse_args([option, bad])
    capsys.readouterr()
    assert ca.PREFILL_VARIANTS == {"deep": "mma-prefill-deep", "wide": "mma-prefill-wide", "tall": "mma-prefill-tall",
                                   "wgmma": "wgmma-prefill", "wgmma-overlap": "wgmma-prefill-overlap",
                                   "wgmma-gather": "wgmma-prefill", "wgmma-overlap-gather": "wgmma-prefill-overlap",
                                   "wgmma-persistent": "wgmma-prefill-persistent"}
    assert parser.parse_args(["--prefill-variants", "wide,wgmma"]).prefill_variants == ["wide", "wgmma"]
    # --attn-block-size (b_wgmma's TMA A/B at block 64): the block sizes the wgmma prefill's TMA boxes take
    assert parser.parse_args([]).attn_block_size == 16
    assert parser.parse_args(["--attn-block-size", "64"]).attn_block_size == 64
    with pytest.raises(SystemExit):
        parser.parse_args(["--attn-block-size", "5"])
    capsys.readouterr()
    # the wgmma variant runs with KVKERNELS_CUDA_WGMMA=require (a fallback would time the wide kernel)
    with ca.variant_env("wgmma", ca.PREFILL_VARIANTS):
        assert os.environ["KVKERNELS_CUDA_ATTN_PATH"] == "wgmma-prefill" and os.environ["KVKERNELS_CUDA_WGMMA"] == "require"
    with ca.variant_env("wgmma-overlap", ca.PREFILL_VARIANTS):
        assert os.environ["KVKERNELS_CUDA_ATTN_PATH"] == "wgmma-prefill-overlap"
        assert os.environ["KVKERNELS_CUDA_WGMMA"] == "require" and "KVKERNELS_CUDA_ATTN_SPLITS" not in os.environ
    with ca.variant_env("wide", ca.PREFILL_VARIANTS):
        assert "KVKERNELS_CUDA_WGMMA" not in os.environ
    # the -gather variants: the same kernels with every K / V tile gathered (KVKERNELS_CUDA_NO_TMA=1), the others
    # with the switch unset (TMA where the block size allows), whatever the caller's environment holds
    os.environ["KVKERNELS_CUDA_NO_TMA"] = "1"
    try:
        with ca.variant_env("wgmma-overlap-gather", ca.PREFILL_VARIANTS):
            assert os.environ["KVKERNELS_CUDA_ATTN_PATH"] == "wgmma-prefill-overlap"
            assert os.environ["KVKERNELS_CUDA_NO_TMA"] == "1" and os.environ["KVKERNELS_CUDA_WGMMA"] == "require"
        with ca.variant_env("wgmma", ca.PREFILL_VARIANTS):
            assert "KVKERNELS_CUDA_NO_TMA" not in os.environ
        assert ca.variant_setting("wgmma-gather", ca.PREFILL_VARIANTS) == (
            "KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill KVKERNELS_CUDA_WGMMA=require KVKERNELS_CUDA_NO_TMA=1")
    finally:
        del os.environ["KVKERNELS_CUDA_NO_TMA"]

    def row(case, impl, ms, sdpa=None, checked=True, skipped=None, queries=4096, head_dim=128):
        return dict(case=case, kind="prefill", dtype=case.split()[1], impl=impl, ms=ms, checked=checked,
                    speedup_vs={} if sdpa is None else {"sdpa-flash-contiguous": sdpa}, skipped=skipped,
                    queries=queries, head_dim=head_dim)

    b, f = "prefill bfloat16 q4096 ctx4096", "prefill fp8_e4m3 q4096 ctx4096"
    rows = [row(b, "kvkernels-wide", 2.0, 0.2), row(b, "kvkernels-deep", 1.0, 0.4),
            row(b, "sdpa-flash-contiguous", 0.4),
            row(f, "kvkernels-wide", None, skipped="RuntimeError: boom"), row(f, "kvkernels-deep", 0.5, 0.8, False),
            row(f, "sdpa-flash-contiguous", None, skipped="no flash")]
    # issue 37: 4096 x 4096 against cuDNN SDPA (1.0 at d128), the e4m3 cache against the bf16 one (1.0)
    rows[1]["speedup_vs"]["sdpa-cudnn-contiguous"] = 0.25
    assert ca.targets(rows, prefill_impl="kvkernels-deep")[2:] == [
        f"{b}: 0.25x cuDNN SDPA (target 1.0)", f"{f}: missingx cuDNN SDPA (target 1.0)",
        f"{f}: 2.00x its bfloat16 cache (target 1.0)"]
    assert ca.targets(rows, prefill_impl="kvkernels-wide")[2:] == [
        f"{b}: missingx cuDNN SDPA (target 1.0)", f"{f}: missingx cuDNN SDPA (target 1.0)",
        f"{f}: missingx its bfloat16 cache (target 1.0)"]
    # the goal follows the row's queries and head dim (a block-size suffix in the name changes nothing)
    small = [row("prefill bfloat16 q512 ctx1024", "kvkernels", 0.1, 1.4, queries=512),
             dict(row("prefill bfloat16 q4096 ctx4096 d64 block64", "kvkernels", 0.1, 1.0, head_dim=64),
                  speedup_vs={"sdpa-cudnn-contiguous": 0.9})]
    assert ca.targets(small)[2:] == ["prefill bfloat16 q512 ctx1024: 1.40x SDPA flash (target 1.3)",
                                     "prefill bfloat16 q4096 ctx4096 d64 block64: 0.90x cuDNN SDPA (target 0.8)"]
    del rows[1]["speedup_vs"]["sdpa-cudnn-contiguous"]
    assert ca.prefill_variant_lines(rows, ["wide", "deep"]) == [
        f"{b}: wide 2.0000 ms (0.20x SDPA flash), deep 1.0000 ms (0.40x SDPA flash) = 2.00x wide, "
        "sdpa-flash 0.4000 ms",
        f"{f}: wide skipped: RuntimeError: boom, deep 0.5000 ms (0.80x SDPA flash) MISMATCH, sdpa-flash skipped: no flash"]
    # with cuDNN SDPA timed too (the wgmma A/B of gpu_validate.sh's b_wgmma step)
    w = row(b, "kvkernels-wgmma", 0.5, 0.8)
    w["speedup_vs"]["sdpa-cudnn-contiguous"] = 0.52
    rows2 = [row(b, "kvkernels-wide", 2.0, 0.2), w, row(b, "sdpa-flash-contiguous", 0.4),
             row(b, "sdpa-cudnn-contiguous", 0.26)]
    assert ca.prefill_variant_lines(rows2, ["wide", "wgmma"]) == [
        f"{b}: wide 2.0000 ms (0.20x SDPA flash), wgmma 0.5000 ms (0.80x SDPA flash, 0.52x cuDNN) = 4.00x wide, "
        "sdpa-flash 0.4000 ms, sdpa-cudnn 0.2600 ms"]
    # the e4m3-cache prefill against the same variant's bf16-cache one (b_wgmma: target 1.0)
    rows3 = [row(b, "kvkernels-wgmma", 0.5), row(f, "kvkernels-wgmma", 0.4), row(f, "kvkernels-wide", 1.0),
             row(b, "kvkernels-wide", None, skipped="boom")]
    assert ca.prefill_fp8_lines(rows3, ["wide", "wgmma"]) == [
        f"{f} [wide]: missing against its bfloat16 cache",
        f"{f} [wgmma]: 0.4000 ms = 1.25x its bfloat16 cache (0.5000 ms) (target 1.0)"]
    assert ca.prefill_fp8_lines(rows2, ["wide", "wgmma"]) == []

    if not torch.cuda.is_available():
        assert ca.main(["--prefill-variants", "wide,deep", "--attn-dtypes", "", "--attn-prefill-dtypes",
                        "bfloat16,fp8_e4m3"]) == 0
        out = capsys.readouterr().out
        assert "no CUDA device" in out and "target: decode" not in out


def test_cuda_mla_decompress_variants_options_and_report(capsys, monkeypatch):
    """kvkernels.bench.cuda_mla --decompress-variants (the GPU script's b_decomp step): the names are checked
    when parsed; KVKERNELS_CUDA_DECOMPRESS is set inside a variant's batches and restored after them; the
    report gives each variant's time, its speed-up over the first named and the torch matmul's time, from rows
    (synthetic here: timing needs a GPU); without a GPU the run says so."""
    import argparse

    from kvkernels.bench import cuda_mla as cm

    parser = argparse.ArgumentParser()
    cm.add_arguments(parser)
    assert parser.parse_args(["--decompress-variants", "tile64,persist"]).decompress_variants == ["tile64", "persist"]
    assert parser.parse_args([]).decompress_variants == []
    for bad in ("tile64,tile128", "persist64,persist64"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--decompress-variants", bad])
    assert parser.parse_args(["--decompress-variants", "tile64,persist64,persist128"]).decompress_variants == [
        "tile64", "persist64", "persist128"]
    capsys.readouterr()

    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "tile64")
    with cm.decompress_env("persist"):
        assert os.environ["KVKERNELS_CUDA_DECOMPRESS"] == "persist"
    with cm.decompress_env(None):  # the torch matmul's batches: unchanged
        assert os.environ["KVKERNELS_CUDA_DECOMPRESS"] == "tile64"
    assert os.environ["KVKERNELS_CUDA_DECOMPRESS"] == "tile64"
    monkeypatch.delenv("KVKERNELS_CUDA_DECOMPRESS")
    with cm.decompress_env("tile64"):
        pass
    assert "KVKERNELS_CUDA_DECOMPRESS" not in os.environ

    def row(case, impl, ms, tflops, checked=True):
        return dict(case=case, kind="decompress", impl=impl, ms=ms, tflops=tflops, checked=checked, skipped=None)

    a, b = "mla decompress bfloat16 T2048 h16", "mla decompress bfloat16 T2048 h128"
    rows = [dict(case="copy bandwidth", kind="copy", impl="copy", ms=None),
            row(a, "kvkernels-tile64", 0.4, 21.5), row(a, "kvkernels-persist", 0.1, 86.0),
            row(a, "torch-matmul", 0.02, 430.0), row(b, "kvkernels-tile64", 2.0, 34.4),
            row(b, "kvkernels-persist", 1.0, 68.7, checked=False), row(b, "torch-matmul", None, None)]
    rows[-1]["skipped"] = "RuntimeError: boom"
    assert cm.decompress_variant_lines(rows, ["tile64", "persist"]) == [
        f"{a}: tile64 0.4000 ms (22 TFLOP/s), persist 0.1000 ms (86 TFLOP/s) = 4.00x tile64, "
        f"torch-matmul 0.0200 ms (430 TFLOP/s)",
        f"{b}: tile64 2.0000 ms (34 TFLOP/s), persist 1.0000 ms (69 TFLOP/s) = 2.00x tile64 MISMATCH, "
        f"torch-matmul skipped: RuntimeError: boom"]

    if not torch.cuda.is_available():
        assert cm.main(["--decompress-variants", "tile64,persist", "--mla-batches", ""]) == 0
        assert "no CUDA device" in capsys.readouterr().out


def test_cuda_mla_attn_variants_options(monkeypatch):
    """kvkernels.bench.cuda_mla --mla-attn-variants (the GPU script's b_mla_wgmma step): the names are checked
    when parsed; inside a variant's batches KVKERNELS_CUDA_MLA_PATH / _WGMMA / _MLA_SCHED name its kernel, schedule
    and split plan (wgmma-seesaw: the seesaw, with require so that a fallback is a skipped row; -meta: the metadata
    pass's plan) and are restored after them. --mla-mixed: batches of LENxCOUNT terms."""
    import argparse

    from kvkernels.bench import cuda_mla as cm

    parser = argparse.ArgumentParser()
    cm.add_arguments(parser)
    names = ["mma", "wgmma", "wgmma-seesaw", "wgmma-meta", "wgmma-seesaw-meta"]
    assert parser.parse_args(["--mla-attn-variants", ",".join(names)]).mla_attn_variants == names
    assert parser.parse_args(["--mla-graph"]).mla_graph and not parser.parse_args([]).mla_graph
    with pytest.raises(SystemExit):
        parser.parse_args(["--mla-attn-variants", "mma,seesaw"])
    monkeypatch.setenv("KVKERNELS_CUDA_MLA_PATH", "mma64")
    monkeypatch.delenv("KVKERNELS_CUDA_WGMMA", raising=False)
    with cm.attn_variant_env("wgmma-seesaw"):
        assert (os.environ["KVKERNELS_CUDA_MLA_PATH"], os.environ["KVKERNELS_CUDA_WGMMA"]) == ("wgmma-seesaw", "require")
    with cm.attn_variant_env("mma"):
        assert "KVKERNELS_CUDA_MLA_PATH" not in os.environ and "KVKERNELS_CUDA_WGMMA" not in os.environ
    monkeypatch.setenv("KVKERNELS_CUDA_MLA_SCHED", "shape")
    with cm.attn_variant_env("wgmma-seesaw-meta"):
        assert (os.environ["KVKERNELS_CUDA_MLA_PATH"], os.environ["KVKERNELS_CUDA_MLA_SCHED"]) == ("wgmma-seesaw",
                                                                                                  "metadata")
    with cm.attn_variant_env("wgmma"):
        assert "KVKERNELS_CUDA_MLA_SCHED" not in os.environ
    assert os.environ["KVKERNELS_CUDA_MLA_PATH"] == "mma64" and "KVKERNELS_CUDA_WGMMA" not in os.environ
    assert os.environ["KVKERNELS_CUDA_MLA_SCHED"] == "shape"
    assert parser.parse_args(["--mla-mixed", "3x1+2x2,5x1"]).mla_mixed == [[3, 2, 2], [5]]
    for bad in ("32768", "1x1+", "-1x2"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--mla-mixed", bad])


def test_write_result_names_the_files_after_the_kind_cpu_and_time(tmp_path):
    """machine.write_result: the result files every benchmark script writes (<kind>-<cpu slug>-<time>.json /
    .txt), the record as JSON (non-JSON values as text) and the text as printed, ending in one newline."""
    import datetime

    from kvkernels.bench import machine

    when = datetime.datetime(2026, 11, 28, 21, 59, 7)
    stem = machine.write_result(tmp_path / "new", "isa-ab", {"a": 1, "p": tmp_path}, "table\n\n",
                                cpu="AMD EPYC 9B14", when=when)
    assert stem == tmp_path / "new" / "isa-ab-amd-epyc-9b14-20261128-215907"
    assert json.loads(stem.with_suffix(".json").read_text()) == {"a": 1, "p": str(tmp_path)}
    assert stem.with_suffix(".txt").read_text() == "table\n"


def test_cuda_mla_prefill_end_to_end_and_dense_decode_on_the_cpu(monkeypatch):
    """kvkernels.bench.cuda_mla's MLA prefill end to end (mla_decompress + paged_attention vs torch.matmul +
    SDPA) and the decode cases' dense bf16 reference row, their arithmetic run on the CPU ops (the data on
    "cpu", timing replaced: it needs CUDA events): ours and the torch pipelines must match the float32 check
    of the last queries, the dense decode must match the decode check, so that a GPU run's rows are right."""
    import argparse

    from kvkernels.bench import cuda_attention as ca
    from kvkernels.bench import cuda_mla as m

    monkeypatch.setattr(m, "DEVICE", "cpu")
    monkeypatch.setattr(m, "_fits", lambda nbytes, args: True)
    monkeypatch.setattr(ca.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(ca.torch.cuda, "get_device_name", lambda *a: "cpu (test)")
    monkeypatch.setattr(ca, "time_cuda", lambda call, reps, min_ms: (call(1), 1.0)[1])
    parser = argparse.ArgumentParser()
    m.add_arguments(parser)
    args = parser.parse_args(["--mla-prefill-tokens", "96"])
    gen = torch.Generator().manual_seed(0)
    for dtype_name in ("bfloat16", "fp8_e4m3"):
        rows = {r["impl"]: r for r in m.prefill_case(dtype_name, 96, 2, args, gen)}
        assert rows["kvkernels"]["checked"] is True, rows["kvkernels"]
        assert rows["kvkernels"]["ms"] == 1.0 and rows["kvkernels"]["tflops"] > 0
        timed = [r for r in rows.values() if r["ms"]]
        assert all(r["checked"] is True for r in timed), timed  # the torch pipelines that ran on the CPU
        assert all(r["skipped"] for r in rows.values() if not r["ms"])
        dec = {r["impl"]: r for r in m.decode_case(dtype_name, 4, 2, 100, 1.0, args, gen)}
        assert dec["kvkernels"]["checked"] is True and dec["torch-dense-bf16"]["checked"] is True, dec
        assert dec["kvkernels"]["speedup_vs"] == {"torch-dense-bf16": 1.0}
        mixed = m.decode_case(dtype_name, 4, 3, 300, 1.0, args, gen, [300, 1, 0])  # --mla-mixed: no dense row
        assert [r["impl"] for r in mixed] == ["kvkernels"] and mixed[0]["checked"] is True, mixed
        assert mixed[0]["case"] == f"mla decode {dtype_name} h4 b3 mixed max300 keys301"
        assert mixed[0]["gbps"] == pytest.approx(301 * 576 * (1 if dtype_name == "fp8_e4m3" else 2) / 1e-3 / 1e9)
    assert m.prefill_case("bfloat16", 100, 2, args, gen)[0]["skipped"] == "tokens not a multiple of 16"
    lines = ca.peer_lines(list(dec.values()))
    assert lines == ["mla decode fp8_e4m3 h4 b2 ctx100: kvkernels 1.0000 ms; torch-dense-bf16 1.0000 ms "
                     "(ours 1.00x faster)"]

"""benchmarks/decode_profile.py: how a sampled address's inline chain becomes a stage, and that the
kernel functions it names still exist (a rename would otherwise move samples to "other")."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("decode_profile", ROOT / "benchmarks" / "decode_profile.py")
prof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prof)

NS = "kvkernels::cpu::avx512vbmi::"


@pytest.mark.parametrize("chain, stage", [
    (["_mm512_fmadd_ps", f"void {NS}dot4x2_words<c10::BFloat16>", f"void {NS}attend_item<c10::BFloat16, c10::BFloat16>"],
     "logits"),
    ([f"{NS}Fp8WordLoader<kvkernels::cpu::fp8_e4m3>::load", f"void {NS}pv4_words<2, kvkernels::cpu::fp8_e4m3>",
      f"void {NS}chunk_values_words<kvkernels::cpu::fp8_e4m3>"], "fp8 lookup (P V)"),
    (["_mm_prefetch", f"{NS}Prefetcher::at", f"void {NS}chunk_logits_words<c10::BFloat16>"], "prefetch (logits)"),
    ([f"{NS}Vec::exp", f"{NS}softmax_rows4", f"void {NS}attend_item<float, float>"], "softmax"),
    ([f"{NS}chunk_slots", f"void {NS}attend_item<float, float>"], "addressing"),
    ([f"void {NS}attend_item<float, float>"], "other kvkernels code"),
    (["??"], "other kvkernels code"),
])
def test_stage_of(chain, stage):
    assert prof.stage_of(chain) == stage


def test_every_named_function_exists_in_the_kernel():
    source = "".join(p.read_text() for p in (ROOT / "csrc" / "cpu").glob("*.h"))
    for _, funcs in prof.STAGES:
        for name in funcs:
            *cls, fn = name.split("::")
            if cls:
                assert re.search(rf"struct {cls[0]}\b", source), name
            assert re.search(rf"\b{fn}\s*[(<{{]", source), name

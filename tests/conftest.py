import collections
import os

import pytest

# The CPU attention kernels reuse per-thread scratch across calls; poisoned with NaN on every call
# here, a kernel that reads scratch it did not write in the same call fails the tests instead of
# silently using a stale value.
os.environ.setdefault("KVKERNELS_CPU_POISON_SCRATCH", "1")

SKIP_REASONS_SHOWN = 25


def skip_reason(report) -> str:
    """The reason a skipped test report gives (``pytest.skip(reason)``, a ``skipif`` mark's reason)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.strip().splitlines()[0] if reason.strip() else "(no reason given)"
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After the run (``make test`` runs ``pytest -q tests``): the fuzzer's calls per op (when
    tests/test_fuzz.py ran), then why tests were skipped, one line per
    reason with its count, most frequent first (``-rs`` lists every skipped test instead: on a machine
    without a GPU that is well over a thousand lines)."""
    fuzz_summary(terminalreporter)
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter(skip_reason(report) for report in skipped).most_common()
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for reason, count in reasons[:SKIP_REASONS_SHOWN]:
        terminalreporter.write_line(f"{count:>6}  {reason}")
    rest = reasons[SKIP_REASONS_SHOWN:]
    if rest:
        terminalreporter.write_line(f"{sum(c for _, c in rest):>6}  ({len(rest)} other reasons; pytest -rs lists "
                                    f"every skipped test)")


def fuzz_summary(terminalreporter):
    """tests/test_fuzz.py, when it ran: the calls tried per op, by outcome, and the findings of a timed run."""
    import sys

    fuzz = sys.modules.get("test_fuzz")
    if fuzz is not None and fuzz.STATS:
        terminalreporter.write_sep("-", "kvkernels fuzz: calls per op")
        terminalreporter.write_line(fuzz.summary())


@pytest.fixture(scope="session")
def ort_library_path():
    """libkvkernels_ort.so, built (incrementally) by scripts/build_ort.sh for the ONNX Runtime tests
    (tests/test_onnx*.py). A failed build fails those tests: they never skip."""
    import kvkernels.onnx
    return kvkernels.onnx.build_library()


@pytest.fixture(scope="session")
def jax_library_path():
    """build-jax/libkvkernels_jax.so, built (incrementally, CPU only) by scripts/build_jax.sh for the JAX
    tests (tests/test_jax*.py, which skip only when jax is not installed). A failed build fails them."""
    import kvkernels.jax
    return kvkernels.jax.build_library(cuda=False)

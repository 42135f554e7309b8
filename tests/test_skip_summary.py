"""tests/conftest.py's summary of skipped tests: one line per reason with its count (``make test`` runs
``pytest -q``, where ~1,900 tests skip on a machine without a GPU), run on a small test file of its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TESTS = '''
import pytest

@pytest.mark.parametrize("i", range(5))
@pytest.mark.skipif(True, reason="no CUDA device")
def test_gpu(i):
    pass

@pytest.mark.parametrize("op", ["a", "b"])
def test_op(op):
    pytest.skip(f"op {op} has no MPS kernel")

def test_also_mps():
    pytest.skip("op a has no MPS kernel")

def test_runs():
    pass
'''


def run_pytest(tmp_path: Path, *extra: str) -> str:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_tiny.py").write_text(TESTS)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_skips_are_summarized_by_reason(tmp_path):
    out = run_pytest(tmp_path)
    lines = out.splitlines()
    (head,) = [i for i, line in enumerate(lines) if "8 skipped, by reason" in line]
    # pytest.skip() and skipif reasons alike, most frequent first
    assert lines[head + 1:head + 4] == ["     5  no CUDA device", "     2  op a has no MPS kernel",
                                        "     1  op b has no MPS kernel"]
    assert "1 passed, 8 skipped" in out


def test_no_summary_without_skips(tmp_path):
    out = run_pytest(tmp_path, "-k", "runs")
    assert "by reason" not in out

"""The GPU validation scripts (scripts/gpu_validate.sh, scripts/gpu_sanitize.sh, scripts/gpu_common.sh,
scripts/gpu_out_limits.py) without a GPU: the shared deadline and per-step limits, a pytest run stopped
by SIGINT that still leaves its summary and junit XML, summary.txt written step by step, $OUT kept within
what the device tool brings back, and the sanitizer's test ids still collected. They run once, on a
machine lent for minutes: a bug found there costs the run."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None or shutil.which("timeout") is None, reason="needs bash and timeout")


def _limits_module():
    spec = importlib.util.spec_from_file_location("gpu_out_limits", os.path.join(SCRIPTS, "gpu_out_limits.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAP_", "BUDGET", "SKIP_BUILD"))}
    env.update(PYTHON=sys.executable, **{k: str(v) for k, v in extra.items()})
    return env


def _plan(script: str) -> list[str]:
    text = open(os.path.join(SCRIPTS, script)).read()
    block = re.search(r'^PLAN="(.*?)"$', text, re.S | re.M).group(1)
    return [line.split()[0] for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("script", ["gpu_validate.sh", "gpu_sanitize.sh", "gpu_common.sh"])
def test_scripts_parse(script):
    result = subprocess.run([BASH, "-n", os.path.join(SCRIPTS, script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", ["gpu_validate.sh", "gpu_sanitize.sh"])
def test_no_time_left_skips_every_step_and_still_reports(script, tmp_path):
    """BUDGET=0: every step is skipped for the deadline, and summary.txt still has a line per step,
    the closing line and the out-limits line."""
    out = tmp_path / "out"
    result = subprocess.run([BASH, os.path.join(SCRIPTS, script)], capture_output=True, text=True, timeout=120,
                            env=_env(DRY_RUN=1, BUDGET=0, OUT=out))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (out / "summary.txt").read_text()
    for step in _plan(script):
        assert re.search(rf"\] {step} +SKIPPED +deadline: ", summary), (step, summary)
    assert "done in " in summary and f"0 ok, 0 failed, 0 timed out, {len(_plan(script))} skipped" in summary
    assert "out limits: " in summary
    assert len(os.listdir(out)) <= 8


def test_unknown_step_is_refused(tmp_path):
    result = subprocess.run([BASH, os.path.join(SCRIPTS, "gpu_validate.sh"), "env", "no_such_step"],
                            capture_output=True, text=True, timeout=60, env=_env(DRY_RUN=1, OUT=tmp_path))
    assert result.returncode == 2 and "unknown step 'no_such_step'" in result.stdout


def _steps_driver(budget: int, steps: str) -> str:
    """A bash driver of gpu_common.sh (BUDGET=budget, GRACE=4, MIN_STEP=3): gpu_init selftest, then `steps`
    (step functions and run_step lines), gpu_finish, and "finish=<its status>" on stdout."""
    return f"""
set -u
BUDGET={budget} GRACE=4 MIN_STEP=3
source {SCRIPTS}/gpu_common.sh
gpu_init selftest
{steps}
gpu_finish
echo "finish=$?"
"""


def test_sigint_at_the_deadline_keeps_the_pytest_summary_and_junit(tmp_path):
    """A step whose cap exceeds the time left runs under (time left - GRACE); at that limit pytest gets
    SIGINT, ends with its summary and junit XML (the test that finished is in it), the step is reported
    TIMEOUT, the next step is skipped for the deadline, and the run still ends with the summary."""
    tests = tmp_path / "selftest"
    tests.mkdir()
    (tests / "test_sleepy.py").write_text(
        "import time\n\n\ndef test_quick():\n    pass\n\n\ndef test_sleepy():\n    time.sleep(120)\n")
    out = tmp_path / "out"
    driver = _steps_driver(24, f"""
step_sleepy() {{ pytest_step tests.log {tests}/test_sleepy.py -p no:randomly; }}
step_after() {{ STEP_DETAIL="ran"; }}
run_step sleepy 600 step_sleepy
run_step after 600 step_after""")
    result = subprocess.run([BASH, "-c", driver], capture_output=True, text=True, timeout=90,
                            env=_env(OUT=out))
    summary = (out / "summary.txt").read_text()
    assert "finish=1" in result.stdout, result.stdout + result.stderr
    sleepy = next(line for line in summary.splitlines() if "] sleepy " in line)
    assert re.search(r"sleepy +TIMEOUT +rc=124 .*SIGINT at (1[0-9]|20)s; 1 passed in ", sleepy), summary
    assert re.search(r"\] after +SKIPPED +deadline: ", summary), summary
    assert "0 ok, 0 failed, 1 timed out, 1 skipped" in summary
    log = (out / "tests.log").read_text()
    assert "test_sleepy.py::test_sleepy" in log and "KeyboardInterrupt" in log
    with tarfile.open(out / "results.tar.gz") as tar:
        xml = tar.extractfile("results/junit-sleepy.xml").read().decode()
    assert 'name="test_quick"' in xml and 'tests="1"' in xml
    assert sorted(os.listdir(out)) == ["results.tar.gz", "summary.txt", "tests.log"]


def test_hang_guard_ends_a_stuck_test_and_leaves_the_time_to_the_next_steps(tmp_path):
    """HANG_EXIT_S: a test stuck where SIGINT cannot reach it (here SIGINT blocked, as a thread waiting on a
    hung GPU kernel) is ended after that many seconds with every stack dumped to the log, the step fails
    naming the hang guard and the test, and the next step runs at once instead of after the step's cap."""
    tests = tmp_path / "selftest"
    tests.mkdir()
    (tests / "test_stuck.py").write_text(
        "import signal\nimport time\n\n\ndef test_fine():\n    pass\n\n\ndef test_stuck():\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n    time.sleep(60)\n")
    out = tmp_path / "out"
    driver = _steps_driver(80, f"""
step_stuck() {{ HANG_EXIT_S=3 pytest_step tests.log {tests}/test_stuck.py -p no:randomly; }}
step_after() {{ STEP_DETAIL="ran"; }}
run_step stuck 70 step_stuck
run_step after 600 step_after""")
    start = time.monotonic()
    subprocess.run([BASH, "-c", driver], capture_output=True, text=True, timeout=120, env=_env(OUT=out))
    assert time.monotonic() - start < 40  # not the step's 70 s cap
    summary = (out / "summary.txt").read_text()
    stuck = next(line for line in summary.splitlines() if "] stuck " in line)
    assert re.search(r"stuck +FAIL .*hang guard: a test ran past HANG_EXIT_S=3s, run ended: test_stuck.py::test_stuck;", stuck), summary
    assert re.search(r"\] after +ok .*ran", summary), summary
    log = (out / "tests.log").read_text()
    assert "test_stuck.py::test_stuck Timeout (0:00:03)!" in log and "line 11 in test_stuck" in log


def _clocks_module():
    spec = importlib.util.spec_from_file_location("gpu_clocks", os.path.join(SCRIPTS, "gpu_clocks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_clock_summary():
    """Busy samples only (utilization > 0), median / min / max SM clock, the event reasons by name
    (idle left out: it is what an idle sample says); N/A power and junk lines are passed over."""
    summary = _clocks_module().summary
    lines = ["2026/11/26 11:00:00.000, 0, 345, 2619, 76.1, 40, 0x0000000000000001",
             "2026/11/26 11:00:00.200, 100, 1980, 2619, 650.2, 55, 0x0000000000000000",
             "2026/11/26 11:00:00.400, 97, 1755, 2619, [N/A], 58, 0x0000000000000004",
             "2026/11/26 11:00:00.600, 100, 1980, 2619, 690.7, 60, 0x0000000000000000",
             "Unable to determine the device handle",
             ""]
    line = summary(lines)
    assert line.startswith("clocks: sm 1980 MHz (min 1755, max 1980) in 3 busy of 4 samples"), line
    assert "mem 2619 MHz" in line and "power max 691 W" in line and "temp max 60 C" in line
    assert line.endswith("held below max by: sw power cap"), line
    assert summary(lines[:1]).startswith("clocks: sm 345 MHz (min 345, max 345) in 1 samples, none busy")
    assert summary(["2026/11/26 11:00:00.000, 100, 1980, 2619, 650.2, 55"]).endswith("temp max 55 C")
    assert summary(["No devices were found"]) == "clocks: no samples (nvidia-smi gave none)"


@pytest.mark.parametrize("reasons_field", [True, False], ids=["event-reasons", "older-driver"])
def test_bench_step_samples_clocks(tmp_path, reasons_field):
    """clocks_start / clocks_stop around a command, with a stand-in nvidia-smi on PATH: the samples land
    in results/clocks-<step>.csv, the sampler is stopped, one summary line comes back; a driver that
    rejects the event-reason field is sampled without it."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    reject = "" if reasons_field else 'case "$*" in *clocks_event_reasons*) echo "not a valid field"; exit 2;; esac\n'
    fake.write_text("#!/usr/bin/env bash\n" + reject +
                    'line="2026/11/26 11:00:00.000, 100, 1980, 2619, 650.2, 55"\n'
                    'case "$*" in *clocks_event_reasons*) line="$line, 0x0000000000000004";; esac\n'
                    'case "$*" in *-lms*) while true; do echo "$line"; sleep 0.1; done;; esac\n'
                    'echo "$line"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    driver = f"""
set -u
BUDGET=60
source {SCRIPTS}/gpu_common.sh
gpu_init selftest
step_bench() {{
  clocks_start; sampler=$CLOCKS_PID; sleep 1
  clocks_stop >"$SCRATCH/clocks.txt"; STEP_DETAIL=$(cat "$SCRATCH/clocks.txt")
  kill -0 "$sampler" 2>/dev/null && echo "sampler still running" || echo "sampler stopped"
}}
run_step bench 30 step_bench
gpu_finish
"""
    env = _env(OUT=out)
    env["PATH"] = f"{fake.parent}:{env['PATH']}"
    result = subprocess.run([BASH, "-c", driver], capture_output=True, text=True, timeout=60, env=env)
    summary = (out / "summary.txt").read_text()
    assert "sampler stopped" in result.stdout, result.stdout + result.stderr
    bench = next(line for line in summary.splitlines() if "] bench " in line)
    assert re.search(r"clocks: sm 1980 MHz \(min 1980, max 1980\) in \d+ busy of \d+ samples", bench), bench
    assert ("held below max by: sw power cap" in bench) == reasons_field, bench
    with tarfile.open(out / "results.tar.gz") as tar:
        samples = tar.extractfile("results/clocks-bench.csv").read().decode().splitlines()
    assert len(samples) >= 3 and all(line.startswith("2026/11/26") for line in samples), samples


def test_out_limits(tmp_path):
    """More than 8 files, a path too deep, a bad name, a link and an oversized log: afterwards at most 8
    plain files no deeper than out/a/b/file, the log cut to the size limit with a note, the rest in
    overflow.tar.gz, the files to keep first still there."""
    limits = _limits_module()
    out = tmp_path / "out"
    (out / "a" / "b" / "c").mkdir(parents=True)
    for name in ["summary.txt", "env.txt"] + [f"extra{i}.txt" for i in range(9)]:
        (out / name).write_text(name)
    (out / "a" / "b" / "c" / "deep.txt").write_text("deep")
    (out / "a" / "b" / "fine.txt").write_text("fine")
    (out / "bad name.txt").write_text("bad")
    os.symlink("env.txt", out / "link.txt")
    (out / "big.log").write_bytes(b"first line\n" + b"x" * (3 << 20) + b"\nlast line\n")
    notes = limits.enforce(str(out), max_files=8, max_bytes=2 << 20, keep=("summary.txt", "env.txt"))
    files = limits.walk(str(out))
    assert len(files) <= 8 and all(len(f.split(os.sep)) <= 3 for f in files), files
    assert all(os.path.isfile(out / f) and not os.path.islink(out / f) for f in files)
    assert {"summary.txt", "env.txt", "overflow.tar.gz"} <= set(files)
    big = (out / "big.log").read_bytes()
    assert len(big) <= 2 << 20 and big.startswith(b"first line") and big.endswith(b"last line\n")
    assert b"gpu_out_limits: " in big
    with tarfile.open(out / "overflow.tar.gz") as tar:
        packed = set(tar.getnames())
    assert {"a/b/c/deep.txt", "bad name.txt", "link.txt"} <= packed
    assert len(packed) + len(files) - 1 == 16  # every file is either still there or in the archive
    assert any("cut to" in n for n in notes)
    assert limits.enforce(str(out), max_files=8, max_bytes=2 << 20) == []  # a second pass changes nothing


def test_sanitizer_cases_are_collected(tmp_path):
    """Every test id of scripts/gpu_sanitize_cases.txt exists (a renamed case would make the sanitizer
    run select nothing), and some of them are marked memcheck."""
    lines = [line.split() for line in open(os.path.join(SCRIPTS, "gpu_sanitize_cases.txt"))
             if line.strip() and not line.startswith("#")]
    ids = [parts[0] for parts in lines]
    assert ids and any(parts[1:] == ["memcheck"] for parts in lines)
    assert all(parts[1:] in ([], ["memcheck"]) for parts in lines), lines
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = {line.strip() for line in result.stdout.splitlines()}
    missing = [i for i in ids if i not in collected]
    assert not missing, f"not collected: {missing}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"


def test_readme_step_table_lists_every_validate_step_with_its_cap():
    """csrc/cuda/README.md's table of gpu_validate.sh steps names every step of PLAN, with PLAN's cap (a step
    added to the script, e.g. b_pvariants, is documented where the GPU session reads what to run)."""
    text = open(os.path.join(SCRIPTS, "gpu_validate.sh")).read()
    block = re.search(r'^PLAN="(.*?)"$', text, re.S | re.M).group(1)
    caps = dict(line.split() for line in block.splitlines() if line.strip())
    readme = open(os.path.join(ROOT, "csrc", "cuda", "README.md")).read()
    table = re.search(r"^\| step \| cap \(s\) \| what \|\n((?:\|.*\n)+)", readme, re.M).group(1)
    documented = {}
    for names, cap in re.findall(r"^\| ((?:`\w+`(?:, )?)+) \| (\d+)(?: each)? \|", table, re.M):
        for name in re.findall(r"`(\w+)`", names):
            documented[name] = cap
    assert documented == caps


class _Metric:
    """An instanced ncu metric: one value per SASS instruction (pc)."""

    def __init__(self, by_pc: dict):
        self.pcs, self.values = list(by_pc), list(by_pc.values())

    def num_instances(self):
        return len(self.values)

    def has_correlation_ids(self):
        return True

    def correlation_ids(self):
        ids = _Metric({})
        ids.values = self.pcs
        return ids

    def as_uint64(self, i):
        return self.values[i]

    def as_double(self):
        return 125000.0


class _Action:
    def __init__(self, metrics: dict):
        self.metrics = metrics

    def name(self):
        return "merge_splits_kernel"

    def metric_names(self):
        return list(self.metrics) + ["gpu__time_duration.sum"]

    def metric_by_name(self, name):
        return self.metrics.get(name, _Metric({}))

    def source_info(self, pc):
        info = type("Info", (), {"file_name": lambda s: "/x/attention_merge.cuh", "line": lambda s: pc // 16})
        return info()

    def sass_by_pc(self, pc):
        return f"  FFMA R{pc}, R1, R2, R3"


def test_ncu_hot_sums_samples_by_reason_line_and_instruction(monkeypatch, capsys):
    """scripts/probe/ncu_hot.py on a stub ncu_report: the *_not_issued twins are not counted again, samples
    sum per reason, per source line and per instruction, hottest first."""
    prefix = "smsp__pcsamp_warps_issue_stalled_"
    action = _Action({prefix + "long_scoreboard": _Metric({32: 60, 48: 20, 64: 0}),
                      prefix + "long_scoreboard_not_issued": _Metric({32: 55}),
                      prefix + "wait": _Metric({32: 10, 80: 10})})
    rng = type("Range", (), {"num_actions": lambda s: 1, "action_by_idx": lambda s, i: action})()
    ctx = type("Ctx", (), {"num_ranges": lambda s: 1, "range_by_idx": lambda s, i: rng})()
    monkeypatch.setitem(sys.modules, "ncu_report", type(sys)("ncu_report"))
    sys.modules["ncu_report"].load_report = lambda path: ctx
    spec = importlib.util.spec_from_file_location("ncu_hot", os.path.join(SCRIPTS, "probe", "ncu_hot.py"))
    hot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hot)
    hot.main(["report.ncu-rep", "--top", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "-- merge_splits_kernel: 125.0 us, 100 samples"
    assert out[2] == "   reasons: long_scoreboard 80%, wait 20%"
    # pc 32 and 48 are line 2 and 3 (pc // 16), pc 80 line 5: line 2 has 70 samples, 60 of them long_scoreboard.
    assert out[4].split() == ["70.0%", "attention_merge.cuh:2", "long_scoreboard", "86%,", "wait", "14%"]
    assert out[5].split()[:2] == ["20.0%", "attention_merge.cuh:3"]
    assert len([line for line in out if line.startswith("   ") and "%" in line.split()[0]]) == 4  # --top 2, twice
    assert out[7].split()[:4] == ["70.0%", "attention_merge.cuh:2", "FFMA", "R32,"]

"""``python -m kvkernels``: the usage for -h / --help / no command (exit 0), an unknown command
(exit 2), and every option of ``demo`` and ``demo kernels`` showing its default in ``--help``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvkernels import demo, demo_kernels
from kvkernels.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [[], ["-h"], ["--help"], ["help"]])
def test_usage_lists_the_commands(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m kvkernels {info,demo,bench,transformers}")
    for command in ("info", "demo", "bench", "transformers"):
        assert f"\n  {command} " in out  # one line saying what it does


def test_unknown_command_exits_2_with_the_usage(capsys):
    assert main(["--bogus"]) == 2
    err = capsys.readouterr().err
    assert "usage: python -m kvkernels" in err and "unknown command '--bogus'" in err


def test_help_through_python_dash_m():
    run = subprocess.run([sys.executable, "-m", "kvkernels", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "python -m kvkernels <command> --help" in run.stdout


@pytest.mark.parametrize("command", [["info"], ["demo"], ["demo", "kernels"], ["bench"]])
def test_command_help_exits_0(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m kvkernels {' '.join(command)}")


@pytest.mark.parametrize("module", [demo, demo_kernels])
def test_demo_help_shows_every_default(module):
    parser = module.build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help" and a.default is not False]
    assert options
    for action in options:
        text = " ".join(parser._get_formatter()._format_action(action).split())  # as --help prints it
        assert "(default: " in text, text
        if action.default is not None:
            assert f"(default: {action.default})" in text, text


def test_demo_kernels_uses_one_thread_like_demo(capsys):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert demo_kernels.build_parser().parse_args([]).threads == demo.build_parser().parse_args([]).threads == 1
        assert demo.main(["kernels", "--batch", "2", "--prompt-len", "9", "--new-tokens", "3"]) == 0
        assert ", 1 threads, " in capsys.readouterr().out
        assert torch.get_num_threads() == 2  # restored
        assert demo.main(["kernels", "--batch", "2", "--prompt-len", "9", "--new-tokens", "3", "--threads", "3"]) == 0
        assert ", 3 threads, " in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)

"""The declared dependency ranges, the lock file and the Makefile's compatibility targets agree."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def makefile_var(name: str) -> str:
    return re.search(rf"^{name} := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def transformers_range() -> tuple[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    ranges = set(re.findall(r'"transformers(?:\[[\w,]+\])?>=([\d.]+),<([\d.]+)"', text))
    assert len(re.findall(r'"transformers\b', text)) == sum(1 for _ in re.finditer(
        r'"transformers(?:\[[\w,]+\])?>=[\d.]+,<[\d.]+"', text)), "a transformers requirement without the range"
    assert len(ranges) == 1, f"pyproject.toml: every transformers requirement should state one range, got {ranges}"
    return ranges.pop()


def version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def test_lock_pins_every_development_requirement():
    pins = lock()
    wanted = [line.strip().lower() for line in (ROOT / "requirements" / "dev.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert wanted and all(name in pins for name in wanted + ["torch"]), sorted(set(wanted) - set(pins))
    assert all(re.fullmatch(r"[\w.]+", v) for v in pins.values()), "exact versions only"


def test_compat_targets_are_the_ends_of_the_declared_range():
    low, high = transformers_range()
    oldest, newest = makefile_var("TRANSFORMERS_OLDEST"), makefile_var("TRANSFORMERS_NEWEST")
    assert oldest == low, "make test-compat must test the oldest transformers pyproject.toml allows"
    assert version(oldest) <= version(newest) < version(high)
    # the newest tested is the newest release below the bound: the bound is the next minor version
    assert version(high) == (version(newest)[0], version(newest)[1] + 1)
    assert version(oldest) <= version(lock()["transformers"]) <= version(newest)


def test_abi_check_covers_the_stated_torch_range():
    """`make test-abi` runs a wheel built on the lock's torch at both ends of the torch range the README
    states; pyproject's requirement starts at the oldest."""
    oldest, newest = makefile_var("ABI_TORCH_OLDEST"), makefile_var("ABI_TORCH_NEWEST")
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"torch (\d+\.\d+)–(\d+\.\d+) already installed \(tested at both ends", readme)
    assert m, "README.md: the install section should state the tested torch range"
    assert (m.group(1), m.group(2)) == (oldest.rsplit(".", 1)[0], newest.rsplit(".", 1)[0])
    assert f'"torch>={oldest.rsplit(".", 1)[0]}"' in (ROOT / "pyproject.toml").read_text()
    assert version(oldest) <= version(lock()["torch"]) <= version(newest)

#!/usr/bin/env python3
"""Type-check every Metal kernel on Linux: MSL compiled as C++17 through metal/shim/msl_shim.h.

Each compile unit is exactly what kvkernels/metal/source.py hands to torch.mps.compile_shader
(common.h + #defines + metal/<family>.metal), for every variant in source.VARIANTS, so every
instantiation the dispatch code can request is checked. g++ always; clang++ too when one is
installed (it is optional: set CLANG=... to pick one; none is required on CI). Warnings are errors.

    python scripts/check_metal.py            # all families, g++ (+ clang++ if present)
    python scripts/check_metal.py paged_attention --compiler g++
Exit status 1 on any error. Cannot catch (see metal/README.md): address-space mismatches between
device/threadgroup/thread pointers, MSL-only restrictions (no double, no recursion), attributes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_source_module():
    """kvkernels/metal/source.py on its own (importing the package would load torch)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvkernels_metal_source", ROOT / "kvkernels/metal/source.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


source = _load_source_module()

SHIM = ROOT / "metal" / "shim"
WARNINGS = ["-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-Wno-unused-function",
            "-Wno-unused-variable", "-Wno-unused-but-set-variable"]


def compilers(choice: str | None) -> list[str]:
    if choice:
        return [choice]
    found = ["g++"]
    clang = os.environ.get("CLANG") or next((c for c in ("clang++", "clang++-19", "clang++-18", "clang++-17",
                                                          "clang++-16", "clang++-15", "clang++-14")
                                             if shutil.which(c)), None)
    if clang:
        found.append(clang)
    return found


def flags(cxx: str) -> list[str]:
    extra = ["-Wno-gnu-anonymous-struct", "-Wno-nested-anon-types", "-Wno-unknown-attributes"] if "clang" in cxx \
        else ["-Wno-attributes"]
    return ["-std=c++17", "-fsyntax-only", f"-I{SHIM / 'include'}", f"-I{SHIM}", "-include", "msl_shim.h",
            *WARNINGS, *extra]


def check(cxx: str, files: list[Path]) -> tuple[bool, str]:
    res = subprocess.run([cxx, *flags(cxx), "-x", "c++", *map(str, files)], capture_output=True, text=True)
    return res.returncode == 0, res.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=list(source.FAMILIES))
    ap.add_argument("--compiler")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        units = []
        for fam in args.families:
            for i, defines in enumerate(source.VARIANTS[fam]):
                path = Path(tmp) / f"{fam}_{i}.cpp"
                path.write_text(source.compile_unit(fam, defines))
                units.append((fam, defines, path))
        for cxx in compilers(args.compiler):
            start = time.time()
            # one compiler process per family and job slice (amortizes start-up over many units)
            batches = []
            for fam in args.families:
                fam_units = [u for u in units if u[0] == fam]
                for j in range(args.jobs):
                    part = fam_units[j::args.jobs]
                    if part:
                        batches.append(part)
            with ThreadPoolExecutor(args.jobs) as pool:
                results = list(pool.map(lambda b: (b, check(cxx, [u[2] for u in b])), batches))
            failed = [(b, err) for b, (ok, err) in results if not ok]
            for b, err in failed:
                status = 1
                names = ", ".join(f"{u[0]}{u[1]}" for u in b)
                print(f"FAIL ({cxx}) one of: {names}\n{err}")
            n = len(units)
            print(f"check_metal: {cxx}: {n} compile units ({', '.join(args.families)}) "
                  f"{'FAILED' if failed else 'ok'} in {time.time() - start:.1f} s")
        if len(compilers(args.compiler)) == 1 and not args.compiler:
            print("check_metal: no clang++ found; checked with g++ only (clang is optional)")
    return status


if __name__ == "__main__":
    sys.exit(main())

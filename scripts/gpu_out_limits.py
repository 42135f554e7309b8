#!/usr/bin/env python3
"""Fit a device run's $OUT folder to what the device tool brings back (scripts/gpu_validate.sh).

The tool returns at most 8 files of at most 16 MiB each, no deeper than $OUT/a/b/file, each file and
folder named in letters, digits, '.', '_' and '-'; anything else stays behind. This script moves what
would stay behind into files that come back:

- a path too deep, a name with other characters, a link or anything not a plain file: packed into
  $OUT/overflow.tar.gz (and removed);
- more files than allowed: the first ones of --keep (in that order), then the most recent, stay; the
  others go into overflow.tar.gz;
- a file over the size limit: text (.log .txt .xml .json .csv) keeps its first MiB and as much of its
  end as fits, with a line saying what was cut; anything else is removed and listed.

Prints one line per change, then "out limits: N files, ..." (appended to summary.txt by the scripts).
Only the standard library; exit status 0 unless $OUT cannot be read.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
import tarfile
import time

NAME = re.compile(r"^[A-Za-z0-9._-]+$")
TEXT = (".log", ".txt", ".xml", ".json", ".csv")
MIB = 1 << 20
OVERFLOW = "overflow.tar.gz"


def walk(out: str):
    """Every non-directory entry under out (links included, not followed), as relative paths."""
    found = []
    for parent, dirs, files in os.walk(out, followlinks=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(parent, d))]:
            found.append(os.path.relpath(os.path.join(parent, name), out))
    return sorted(found)


def returnable(rel: str, out: str, max_depth: int) -> bool:
    parts = rel.split(os.sep)
    path = os.path.join(out, rel)
    return (len(parts) <= max_depth + 1 and all(NAME.match(p) for p in parts)
            and os.path.isfile(path) and not os.path.islink(path))


def truncate_text(path: str, limit: int) -> str:
    size = os.path.getsize(path)
    head = min(MIB, limit // 16)
    tail = limit - head - 4096  # 4 KiB for the note
    with open(path, "rb") as f:
        first = f.read(head)
        f.seek(size - tail)
        last = f.read(tail)
    note = (f"\n\n[gpu_out_limits: {size - head - tail} bytes cut here to keep the file under "
            f"{limit // MIB} MiB]\n\n").encode()
    with open(path, "wb") as f:
        f.write(first + note + last)
    return f"{os.path.basename(path)}: {size / MIB:.1f} MiB cut to {os.path.getsize(path) / MIB:.1f} MiB"


def pack(out: str, rels: list[str], limit: int) -> list[str]:
    """Add rels to out/overflow.tar.gz (appending to one already there) and remove them."""
    archive = os.path.join(out, OVERFLOW)
    members = []
    if os.path.exists(archive):
        with tarfile.open(archive, "r:gz") as old:
            members = [(m, old.extractfile(m).read() if m.isfile() else None) for m in old.getmembers()]
    notes = []
    tmp = archive + ".tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for m, data in members:
            tar.addfile(m, None if data is None else io.BytesIO(data))
        for rel in rels:
            path = os.path.join(out, rel)
            if os.path.islink(path) or os.path.isfile(path):
                tar.add(path, arcname=rel, recursive=False)
            notes.append(f"{rel}: into {OVERFLOW}")
    os.replace(tmp, archive)
    for rel in rels:
        path = os.path.join(out, rel)
        if os.path.islink(path) or os.path.isfile(path):
            os.remove(path)
    if os.path.getsize(archive) > limit:
        notes.append(f"{OVERFLOW} is {os.path.getsize(archive) / MIB:.1f} MiB: over the limit, removed")
        os.remove(archive)
    return notes


def remove_empty_dirs(out: str) -> None:
    for parent, dirs, files in os.walk(out, topdown=False):
        if parent != out and not os.listdir(parent):
            os.rmdir(parent)


def enforce(out: str, max_files: int = 8, max_bytes: int = 16 * MIB, max_depth: int = 2,
            keep: tuple[str, ...] = ()) -> list[str]:
    """Apply the limits to out; returns one note per change."""
    notes = []
    bad = [rel for rel in walk(out) if not returnable(rel, out, max_depth) and rel != OVERFLOW]
    if bad:
        notes += pack(out, bad, max_bytes)
    for rel in walk(out):
        path = os.path.join(out, rel)
        if os.path.getsize(path) > max_bytes:
            if rel.endswith(TEXT):
                notes.append(truncate_text(path, max_bytes))
            else:
                notes.append(f"{rel}: {os.path.getsize(path) / MIB:.1f} MiB, not text: removed")
                os.remove(path)
    files = walk(out)
    if len(files) > max_files:
        order = {name: i for i, name in enumerate(keep)}
        ranked = sorted((f for f in files if f != OVERFLOW),
                        key=lambda f: (order.get(f, len(order)), -os.path.getmtime(os.path.join(out, f))))
        stay = ranked[:max_files - 1]
        notes += pack(out, [f for f in ranked if f not in stay], max_bytes)
    remove_empty_dirs(out)
    return notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--max-files", type=int, default=8)
    p.add_argument("--max-mib", type=float, default=16)
    p.add_argument("--max-depth", type=int, default=2, help="folders below out (out/a/b/file: 2)")
    p.add_argument("--keep", default="summary.txt,env.txt,tests.log,build.log,results.tar.gz,bench.log",
                   help="files that stay first when there are too many, in order")
    args = p.parse_args(argv)
    if not os.path.isdir(args.out):
        print(f"out limits: {args.out} is not a folder", file=sys.stderr)
        return 1
    started = time.monotonic()
    notes = enforce(args.out, args.max_files, int(args.max_mib * MIB), args.max_depth,
                    tuple(k for k in args.keep.split(",") if k))
    for note in notes:
        print(f"out limits: {note}")
    files = walk(args.out)
    sizes = sorted(((os.path.getsize(os.path.join(args.out, f)), f) for f in files), reverse=True)
    biggest = f", largest {sizes[0][1]} {sizes[0][0] / MIB:.2f} MiB" if sizes else ""
    print(f"out limits: {len(files)} files{biggest}, {sum(s for s, _ in sizes) / MIB:.2f} MiB in all "
          f"({'changed' if notes else 'nothing to change'}, {time.monotonic() - started:.1f}s): "
          + " ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``python -m kvkernels info | demo | bench [options]``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "info"
    if command == "info":
        from kvkernels.info import main as info
        return info(argv)
    if command == "demo":
        from kvkernels.demo import main as demo
        return demo(argv)
    if command == "bench":
        from kvkernels.bench import main as bench
        return bench(argv)
    print(f"usage: python -m kvkernels {{info,demo,bench}} [options]  (got {command!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

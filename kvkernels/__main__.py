"""Command line: ``python -m kvkernels info | demo | bench | transformers [options]``."""

from __future__ import annotations

import sys

USAGE = """\
usage: python -m kvkernels {info,demo,bench,transformers} [options]

commands:
  info   the compiled backends (CPU / CUDA / Metal kernels per op), the CPU ISA in use, the torch version
  demo   a small transformers model generating on the paged cache against the stock cache, self-checked
         (demo kernels: the ops-level demo, no transformers needed)
  bench  benchmarks: the kernels against PyTorch and the measured memory bandwidth (--suite cache: the
         cache manager; --suite generate: transformers generate() on both caches)
  transformers  transformers' command line with kvkernels' flash kernel registered, e.g. `python -m
         kvkernels transformers serve MODEL --continuous-batching --attn-implementation
         kvkernels/flash-attn2-api` (kvkernels.integrations.transformers_flash)

python -m kvkernels <command> --help lists the command's options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command = argv.pop(0)
    if command == "info":
        from kvkernels.info import main as info
        return info(argv)
    if command == "demo":
        from kvkernels.demo import main as demo
        return demo(argv)
    if command == "bench":
        from kvkernels.bench import main as bench
        return bench(argv)
    if command == "transformers":
        from kvkernels.integrations.transformers_flash import cli_main
        return cli_main(argv)
    print(f"{USAGE}\n\npython -m kvkernels: unknown command {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

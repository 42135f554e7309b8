"""The CPU benchmark, as ``python -m kvkernels bench`` (options: --help; see README.md here)."""
import sys, pathlib
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout
import torch  # noqa: E402,F401  (libtorch before the kvkernels extension)
from kvkernels.bench import main  # noqa: E402
sys.exit(main(sys.argv[1:]))

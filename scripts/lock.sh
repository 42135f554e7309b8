#!/usr/bin/env bash
# Regenerates requirements/lock.txt: a throwaway venv gets the newest releases of
# requirements/dev.txt (plus torch $TORCH_VERSION), and the lock records every installed package's
# exact version. Run the tests on the new lock (rm -rf .venv && make test) before committing it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
venv=$(mktemp -d)/venv
"$PYTHON" -m venv "$venv"
"$venv/bin/pip" install -q "torch==$TORCH_VERSION" -r requirements/dev.txt
{
  echo "# The tested environment of kvkernels' development venv (make demo / make test / CI): every package"
  echo "# and its exact version, used as pip constraints (-c), so a new upstream release never changes"
  echo "# what a fresh machine installs. Written by scripts/lock.sh on $(date +%F)" \
       "(CPython $("$venv/bin/python" -c 'import platform; print(platform.python_version())'), $(uname -m));"
  echo "# regenerate it with \`make lock\` and rerun the tests before committing the new file."
  echo "# torch is pinned without its local tag: pip resolves torch==2.13.0 to 2.13.0+cpu where a CPU"
  echo "# wheel is on its find-links (this project's machines), and to PyPI's CUDA build elsewhere."
  "$venv/bin/pip" freeze --all | grep -v '^pip==' | sed 's/^torch==\([0-9.]*\)+.*/torch==\1/'
} > requirements/lock.txt
rm -rf "$(dirname "$venv")"
echo "requirements/lock.txt: $(grep -c '==' requirements/lock.txt) pinned packages"

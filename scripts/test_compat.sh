#!/usr/bin/env bash
# make test-compat: the transformers-facing tests against each transformers version given (the
# oldest and the newest that pyproject.toml allows), each in a venv of its own under build-compat/
# that is kept for reruns. torch and the test tools come from requirements/lock.txt; transformers
# brings the dependencies it asks for. The extension built by `make build` is used as it is (the
# same torch, so the same .so).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TESTS=(tests/test_transformers.py tests/test_transformers_mla.py tests/test_generation.py
       tests/test_compile_decode.py tests/test_demo.py tests/test_docs_examples.py tests/test_transformers_cb.py)
status=0
summary=()
for version in "$@"; do
  venv=build-compat/transformers-$version
  # psutil: transformers' continuous batching sizes its CPU cache with it (tests/test_transformers_cb.py)
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import transformers, torch, psutil" 2>/dev/null; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" &&
      "$venv/bin/pip" install -q -c requirements/lock.txt torch numpy pytest hypothesis expecttest psutil &&
      "$venv/bin/pip" install -q "transformers==$version" || { summary+=("transformers $version: install failed"); status=1; continue; }
  fi
  installed=$("$venv/bin/python" -c "import transformers; print(transformers.__version__)")
  echo "== transformers $installed ($venv)"
  if "$venv/bin/python" -m pytest -q -p no:cacheprovider -W error::FutureWarning "${TESTS[@]}"; then
    summary+=("transformers $installed: passed")
  else
    summary+=("transformers $installed: FAILED")
    status=1
  fi
done
printf '%s\n' "${summary[@]}"
exit $status

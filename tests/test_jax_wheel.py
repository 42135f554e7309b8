"""A wheel built with jax installed carries kvkernels.jax and its CPU library, and the installed package
finds that library without the checkout (setup.py's build_ext; kvkernels/jax/_library.py looks beside
itself first). The wheel is built as `pip install .` builds it: pip's in-tree build through setup.py,
against this venv's torch, CPU kernels only (KVKERNELS_NO_CUDA=1); the objects of `make build` are
reused (ninja), so this costs the link steps and scripts/build_jax.sh's incremental run."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="jax is not installed (requirements/lock.txt pins it)")

ROOT = Path(__file__).resolve().parents[1]

# Run outside the checkout, on the unpacked wheel only: a decode step of paged_attention on the packaged
# library against a dense float64 softmax in numpy.
PROGRAM = r"""
import numpy as np, jax.numpy as jnp
import kvkernels.jax as kj
lib = kj.library_path()
assert lib.parent == __import__("pathlib").Path(kj.__file__).resolve().parent, lib
rng = np.random.default_rng(0)
blocks, block, hkv, hq, d, n = 3, 4, 2, 4, 8, 10
k = rng.standard_normal((blocks, block, hkv, d)).astype(np.float32)
v = rng.standard_normal((blocks, block, hkv, d)).astype(np.float32)
q = rng.standard_normal((1, hq, d)).astype(np.float32)
table = np.array([[2, 0, 1]], np.int32)
out = np.asarray(kj.paged_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(table),
                                    jnp.asarray(np.array([n], np.int32)))[0])
keys = k[table[0]].reshape(-1, hkv, d)[:n].astype(np.float64)
vals = v[table[0]].reshape(-1, hkv, d)[:n].astype(np.float64)
for h in range(hq):
    s = keys[:, h // 2] @ q[0, h].astype(np.float64) / np.sqrt(d)
    p = np.exp(s - s.max()); p /= p.sum()
    assert np.abs(out[0, h] - p @ vals[:, h // 2]).max() < 1e-5, h
print("ok", lib)
"""


def test_wheel_ships_and_finds_the_jax_library(tmp_path):
    env = dict(os.environ, KVKERNELS_NO_CUDA="1", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                            "-w", str(tmp_path / "dist"), str(ROOT)], env=env, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("kvkernels-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {"kvkernels/jax/__init__.py", "kvkernels/jax/ops.py", "kvkernels/jax/libkvkernels_jax.so"} <= names
        z.extractall(tmp_path / "site")
    os.chmod(tmp_path / "site" / "kvkernels" / "jax" / "libkvkernels_jax.so", 0o755)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("KVKERNELS_JAX")}
    run_env["PYTHONPATH"] = str(tmp_path / "site")
    run = subprocess.run([sys.executable, "-c", PROGRAM], cwd=tmp_path, env=run_env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.startswith("ok " + str(tmp_path / "site")), run.stdout


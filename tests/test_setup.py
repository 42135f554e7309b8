"""setup.py's build decisions, without building: whether the CUDA sources join (a torch whose CUDA major
version differs from nvcc's builds the CPU kernels with a warning instead of failing in
torch.utils.cpp_extension), the message when nothing provides bdist_wheel (old setuptools without
`wheel` under --no-build-isolation), and the abi3 wheel tag."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module: its setup() call runs only as __main__."""
    spec = importlib.util.spec_from_file_location("kvkernels_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NVCC = "/usr/local/cuda/bin/nvcc"


@pytest.mark.parametrize("torch_cuda,nvcc,version,no_cuda,build", [
    (None, NVCC, (13, 0), False, False),     # CPU torch: no CUDA, nothing to say
    ("12.8", NVCC, (12, 8), False, True),    # matching toolkit
    ("12.8", NVCC, (12, 4), False, True),    # minor difference: torch only warns, the build works
    ("12.8", NVCC, None, False, True),       # version not parsed: torch skips its check as well
    ("13.0", NVCC, (13, 0), True, False),    # KVKERNELS_NO_CUDA=1
    ("12.8", NVCC, (13, 0), True, False),    # KVKERNELS_NO_CUDA=1 silences the mismatch
])
def test_cuda_plan_without_warning(setup_py, torch_cuda, nvcc, version, no_cuda, build):
    assert setup_py.cuda_plan(torch_cuda, nvcc, version, no_cuda) == (build, None)


def test_cuda_major_mismatch_builds_cpu_with_warning(setup_py):
    # PyPI's torch 2.10 (CUDA 12.8) on a machine whose nvcc is CUDA 13.0.
    build, warning = setup_py.cuda_plan("12.8", NVCC, (13, 0), False)
    assert build is False
    for part in ("CUDA 13.0", "CUDA 12.8", NVCC, "KVKERNELS_NO_CUDA=1", "CPU kernels only"):
        assert part in warning, part
    build, warning = setup_py.cuda_plan("13.0", NVCC, (12, 9), False)
    assert build is False and "CUDA 12.9" in warning and "CUDA 13.0" in warning


def test_cuda_torch_without_nvcc_builds_cpu_with_warning(setup_py):
    build, warning = setup_py.cuda_plan("12.8", None, None, False)
    assert build is False
    assert "no nvcc" in warning and "KVKERNELS_NO_CUDA=1" in warning


def test_nvcc_release_parses_nvcc_version(setup_py, tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    fake.chmod(0o755)
    assert setup_py.nvcc_release(str(fake)) == (13, 0)
    fake.write_text("#!/bin/sh\necho 'something else'\n")
    assert setup_py.nvcc_release(str(fake)) is None
    assert setup_py.nvcc_release(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("commands", [["bdist_wheel"], ["dist_info", "--output-dir", "x"],
                                      ["editable_wheel", "--dist-dir", "x"]])
def test_wheel_commands_need_bdist_wheel(setup_py, commands):
    message = setup_py.wheel_support_error(commands, "65.5.0", has_bdist_wheel=False)
    assert "setuptools 65.5.0" in message and "pip install wheel" in message
    assert setup_py.wheel_support_error(commands, "84.2.1", has_bdist_wheel=True) is None


def test_in_place_build_needs_no_bdist_wheel(setup_py):
    assert setup_py.wheel_support_error(["-q", "build_ext", "--inplace"], "65.5.0", has_bdist_wheel=False) is None


def test_this_setuptools_has_bdist_wheel(setup_py):
    import setuptools

    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    if (major, minor) >= (70, 1):
        assert setup_py.has_bdist_wheel()


def test_wheel_tag_matches_limited_api(setup_py):
    # torch compiles with -DPy_LIMITED_API=<min_supported_cpython>; the wheel must say the same.
    from torch.utils import cpp_extension

    assert setup_py.limited_api_tag("0x030A0000") == "cp310"
    assert setup_py.limited_api_tag("0x030B0000") == "cp311"
    assert setup_py.limited_api_tag() == setup_py.limited_api_tag(cpp_extension.min_supported_cpython)
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'requires-python = ">=3.10"' in f.read()
    assert setup_py.limited_api_tag() == "cp310"


def test_setup_py_stops_with_the_wheel_message(tmp_path):
    """Run as pip does (setuptools.build_meta execs it as __main__), with the bdist_wheel entry point
    hidden: it exits 1 with the message before building anything."""
    hide = (
        "import importlib.metadata as m, runpy, sys\n"
        "real = m.entry_points\n"
        "def entry_points(**kw):\n"
        "    eps = real(**kw)\n"
        "    if kw.get('group') == 'distutils.commands':\n"
        "        return m.EntryPoints(e for e in eps if e.name != 'bdist_wheel')\n"
        "    return eps\n"
        "m.entry_points = entry_points\n"
        "sys.argv = ['setup.py', 'bdist_wheel']\n"
        "runpy.run_path('setup.py', run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cannot build a wheel without the `wheel` package" in result.stderr
    assert "pip install wheel" in result.stderr


READELF_SHARED = """
 0x0000000000000001 (NEEDED)             Shared library: [libc10.so]
 0x0000000000000001 (NEEDED)             Shared library: [libstdc++.so.6]
 0x0000000000000001 (NEEDED)             Shared library: [libgcc_s.so.1]
"""


def test_cxx_runtime_check(setup_py):
    """A build whose compiler linked libstdc++ statically is refused (it crashed beside torch's)."""
    assert setup_py.needed_libraries(READELF_SHARED) == ["libc10.so", "libstdc++.so.6", "libgcc_s.so.1"]
    assert setup_py.cxx_runtime_error("_C.so", READELF_SHARED) is None
    static = READELF_SHARED.replace("libstdc++.so.6", "libm.so.6")
    assert "linked the C++ runtime statically" in setup_py.cxx_runtime_error("_C.so", static)


def test_built_extension_loads_shared_libstdcxx(setup_py):
    import shutil

    import kvkernels._C as ext
    if not sys.platform.startswith("linux"):
        pytest.skip("the libstdc++ link rule is Linux's (macOS links libc++)")
    if shutil.which("readelf") is None:
        pytest.skip("readelf is not installed")
    out = subprocess.run(["readelf", "-d", ext.__file__], capture_output=True, text=True, check=True).stdout
    assert setup_py.cxx_runtime_error(ext.__file__, out) is None


@pytest.mark.parametrize("visible", [[], [(9, 0)], [(8, 0), (8, 6)]])
def test_unset_arch_list_defaults_to_the_supported_architectures(setup_py, visible):
    # A build host without a GPU (torch's own default list would be empty: IndexError in
    # _get_cuda_arch_flags), or with one of the GPUs the defaults cover: no extra advice.
    for unset in (None, "", "  "):
        arch_list, message = setup_py.cuda_arch_plan(unset, visible)
        assert arch_list == "8.0;9.0a"
        for part in ('TORCH_CUDA_ARCH_LIST="8.0;9.0a"', "KVKERNELS_NO_CUDA=1", "sm_90a"):
            assert part in message, part
        assert "runs none of these" not in message


def test_unset_arch_list_names_a_visible_gpu_it_does_not_cover(setup_py):
    arch_list, message = setup_py.cuda_arch_plan(None, [(9, 0), (10, 0)])
    assert arch_list == "8.0;9.0a"
    assert "sm_100" in message and 'TORCH_CUDA_ARCH_LIST="8.0+PTX"' in message


def test_a_set_arch_list_is_kept(setup_py):
    assert setup_py.cuda_arch_plan("9.0a", []) == ("9.0a", None)
    assert setup_py.cuda_arch_plan("8.6;8.9+PTX", [(10, 0)]) == ("8.6;8.9+PTX", None)


def test_toolkit_root_is_found_behind_an_nvcc_wrapper(setup_py, tmp_path):
    """A wrapper script on PATH (this project's machines: /usr/local/bin/nvcc execs
    /usr/local/cuda-13.0/bin/nvcc) makes torch's CUDA_HOME /usr/local, which has no CUDA headers: the
    toolkit nvcc really runs from is found through `nvcc --dryrun`'s TOP."""
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime_api.h").write_text("")
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\necho '#$ _NVVM_BRANCH_=nvvm' >&2\necho '#$ TOP={toolkit}/bin/..' >&2\n")
    wrapper.chmod(0o755)
    assert setup_py.nvcc_top(str(wrapper)) == str(toolkit)
    assert setup_py.cuda_toolkit_root([str(tmp_path), setup_py.nvcc_top(str(wrapper)), None]) == str(toolkit)
    assert setup_py.cuda_toolkit_root([str(tmp_path), None]) is None
    assert setup_py.nvcc_top(str(tmp_path / "missing")) is None


def test_jax_libraries_are_built_when_jax_is_installed(setup_py):
    assert setup_py.jax_plan(True, False, False)
    assert not setup_py.jax_plan(False, False, False)  # no jax: the torch extension alone
    assert not setup_py.jax_plan(True, True, False)    # KVKERNELS_NO_JAX=1 (make build: make jax-cpu builds them)
    assert not setup_py.jax_plan(True, False, True)    # sanitizer / AMX-emulator builds

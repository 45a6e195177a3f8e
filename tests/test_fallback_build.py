"""The host kernels' portable fallbacks, which this machine's compiler never takes.

``_kernels.pyx`` is rebuilt from the installed sources, bounds-checked, with
``PKV_NO_VECTOR`` (the plain loops a compiler without vector extensions
gets) and ``PKV_NO_FLOAT16`` (numpy's npymath float16 conversions, for a
compiler without ``_Float16``), then a ragged float32 and float16 workload
runs through both builds: the fallback must agree with the vector build.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.resources import files

import numpy as np
import pytest

import pagedkv
from pagedkv.backends import host

# builds the kernels without vector extensions first
pytestmark = pytest.mark.slow

SETUP = textwrap.dedent("""
    import os, numpy as np
    from Cython.Build import cythonize
    from setuptools import Extension, setup
    setup(script_args=["build_ext", "--inplace", "-q"], ext_modules=cythonize(
        [Extension("fallback_kernels", ["fallback_kernels.pyx"],
                   include_dirs=[np.get_include(), "."],
                   library_dirs=[os.path.join(os.path.dirname(np.get_include()), "lib")],
                   libraries=["npymath"],
                   define_macros=[("PKV_NO_VECTOR", None), ("PKV_NO_FLOAT16", None)],
                   extra_compile_args=["-O1"])],
        compiler_directives={"language_level": 3, "boundscheck": True, "wraparound": False},
        quiet=True))
""")


@pytest.fixture(scope="module")
def fallback_kernels(tmp_path_factory):
    pytest.importorskip("Cython", reason="needs Cython (the test extra installs it)")
    if sys.platform == "win32":
        pytest.skip("the fallback build script passes GCC/Clang flags")
    build = tmp_path_factory.mktemp("fallback")
    sources = files("pagedkv")
    shutil.copy(sources / "_kernels.pyx", build / "fallback_kernels.pyx")
    for header in ("pkv_half.h", "pkv_simd.h", "pkv_block.h", "pkv_quant.h", "pkv_recurrent.h",
                   "_kernels_rows.pxi", "_kernels_recurrent.pxi"):
        shutil.copy(sources / header, build / header)
    for header in ("pkv_work_item.h", "pkv_storage.h", "pkv_tanh.h", "pkv_variant.h"):
        shutil.copy(files("pagedkv.opencl") / header, build / header)
    (build / "setup.py").write_text(SETUP)
    result = subprocess.run([sys.executable, "setup.py"], cwd=build, capture_output=True,
                            text=True, env={**os.environ, "CFLAGS": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    module = next(p for p in os.listdir(build) if p.startswith("fallback_kernels") and
                  p.endswith((".so", ".pyd")))
    spec = importlib.util.spec_from_file_location("fallback_kernels", build / module)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    return kernels


def run_workload(dtype, head_dim):
    """Outputs and gathered K/V of a ragged prefill, then a decode step."""
    rng = np.random.default_rng(1)
    cache = pagedkv.PagedKVCache(1, 2, head_dim, num_pages=64, page_size=7, dtype=dtype,
                                 backend="host")
    seqs = [cache.add_sequence() for _ in range(3)]
    outputs = []
    for counts in ([9, 20, 3], [1, 1, 1]):
        batch = cache.append(seqs, counts)
        n = sum(counts)
        k, v = (rng.standard_normal((n, 2, head_dim), dtype=np.float32) for _ in range(2))
        cache.store(0, batch, k, v)
        outputs.append(cache.attention(0, batch, rng.standard_normal((n, 6, head_dim),
                                                                     dtype=np.float32)))
    return outputs, [cache.gather(0, s) for s in seqs]


@pytest.mark.parametrize("dtype,head_dim", [("float32", 128), ("float32", 40), ("float16", 64),
                                            ("bfloat16", 64)])
def test_fallback_kernels_agree_with_the_vector_build(fallback_kernels, monkeypatch, dtype,
                                                      head_dim):
    expected_out, expected_kv = run_workload(dtype, head_dim)
    monkeypatch.setattr(host, "_kernels", fallback_kernels)
    out, kv = run_workload(dtype, head_dim)
    for got, want in zip(out, expected_out):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for (k, v), (k_want, v_want) in zip(kv, expected_kv):
        np.testing.assert_array_equal(k, k_want)   # the same float16 / bfloat16 rounding
        np.testing.assert_array_equal(v, v_want)


def run_recurrences():
    """Outputs and states of both recurrences over a ragged step with saves (host)."""
    from types import SimpleNamespace
    rng = np.random.default_rng(2)
    backend = pagedkv.PagedKVCache(1, 1, 8, num_pages=1, backend="host")._backend
    store = backend.state_store([((70, 3), (4, 16, 40))], 6)
    step = SimpleNamespace(query_start=np.array([0, 1, 31], np.int32),
                           slots=np.array([0, 1], np.int32), save_rows=np.array([9], np.int32),
                           save_slots=np.array([2], np.int32))
    y = backend.causal_conv1d(store, 0, 0, step, rng.standard_normal((31, 70), dtype=np.float32),
                              rng.standard_normal((70, 4), dtype=np.float32), None, True)
    q, k = (rng.standard_normal((31, 2, 16), dtype=np.float32) for _ in "qk")
    o = backend.gated_delta_rule(store, 0, 1, step, q, k,
                                 rng.standard_normal((31, 4, 40), dtype=np.float32),
                                 -rng.uniform(0, 1, (31, 4)).astype(np.float32),
                                 rng.uniform(0, 1, (31, 4)).astype(np.float32), 0.25, True)
    slots = np.arange(6, dtype=np.int32)
    return [y, o, store.read(0, 0, slots), store.read(0, 1, slots)]


def test_fallback_recurrences_agree_with_the_vector_build(fallback_kernels, monkeypatch):
    expected = run_recurrences()
    monkeypatch.setattr(host, "_kernels", fallback_kernels)
    for got, want in zip(run_recurrences(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

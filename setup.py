"""Build the Cython host backend.

The Cython directives are set once here.  ``PAGEDKV_DEBUG=1`` turns bounds
checks and wraparound back on (a debugging build); ``PAGEDKV_PORTABLE=1``
drops ``-march=native`` for a binary that runs on any CPU of the architecture.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("PAGEDKV_DEBUG", "") == "1"
PORTABLE = os.environ.get("PAGEDKV_PORTABLE", "") == "1"


def _compiler_accepts(flags):
    """True if the C compiler builds and links a trivial file with ``flags``."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()
    if shutil.which(cc[0]) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() < 0;}\n"
                    if "-fopenmp" in flags else "int main(void){return 0;}\n")
        cmd = cc + flags + [src, "-o", os.path.join(tmp, "probe")]
        return subprocess.run(cmd, capture_output=True).returncode == 0


compile_args, link_args = [], []
if sys.platform != "win32":
    compile_args += ["-O3"]
    # Let the compiler vectorise float reductions (dot products) without
    # -ffast-math, which would also flush denormals for the whole process.
    compile_args += ["-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
                     "-fno-signed-zeros"]
    if not PORTABLE and _compiler_accepts(["-march=native"]):
        compile_args.append("-march=native")
    if _compiler_accepts(["-fopenmp-simd"]):
        compile_args.append("-fopenmp-simd")
    if _compiler_accepts(["-fopenmp"]):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    else:
        print("pagedkv: compiler has no OpenMP; the host kernels will run serially")

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
}


# numpy's static npymath library: pkv_half.h falls back on its float16
# conversions where the compiler has no _Float16 (it lies next to numpy's
# headers in numpy 1.x and 2.x alike).
NPYMATH_DIR = os.path.join(os.path.dirname(np.get_include()), "lib")


def ext(name, language="c", libraries=()):
    return Extension(
        f"pagedkv.{name}",
        [f"pagedkv/{name}.pyx"],
        include_dirs=[np.get_include(), "pagedkv", "opencl"],   # opencl/pkv_work_item.h
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        library_dirs=[NPYMATH_DIR] if libraries else [],
        libraries=list(libraries),
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        language=language,
    )


setup(
    ext_modules=cythonize(
        [ext("_allocator"), ext("_page_table", "c++"), ext("_kernels", libraries=["npymath"])],
        compiler_directives=directives,
    ),
)

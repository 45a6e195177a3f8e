"""Build the Cython host backend.

The host kernels (``pagedkv/_kernels.pyx`` with ``pkv_simd.h`` and
``pkv_half.h``) are compiled once per instruction-set level of the target
architecture (``pagedkv/_levels.py``: on x86-64 baseline SSE2, AVX2 and
AVX-512; on AArch64 the NEON baseline), as ``pagedkv._kernels_<level>``;
``pagedkv._cpu`` imports the best one the CPU runs.  Each level's module is a
generated three-line ``.pyx`` under ``build/`` that includes ``_kernels.pyx``,
so the kernels have one source.  Everything else (``_allocator``, ``_pool``,
``_page_table``, ``_placement``, ``_prefix_chains``, ``_cpuid``, ``_ints``, ``_rows``) is built
at the baseline: it runs before the
choice.

The Cython directives are set once here.  ``PAGEDKV_DEBUG=1`` turns bounds
checks and wraparound back on (a debugging build); ``PAGEDKV_PORTABLE=1``
builds the baseline level alone (a quicker build; the kernels run slower).
``PAGEDKV_SANITIZE=1`` builds every module with AddressSanitizer and UBSan
(see "Sanitizer build" below).
"""
import os
import runpy
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("PAGEDKV_DEBUG", "") == "1"
PORTABLE = os.environ.get("PAGEDKV_PORTABLE", "") == "1"
LEVELS = runpy.run_path(os.path.join(HERE, "pagedkv", "_levels.py"))

# A loop that the compiler turns into vector instructions of the level's width:
# a level's flags count only if the compiler and the assembler take them.
VECTOR_PROBE = """
typedef float pkv_v16 __attribute__((vector_size(64)));
int main(int argc, char **argv) {
    volatile pkv_v16 x = {0};
    pkv_v16 y = x * x + x;
    (void)argv;
    return (int)y[argc & 15];
}
"""


def _arch_flags():
    """The ``-arch`` flags macOS builds take from ``ARCHFLAGS`` (cibuildwheel sets them)."""
    return os.environ.get("ARCHFLAGS", "").split() if sys.platform == "darwin" else []


def _compiler_accepts(flags, source="int main(void){return 0;}\n"):
    """True if the C compiler builds and links ``source`` with ``flags``."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()
    if shutil.which(cc[0]) is None:
        return False
    if "-fopenmp" in flags:
        source = "#include <omp.h>\nint main(void){return omp_get_max_threads() < 0;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(source)
        cmd = cc + _arch_flags() + flags + [src, "-o", os.path.join(tmp, "probe")]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def _target_arch():
    """The architecture the extensions are built for (a ``_levels.normalize_arch`` name).

    On macOS a single ``-arch`` in ``ARCHFLAGS`` decides (cibuildwheel
    cross-compiles x86_64 on arm64 that way); several (universal2) get the
    baseline alone, since one compile serves every architecture.
    """
    archs = [a for flag, a in zip(_arch_flags(), _arch_flags()[1:]) if flag == "-arch"]
    if len(archs) > 1:
        return "universal2"
    machine = archs[0] if archs else sysconfig.get_platform().rsplit("-", 1)[-1]
    return LEVELS["target_arch"](machine, struct.calcsize("P"))


compile_args, link_args = [], []
if sys.platform != "win32":
    compile_args += ["-O3"]
    # Let the compiler vectorise float reductions (dot products) without
    # -ffast-math, which would also flush denormals for the whole process.
    compile_args += ["-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
                     "-fno-signed-zeros"]
    # GCC's note that passing 32-byte vectors changed ABI in GCC 4.6: pkv_simd.h
    # passes them only between its static functions, in the baseline build
    if _compiler_accepts(["-Werror", "-Wno-psabi"]):
        compile_args.append("-Wno-psabi")
    if _compiler_accepts(["-fopenmp-simd"]):
        compile_args.append("-fopenmp-simd")
    if _compiler_accepts(["-fopenmp"]):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    else:
        print("pagedkv: compiler has no OpenMP; the host kernels will run serially")

# --- Sanitizer build --------------------------------------------------------------------
# PAGEDKV_SANITIZE=1 compiles every module with AddressSanitizer and UndefinedBehaviorSanitizer
# (GCC or Clang), with the release directives (no bounds checks: the sanitizers check the C
# that a release runs) and OpenMP; any UB report aborts.  Python itself is not instrumented,
# so the ASan runtime must be loaded first, and libstdc++ after it (ASan wraps __cxa_throw):
# LD_PRELOAD="$(cc -print-file-name=libasan.so) $(cc -print-file-name=libstdc++.so)".
# PAGEDKV_CPU_LEVEL=<level> then builds that kernel level alone (a quicker build, for the
# machine that runs the tests).  tests/test_sanitizers.py builds and runs it.
SANITIZE = os.environ.get("PAGEDKV_SANITIZE", "") == "1"
SANITIZE_LEVEL = os.environ.get("PAGEDKV_CPU_LEVEL", "").strip().lower() if SANITIZE else ""
if SANITIZE:
    if sys.platform == "win32":
        sys.exit("PAGEDKV_SANITIZE=1 needs GCC or Clang (the flags are theirs)")
    sanitizers = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    compile_args += sanitizers + ["-O1", "-g", "-fno-omit-frame-pointer"]   # -O1 after -O3
    link_args += sanitizers


def kernel_levels():
    """The levels to build the kernels for: every level of the target the compiler takes."""
    levels = LEVELS["levels_for"](_target_arch())
    if PORTABLE or sys.platform == "win32":  # MSVC: no vector extensions, plain loops only
        return levels[:1]
    if SANITIZE_LEVEL:
        chosen = [level for level in levels if level.name == SANITIZE_LEVEL]
        if not chosen:
            sys.exit(f"PAGEDKV_CPU_LEVEL: expected one of {[lv.name for lv in levels]}, "
                     f"got {SANITIZE_LEVEL!r}")
        return chosen
    built = [levels[0]]
    for level in levels[1:]:
        if _compiler_accepts(list(level.flags) + ["-O2"], VECTOR_PROBE):
            built.append(level)
        else:
            print(f"pagedkv: the C compiler does not take {' '.join(level.flags)}; the "
                  f"{level.name!r} level of the host kernels is left out")
    return built


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

# Where the generated per-level sources go (never into the package).
LEVEL_SOURCES = os.path.join("build", "pagedkv_levels")

LEVEL_TEMPLATE = '''\
# Generated by setup.py; edit pagedkv/_kernels.pyx instead.
"""pagedkv's host kernels (``_kernels.pyx``) compiled for the {name!r} level: {description}."""
include "_kernels.pyx"
include "_kernels_level.pxi"

#: The instruction-set level this module was compiled for.
CPU_LEVEL = "{name}"
'''


def ext(name, language="c", libraries=(), source=None, extra_args=()):
    return Extension(
        f"pagedkv.{name}",
        [source or f"pagedkv/{name}.pyx"],
        include_dirs=[np.get_include(), "pagedkv", "opencl"],   # opencl/pkv_work_item.h
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        library_dirs=[NPYMATH_DIR] if libraries else [],
        libraries=list(libraries),
        extra_compile_args=compile_args + list(extra_args),
        extra_link_args=link_args,
        language=language,
    )


def kernel_extension(level):
    """The extension ``pagedkv._kernels_<level>``, from a generated source that includes
    ``_kernels.pyx`` (rewritten only when its text changes, so rebuilds stay incremental)."""
    os.makedirs(LEVEL_SOURCES, exist_ok=True)
    source = os.path.join(LEVEL_SOURCES, f"_kernels_{level.name}.pyx")
    text = LEVEL_TEMPLATE.format(name=level.name, description=level.description)
    if not os.path.exists(source) or open(source).read() != text:
        with open(source, "w") as f:
            f.write(text)
    return ext(f"_kernels_{level.name}", libraries=["npymath"], source=source,
               extra_args=level.flags)


def _build_jobs():
    """Compiler processes at once: one per core (the kernel levels compile side by side)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


setup(
    options={"build_ext": {"parallel": _build_jobs()}},
    ext_modules=cythonize(
        [ext("_allocator"), ext("_pool", "c++"), ext("_page_table", "c++"),
         ext("_placement", "c++"), ext("_prefix_chains", "c++"), ext("_cpuid"), ext("_ints"),
         ext("_rows")]
        + [kernel_extension(level) for level in kernel_levels()],
        compiler_directives=directives,
        include_path=["pagedkv"],
        nthreads=_build_jobs(),      # Cython's translation too, one module per core
    ),
)

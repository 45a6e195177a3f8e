"""The host kernels' instruction-set levels: the compiler flags and CPU features of each.

One table serves the build and the import: ``setup.py`` compiles
``_kernels.pyx`` once per level of the target architecture, as
``pagedkv._kernels_<level>`` with the level's flags, and :mod:`pagedkv._cpu`
imports the best level whose features the CPU has.  This module imports
nothing, so that ``setup.py`` can read it before pagedkv is built.

Levels are listed from the lowest; the first of each architecture is its
baseline, built with the compiler's default flags, which every CPU of the
architecture runs (and so do ``_allocator``, ``_page_table`` and ``_cpuid``,
which run before the choice).
"""
from typing import NamedTuple, Tuple


class Level(NamedTuple):
    """One instruction-set level of the host kernels.

    Attributes
    ----------
    name : str
        The module suffix and the value ``PAGEDKV_CPU_LEVEL`` takes.
    description : str
        What the level uses, for ``pagedkv.show_config()``.
    flags : tuple of str
        GCC/Clang flags added to the common ones for this level's module.
    features : frozenset of str
        CPU features (as :func:`pagedkv._cpu.cpu_features` names them) that
        code built with ``flags`` may use: the level runs only where the CPU
        has them all.
    """

    name: str
    description: str
    flags: Tuple[str, ...]
    features: frozenset


# x86-64-v3 (Haswell, Zen 1 and later), spelled out so that the flags and the
# run-time check name the same features, and older compilers (no
# -march=x86-64-v3 before GCC 11) take them.
_V3_FLAGS = ("-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mmovbe", "-mpopcnt",
             "-mcx16", "-msahf")
_V3_FEATURES = frozenset({"sse3", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm",
                          "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "lzcnt", "movbe",
                          "os_avx"})
# x86-64-v4 (Skylake-SP, Ice Lake, Zen 4 and later).
_V4_FLAGS = _V3_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512cd", "-mavx512dq", "-mavx512vl")
_V4_FEATURES = _V3_FEATURES | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                               "os_avx512"}

LEVELS = {
    "x86_64": (
        Level("baseline", "SSE2 (the x86-64 baseline)", (), frozenset()),
        Level("avx2", "AVX2 + FMA + F16C (x86-64-v3)", _V3_FLAGS, _V3_FEATURES),
        Level("avx512", "AVX-512 F/BW/CD/DQ/VL (x86-64-v4)", _V4_FLAGS, _V4_FEATURES),
    ),
    # Advanced SIMD is part of ARMv8-A: the baseline has it.
    "aarch64": (Level("baseline", "NEON (the AArch64 baseline)", (), frozenset()),),
}
_OTHER = (Level("baseline", "the compiler's default for this architecture", (), frozenset()),)


def normalize_arch(machine: str) -> str:
    """The ``LEVELS`` key of a machine name (``platform.machine()``, a platform tag's tail).

    ``"AMD64"`` and ``"x86_64"`` are ``"x86_64"``, ``"arm64"`` and ``"aarch64"``
    are ``"aarch64"``; other names come back lower-cased.
    """
    machine = machine.lower()
    if machine in ("x86_64", "amd64", "x64"):
        return "x86_64"
    if machine in ("aarch64", "arm64"):
        return "aarch64"
    return machine


def target_arch(machine: str, pointer_bytes: int) -> str:
    """The ``LEVELS`` key of code built for ``machine`` with pointers of ``pointer_bytes``.

    A 32-bit build on a 64-bit machine (``platform.machine()`` names the
    kernel's) is ``"i686"`` or ``"arm"``, which have only a baseline here.
    """
    arch = normalize_arch(machine)
    if pointer_bytes == 4:
        return {"x86_64": "i686", "aarch64": "arm"}.get(arch, arch)
    return arch


def levels_for(arch: str) -> Tuple[Level, ...]:
    """The levels of architecture ``arch`` (a ``normalize_arch`` name), lowest first.

    Returns
    -------
    tuple of Level
        Only a baseline for an architecture without a table here.
    """
    return LEVELS.get(arch, _OTHER)

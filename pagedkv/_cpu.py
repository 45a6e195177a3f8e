"""The host kernels of this CPU's instruction-set level, chosen once, at import.

``setup.py`` compiles ``_kernels.pyx`` once per level of the architecture
(:mod:`pagedkv._levels`): on x86-64 ``pagedkv._kernels_baseline`` (SSE2),
``_kernels_avx2`` (x86-64-v3) and ``_kernels_avx512`` (x86-64-v4); on
AArch64 the baseline alone (NEON).  This module reads the CPU's features
(``cpuid`` and ``xgetbv`` through the baseline module ``_cpuid``: they are
what the CPU, or an emulator such as qemu, really offers, which
``/proc/cpuinfo`` under an emulator is not) and imports the best level that
the CPU runs and the build has.  ``kernels`` is that module::

    from pagedkv._cpu import kernels as _kernels

``PAGEDKV_CPU_LEVEL=baseline|avx2|avx512`` forces a lower level (for tests
and bug reports).  A level above what the CPU runs is refused with a
``RuntimeWarning``, and the best level it runs is taken instead; a name that
is no level of this architecture is a ``ValueError``.
"""
import importlib
import importlib.util
import os
import platform
import struct
import warnings
from types import ModuleType
from typing import (TYPE_CHECKING, Callable, Collection, FrozenSet, List, Optional, Sequence,
                    Tuple)

from pagedkv import _cpuid
from pagedkv._levels import Level, levels_for, target_arch

ENV_VAR = "PAGEDKV_CPU_LEVEL"

# (leaf, subleaf, register (0 eax, 1 ebx, 2 ecx, 3 edx), bit, feature name)
_X86_FEATURE_BITS = (
    (1, 0, 3, 25, "sse"), (1, 0, 3, 26, "sse2"),
    (1, 0, 2, 0, "sse3"), (1, 0, 2, 9, "ssse3"), (1, 0, 2, 12, "fma"), (1, 0, 2, 13, "cx16"),
    (1, 0, 2, 19, "sse4_1"), (1, 0, 2, 20, "sse4_2"), (1, 0, 2, 22, "movbe"),
    (1, 0, 2, 23, "popcnt"), (1, 0, 2, 27, "osxsave"), (1, 0, 2, 28, "avx"),
    (1, 0, 2, 29, "f16c"),
    (7, 0, 1, 3, "bmi1"), (7, 0, 1, 5, "avx2"), (7, 0, 1, 8, "bmi2"),
    (7, 0, 1, 16, "avx512f"), (7, 0, 1, 17, "avx512dq"), (7, 0, 1, 28, "avx512cd"),
    (7, 0, 1, 30, "avx512bw"), (7, 0, 1, 31, "avx512vl"),
    (0x80000001, 0, 2, 0, "lahf_lm"), (0x80000001, 0, 2, 5, "lzcnt"),
)
_XCR0_AVX = 0x6        # SSE and AVX (YMM) state
_XCR0_AVX512 = 0xE6    # ... and opmask, ZMM0-15 upper halves, ZMM16-31


def host_arch() -> str:
    """The architecture this interpreter runs (a :func:`pagedkv._levels.target_arch` name)."""
    return target_arch(platform.machine(), struct.calcsize("P"))


def decode_x86_features(
        cpuid: Callable[[int, int], Optional[Tuple[int, int, int, int]]], xcr0: int,
        sysctl_int: Callable[[str], Optional[int]] = lambda name: None) -> FrozenSet[str]:
    """CPU feature names from the x86 registers.

    Parameters
    ----------
    cpuid : callable
        ``cpuid(leaf, subleaf)`` -> ``(eax, ebx, ecx, edx)``, or None for a
        leaf the CPU does not report.
    xcr0 : int
        The register state the OS saves (0 without OSXSAVE).
    sysctl_int : callable
        ``sysctl_int(name)`` -> int or None; on macOS, which enables the
        AVX-512 state lazily, ``hw.optional.avx512f`` stands in for XCR0.

    Returns
    -------
    frozenset of str
        The names of ``_X86_FEATURE_BITS`` whose bit is set, plus ``"os_avx"``
        and ``"os_avx512"`` where the OS saves those registers.
    """
    leaves = {}
    found = set()
    for leaf, subleaf, register, bit, name in _X86_FEATURE_BITS:
        if (leaf, subleaf) not in leaves:
            leaves[leaf, subleaf] = cpuid(leaf, subleaf)
        regs = leaves[leaf, subleaf]
        if regs is not None and regs[register] >> bit & 1:
            found.add(name)
    if "osxsave" in found and xcr0 & _XCR0_AVX == _XCR0_AVX:
        found.add("os_avx")
        if xcr0 & _XCR0_AVX512 == _XCR0_AVX512 or sysctl_int("hw.optional.avx512f") == 1:
            found.add("os_avx512")
    return frozenset(found)


def cpu_features() -> FrozenSet[str]:
    """The features of the CPU this process runs on (empty off x86).

    Returns
    -------
    frozenset of str
        See :func:`decode_x86_features`.
    """
    if not _cpuid.IS_X86:
        return frozenset()
    return decode_x86_features(_cpuid.cpuid, _cpuid.xcr0(), _cpuid.sysctl_int)


def choose_level(levels: Sequence[Level], features: FrozenSet[str], built: Collection[str],
                 requested: Optional[str] = None) -> Tuple[Level, List[str]]:
    """The level to run, and why.

    Parameters
    ----------
    levels : tuple of pagedkv._levels.Level
        The architecture's levels, lowest first.
    features : frozenset of str
        The CPU's features.
    built : collection of str
        Names of the levels whose module the build has.
    requested : str or None
        ``PAGEDKV_CPU_LEVEL``: the highest level to consider; None or ``""``
        for no limit.

    Returns
    -------
    level : pagedkv._levels.Level
        The highest level that is built, that the CPU runs and, when
        ``requested`` is given, not above it.
    notes : list of str
        Why the level differs from ``requested`` (for a ``RuntimeWarning``);
        empty when it does not.

    Raises
    ------
    ValueError
        ``requested`` is not a level of the architecture.
    ImportError
        No level is built that the CPU runs (a build without its kernels).
    """
    names = [level.name for level in levels]
    runnable = [level for level in levels if level.features <= features]
    notes = []
    limit = len(levels)
    if requested:
        requested = requested.strip().lower()
        if requested not in names:
            raise ValueError(f"{ENV_VAR}: expected one of {names} on this CPU architecture, or "
                             f"unset for the best level the CPU runs, got {requested!r}")
        limit = names.index(requested) + 1
        if levels[limit - 1] not in runnable:
            missing = sorted(levels[limit - 1].features - features)
            notes.append(f"{ENV_VAR}={requested}: this CPU cannot run that level (it lacks "
                         f"{', '.join(missing)})")
    candidates = [level for level in runnable[:limit] if level.name in built]
    if not candidates:
        raise ImportError(f"pagedkv's host kernels are missing: no kernel module for the "
                          f"levels {[level.name for level in runnable[:limit]]} is built")
    chosen = candidates[-1]
    if requested and chosen.name != requested and not notes:
        notes.append(f"{ENV_VAR}={requested}: that level is not built (built: "
                     f"{sorted(built, key=names.index)})")
    if notes:
        notes[-1] += f"; using the {chosen.name!r} level"
    return chosen, notes


def module_name(level_name: str) -> str:
    """The module that holds the kernels of a level: ``pagedkv._kernels_<level>``."""
    return f"pagedkv._kernels_{level_name}"


def _built(levels: Sequence[Level]) -> List[str]:
    return [level.name for level in levels
            if importlib.util.find_spec(module_name(level.name)) is not None]


ARCH = host_arch()
LEVELS = levels_for(ARCH)
FEATURES = cpu_features()
#: Names of the levels this CPU runs, and of those the build has, lowest first.
SUPPORTED = tuple(level.name for level in LEVELS if level.features <= FEATURES)
BUILT = tuple(_built(LEVELS))
#: The value of ``PAGEDKV_CPU_LEVEL`` the choice was made with ("" when unset).
REQUESTED = os.environ.get(ENV_VAR, "").strip()


def _load() -> Tuple[Level, ModuleType]:
    chosen, notes = choose_level(LEVELS, FEATURES, BUILT, REQUESTED)
    for note in notes:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    return chosen, importlib.import_module(module_name(chosen.name))


#: The chosen level (a :class:`pagedkv._levels.Level`), and its kernel module.
if TYPE_CHECKING:
    # every level's module has the interface that pagedkv/_kernels.pyi describes
    from pagedkv import _kernels as kernels
    level: Level
else:
    level, kernels = _load()

"""CPU feature registers, read for the import-time choice of the host kernels' level.

Built at the baseline level of the architecture (no ``-m`` flags), since it
runs before the choice.  It only reads registers (``pkv_cpuid.h``); their
decoding into feature names and the choice are in :mod:`pagedkv._cpu`.
"""
from libc.stdint cimport uint32_t, uint64_t

cdef extern from "pkv_cpuid.h" nogil:
    int PKV_X86
    int pkv_cpuid(uint32_t leaf, uint32_t subleaf, uint32_t* regs)
    uint64_t pkv_xcr0()
    long pkv_sysctl_int(const char* name)

#: Whether this module was built for x86 (``cpuid`` answers only there).
IS_X86 = bool(PKV_X86)


def cpuid(uint32_t leaf, uint32_t subleaf=0):
    """The registers of the ``cpuid`` instruction.

    Parameters
    ----------
    leaf, subleaf : int
        The ``eax`` and ``ecx`` inputs, e.g. ``(7, 0)`` for the structured
        extended features.

    Returns
    -------
    tuple of 4 int or None
        ``(eax, ebx, ecx, edx)``; None where the CPU does not report the leaf
        (above its highest basic or extended leaf) or off x86.
    """
    cdef uint32_t regs[4]
    if not pkv_cpuid(leaf, subleaf, regs):
        return None
    return regs[0], regs[1], regs[2], regs[3]


def xcr0():
    """The register state the OS saves (XCR0): bit 1 SSE, bit 2 AVX, bits 5-7 AVX-512.

    Returns
    -------
    int
        0 where the OS has not enabled XSAVE, and off x86.
    """
    return pkv_xcr0()


def sysctl_int(name):
    """The value of the macOS sysctl ``name`` (e.g. ``"hw.optional.avx512f"``).

    Returns
    -------
    int or None
        None where the sysctl does not exist, and everywhere but macOS.
    """
    cdef long value = pkv_sysctl_int(name.encode("ascii"))
    return None if value < 0 else value

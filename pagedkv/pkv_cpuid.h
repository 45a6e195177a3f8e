/* CPU feature probing for the import-time choice of the host kernels' level.
 *
 * This header is compiled at the baseline level (no -m flags): it runs before
 * the choice, on any CPU of the architecture.  It only reads registers; the
 * decoding of feature bits and the choice itself are in pagedkv/_cpu.py.
 */
#ifndef PKV_CPUID_H
#define PKV_CPUID_H
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
#define PKV_X86 1
#if defined(_MSC_VER)
#include <intrin.h>
#else
#include <cpuid.h>
#endif
#else
#define PKV_X86 0
#endif

#if defined(__APPLE__)
#include <string.h>
#include <sys/sysctl.h>
#define PKV_DARWIN 1
#else
#define PKV_DARWIN 0
#endif

/* regs = {eax, ebx, ecx, edx} of cpuid(leaf, subleaf).  Returns 0 (regs all
 * zero) where the leaf is above the highest one the CPU reports in its range
 * (basic or extended), and everywhere off x86. */
static int pkv_cpuid(uint32_t leaf, uint32_t subleaf, uint32_t *regs) {
    regs[0] = regs[1] = regs[2] = regs[3] = 0;
#if PKV_X86 && defined(_MSC_VER)
    int r[4];
    __cpuid(r, (int)(leaf & 0x80000000u));
    if ((uint32_t)r[0] < leaf) return 0;
    __cpuidex(r, (int)leaf, (int)subleaf);
    for (int i = 0; i < 4; i++) regs[i] = (uint32_t)r[i];
    return 1;
#elif PKV_X86
    unsigned int a, b, c, d;
    if (!__get_cpuid_count(leaf, subleaf, &a, &b, &c, &d)) return 0;
    regs[0] = a; regs[1] = b; regs[2] = c; regs[3] = d;
    return 1;
#else
    (void)leaf; (void)subleaf;
    return 0;
#endif
}

/* XCR0, the register state the OS saves on a context switch (bit 1 SSE,
 * 2 AVX, 5-7 AVX-512).  0 where the OS has not enabled XSAVE (OSXSAVE clear:
 * xgetbv itself would fault) and off x86. */
static uint64_t pkv_xcr0(void) {
#if PKV_X86
    uint32_t regs[4];
    if (!pkv_cpuid(1, 0, regs) || !(regs[2] & (1u << 27))) return 0;
#if defined(_MSC_VER)
    return (uint64_t)_xgetbv(0);
#else
    uint32_t eax, edx;
    /* xgetbv spelled as bytes: the mnemonic would need -mxsave, which this
     * baseline file must not get. */
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
#endif
#else
    return 0;
#endif
}

/* The integer value of a macOS sysctl such as "hw.optional.avx512f"; -1
 * where it does not exist, and everywhere but macOS.  macOS enables the
 * AVX-512 register state lazily, on a thread's first AVX-512 instruction, so
 * XCR0 alone under-reports it there. */
static long pkv_sysctl_int(const char *name) {
#if PKV_DARWIN
    int64_t value64 = 0;
    size_t size = sizeof value64;
    if (sysctlbyname(name, &value64, &size, NULL, 0) != 0) return -1;
    if (size == sizeof(int32_t)) {
        int32_t value32;
        memcpy(&value32, &value64, sizeof value32);
        return (long)value32;
    }
    return (long)value64;
#else
    (void)name;
    return -1;
#endif
}

#endif

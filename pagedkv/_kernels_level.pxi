# What a level's kernel module (``pagedkv._kernels_<level>``) adds to
# ``_kernels.pyx``: how it was built.  setup.py generates each level's module
# source as ``include "_kernels.pyx"``, this file, and ``CPU_LEVEL = "<level>"``.

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define PKV_OPENMP_VERSION _OPENMP
    static int pkv_openmp_max_threads(void) { return omp_get_max_threads(); }
    #else
    #define PKV_OPENMP_VERSION 0
    static int pkv_openmp_max_threads(void) { return 1; }
    #endif
    """
    int PKV_OPENMP_VERSION
    int pkv_openmp_max_threads() nogil

#: The ``_OPENMP`` date (e.g. 201511 for OpenMP 4.5) this module was compiled
#: with; 0 when it was compiled without OpenMP (its loops then run serially).
OPENMP_VERSION = PKV_OPENMP_VERSION


def openmp_max_threads():
    """``omp_get_max_threads()``: the threads an OpenMP region would use by default (1 without OpenMP)."""
    return pkv_openmp_max_threads()

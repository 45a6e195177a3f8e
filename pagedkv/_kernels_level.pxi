# What a level's kernel module (``pagedkv._kernels_<level>``) adds to
# ``_kernels.pyx``: how it was built.  setup.py generates each level's module
# source as ``include "_kernels.pyx"``, this file, and ``CPU_LEVEL = "<level>"``.

cdef extern from *:
    """
    #ifdef _OPENMP
    #define PKV_OPENMP_VERSION _OPENMP
    #else
    #define PKV_OPENMP_VERSION 0
    #endif
    """
    int PKV_OPENMP_VERSION

#: The ``_OPENMP`` date (e.g. 201511 for OpenMP 4.5) this module was compiled
#: with; 0 when it was compiled without OpenMP (its loops then run serially).
OPENMP_VERSION = PKV_OPENMP_VERSION

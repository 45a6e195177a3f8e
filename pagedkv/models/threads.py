"""Keep BLAS from fighting the KV kernels for the CPU cores.

Every layer of a step alternates NumPy matmuls (OpenBLAS, with its own worker
threads) and the cache's kernels (OpenMP threads on the host backend, PoCL's
threads for OpenCL on a CPU).  OpenBLAS workers busy-wait for a while after
each call, so the kernels' threads find their cores taken; on a 2-core
machine that slowed decoding of SmolLM2-135M from ~30 to ~0.5 tokens/s.
One BLAS thread removes the fight at little cost for decode-sized matmuls.
"""
import contextlib
import warnings


@contextlib.contextmanager
def blas_threads(num_threads):
    """Limit BLAS to ``num_threads`` inside the block (``None`` = leave as is).

    Uses ``threadpoolctl`` when installed; without it, warns once and runs
    with the library defaults (set ``OPENBLAS_NUM_THREADS`` before starting
    Python for the same effect).
    """
    if num_threads is None:
        yield
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        warnings.warn("threadpoolctl is not installed, so BLAS keeps its default thread count; "
                      "if generation is slow, set OPENBLAS_NUM_THREADS=1 before starting Python",
                      stacklevel=3)
        yield
        return
    with threadpool_limits(limits=int(num_threads), user_api="blas"):
        yield

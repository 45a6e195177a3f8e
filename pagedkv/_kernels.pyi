# Type stub of the compiled module pagedkv/_kernels.pyx, which setup.py builds once per
# instruction-set level as ``pagedkv._kernels_<level>`` (with ``_kernels_level.pxi``);
# ``pagedkv._cpu.kernels`` is the level chosen at import.  Pools are
# [num_pages, num_kv_heads, page_size, head_dim] arrays of a storage format's element
# (float32, float16 as uint16 bits, bfloat16 as int16 bits, int8); scale pools are
# float32 [num_pages, num_kv_heads, page_size] (1x1x1 placeholders for float formats).
from typing import Optional, TypedDict, type_check_only

import numpy as np
import numpy.typing as npt

# the dict of `pkv_variant` (opencl/pkv_variant.h), as AttentionParams holds it
@type_check_only
class Variant(TypedDict):
    soft_cap: float
    has_sinks: int
    has_bias: int

# the dict paged_attention converts to its `cdef struct AttentionParams` (no runtime name)
@type_check_only
class AttentionParams(TypedDict):
    heads_per_item: int
    max_rows_per_item: int
    scale: float
    variant: Variant
    rotation_block: int
    rotation_scale: float
    num_threads: int

BLOCK_MIN_QUERIES: int
SPAN_KEYS_PER_STEP: int
# from _kernels_level.pxi
OPENMP_VERSION: int
CPU_LEVEL: str

def scatter(k_pool: np.ndarray, v_pool: np.ndarray, k_scales: npt.NDArray[np.float32],
            v_scales: npt.NDArray[np.float32], slot_mapping: npt.NDArray[np.int64],
            k: npt.NDArray[np.float32], v: npt.NDArray[np.float32], rotation_block: int,
            rotation_scale: float, num_threads: int) -> None: ...
def gather(pool: np.ndarray, scales: npt.NDArray[np.float32], slots: npt.NDArray[np.int64],
           out: npt.NDArray[np.float32], rotation_block: int, rotation_scale: float,
           num_threads: int) -> None: ...
def aligned_empty(n: int) -> npt.NDArray[np.float32]: ...
def paged_attention(q: npt.NDArray[np.float32], k_pool: np.ndarray, v_pool: np.ndarray,
                    k_scales: npt.NDArray[np.float32], v_scales: npt.NDArray[np.float32],
                    page_indptr: npt.NDArray[np.int32], page_indices: npt.NDArray[np.int32],
                    items: npt.NDArray[np.int32], item_offsets: npt.NDArray[np.int32],
                    sinks: Optional[npt.NDArray[np.float32]], out: npt.NDArray[np.float32],
                    params: AttentionParams,
                    bias_slopes: Optional[npt.NDArray[np.float32]] = None,
                    lse: Optional[npt.NDArray[np.float32]] = None) -> None: ...
# from _kernels_recurrent.pxi: recurrent layers' states [num_slots, *shape], advanced in place
def gated_delta_rule(state: npt.NDArray[np.float32], query_start: npt.NDArray[np.int32],
                     slots: npt.NDArray[np.int32], save_start: npt.NDArray[np.int32],
                     save_rows: npt.NDArray[np.int32], save_slots: npt.NDArray[np.int32],
                     q: npt.NDArray[np.float32], k: npt.NDArray[np.float32],
                     v: npt.NDArray[np.float32], g: npt.NDArray[np.float32],
                     beta: npt.NDArray[np.float32], scale: float, l2norm: bool,
                     out: npt.NDArray[np.float32], num_threads: int) -> None: ...
def causal_conv1d(state: npt.NDArray[np.float32], query_start: npt.NDArray[np.int32],
                  slots: npt.NDArray[np.int32], save_start: npt.NDArray[np.int32],
                  save_rows: npt.NDArray[np.int32], save_slots: npt.NDArray[np.int32],
                  x: npt.NDArray[np.float32], weight: npt.NDArray[np.float32],
                  bias: Optional[npt.NDArray[np.float32]], silu: bool,
                  out: npt.NDArray[np.float32], num_threads: int) -> None: ...

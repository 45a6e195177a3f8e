"""What ``store`` and ``attention`` accept: numpy arrays, torch CPU tensors, any CPU
object with ``__dlpack__``, and the backend's own device arrays.

Everything but the backend's device arrays is turned into a numpy ndarray
that shares the caller's memory where it can (a float32 contiguous tensor
costs no copy); the kernels then make the one float32 contiguous copy they
need, if any.  torch is never imported here: a tensor is recognised by its
type's module, and torch is used only when the caller already imported it.
"""
import sys

import numpy as np

from pagedkv.errors import ArgumentTypeError

_DLPACK_CPU = 1          # DLDeviceType kDLCPU


def is_torch_tensor(x):
    """Whether ``x`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def to_numpy(name, x):
    """``x`` (ndarray, torch CPU tensor or a CPU ``__dlpack__`` object) as an ndarray.

    Raises
    ------
    ArgumentTypeError
        ``x`` is none of those.
    ValueError
        A tensor on another device (CUDA, MPS, ...) or one that requires grad;
        the message says what to do.
    """
    if isinstance(x, np.ndarray):
        return np.asarray(x)          # a subclass's own idea of its shape is not trusted
    if is_torch_tensor(x):
        if x.requires_grad:
            raise ValueError(f"{name}: the torch tensor requires grad; pass "
                             f"{name}.detach() (pagedkv computes no gradients)")
        if x.device.type != "cpu":
            raise ValueError(f"{name}: the torch tensor is on {x.device}; pagedkv's host and "
                             f"opencl backends read CPU memory: pass {name}.cpu()")
        if x.dtype == sys.modules["torch"].bfloat16:   # numpy has no bfloat16
            x = x.float()
        return x.numpy()
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type, device_id = x.__dlpack_device__()
        if int(device_type) != _DLPACK_CPU:
            raise ValueError(f"{name}: the array lives on DLPack device ({int(device_type)}, "
                             f"{device_id}), not the CPU; copy it to host memory first")
        try:
            return np.from_dlpack(x)
        except (TypeError, BufferError, RuntimeError) as exc:
            raise ArgumentTypeError(f"{name}: numpy cannot read this {type(x).__name__} "
                                    f"through DLPack ({exc})") from None
    raise ArgumentTypeError(f"{name}: expected a numpy array, a torch CPU tensor or an array "
                            f"with __dlpack__, got {type(x).__name__}")

"""What ``store`` and ``attention`` accept: numpy arrays, torch CPU tensors, any CPU
object with ``__dlpack__``, and the backend's own device arrays.

Everything but the backend's device arrays is turned into a numpy ndarray
that shares the caller's memory where it can (a float32 contiguous tensor
costs no copy); the kernels then make the one float32 contiguous copy they
need, if any.  torch is never imported here: a tensor is recognised by its
type's module, and torch is used only when the caller already imported it.
"""
import operator
import sys
from typing import Any

import numpy as np

from pagedkv.errors import ArgumentTypeError

_DLPACK_CPU = 1          # DLDeviceType kDLCPU
#: The float dtypes the kernels take as numpy arrays (torch's bfloat16 arrives as
#: float32); not float128, whose width differs between platforms.
FLOAT_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))
# Raised by the interpreter, not by a bad argument: they pass through as they came
# (a failed call still changes nothing, since nothing was done yet).
_INTERPRETER_ERRORS = (MemoryError, RecursionError)


def is_torch_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def array_or_as_given(name: str, x: Any) -> Any:
    """``x`` as an ndarray when it is a torch tensor or a ``__dlpack__`` object, else ``x``.

    For arguments that also take plain sequences (``sinks``): lists, tuples
    and ndarrays pass through unchanged for the caller's ``np.asarray``.
    """
    if isinstance(x, np.ndarray) or not (is_torch_tensor(x) or hasattr(x, "__dlpack__")):
        return x
    return to_numpy(name, x)


def to_numpy(name: str, x: Any) -> np.ndarray:
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
        torch = sys.modules["torch"]
        if x.layout != torch.strided:
            raise ArgumentTypeError(f"{name}: expected a dense torch tensor, got layout "
                                    f"{x.layout}; pass {name}.to_dense()")
        if x.is_floating_point() and x.dtype not in (torch.float16, torch.bfloat16,
                                                     torch.float32, torch.float64):
            raise ArgumentTypeError(f"{name}: expected a float dtype (float16, bfloat16, "
                                    f"float32 or float64), got {x.dtype}")
        if x.dtype == torch.bfloat16:   # numpy has no bfloat16
            x = x.float()
        try:
            return x.resolve_neg().numpy()   # resolve_neg: a no-op unless a lazy negation
        except (TypeError, RuntimeError) as exc:   # nested, quantized, tensor subclasses
            raise ArgumentTypeError(f"{name}: numpy cannot read this torch tensor "
                                    f"({exc})") from None
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        kind = type(x).__name__
        try:
            device = x.__dlpack_device__()
            device_type, device_id = (operator.index(e) for e in device)
        except _INTERPRETER_ERRORS:
            raise
        except Exception as exc:   # the object's own code: a wrong answer, or it raised
            raise ArgumentTypeError(f"{name}: this {kind}'s __dlpack_device__() gave no "
                                    f"(device_type, device_id) pair of ints "
                                    f"({type(exc).__name__}: {exc})"[:300]) from exc
        if device_type != _DLPACK_CPU:
            raise ValueError(f"{name}: the array lives on DLPack device ({device_type}, "
                             f"{device_id}), not the CPU; copy it to host memory first")
        try:
            return np.from_dlpack(x)
        except _INTERPRETER_ERRORS:
            raise
        except Exception as exc:   # __dlpack__ raised, or gave no valid capsule
            raise ArgumentTypeError(f"{name}: numpy cannot read this {kind} through DLPack "
                                    f"({type(exc).__name__}: {exc})"[:300]) from exc
    raise ArgumentTypeError(f"{name}: expected a numpy array, a torch CPU tensor or an array "
                            f"with __dlpack__, got {type(x).__name__}")

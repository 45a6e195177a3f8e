"""Building the ``.cl`` programs once per context, and calling their kernels by argument name.

``#include "x.h"`` lines are expanded before the build (see
:mod:`pagedkv.backends.kernel_source`), so that a program's text is
self-contained: no ``-I`` path with spaces to quote, and pyopencl's binary
cache sees header edits.

A kernel's arguments are declared once, in its ``.cl`` signature.
:class:`KernelCall` reads the names and types from there, sets the scalar
dtypes, and launches with keyword arguments, so that Python never counts
argument positions.
"""
import re
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pagedkv import _process
from pagedkv.backends.kernel_source import read_source, variant_dtype

if TYPE_CHECKING:   # annotations only: pyopencl is imported lazily
    import pyopencl

#: A kernel's arguments: (name, numpy scalar type or struct dtype, or None for a buffer).
Signature = List[Tuple[str, Any]]

_KERNEL = re.compile(r"__kernel\s+(?:__attribute__\(\(.*?\)\)\s*)?void\s+(\w+)\s*\((.*?)\)\s*\{",
                     re.DOTALL)
_SCALARS: Dict[str, Any] = {"int": np.int32, "uint": np.uint32, "long": np.int64,
                             "ulong": np.uint64, "float": np.float32,
                             # a struct by value: a 0-d array of its numpy twin
                             "pkv_variant": variant_dtype()}


class KernelBuildError(RuntimeError):
    """An OpenCL program failed to build; the message names the file, options and log."""


def kernel_signatures(text: str) -> Dict[str, Signature]:
    """``{kernel name: [(argument name, numpy scalar type or None for a buffer)]}``.

    Parses the ``__kernel void name(...)`` signatures of a program's text;
    comments in the argument list are ignored.
    """
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    signatures = {}
    for name, arg_list in _KERNEL.findall(text):
        args: Signature = []
        for arg in arg_list.split(","):
            words = arg.replace("*", " * ").split()
            pointer = "*" in words
            base = [w for w in words if w not in ("const", "__global", "__local", "*",
                                                  "__constant", "restrict")]
            arg_type, arg_name = base[0], base[-1]
            if not pointer and arg_type not in _SCALARS:
                raise ValueError(f"kernel {name}: argument {arg_name} has a scalar type "
                                 f"{arg_type!r} that KernelCall cannot pass")
            args.append((arg_name, None if pointer else _SCALARS[arg_type]))
        signatures[name] = args
    return signatures


class KernelCall:
    """One kernel of a built program, launched with keyword arguments.

    ``call(queue, global_size, local_size, wait_for=None, **args)`` takes
    every argument of the kernel's ``.cl`` signature by name: buffers as
    ``pyopencl.Buffer`` (or anything with ``.data``), scalars as Python
    numbers (cast to the signature's type).  Setting the arguments and
    enqueuing happen under one lock, so threads sharing a kernel cannot mix
    each other's arguments.
    """

    def __init__(self, program: "pyopencl.Program", name: str, signature: Signature):
        import pyopencl as cl
        self._cl = cl
        self.name = name
        self.kernel = cl.Kernel(program, name)
        self.arg_names = [arg for arg, _ in signature]
        self._arg_set = frozenset(self.arg_names)
        self._buffer_args = [i for i, (_, dtype) in enumerate(signature) if dtype is None]
        # With the scalar types declared, pyopencl packs scalars itself; otherwise
        # it tries the other argument kinds first for every scalar of every launch.
        self.kernel.set_scalar_arg_dtypes([dtype for _, dtype in signature])
        self._lock = threading.Lock()

    def __call__(self, queue: "pyopencl.CommandQueue", global_size: Tuple[int, ...],
                 local_size: Optional[Tuple[int, ...]], *,
                 wait_for: "Optional[Sequence[pyopencl.Event]]" = None,
                 **args: Any) -> "pyopencl.Event":
        try:
            values = [args[name] for name in self.arg_names]
        except KeyError:
            values = None
        if values is None or len(args) != len(values):
            missing = sorted(self._arg_set - set(args))
            extra = sorted(set(args) - self._arg_set)
            raise TypeError(f"kernel {self.name}: missing arguments {missing}, unknown {extra}")
        buffer = self._cl.Buffer
        for i in self._buffer_args:   # a pyopencl Array passes its buffer
            if not isinstance(values[i], buffer):
                values[i] = values[i].data
        with self._lock:
            self.kernel.set_args(*values)
            return self._cl.enqueue_nd_range_kernel(queue, self.kernel, global_size, local_size,
                                                    wait_for=wait_for or None)

    def local_memory(self, device: "pyopencl.Device") -> int:
        """Bytes of local memory one work-group of this kernel takes on ``device``
        (the driver's count, ``CL_KERNEL_LOCAL_MEM_SIZE``)."""
        return self.kernel.get_work_group_info(
            self._cl.kernel_work_group_info.LOCAL_MEM_SIZE, device)

    def work_group_limit(self, device: "pyopencl.Device") -> int:
        """The most work-items per work-group this kernel allows on ``device``."""
        return self.kernel.get_work_group_info(
            self._cl.kernel_work_group_info.WORK_GROUP_SIZE, device)


def build_program(context: "pyopencl.Context", name: str, options: Sequence[str],
                  source: Optional[str] = None) -> Dict[str, KernelCall]:
    """The program ``name`` (a ``.cl`` file) built for ``context`` with ``options``, memoized.

    The memo lives in :mod:`pagedkv._process`, keyed weakly by ``context``:
    the programs go when the context does (or at ``_process.clear_caches()``).

    Parameters
    ----------
    context : pyopencl.Context
    name : str
        File name in the kernel source folder, e.g. ``"attention.cl"``.
    options : tuple of str
        Build options, e.g. ``("-DPKV_HEAD_DIM=128",)``.
    source : str, optional
        The program text, instead of reading ``name`` (the key still includes
        the text, so a different text is a different program).

    Returns
    -------
    dict
        ``{kernel name: KernelCall}`` for every kernel the program was built with.

    Raises
    ------
    KernelBuildError
        The compiler rejected the program; the message names the file, the
        device, the options and includes the build log.
    """
    import pyopencl as cl
    text = read_source(name) if source is None else source
    key = (name, tuple(options), text)
    state = _process.opencl
    with state.lock:
        programs = state.programs_for(context)
        kernels = programs.get(key)
        if kernels is None:
            try:
                program = cl.Program(context, text).build(options=list(options))
            except cl.Error as exc:   # pyopencl's RuntimeError carries the build log
                devices = ", ".join(d.name.strip() for d in context.devices)
                raise KernelBuildError(
                    f"building opencl/{name} for {devices} with options {' '.join(options)!r} "
                    f"failed:\n{exc}") from None
            # the kernels this build has (a source may #if some out)
            built = set(program.get_info(cl.program_info.KERNEL_NAMES).split(";"))
            kernels = {kernel: KernelCall(program, kernel, signature)
                       for kernel, signature in kernel_signatures(text).items()
                       if kernel in built}
            programs[key] = kernels
    return kernels

"""The kernel sources: where the ``.cl`` and shared ``.h`` files live, and reading them.

They ship in the wheel as the package ``pagedkv.opencl`` (the top-level
``opencl/`` folder of the source tree); when pagedkv runs from a source
checkout that was never installed, they are read from ``<repo>/opencl``.
Besides the OpenCL programs, the host build compiles against
``pkv_work_item.h``, ``pkv_storage.h`` and ``pkv_variant.h``, and Python reads
their lists from there, so the work-item layout, the storage formats and the
variant's scalars (``pkv_variant``) are written down once for Python, Cython
and OpenCL C.
"""
import functools
import importlib.resources
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, List, Optional

import numpy as np

if TYPE_CHECKING:   # annotations only
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable
    from pagedkv._kernels import Variant
    from pagedkv.attention_spec import AttentionSpec

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([\w.]+)"\s*$', re.MULTILINE)


def source_dir() -> "Traversable":
    """The directory (a Traversable) holding the ``.cl`` and ``.h`` files."""
    try:
        installed = importlib.resources.files("pagedkv.opencl")
        if installed.joinpath("attention.cl").is_file():
            return installed
    except ModuleNotFoundError:  # source tree on sys.path, package never installed
        pass
    return Path(__file__).resolve().parents[2] / "opencl"


def read_source(name: str, directory: "Optional[Traversable]" = None) -> str:
    """The text of ``name`` with its ``#include "..."`` lines expanded (each once).

    ``#line`` directives keep compiler messages pointing at the original files.
    """
    directory = source_dir() if directory is None else directory
    seen = set()

    def expand(file_name: str) -> str:
        if file_name in seen:
            return ""
        seen.add(file_name)
        text = directory.joinpath(file_name).read_text(encoding="utf-8")
        out, last = [f'#line 1 "{file_name}"\n'], 0
        for match in _INCLUDE.finditer(text):
            out.append(text[last:match.start()])
            out.append(expand(match.group(1)))
            line = text.count("\n", 0, match.end()) + 1
            out.append(f'\n#line {line + 1} "{file_name}"')
            last = match.end()
        out.append(text[last:])
        return "".join(out)

    return expand(name)


def _header_list(file_name: str, macro: str) -> List[str]:
    """The entries of ``#define <macro>(X) ...`` in a kernel header: ``X(NAME)``
    gives ``NAME``, ``OTHER(X)`` the entries of ``OTHER`` (``#define OTHER(X) ...``
    in this header or in one it includes)."""
    text = source_dir().joinpath(file_name).read_text(encoding="utf-8")
    line = re.search(rf"^#define {macro}\(X\) (.*)$", text, re.MULTILINE)
    if line is None:
        for included in _INCLUDE.findall(text):
            try:
                return _header_list(included, macro)
            except RuntimeError:
                pass
        raise RuntimeError(f"{file_name} has no '#define {macro}(X) ...' line")
    names: List[str] = []
    for name, nested in re.findall(r"\bX\((\w+)\)|\b(\w+)\(X\)", line.group(1)):
        names.extend([name] if name else _header_list(file_name, nested))
    return names


def header_table(file_name: str, macro: str) -> SimpleNamespace:
    """The ``X(NAME)`` list of ``#define <macro>(X) ...`` in a kernel header (nested
    lists ``OTHER(X)`` expanded): a namespace ``NAME -> index``, with ``COUNT`` the
    list's length."""
    names = _header_list(file_name, macro)
    return SimpleNamespace(COUNT=len(names), **{n: i for i, n in enumerate(names)})


def work_item_fields() -> SimpleNamespace:
    """The work-item columns of ``pkv_work_item.h`` (the band's from ``pkv_variant.h``),
    e.g. ``W.KEY0``; ``W.COUNT`` columns."""
    return header_table("pkv_work_item.h", "PKV_WORK_ITEM")


def storage_kinds() -> SimpleNamespace:
    """The storage formats of ``pkv_storage.h`` (``#define PKV_STORAGE_<NAME> <number>``
    lines), e.g. ``S.INT8``, the number the kernels know the format by."""
    text = source_dir().joinpath("pkv_storage.h").read_text(encoding="utf-8")
    kinds = re.findall(r"^#define PKV_STORAGE_(\w+) (\d+)$", text, re.MULTILINE)
    return SimpleNamespace(COUNT=len(kinds), **{name: int(value) for name, value in kinds})


_C_SCALARS = {"float": np.float32, "int": np.int32}


@functools.lru_cache(maxsize=None)
def variant_dtype() -> np.dtype:
    """The numpy twin of ``pkv_variant``, the variant's scalars (``PKV_VARIANT_FIELDS``
    in ``pkv_variant.h``: one field per ``X(type, name)``, in order)."""
    text = source_dir().joinpath("pkv_variant.h").read_text(encoding="utf-8")
    line = re.search(r"^#define PKV_VARIANT_FIELDS\(X\)((?:.*\\\n)*.*)$", text, re.MULTILINE)
    if line is None:
        raise RuntimeError("pkv_variant.h has no '#define PKV_VARIANT_FIELDS(X) ...'")
    fields = re.findall(r"\bX\((\w+),\s*(\w+)\)", re.sub(r"/\*.*?\*/", "", line.group(1)))
    return np.dtype([(name, _C_SCALARS[kind]) for kind, name in fields])


def variant_scalars(spec: "AttentionSpec") -> "Variant":
    """The scalars of ``spec``'s variant as ``pkv_variant`` names them (what both
    backends pass their kernels as that one struct)."""
    values: "Variant" = {"soft_cap": spec.logits_soft_cap or 0.0,
                         "has_sinks": int(spec.sinks is not None),
                         "has_bias": int(spec.alibi_slopes is not None)}
    if tuple(values) != variant_dtype().names:
        raise RuntimeError(f"pkv_variant.h's fields {variant_dtype().names} are not the "
                           f"scalars Python fills, {tuple(values)}")
    return values

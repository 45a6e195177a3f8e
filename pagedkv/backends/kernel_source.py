"""The kernel sources: where the ``.cl`` and shared ``.h`` files live, and reading them.

They ship in the wheel as the package ``pagedkv.opencl`` (the top-level
``opencl/`` folder of the source tree); when pagedkv runs from a source
checkout that was never installed, they are read from ``<repo>/opencl``.
Besides the OpenCL programs, the host build compiles against
``pkv_work_item.h``, and the planner reads its field list from there, so the
work-item layout is written down once for Python, Cython and OpenCL C.
"""
import importlib.resources
import re
from pathlib import Path
from types import SimpleNamespace

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([\w.]+)"\s*$', re.MULTILINE)
_WORK_ITEM = re.compile(r"^#define PKV_WORK_ITEM\(X\) (.*)$", re.MULTILINE)


def source_dir():
    """The directory (a Traversable) holding the ``.cl`` and ``.h`` files."""
    try:
        installed = importlib.resources.files("pagedkv.opencl")
        if installed.joinpath("attention.cl").is_file():
            return installed
    except ModuleNotFoundError:  # source tree on sys.path, package never installed
        pass
    return Path(__file__).resolve().parents[2] / "opencl"


def read_source(name, directory=None):
    """The text of ``name`` with its ``#include "..."`` lines expanded (each once).

    ``#line`` directives keep compiler messages pointing at the original files.
    """
    directory = source_dir() if directory is None else directory
    seen = set()

    def expand(file_name):
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


def work_item_fields():
    """The work-item columns of ``pkv_work_item.h``: a namespace ``NAME -> index``
    with ``FIELDS``, the column count (e.g. ``W.KEY0``, ``W.FIELDS``)."""
    text = source_dir().joinpath("pkv_work_item.h").read_text(encoding="utf-8")
    names = re.findall(r"X\((\w+)\)", _WORK_ITEM.search(text).group(1))
    return SimpleNamespace(FIELDS=len(names), **{n: i for i, n in enumerate(names)})

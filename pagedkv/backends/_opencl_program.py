"""Loading the ``.cl`` sources and building them once per context.

The sources ship in the wheel as the package ``pagedkv.opencl`` (the
top-level ``opencl/`` folder of the source tree); when pagedkv runs from a
source checkout that was never installed, they are read from ``<repo>/opencl``.
``#include "x.h"`` lines are expanded here, from the same place, so that a
program's text is self-contained: no ``-I`` path with spaces to quote, and
pyopencl's binary cache sees header edits.
"""
import importlib.resources
import re
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([\w.]+)"\s*$', re.MULTILINE)
_programs: dict = {}   # (Context, file name, options, text) -> built pyopencl.Program


class KernelBuildError(RuntimeError):
    """An OpenCL program failed to build; the message names the file, options and log."""


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


def build_program(context, name, options, source=None):
    """The program ``name`` (a ``.cl`` file) built for ``context`` with ``options``, memoized.

    Parameters
    ----------
    context : pyopencl.Context
    name : str
        File name under :func:`source_dir`, e.g. ``"attention.cl"``.
    options : tuple of str
        Build options, e.g. ``("-DPKV_HEAD_DIM=128",)``.
    source : str, optional
        The program text, instead of reading ``name`` (the key still includes
        the text, so a different text is a different program).

    Raises
    ------
    KernelBuildError
        The compiler rejected the program; the message names the file, the
        device, the options and includes the build log.
    """
    import pyopencl as cl
    text = read_source(name) if source is None else source
    key = (context, name, tuple(options), text)
    program = _programs.get(key)
    if program is None:
        try:
            program = cl.Program(context, text).build(options=list(options))
        except cl.Error as exc:   # pyopencl's RuntimeError carries the build log
            devices = ", ".join(d.name.strip() for d in context.devices)
            raise KernelBuildError(
                f"building opencl/{name} for {devices} with options {' '.join(options)!r} "
                f"failed:\n{exc}") from None
        _programs[key] = program
    return program

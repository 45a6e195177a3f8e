"""The type stubs of the compiled modules (``pagedkv/*.pyi``) against the modules themselves.

mypy type-checks the Python code against the stubs; ``mypy.stubtest`` (run here)
checks that the stubs say what the built modules have: every name, every
function's parameters, which classes can be subclassed.  The kernels' stub
(``_kernels.pyi``) describes every level's module (``pagedkv._kernels_<level>``),
so it is checked against the level this process imported.
"""
import os
import shutil
import subprocess
import sys
from importlib.resources import files

import pytest

import pagedkv
from pagedkv import _cpu

# What Cython adds or hides that a stub does not describe.
ALLOWLIST = r"""
# doctest and pickling helpers of every Cython module and extension type
pagedkv\._\w+\.__test__
pagedkv\._\w+(\.\w+)?\.__(reduce|setstate)_cython__
# the C functions a module shares with the modules that cimport it
pagedkv\._\w+\.__pyx_capi__
# an extension type's __cinit__ takes the constructor's arguments, which Python
# cannot introspect: the stubs give them as __init__'s
pagedkv\._\w+\.\w+\.__init__
"""

MYPY_CONFIG = """
[mypy]
ignore_missing_imports = True
follow_imports = silent
"""

COMPILED = ("_allocator", "_pool", "_page_table", "_placement", "_prefix_chains", "_cpuid",
            "_ints", "_rows")


def test_every_compiled_module_ships_a_stub():
    names = {p.name for p in files("pagedkv").iterdir()}
    for module in COMPILED + ("_kernels",):
        assert module + ".pyi" in names, module


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_stubs_match_the_compiled_modules(tmp_path):
    pytest.importorskip("mypy.stubtest")
    # the stubs in a folder of their own, the kernels' as the imported level's module
    package = tmp_path / "stubs" / "pagedkv"
    package.mkdir(parents=True)
    (package / "__init__.pyi").write_text("")
    source = files("pagedkv")
    for module in COMPILED + ("_kernels",):
        (package / f"{module}.pyi").write_text(source.joinpath(f"{module}.pyi").read_text())
    level_module = _cpu.kernels.__name__.rpartition(".")[2]
    shutil.copy(package / "_kernels.pyi", package / f"{level_module}.pyi")
    allowlist = tmp_path / "allowlist.txt"
    allowlist.write_text(ALLOWLIST)
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG + f"mypy_path = {tmp_path / 'stubs'}\n")
    command = [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(config),
               "--allowlist", str(allowlist)]
    help_text = subprocess.run(command[:3] + ["--help"], capture_output=True, text=True).stdout
    if "--ignore-disjoint-bases" in help_text:
        command.append("--ignore-disjoint-bases")   # (PEP 800: extension types are such bases)
    modules = [f"pagedkv.{m}" for m in COMPILED + (level_module,)]
    # the runtime modules: this process's pagedkv (a build in place, or the installed one)
    root = os.path.dirname(os.path.dirname(pagedkv.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    result = subprocess.run(command + modules, capture_output=True, text=True, cwd=tmp_path,
                            env=env)
    assert result.returncode == 0, result.stdout + result.stderr

"""The behaviour and stress tests on a build with AddressSanitizer and UBSan.

A copy of the sources is built in a temporary folder with ``PAGEDKV_SANITIZE=1``
(``setup.py``: every Cython module with ``-fsanitize=address,undefined``, the
release directives, OpenMP on), for the kernel level this CPU runs only (a
quicker build).  Then ``SANITIZED_TESTS`` run on it in a fresh interpreter:

- ``LD_PRELOAD`` loads the ASan runtime first, as an uninstrumented Python
  needs, and libstdc++ after it, so that ASan finds the ``__cxa_throw`` it
  wraps (pyopencl and ``_page_table`` throw C++ exceptions);
- ``PYTHONMALLOC=malloc``: Python objects come from malloc, so ASan also sees
  a Cython module write past one or use it after it is freed;
- ``detect_leaks=0``: LeakSanitizer would report the interpreter's own
  allocations (CPython frees not everything at exit, and numpy keeps caches:
  about fifty reports per process here, none from pagedkv), its exit status 23
  fails the tests that check a child process's status, and its suppressions
  match any frame of a stack, so suppressing the interpreter would also hide
  pagedkv.  pagedkv's C heap is C++ containers that Cython's generated
  deallocators destroy; that every page returns to the pool is asserted by
  the tests themselves;
- OpenCL is hidden (``OCL_ICD_VENDORS`` names an empty folder): its drivers are
  not instrumented, one crashes under ASan at load, and the opencl backend
  runs no pagedkv C code the host backend does not run too;
- any report fails the test, whatever pytest's exit status.  ASan writes to
  files (``log_path``), also from the processes the tests start; GCC's UBSan
  runtime ignores ``log_path`` beside ASan and writes to stderr, so the inner
  pytest captures only ``sys.stderr`` (``--capture=sys``), not the file
  descriptor, and the report reaches the output checked here (a test's child
  process that UBSan stops fails that test).

Linux only.  Without a compiler that links ``-fsanitize=address,undefined``,
or without Cython, the test skips, except in CI (``$CI`` set), where it fails.
"""
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from pagedkv import _cpu

# builds every Cython module with ASan and UBSan, then runs the host tests on it
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

# The tests that exercise the compiled modules on the host backend.
SANITIZED_TESTS = [
    "tests/test_attention.py", "tests/test_attention_variants.py", "tests/test_lifecycle.py",
    "tests/test_errors.py", "tests/test_page_tables.py", "tests/test_allocator.py",
    "tests/test_prefix_cache.py", "tests/test_reliability.py", "tests/test_fuzz_state.py",
    "tests/test_transfer.py", "tests/test_masked_values.py", "tests/test_recurrent_kernels.py",
    "tests/test_states.py",
]
# ASan reserves terabytes of shadow address space: a test that caps RLIMIT_AS cannot run.
NOT_UNDER_ASAN = [
    "tests/test_reliability.py::test_an_address_space_limit_gives_memory_error_not_a_crash",
]
# What the copy needs to build and test: the sources, and the files pyproject.toml names.
COPIED = ["pagedkv", "opencl", "tests", "setup.py", "pyproject.toml", "README.md", "LICENSE"]
GENERATED = shutil.ignore_patterns("*.so", "*.pyd", "_*.c", "_*.cpp", "__pycache__")
# What every sanitizer report (and warning) in the output has: UBSan's "file:line:col:
# runtime error: ...", ASan's "==pid==ERROR: AddressSanitizer: ...".
REPORT = re.compile(r": runtime error: |AddressSanitizer|UndefinedBehaviorSanitizer|LeakSanitizer")


def unavailable(reason):
    """Skip for ``reason``; in CI, fail: CI must run this test."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the sanitizer build")
    pytest.skip(reason)


def compiler():
    """The C compiler that setup.py uses, as a command list."""
    return (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()


def runtime_file(cc, *names):
    """The full path of the first library of ``names`` the compiler knows, or None."""
    for name in names:
        found = subprocess.run(cc + [f"-print-file-name={name}"], capture_output=True,
                               text=True).stdout.strip()
        if os.path.isabs(found) and os.path.exists(found):
            return found
    return None


def preload():
    """``LD_PRELOAD`` for the sanitized modules: the compiler's ASan runtime, then
    libstdc++; skip (or fail in CI) where the compiler cannot link sanitized code."""
    cc = compiler()
    if shutil.which(cc[0]) is None:
        unavailable(f"no C compiler ({cc[0]})")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "probe.c")
        src.write_text("int main(void) { return 0; }\n")
        probe = subprocess.run(cc + ["-fsanitize=address,undefined", str(src), "-o",
                                     str(Path(tmp, "probe"))], capture_output=True, text=True)
    if probe.returncode != 0:
        unavailable(f"{cc[0]} cannot link -fsanitize=address,undefined (install GCC's "
                    f"libasan and libubsan, or Clang's libclang-rt-dev): {probe.stderr[-500:]}")
    # Clang's first: Clang also finds GCC's libasan, which lacks Clang's UBSan handlers
    asan = runtime_file(cc, f"libclang_rt.asan-{platform.machine()}.so", "libasan.so")
    cxx = runtime_file(cc, "libstdc++.so", "libstdc++.so.6")
    if asan is None or cxx is None:
        unavailable(f"{cc[0]} names no shared ASan runtime or libstdc++ to preload")
    return f"{asan} {cxx}"


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory):
    """``(copy, env)``: a sanitized build of the sources, and the environment to run it in."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the sanitizer run is set up for Linux (LD_PRELOAD, GCC/Clang runtimes)")
    if not (ROOT / "setup.py").exists():
        unavailable(f"needs the source checkout ({ROOT} has no setup.py)")
    if importlib.util.find_spec("Cython") is None:
        unavailable("needs Cython (the test extra installs it)")
    ld_preload = preload()
    copy = tmp_path_factory.mktemp("sanitized")
    for name in COPIED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, copy / name, ignore=GENERATED)
        else:
            shutil.copy2(ROOT / name, copy / name)
    # the installed layout: the kernels' .cl files are the package pagedkv.opencl
    shutil.copytree(ROOT / "opencl", copy / "pagedkv" / "opencl")
    level = _cpu.kernels.CPU_LEVEL
    build_env = {k: v for k, v in os.environ.items()
                 if k not in ("PAGEDKV_DEBUG", "PAGEDKV_PORTABLE")}
    build_env.update(PAGEDKV_SANITIZE="1", PAGEDKV_CPU_LEVEL=level)
    build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
                           cwd=copy, env=build_env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, (build.stdout + build.stderr)[-6000:]
    logs, no_drivers = copy / "sanitizer-logs", copy / "no-opencl-drivers"
    logs.mkdir()
    no_drivers.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")}
    env.update(
        PYTHONPATH=str(copy), PAGEDKV_CPU_LEVEL=level, PYTHONMALLOC="malloc",
        LD_PRELOAD=ld_preload, OCL_ICD_VENDORS=str(no_drivers),
        ASAN_OPTIONS=f"detect_leaks=0:log_path={logs}/asan",
        UBSAN_OPTIONS="print_stacktrace=1",
    )
    return copy, env


def asan_logs(copy):
    """The ASan reports of the run's processes (its log files), as one text."""
    return "\n".join(p.read_text(errors="replace")
                     for p in sorted((copy / "sanitizer-logs").iterdir()))


def test_the_run_imports_the_instrumented_modules(sanitized):
    copy, env = sanitized
    script = ("import pagedkv, pagedkv._cpu as c, pagedkv._allocator as a, "
              "pagedkv._page_table as p, pagedkv._cpuid as i\n"
              "print(pagedkv.available_backends())\n"
              "for m in (c.kernels, a, p, i): print(m.__file__)")
    result = subprocess.run([sys.executable, "-c", script], cwd=copy, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    backends, *modules = result.stdout.split()
    assert backends == "['host']"          # OpenCL hidden
    assert Path(modules[0]).name.startswith(f"_kernels_{_cpu.kernels.CPU_LEVEL}.")
    for module in map(Path, modules):
        assert module.parent == copy / "pagedkv", module
        code = module.read_bytes()
        assert b"__asan_report_" in code and b"__ubsan_handle_" in code, \
            f"{module.name} is not instrumented"
    assert not asan_logs(copy) and not REPORT.search(result.stderr), result.stderr


def test_behaviour_and_stress_tests_pass_with_no_sanitizer_report(sanitized):
    copy, env = sanitized
    # -v: the output names the test before it runs, so a report's test is the line above it
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--capture=sys",
               f"--basetemp={copy / 'pytest-tmp'}", *SANITIZED_TESTS]
    command += [arg for test in NOT_UNDER_ASAN for arg in ("--deselect", test)]
    result = subprocess.run(command, cwd=copy, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=1200)
    output = result.stdout
    logs = asan_logs(copy)
    assert not logs and not REPORT.search(output), f"{logs[:12000]}\n{output[-12000:]}"
    assert result.returncode == 0, output[-6000:]

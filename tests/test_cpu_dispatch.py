"""The host kernels' instruction-set levels: the import-time choice, and each level's results.

The build compiles ``_kernels.pyx`` once per level (``pagedkv._levels``) and
``pagedkv._cpu`` imports the best one the CPU runs.  Here:

- the choice itself, on made-up CPUs (feature bits, XCR0, ``PAGEDKV_CPU_LEVEL``);
- ``cpu_probe.py`` (store, attention, gather) in a fresh process at every
  level this CPU runs, forced through ``PAGEDKV_CPU_LEVEL``, against NumPy;
- the same probe under ``qemu-x86_64`` with a Haswell CPU (AVX2, no
  AVX-512) and a Nehalem (no AVX at all): a binary built on a larger CPU must
  pick a level these run, not die with an illegal instruction.  These need
  Debian's ``qemu-user``; they skip without it, except in CI (``$CI`` set),
  where a missing qemu fails.
"""
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedkv import _cpu
from pagedkv._levels import LEVELS, levels_for, target_arch
from reference import TOLERANCE, dense_attention, round_to_storage

import cpu_probe
from python_child import run_python

PROBE = Path(cpu_probe.__file__).resolve()
X86 = levels_for("x86_64")
# qemu-user is Linux's; qemu-x86_64 runs this interpreter only on an x86-64 host
ON_LINUX_X86_64 = _cpu.ARCH == "x86_64" and sys.platform.startswith("linux")
QEMU = shutil.which("qemu-x86_64")

# Enough of cpuid for decode_x86_features: leaf -> (eax, ebx, ecx, edx).
_LEAF1_V2 = (1 << 0) | (1 << 9) | (1 << 13) | (1 << 19) | (1 << 20) | (1 << 23)  # SSE3..POPCNT
_LEAF1_V3 = _LEAF1_V2 | (1 << 12) | (1 << 22) | (1 << 27) | (1 << 28) | (1 << 29)  # +FMA..F16C
_LEAF7_V3 = (1 << 3) | (1 << 5) | (1 << 8)                                        # BMI1 AVX2 BMI2
_LEAF7_V4 = _LEAF7_V3 | (1 << 16) | (1 << 17) | (1 << 28) | (1 << 30) | (1 << 31)
_EXT_V2, _EXT_V3 = 1 << 0, (1 << 0) | (1 << 5)                                  # LAHF, LZCNT
_SSE2 = (1 << 25) | (1 << 26)


def fake_cpuid(leaf1_ecx, leaf7_ebx, ext_ecx):
    regs = {1: (0, 0, leaf1_ecx, _SSE2), 7: (0, leaf7_ebx, 0, 0), 0x80000001: (0, 0, ext_ecx, 0)}
    return lambda leaf, subleaf: regs.get(leaf)


HASWELL = fake_cpuid(_LEAF1_V3, _LEAF7_V3, _EXT_V3)
SKYLAKE_SP = fake_cpuid(_LEAF1_V3, _LEAF7_V4, _EXT_V3)
NEHALEM = fake_cpuid(_LEAF1_V2, 0, _EXT_V2)
ALL_BUILT = [level.name for level in X86]


def best(features, built=ALL_BUILT, requested=None):
    level, notes = _cpu.choose_level(X86, features, built, requested)
    return level.name, notes


# -- the choice ---------------------------------------------------------------------------

def test_each_cpu_model_gets_its_best_level():
    assert best(_cpu.decode_x86_features(NEHALEM, 0)) == ("baseline", [])
    assert best(_cpu.decode_x86_features(HASWELL, 0x7)) == ("avx2", [])
    assert best(_cpu.decode_x86_features(SKYLAKE_SP, 0xE7)) == ("avx512", [])


def test_registers_the_os_does_not_save_are_not_used():
    # AVX-512 CPU, OS saving only the AVX state: AVX2; saving no AVX state: baseline
    assert best(_cpu.decode_x86_features(SKYLAKE_SP, 0x7))[0] == "avx2"
    assert best(_cpu.decode_x86_features(SKYLAKE_SP, 0x3))[0] == "baseline"
    # macOS enables the AVX-512 state on first use: its sysctl stands in for XCR0
    macos = _cpu.decode_x86_features(SKYLAKE_SP, 0x7, {"hw.optional.avx512f": 1}.get)
    assert best(macos)[0] == "avx512"


def test_a_missing_cpuid_leaf_reads_as_no_features():
    old_cpu = fake_cpuid(_LEAF1_V3, 0, 0)
    no_leaf7 = lambda leaf, subleaf: None if leaf == 7 else old_cpu(leaf, subleaf)  # noqa: E731
    features = _cpu.decode_x86_features(no_leaf7, 0x7)
    assert "avx2" not in features and "avx" in features
    assert best(features)[0] == "baseline"


def test_the_variable_lowers_the_level():
    features = _cpu.decode_x86_features(SKYLAKE_SP, 0xE7)
    assert best(features, requested="avx2") == ("avx2", [])
    assert best(features, requested=" Baseline ") == ("baseline", [])


def test_the_variable_never_raises_the_level_above_the_cpu():
    name, notes = best(_cpu.decode_x86_features(HASWELL, 0x7), requested="avx512")
    assert name == "avx2"
    assert len(notes) == 1
    assert "PAGEDKV_CPU_LEVEL=avx512" in notes[0] and "cannot run" in notes[0]
    assert "avx512f" in notes[0] and "'avx2'" in notes[0]


def test_a_level_the_build_lacks_falls_back_with_a_note():
    features = _cpu.decode_x86_features(SKYLAKE_SP, 0xE7)
    assert best(features, built=["baseline", "avx2"]) == ("avx2", [])
    name, notes = best(features, built=["baseline"], requested="avx2")
    assert name == "baseline" and "not built" in notes[0]


def test_an_unknown_level_is_a_value_error_naming_the_variable():
    with pytest.raises(ValueError, match=r"PAGEDKV_CPU_LEVEL: expected one of \['baseline', "
                                         r"'avx2', 'avx512'\].*got 'sse4'"):
        best(frozenset(), requested="sse4")


def test_no_built_level_is_an_import_error():
    with pytest.raises(ImportError, match="host kernels are missing"):
        best(frozenset(), built=[])


def test_architecture_names():
    assert [lv.name for lv in levels_for("aarch64")] == ["baseline"]
    assert "NEON" in levels_for("aarch64")[0].description
    assert [lv.name for lv in levels_for("riscv64")] == ["baseline"]
    assert target_arch("AMD64", 8) == target_arch("x86_64", 8) == "x86_64"
    assert target_arch("arm64", 8) == "aarch64"
    assert target_arch("x86_64", 4) == "i686"        # a 32-bit build on a 64-bit kernel
    assert [lv.name for lv in levels_for(target_arch("x86_64", 4))] == ["baseline"]
    if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"):
        assert _cpu.ARCH in LEVELS   # the architectures wheels are built for have tables


def test_the_chosen_module_is_the_best_level_this_cpu_runs():
    if not os.environ.get(_cpu.ENV_VAR):
        expected = [name for name in _cpu.SUPPORTED if name in _cpu.BUILT][-1]
        assert _cpu.level.name == expected
    assert _cpu.kernels.CPU_LEVEL == _cpu.level.name
    assert _cpu.kernels.__name__ == f"pagedkv._kernels_{_cpu.level.name}"


@pytest.mark.skipif(os.environ.get("PAGEDKV_PORTABLE") == "1",
                    reason="PAGEDKV_PORTABLE=1 builds the baseline level alone")
def test_every_level_of_the_architecture_is_built():
    assert list(_cpu.BUILT) == [level.name for level in _cpu.LEVELS], (
        "the C compiler refused some level's flags (see the build log)")


# -- each level's results, in a fresh process ----------------------------------------------

def check_probe(inputs, outputs):
    """Assert that ``cpu_probe.run``'s outputs are what NumPy computes from ``inputs``."""
    for dtype, head_dim in cpu_probe.CASES:
        check_case(dtype, head_dim, inputs, outputs)


def check_case(dtype, head_dim, inputs, outputs):
    """One case of ``check_probe``."""
    def given(name):
        return inputs[cpu_probe.key(dtype, head_dim, name)]

    def got(name):
        return outputs[cpu_probe.key(dtype, head_dim, name)]

    seq_k = [np.zeros((0, cpu_probe.NUM_KV_HEADS, head_dim), np.float32) for _ in range(2)]
    seq_v = [a.copy() for a in seq_k]
    for i, counts in enumerate(cpu_probe.STEPS):
        q, k, v = (given(f"step{i}_{x}") for x in "qkv")
        k, v = round_to_storage(k, dtype), round_to_storage(v, dtype)
        starts = np.concatenate([[0], np.cumsum(counts)])
        for b, (r0, r1) in enumerate(zip(starts[:-1], starts[1:])):
            done = len(seq_k[b])
            seq_k[b] = np.concatenate([seq_k[b], k[r0:r1]])
            seq_v[b] = np.concatenate([seq_v[b], v[r0:r1]])
            expected = dense_attention(q[r0:r1], seq_k[b], seq_v[b], done + np.arange(r1 - r0))
            np.testing.assert_allclose(got(f"step{i}_out")[r0:r1], expected,
                                       err_msg=f"{dtype} D={head_dim} step {i} seq {b}",
                                       **TOLERANCE[dtype])
    for b in range(2):
        np.testing.assert_array_equal(got(f"gather_k{b}"), seq_k[b])
        np.testing.assert_array_equal(got(f"gather_v{b}"), seq_v[b])


def run_probe(tmp_path, prefix=(), env=None):
    """Run cpu_probe.py (under ``prefix``, e.g. a qemu command) and check it against NumPy.

    Returns
    -------
    level : str
        The kernel level the probe ran.
    stderr : str
    """
    inputs = cpu_probe.make_inputs()
    np.savez(tmp_path / "inputs.npz", **inputs)
    # from tmp_path, so that pagedkv comes from the installed package, not the source tree
    result = subprocess.run([*prefix, sys.executable, str(PROBE), "inputs.npz", "outputs.npz"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    with np.load(tmp_path / "outputs.npz") as outputs:
        outputs = dict(outputs)
    check_probe(inputs, outputs)
    return str(outputs["level"]), result.stderr


@pytest.mark.parametrize("level", [level.name for level in _cpu.LEVELS])
def test_the_variable_forces_each_level_and_each_agrees_with_numpy(tmp_path, level):
    if level not in _cpu.SUPPORTED or level not in _cpu.BUILT:
        pytest.skip(f"this CPU does not run the {level!r} level, or it is not built")
    ran, stderr = run_probe(tmp_path, env={_cpu.ENV_VAR: level})
    assert ran == level
    assert "RuntimeWarning" not in stderr


def test_a_level_above_the_cpu_warns_and_runs_the_best_it_has(tmp_path):
    above = [level.name for level in _cpu.LEVELS if level.name not in _cpu.SUPPORTED]
    if not above:
        pytest.skip("this CPU runs every level of its architecture")
    ran, stderr = run_probe(tmp_path, env={_cpu.ENV_VAR: above[-1]})
    assert ran == [name for name in _cpu.SUPPORTED if name in _cpu.BUILT][-1]
    assert "RuntimeWarning" in stderr and "cannot run that level" in stderr


def test_an_unknown_level_fails_the_import_with_the_variable_named(tmp_path):
    result = run_python("import pagedkv", env={_cpu.ENV_VAR: "avx1024"})
    assert result.returncode != 0
    assert "ValueError: PAGEDKV_CPU_LEVEL: expected one of" in result.stderr
    assert "'avx1024'" in result.stderr


# -- under emulated CPUs ---------------------------------------------------------------

@pytest.mark.skipif(not os.environ.get("CI"), reason="outside CI the qemu tests may skip")
@pytest.mark.skipif(not ON_LINUX_X86_64, reason="qemu-x86_64 runs this interpreter only on "
                                             "Linux x86-64")
def test_ci_has_qemu():
    assert QEMU, "CI must install Debian's qemu-user (.ci/run does: apt-get install qemu-user)"


@pytest.mark.skipif(not ON_LINUX_X86_64, reason="qemu-x86_64 runs this interpreter only on "
                                             "Linux x86-64")
@pytest.mark.skipif(QEMU is None, reason="needs qemu-x86_64 (Debian's qemu-user)")
@pytest.mark.parametrize("cpu_model,expected", [("Haswell", "avx2"), ("Nehalem", "baseline")])
@pytest.mark.slow
def test_an_emulated_older_cpu_runs_its_level_correctly(tmp_path, cpu_model, expected):
    if expected not in _cpu.BUILT:
        pytest.skip(f"the {expected!r} level is not built")
    env = {_cpu.ENV_VAR: ""}   # the CPU decides
    ran, _ = run_probe(tmp_path, prefix=[QEMU, "-cpu", cpu_model], env=env)
    assert ran == expected, f"under qemu -cpu {cpu_model}"


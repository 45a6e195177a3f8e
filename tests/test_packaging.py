"""What the installed package carries and says about itself: its sources (Cython
.pyx/.pxd/.h, as the sdist and wheel promise, so that a non-editable install
is complete), its license, metadata, version and typing marker, and
``show_config``."""
import io
import subprocess
import sys
from importlib import metadata
from importlib.resources import files

import pagedkv


def test_cython_sources_ship_with_the_package():
    names = {p.name for p in files("pagedkv").iterdir()}
    for source in ("_allocator.pyx", "_allocator.pxd", "_pool.pyx", "_pool.pxd",
                   "_page_table.pyx", "_page_table.pxd", "_placement.pyx", "_prefix_chains.pyx",
                   "pkv_page_table.h", "pkv_page_table.pxd", "_kernels.pyx",
                   "_kernels_rows.pxi", "_kernels_recurrent.pxi", "_kernels_level.pxi", "_cpuid.pyx", "_cpuid.pyi", "_ints.pyx", "_ints.pyi",
                   "_rows.pyx", "_rows.pyi",
                   "pkv_half.h",
                   "pkv_simd.h", "pkv_block.h", "pkv_quant.h", "pkv_recurrent.h", "pkv_hash.h",
                   "pkv_cpuid.h",
                   "py.typed"):
        assert source in names, source


def test_compiled_modules_load():
    from pagedkv import (_allocator, _cpu, _cpuid, _ints, _page_table, _placement,  # noqa: F401
                         _pool, _prefix_chains, _rows)
    assert _cpu.kernels.__name__.startswith("pagedkv._kernels_")
    assert "host" in pagedkv.available_backends()


def test_the_license_ships_and_the_metadata_names_it():
    meta = metadata.metadata("pagedkv")
    assert meta["License-Expression"] == "Apache-2.0"
    license_files = [f for f in metadata.files("pagedkv") if f.name == "LICENSE"]
    assert license_files, "LICENSE is not in the installed distribution"
    text = license_files[0].read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text        # the full text, not a stub


def test_metadata_has_authors_urls_and_classifiers():
    meta = metadata.metadata("pagedkv")
    assert "pagedkv developers" in (meta["Author"] or "") + (meta["Author-email"] or "")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert urls["Source"].startswith("https://github.com/pagedkv/pagedkv")
    assert {"Issues", "Changelog"} <= set(urls)
    assert "Typing :: Typed" in meta.get_all("Classifier")


def test_one_version_everywhere():
    assert pagedkv.__version__ == metadata.version("pagedkv")
    result = subprocess.run([sys.executable, "-m", "pagedkv", "--version"],
                            capture_output=True, text=True, cwd="/" if sys.platform != "win32"
                            else None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"pagedkv {pagedkv.__version__}"


def test_show_config_names_the_level_openmp_and_opencl():
    out = io.StringIO()
    pagedkv.show_config(file=out)
    text = out.getvalue()
    from pagedkv import _cpu
    assert "host kernels:" in text and _cpu.level.name in text
    assert _cpu.kernels.__name__ in text
    assert "levels built:" in text and "levels this CPU runs:" in text
    assert "OpenMP:" in text and "OpenCL:" in text
    config = pagedkv._config.config()
    assert config["version"] == f"pagedkv {pagedkv.__version__}"
    if _cpu.kernels.OPENMP_VERSION:
        assert config["OpenMP"].startswith("on") and "threads" in config["OpenMP"]
    if "opencl" in pagedkv.available_backends():
        assert config["OpenCL"].startswith("devices")

"""The installed package carries its sources: Cython (.pyx/.pxd/.h) as the sdist
and wheel promise, so that a non-editable install is complete."""
from importlib.resources import files

import pagedkv


def test_cython_sources_ship_with_the_package():
    names = {p.name for p in files("pagedkv").iterdir()}
    for source in ("_allocator.pyx", "_allocator.pxd", "_page_table.pyx", "_kernels.pyx",
                   "pkv_half.h", "pkv_simd.h", "pkv_hash.h"):
        assert source in names, source


def test_compiled_modules_load():
    from pagedkv import _allocator, _kernels, _page_table  # noqa: F401
    assert "host" in pagedkv.available_backends()

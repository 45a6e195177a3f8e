"""``import pagedkv`` never imports torch or transformers; ``pagedkv.hf`` without them says
which extra to install.  (Children interpreters: this process may have imported them.)"""
import pytest

from python_child import run_python


def test_import_pagedkv_imports_neither_torch_nor_transformers():
    result = run_python("import sys, pagedkv, pagedkv.models.engine\n"
                        "print(sorted(m for m in ('torch', 'transformers', 'pagedkv.hf') "
                        "if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("missing", ["transformers", "torch"])
def test_pagedkv_hf_without_its_dependencies_names_the_extra(missing):
    result = run_python(f"import sys\nsys.modules[{missing!r}] = None   # as if not installed\n"
                        f"try:\n    import pagedkv.hf\nexcept ImportError as exc:\n"
                        f"    print(type(exc).__name__, exc)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ImportError pagedkv.hf needs torch and transformers")
    assert 'pip install "pagedkv[hf]" torch' in result.stdout

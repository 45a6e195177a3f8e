"""docs/api.md names every public name: a new public call, field, stats key or error
class must be documented there."""
import inspect
import re
from pathlib import Path

import pagedkv

DOC = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
DOCUMENTED = set(re.findall(r"`([A-Za-z_][\w.]*)", DOC))


def public_members(cls):
    return {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}


def test_module_names_are_documented():
    missing = {name for name in pagedkv.__all__ + ["__version__"]
               if name not in DOCUMENTED and f"pagedkv.{name}" not in DOCUMENTED}
    assert not missing, f"docs/api.md lacks {sorted(missing)}"


def test_cache_calls_and_attributes_are_documented():
    cache = pagedkv.PagedKVCache(2, 1, 8, num_pages=4, page_size=4, layer_windows=[None, 4],
                                 backend="host")
    names = public_members(pagedkv.PagedKVCache) | {n for n in vars(cache) if n[0] != "_"}
    names |= set(inspect.signature(pagedkv.PagedKVCache).parameters)
    missing = names - DOCUMENTED
    assert not missing, f"docs/api.md lacks PagedKVCache's {sorted(missing)}"


def test_step_batch_fields_and_stats_keys_are_documented():
    cache = pagedkv.PagedKVCache(2, 1, 8, num_pages=4, page_size=4, layer_windows=[None, 4],
                                 backend="host")
    batch = cache.append([cache.add_sequence()], 3)
    names = public_members(pagedkv.StepBatch) | {n for n in vars(batch) if n[0] != "_"}
    names |= public_members(pagedkv.WindowTables) | set(cache.stats())
    names |= {f.name for f in pagedkv.Checkpoint.__dataclass_fields__.values()
              if not f.name.startswith("_")}
    names |= public_members(pagedkv.StorageFormat)
    missing = names - DOCUMENTED
    assert not missing, f"docs/api.md lacks {sorted(missing)}"


def test_every_error_class_is_documented():
    errors = {name for name, obj in vars(pagedkv.errors).items()
              if inspect.isclass(obj) and issubclass(obj, Exception)}
    missing = {name for name in errors if f"pagedkv.{name}" not in DOCUMENTED}
    assert not missing, f"docs/api.md lacks the errors {sorted(missing)}"


def test_transformers_names_are_documented():
    from hf_models import require_hf
    require_hf()
    import pagedkv.hf
    names = {f"pagedkv.hf.{name}" for name in pagedkv.hf.__all__}
    own = {name for cls in type.mro(pagedkv.hf.PagedCache)[:1] for name in vars(cls)
           if not name.startswith("_")}
    names |= own | set(inspect.signature(pagedkv.hf.PagedCache).parameters)
    names |= set(pagedkv.hf.ModelAttention.__dataclass_fields__) | {"has_windowed_layers"}
    names |= set(inspect.signature(pagedkv.hf.generate_batch).parameters)
    missing = names - DOCUMENTED
    assert not missing, f"docs/api.md lacks {sorted(missing)}"

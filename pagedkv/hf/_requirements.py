"""What pagedkv.hf needs, checked before anything imports it: an ImportError naming the extra."""
INSTALL = 'pip install "pagedkv[hf]" torch'

try:
    import torch  # noqa: F401
    import transformers
    import transformers.cache_utils
except ImportError as exc:
    raise ImportError(f"pagedkv.hf needs torch and transformers (the 'hf' extra): {INSTALL} "
                      f"({exc})") from exc

if not hasattr(transformers.cache_utils.Cache, "get_query_offset"):
    raise ImportError(f"pagedkv.hf needs transformers >= 5.23 (the 'hf' extra), found "
                      f"{transformers.__version__}: {INSTALL}")

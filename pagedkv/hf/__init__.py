"""pagedkv under Hugging Face transformers (the ``hf`` extra).

Importing this package registers the attention implementation ``"pagedkv"``
(and its mask function) with transformers, so that a model loaded after it
with ``attn_implementation="pagedkv"`` computes attention with pagedkv's paged
kernels over a :class:`PagedCache`.  Three ways in (docs/hf.md):

- **attention only**: your own loop appends steps to ``cache.kv`` and runs
  the model on each, packed, inside ``cache.step(batch)``;
- **generate**: ``model.generate(..., past_key_values=PagedCache(...))``
  on padded batches;
- **generate_batch**: :func:`generate_batch`, continuous batching with
  chunked prefill and prefix caching.

``import pagedkv`` never imports this package, torch or transformers.
"""
_INSTALL = 'pip install "pagedkv[hf]" torch'

try:
    import torch  # noqa: F401
    import transformers
except ImportError as exc:
    raise ImportError(f"pagedkv.hf needs torch and transformers (the 'hf' extra): {_INSTALL} "
                      f"({exc})") from exc

import transformers.cache_utils  # noqa: E402

if not hasattr(transformers.cache_utils.Cache, "get_query_offset"):
    raise ImportError(f"pagedkv.hf needs transformers >= 5.23 (the 'hf' extra), found "
                      f"{transformers.__version__}: {_INSTALL}")

from pagedkv.hf.attention import NAME, padding_mask, paged_attention_forward, register
from pagedkv.hf.cache import PagedCache
from pagedkv.hf.config import ModelAttention, UnsupportedModelError, read_model_attention
from pagedkv.hf.generate import generate_batch

register()

__all__ = ["NAME", "ModelAttention", "PagedCache", "UnsupportedModelError", "generate_batch",
           "padding_mask", "paged_attention_forward", "read_model_attention", "register"]

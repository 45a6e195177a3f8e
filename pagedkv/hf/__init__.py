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

Hybrid models (Qwen3.5, Qwen3-Next, LFM2, GraniteMoeHybrid) keep their
recurrent layers' states in the same cache: :mod:`pagedkv.hf.recurrent` routes
their mixers' state calls to it.

``import pagedkv`` never imports this package, torch or transformers.
"""
from pagedkv.hf import _requirements  # noqa: F401  (first: the ImportError naming the extra)
from pagedkv.hf.attention import NAME, padding_mask, paged_attention_forward, register
from pagedkv.hf.cache import PagedCache
from pagedkv.hf.config import ModelAttention, UnsupportedModelError, read_model_attention
from pagedkv.hf.generate import generate_batch

register()

__all__ = ["NAME", "ModelAttention", "PagedCache", "UnsupportedModelError", "generate_batch",
           "padding_mask", "paged_attention_forward", "read_model_attention", "register"]

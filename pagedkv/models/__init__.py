"""A small NumPy Llama engine served through pagedkv (the ``demo`` extra).

Kept apart from the core: ``import pagedkv`` never imports this package, and
only the modules that read model files need the optional dependencies
(``gguf``, ``tokenizers``, ``jinja2``, ``rich``, ``threadpoolctl``).

Modules, one job each:

- :mod:`~pagedkv.models.llama`: config, float32 weights and the forward pass,
  with the KV store / attention injected as a callable.
- :mod:`~pagedkv.models.request`, :mod:`~pagedkv.models.scheduler`,
  :mod:`~pagedkv.models.engine`: continuous batching over a ``PagedKVCache``.
- :mod:`~pagedkv.models.sampling`: greedy and temperature sampling.
- :mod:`~pagedkv.models.gguf_loader`: config and weights from a GGUF file.
- :mod:`~pagedkv.models.tokenizer`: the GGUF's BPE tokenizer and chat template.
- :mod:`~pagedkv.models.default_model`: where SmolLM2-135M-Instruct is installed.
- :mod:`~pagedkv.models.demo`, :mod:`~pagedkv.models.display`,
  :mod:`~pagedkv.models.report`, :mod:`~pagedkv.models.threads`: the
  ``python -m pagedkv demo`` job.
"""
from pagedkv.models.engine import Engine, EngineStats, TokenEvent
from pagedkv.models.llama import LayerWeights, LlamaConfig, LlamaModel, LlamaWeights

__all__ = ["Engine", "EngineStats", "LayerWeights", "LlamaConfig", "LlamaModel", "LlamaWeights",
           "TokenEvent"]

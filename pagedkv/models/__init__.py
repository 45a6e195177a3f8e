"""A small NumPy Llama engine served through pagedkv (the ``demo`` extra).

Kept apart from the core: ``import pagedkv`` never imports this package, and
only the modules that read model files need the optional dependencies
(``gguf``, ``tokenizers``, ``jinja2``, ``rich``, ``threadpoolctl``).

Modules, one job each:

- :mod:`~pagedkv.models.decoder`: what the decoders share (the step loop,
  the attention call with the KV store injected as a callable, norms, RoPE).
- :mod:`~pagedkv.models.llama`: config and float32 weight containers, the
  Llama layer.
- :mod:`~pagedkv.models.gemma`: the Gemma 3 layer (QK-norm, sandwich norms,
  GeGLU, sliding-window and full layers with their own RoPE bases).
- :mod:`~pagedkv.models.request`, :mod:`~pagedkv.models.scheduler`,
  :mod:`~pagedkv.models.engine`: continuous batching over a ``PagedKVCache``.
- :mod:`~pagedkv.models.sampling`: greedy and temperature sampling.
- :mod:`~pagedkv.models.gguf_file`, :mod:`~pagedkv.models.gguf_loader`: a
  GGUF's metadata and tensors; config and weights from them.
- :mod:`~pagedkv.models.tokenizer`: the GGUF's BPE or SentencePiece tokenizer
  and chat template.
- :mod:`~pagedkv.models.default_model`: the models reachable by name
  (SmolLM2-135M-Instruct, Gemma 3 270M) and where they are installed.
- :mod:`~pagedkv.models.demo`, :mod:`~pagedkv.models.display`,
  :mod:`~pagedkv.models.report`, :mod:`~pagedkv.models.threads`: the
  ``python -m pagedkv demo`` job.
"""
from pagedkv.models.decoder import DecoderModel
from pagedkv.models.engine import Engine, EngineStats, TokenEvent
from pagedkv.models.gemma import GemmaConfig, GemmaLayerWeights, GemmaModel
from pagedkv.models.llama import LayerWeights, LlamaConfig, LlamaModel, LlamaWeights

__all__ = ["DecoderModel", "Engine", "EngineStats", "GemmaConfig", "GemmaLayerWeights",
           "GemmaModel", "LayerWeights", "LlamaConfig", "LlamaModel", "LlamaWeights",
           "TokenEvent"]

"""``generate_batch``: continuous batching of a transformers model over pagedkv.

The demo engine (:class:`pagedkv.models.engine.Engine`, with its scheduler)
drives the model: between steps requests join (oldest first, while pages and
the sequence limit allow) and leave as they finish; each step is one forward
pass of the model over every running request's new tokens packed into one row
with no padding (one token per decoding request, a chunk of each prefilling
prompt within the token budget), ``position_ids`` per token, logits only for
the rows that yield a token.  :class:`TransformersDecoder` is the model as the
engine sees it.
"""
import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt
import torch
from transformers import GenerationConfig, PreTrainedModel

from pagedkv.hf.cache import Attend, PagedCache
from pagedkv.hf.config import read_model_attention
from pagedkv.models.engine import Engine

#: GenerationConfig fields generate_batch applies.
SAMPLING_FIELDS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
                   "eos_token_id")
#: Fields with no effect on which tokens come out (or that max_new_tokens overrides).
IGNORED_FIELDS = ("bos_token_id", "pad_token_id", "max_length", "use_cache",
                  "transformers_version", "_from_model_config", "cache_implementation",
                  "return_dict_in_generate", "output_scores", "output_logits")


@dataclass(frozen=True)
class DecoderConfig:
    """What the engine reads of a model (:class:`pagedkv.models.llama.LlamaConfig`'s names)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    layer_windows: Tuple[Optional[int], ...]

    @property
    def has_windowed_layers(self) -> bool:
        return any(w is not None for w in self.layer_windows)


class _StepRecorder:
    """``cache.kv`` as the engine sees it, keeping the batch of each ``append``.

    The engine hands the model a step's attention hook only; a hybrid model's
    recurrent layers also need the step's batch (``query_start``), which is
    the one this cache's last ``append`` returned.  Everything else is
    ``cache.kv``'s own.
    """

    def __init__(self, kv: Any):
        self._kv = kv
        self.batch: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def append(self, *args: Any, **kwargs: Any) -> Any:
        self.batch = self._kv.append(*args, **kwargs)
        return self.batch


class TransformersDecoder:
    """A transformers causal LM with the engine's model interface.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Loaded with ``attn_implementation="pagedkv"``.
    cache : PagedCache
        For ``model.config``; the engine runs on ``cache.kv``.
    """

    def __init__(self, model: PreTrainedModel, cache: PagedCache,
                 steps: Optional[_StepRecorder] = None):
        if getattr(model.config, "_attn_implementation", None) != "pagedkv":
            raise ValueError(
                f"model: expected a model loaded with attn_implementation=\"pagedkv\" (after "
                f"import pagedkv.hf), got {model.config._attn_implementation!r}; call "
                f"model.set_attn_implementation(\"pagedkv\")")
        spec = cache.attention_config
        self.model = model
        self.cache = cache
        self.steps = steps     # the batches of the engine's appends (recurrent layers need them)
        self.name = getattr(model.config, "name_or_path", None) or spec.model_type
        self.config = DecoderConfig(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                    spec.vocab_size, spec.max_position, spec.layer_windows)

    def forward(self, token_ids: npt.ArrayLike, positions: npt.ArrayLike, attend: Attend,
                logit_rows: Optional[npt.ArrayLike] = None) -> np.ndarray:
        """Logits of the selected rows of one packed step.

        Parameters
        ----------
        token_ids, positions : ndarray, shape [num_tokens], int
        attend : AttendFn
            The step's KV hook (``paged_attend(cache.kv, batch)``).
        logit_rows : ndarray, shape [num_logits], int, optional
            Rows whose logits to compute (default: every row).

        Returns
        -------
        ndarray, shape [num_logits, vocab_size], float32
        """
        device = self.model.device
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).view(1, -1).to(device)
        pos = torch.as_tensor(np.asarray(positions, dtype=np.int64)).view(1, -1).to(device)
        keep = 0 if logit_rows is None else \
            torch.as_tensor(np.asarray(logit_rows, dtype=np.int64)).to(device)
        batch = None if self.steps is None else self.steps.batch
        with torch.inference_mode(), self.cache.bind(attend, batch):
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache,
                             use_cache=True, logits_to_keep=keep)
        return out.logits[0].float().cpu().numpy()


def sampling_options(model: PreTrainedModel, generation_config: Optional[GenerationConfig] = None,
                     **kwargs: Any) -> Tuple[Optional[int], Dict[str, Any]]:
    """``max_new_tokens`` and the engine's sampling arguments from GenerationConfig names.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Its ``generation_config`` gives ``eos_token_id`` when nothing else does.
    generation_config : transformers.GenerationConfig, optional
        Default: ``GenerationConfig()`` (greedy).  ``model.generation_config``'s
        sampling settings apply only when passed here.
    **kwargs
        GenerationConfig fields overriding ``generation_config``: ``do_sample``,
        ``temperature``, ``top_k``, ``top_p``, ``max_new_tokens``,
        ``eos_token_id``.

    Returns
    -------
    max_new_tokens : int or None
    options : dict
        ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``stop_ids``.

    Raises
    ------
    ValueError
        A field generate_batch does not apply (beam search, repetition
        penalty, ...), or an unknown name; the message names them.
    """
    config = copy.deepcopy(generation_config) if generation_config is not None \
        else GenerationConfig()
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"generation_config: expected a transformers GenerationConfig, got "
                         f"{type(generation_config).__name__}")
    unknown = config.update(**kwargs)
    if unknown:
        raise ValueError(f"{', '.join(sorted(unknown))}: not GenerationConfig fields")
    unsupported = sorted(set(config.to_diff_dict()) - set(SAMPLING_FIELDS) - set(IGNORED_FIELDS))
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)}: generate_batch applies only "
                         f"{', '.join(SAMPLING_FIELDS)}")
    eos = config.eos_token_id
    if eos is None:
        eos = model.generation_config.eos_token_id
    stop_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if config.do_sample:
        temperature = 1.0 if config.temperature is None else float(config.temperature)
        if not temperature > 0:
            raise ValueError(f"temperature: expected a float > 0 with do_sample=True, got "
                             f"{config.temperature!r}")
        options: dict = dict(temperature=temperature, top_k=int(config.top_k or 0),
                             top_p=1.0 if config.top_p is None else float(config.top_p))
    else:
        options = dict(temperature=0.0, top_k=0, top_p=1.0)
    options["stop_ids"] = stop_ids
    return config.max_new_tokens, options


def _default_num_pages(prompts: Sequence[Sequence[int]], max_new_tokens: int, page_size: int,
                       max_position: int) -> int:
    """Pages for every prompt at its full length at once (no preemption)."""
    return max(1, sum(-(-min(len(p) + max_new_tokens, max_position) // page_size)
                      for p in prompts))


def make_engine(model: PreTrainedModel, cache: PagedCache, *, max_num_seqs: int = 32,
                max_num_batched_tokens: int = 512, seed: Optional[int] = None) -> Engine:
    """The continuous-batching engine over ``model`` and ``cache.kv``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Loaded with ``attn_implementation="pagedkv"``.
    cache : PagedCache
    max_num_seqs, max_num_batched_tokens, seed
        As for :class:`pagedkv.models.engine.Engine`.

    Returns
    -------
    pagedkv.models.engine.Engine
    """
    if not isinstance(cache, PagedCache):
        raise ValueError(f"cache: expected a pagedkv.hf.PagedCache, got "
                         f"{type(cache).__name__}")
    steps = _StepRecorder(cache.kv)
    return Engine(TransformersDecoder(model, cache, steps), steps, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, seed=seed)


def generate_batch(model: PreTrainedModel, prompts: Sequence[Sequence[int]],
                   max_new_tokens: Optional[int] = None, *, cache: Optional[PagedCache] = None,
                   backend: str = "auto", dtype: str = "float32",
                   num_pages: Optional[int] = None, page_size: int = 16,
                   enable_prefix_caching: bool = True, max_num_seqs: int = 32,
                   max_num_batched_tokens: int = 512,
                   generation_config: Optional[GenerationConfig] = None,
                   seed: Optional[int] = None, num_state_slots: Optional[int] = None,
                   state_snapshot_interval: Optional[int] = None,
                   **generation_kwargs: Any) -> List[List[int]]:
    """Complete token-id prompts with continuous batching over a paged KV cache.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder loaded with ``attn_implementation="pagedkv"``.
    prompts : list of sequence of int
        Token ids, each prompt at least one.
    max_new_tokens : int, optional
        Tokens to generate per prompt at most (default: the generation
        config's).
    cache : PagedCache, optional
        Reused across calls (its prefix cache with it); default: a new one of
        ``num_pages`` pages.
    backend, dtype, page_size, enable_prefix_caching
        For the new cache (as :class:`PagedCache`); prefix caching is on by
        default, so prompts sharing a prefix compute it once.
    num_pages : int, optional
        Default: enough for every prompt at its full length at once.
    max_num_seqs : int, default 32
        Most requests running at once.
    max_num_batched_tokens : int, default 512
        Token budget of one step: prefill is chunked to it, beside the decodes.
    generation_config : transformers.GenerationConfig, optional
        Default ``GenerationConfig()``: greedy, stopping at the model's
        ``eos_token_id``.
    seed : int, optional
        Seeds sampling (``do_sample=True``).
    num_state_slots : int, optional
        A hybrid model's new cache: slots of its state pool (default: two per
        request that can run at once, so that prefix snapshots fit beside
        them).
    state_snapshot_interval : int, optional
        A hybrid model's new cache: tokens between state snapshots for prefix
        reuse (as :class:`PagedCache`).
    **generation_kwargs
        GenerationConfig fields: ``do_sample``, ``temperature``, ``top_k``
        (transformers' default 50 applies when sampling), ``top_p``,
        ``eos_token_id``.

    Returns
    -------
    list of list of int
        The generated ids of each prompt, in the order given (a stop token
        that ended one is included).

    Raises
    ------
    ValueError
        A bad prompt, option or GenerationConfig field (named).
    UnsupportedModelError
        A model pagedkv cannot serve.
    """
    prompts = [[int(t) for t in p] for p in prompts]
    new_tokens, options = sampling_options(model, generation_config, **generation_kwargs)
    max_new_tokens = new_tokens if max_new_tokens is None else max_new_tokens
    if cache is None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        if num_pages is None:
            num_pages = _default_num_pages(prompts, max_new_tokens, page_size,
                                           model.config.get_text_config(decoder=True)
                                           .max_position_embeddings or 2**31 - 1)
        num_seqs = min(len(prompts), max_num_seqs)
        state_options: Dict[str, Any] = {}
        if read_model_attention(model.config).is_hybrid:
            state_options = dict(
                num_state_slots=2 * num_seqs + 2 if num_state_slots is None else num_state_slots,
                state_snapshot_interval=state_snapshot_interval)
        cache = PagedCache(model.config, num_pages=num_pages, page_size=page_size,
                           backend=backend, dtype=dtype,
                           enable_prefix_caching=enable_prefix_caching,
                           num_window_pages=_window_pages(model.config, num_pages, page_size,
                                                          num_seqs, max_num_batched_tokens),
                           **state_options)
    engine = make_engine(model, cache, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, seed=seed)
    request_ids = [engine.add_request(p, max_new_tokens=max_new_tokens, **options)
                   for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [list(engine.requests[r].output_ids) for r in request_ids]


def _window_pages(config: Any, num_pages: int, page_size: int, num_seqs: int,
                  max_num_batched_tokens: int) -> Optional[int]:
    """Pages the window pool needs for ``num_seqs`` running sequences (at most ``num_pages``).

    A windowed layer holds about ``(W + new tokens) / page_size + 2`` pages per
    sequence (``PagedKVCache``); the step's new tokens are the budget at most.
    None without windowed layers.
    """
    windows = [w for w in read_model_attention(config).layer_windows if w is not None]
    if not windows:
        return None
    per_seq = -(-max(windows) // page_size) + 3
    return min(num_pages, num_seqs * per_seq + -(-max_num_batched_tokens // page_size))

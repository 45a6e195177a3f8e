"""``PagedCache``: a transformers ``Cache`` whose layers keep their K/V in a ``PagedKVCache``.

transformers runs ``past_key_values.update(k, v, layer_idx)`` in each layer and
then the registered attention function (:mod:`pagedkv.hf.attention`), which
hands the layer's queries, keys and values back to the cache that took the
update.  The cache stores the new tokens' K/V and computes their attention with
``PagedKVCache.store`` / ``PagedKVCache.attention``.  It serves two kinds of
forward pass:

- **padded batches** (``model.generate`` and plain ``model(...)`` calls): row
  ``b`` of the batch is one pagedkv sequence.  The registered mask function
  passes on which of the forward's new tokens are padding; those are never
  stored, and their output rows are zeros.  ``get_seq_length()`` is the
  padded width (what ``generate`` slices its inputs by), while each sequence
  holds only its real tokens, at the positions ``generate`` gives them (the
  count of real tokens before each, from the attention mask).
- **ragged steps** (:meth:`PagedCache.step`, and ``generate_batch``): the
  caller appended a step to :attr:`PagedCache.kv` itself and runs the model on
  the step's tokens packed into one row, with ``position_ids`` per token.

A model of multi-head latent attention (DeepSeek V2/V3) updates the cache
with its normalised latent and rotary key instead of K and V: the cache
keeps them as one latent row (``kv_layout="latent"``), and the attention
call absorbs ``kv_b_proj`` into the queries and the output
(:func:`pagedkv.hf.attention.paged_attention_forward`), so no step expands
the history back into per-head K/V.

A hybrid model's recurrent layers (gated DeltaNet, short convolutions, Mamba2)
keep their state in the same ``PagedKVCache`` (``layer_states``), one slot per
sequence: the mixers hand each step's rows to the cache through the functions
:mod:`pagedkv.hf.recurrent` routes (``PagedKVCache.causal_conv1d`` and
``gated_delta_rule``; Mamba2's scan between ``read_states`` and
``write_states``).  Padding tokens never reach a state, so a left-padded row
advances its state by its real tokens only, as in a step of its own.
"""

import contextlib
import threading
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence,
                    Tuple, Union, cast)

import numpy as np
from transformers.cache_utils import Cache, CacheLayerMixin

import pagedkv
from pagedkv.hf import recurrent
from pagedkv.hf.config import UnsupportedModelError, read_model_attention

if TYPE_CHECKING:   # annotations only: torch comes with transformers
    import torch

_LinearLayerBase: Any
try:    # what transformers' hybrid models expect of a recurrent layer's cache (5.25 tested)
    from transformers.cache_utils import LinearAttentionCacheLayerMixin as _LinearLayerBase
except ImportError:     # an older transformers: attention models only (PagedCache says so)
    _LinearLayerBase = object

    from pagedkv.step import StepBatch

#: What a bound step runs per layer: ``attend(layer, q, k, v, **variants)`` (see ``bind``).
Attend = Callable[..., "torch.Tensor"]

# The update() a layer just made, for the attention call that follows it on the same thread;
# and the padding of the forward pass being set up (padding_mask), for a recurrent first layer.
_pending = threading.local()


def note_padding(batch_size: int, q_length: int, new: "Optional[torch.Tensor]") -> None:
    """The mask function's finding for the pass about to run: which new tokens are real.

    Parameters
    ----------
    batch_size, q_length : int
    new : torch.Tensor, shape [batch_size, q_length], bool, or None
        None: every new token is real.

    Notes
    -----
    An attention layer gets this mask as its ``attention_mask``; a recurrent
    mixer gets none the cache can see, so the first layer of a padded pass
    takes it from here (and clears it).
    """
    _pending.padding = (batch_size, q_length, new)


def _take_padding(batch_size: int, q_length: int) -> "Optional[torch.Tensor]":
    noted = getattr(_pending, "padding", None)
    _pending.padding = None
    if noted is None or noted[:2] != (batch_size, q_length):
        return None
    return noted[2]


def take_update(module: Any, key: "torch.Tensor") -> "Tuple[PagedCache, int, Any]":
    """The cache and layer of the ``update`` that produced ``key``, consumed, and
    the latent rows it took (latent attention; else None).

    Returns
    -------
    cache : PagedCache
    layer : int
    rows : torch.Tensor, shape [B, 1, q, kv_lora_rank + qk_rope_head_dim], or None
        Latent attention: the new tokens' latent rows (the model's ``key`` is
        their expansion, which the cache does not keep).

    Raises
    ------
    ValueError
        ``key`` did not come from a ``PagedCache`` update just before: the
        model runs with another cache or none, or the layer changed its keys
        between the update and the attention call (latent attention: the
        update was another layer's).
    """
    cache, layer, updated_key, rows = getattr(_pending, "update", (None, None, None, None))
    _pending.update = (None, None, None, None)
    latent_matches = rows is not None and layer == getattr(module, "layer_idx", None)
    if cache is None or updated_key is not key and not latent_matches:
        raise ValueError(
            f"layer {getattr(module, 'layer_idx', '?')}: attn_implementation=\"pagedkv\" "
            f"attends over a pagedkv.hf.PagedCache, and this layer's keys did not come from "
            f"one: pass past_key_values=pagedkv.hf.PagedCache(model.config, num_pages=...) "
            f"(and use_cache=True), or use pagedkv.hf.generate_batch")
    return cache, cast(int, layer), rows      # update() set them with the cache


def _as_float_tensor(array: Any) -> "torch.Tensor":
    """A state array from the pool (numpy or torch) as a float32 torch tensor."""
    import torch
    if isinstance(array, torch.Tensor):
        return array.float()
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


class _PagedLayer(CacheLayerMixin):
    """One layer's view of a :class:`PagedCache` (what transformers asks of a cache layer)."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: "PagedCache", window: Optional[int]):
        super().__init__()
        self._cache = cache
        self.is_sliding = window is not None
        self.sliding_window = window
        self.is_initialized = True

    def lazy_initialization(self, key_states: "torch.Tensor",
                            value_states: "torch.Tensor") -> None:
        pass

    def update(self, key_states: "torch.Tensor", value_states: "torch.Tensor", *args: Any,
               **kwargs: Any) -> "Tuple[torch.Tensor, torch.Tensor]":
        raise NotImplementedError("PagedCache.update stores every layer")

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class _PagedStateLayer(_LinearLayerBase):
    """A recurrent layer's view of a :class:`PagedCache`: transformers sees a linear-attention
    layer (``Cache.is_linear``), whose state the cache keeps in ``PagedKVCache``'s pool."""

    supports_early_init = False

    def __init__(self, cache: "PagedCache", num_states: int):
        super().__init__(number_of_states=num_states)
        self._cache = cache
        self.is_initialized = True
        self.is_sliding = False

    @property
    def is_compileable(self) -> bool:
        # generate builds 4D masks for compileable caches; the paged attention takes 2D ones
        return False

    @property
    def is_croppable(self) -> bool:   # type: ignore[override]
        """Assisted decoding crops: the pool keeps ``state_rollback_tokens`` states back."""
        return self._cache.state_rollback_tokens > 0

    def lazy_initialization(self, conv_states: Any = None, recurrent_states: Any = None,
                            state_idx: int = 0, **kwargs: Any) -> None:
        pass

    def update_conv_state(self, conv_states: Any, state_idx: int = 0, **kwargs: Any) -> Any:
        raise NotImplementedError("PagedCache keeps recurrent states in its PagedKVCache")

    def update_recurrent_state(self, recurrent_states: Any, state_idx: int = 0,
                               **kwargs: Any) -> Any:
        raise NotImplementedError("PagedCache keeps recurrent states in its PagedKVCache")

    def get_seq_length(self) -> int:       # type: ignore[override]
        return self._cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class _PaddedStep:
    """The pagedkv step of one padded forward pass."""

    def __init__(self, batch: "StepBatch", valid: np.ndarray, lengths_before: List[int]):
        self.batch = batch
        self.valid = valid                    # [B, q] bool ndarray: the pass's real tokens
        self.lengths_before = lengths_before  # per row, for rolling back an unfinished pass
        self.stored: "set[int]" = set()


class PagedCache(Cache):
    """A transformers ``Cache`` over a :class:`pagedkv.PagedKVCache` sized from a model config.

    Load the model with ``attn_implementation="pagedkv"`` (after ``import
    pagedkv.hf``) and pass the cache as ``past_key_values``.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        ``model.config``.  Read for the layers, KV heads, ``head_dim``, the
        layer types (``sliding_attention`` layers become windowed layers of
        ``sliding_window`` positions, which keep K/V in the window pool),
        the scale (``query_pre_attn_scalar``) and ``attn_logit_softcapping``;
        a hybrid model's recurrent layers (``linear_attention``, ``conv``)
        become recurrent layers of the cache (``layer_states``: float32
        states of the shapes ``pagedkv.hf.config.RecurrentLayer`` gives).
    num_pages : int
        Pages of the full-attention pool.
    page_size : int, default 16
    backend : {"auto", "host", "opencl"}
    dtype : {"float32", "float16", "int8"}
        KV storage; arithmetic is float32 whatever it is.
    enable_prefix_caching : bool, default False
        Reuse cached pages of repeated prompts in :func:`~pagedkv.hf.generate_batch`
        and in steps you append with ``token_ids`` (padded ``generate`` neither
        reuses nor caches prefixes).
    num_window_pages : int, optional
        Pages of the windowed layers' pool (default ``num_pages``).
    max_seq_len : int, optional
    device : optional
        opencl only: as for :class:`pagedkv.PagedKVCache`.
    num_state_slots : int, optional
        Hybrid models: slots of the state pool, each one sequence's state of
        every recurrent layer (default: the ``PagedKVCache``'s).
    state_rollback_tokens : int, default 0
        Hybrid models: tokens a sequence's recurrent states can be rolled back
        by (``crop``: assisted decoding needs its number of draft tokens).
    state_snapshot_interval : int, optional
        Hybrid models with prefix caching: tokens between the state snapshots
        a later prompt can start from (a multiple of ``page_size``; default
        ``16 * page_size``).

    Attributes
    ----------
    kv : pagedkv.PagedKVCache
        The paged cache itself: sequences, pages, ``stats()``.
    attention_config : pagedkv.hf.config.ModelAttention
        What was read from ``config``.

    Raises
    ------
    UnsupportedModelError
        A config pagedkv cannot serve (a layer type with no mapping,
        bidirectional attention, a ``head_dim`` the backend cannot take, ...);
        the message names the config field.  A ``ValueError``.
    ValueError
        A bad cache argument (the message names it).

    Notes
    -----
    In a padded batch, row ``b`` is sequence ``self.rows[b]`` of :attr:`kv`
    from the first forward pass on; a later pass with another batch size is a
    ``ValueError`` (use a new cache, or :meth:`reset`).  ``crop``,
    ``reorder_cache`` and ``batch_repeat_interleave`` (assisted decoding, beam
    search, several return sequences) work on the rows, through
    ``truncate`` and copy-on-write ``fork``.  A hybrid model's recurrent
    states follow: a fork shares them copy-on-write, and ``crop`` within
    ``state_rollback_tokens`` restores them.
    """

    def __init__(self, config: Any, *, num_pages: int, page_size: int = 16,
                 backend: str = "auto", dtype: str = "float32",
                 enable_prefix_caching: bool = False, num_window_pages: Optional[int] = None,
                 max_seq_len: Optional[int] = None, device: Any = None,
                 num_state_slots: Optional[int] = None, state_rollback_tokens: int = 0,
                 state_snapshot_interval: Optional[int] = None):
        spec = read_model_attention(config)
        windows = list(spec.layer_windows) if spec.has_windowed_layers else None
        state_options: Dict[str, Any] = {}
        if spec.is_hybrid:
            if _LinearLayerBase is object:
                raise UnsupportedModelError(
                    f"config.layer_types: {spec.model_type}'s recurrent layers need a "
                    f"transformers with linear-attention cache layers (5.25 is tested), found "
                    f"{__import__('transformers').__version__}")
            recurrent.install(spec.model_type)
            # states stay float32 whatever the K/V storage: a recurrence compounds rounding
            state_options = dict(
                layer_states=[None if s is None else pagedkv.StateSpec(shapes=s.shapes,
                                                                       dtype="float32")
                              for s in spec.layer_states],
                num_state_slots=num_state_slots, state_rollback_tokens=state_rollback_tokens,
                state_snapshot_interval=state_snapshot_interval)
        else:
            for name, value, default in (("num_state_slots", num_state_slots, None),
                                         ("state_rollback_tokens", state_rollback_tokens, 0),
                                         ("state_snapshot_interval", state_snapshot_interval,
                                          None)):
                if value != default:
                    raise ValueError(f"{name}: {spec.model_type} has no recurrent layers, "
                                     f"got {value!r}")
        try:
            kv = pagedkv.PagedKVCache(
                spec.num_layers, spec.num_kv_heads, spec.head_dim, num_pages=num_pages,
                page_size=page_size, dtype=dtype, max_seq_len=max_seq_len, backend=backend,
                device=device, enable_prefix_caching=enable_prefix_caching,
                layer_windows=windows, num_window_pages=num_window_pages,
                kv_layout=spec.kv_layout, v_head_dim=spec.v_head_dim, **state_options)
        except ValueError as exc:
            if str(exc).startswith("head_dim"):
                raise UnsupportedModelError(
                    f"config.head_dim: {spec.head_dim} ({spec.model_type}) cannot be served by "
                    f"the {backend!r} backend: {exc}") from exc
            raise
        self.kv = kv
        #: Tokens a recurrent state can be rolled back by (``crop``), as given to ``kv``.
        self.state_rollback_tokens = int(state_rollback_tokens)
        layers: List[Any] = []
        for window, state in zip(spec.layer_windows,
                                 spec.layer_states or (None,) * spec.num_layers):
            layers.append(_PagedLayer(self, window) if state is None
                          else _PagedStateLayer(self, len(state.shapes)))
        super().__init__(layers=layers)
        self.attention_config = spec
        self.rows: List[int] = []                       # padded batches: a sequence per row
        self._columns = np.zeros((0, 0), dtype=bool)   # [B, width]: which held a real token
        self._step: Optional[_PaddedStep] = None
        self._attend: Optional[Attend] = None
        self._bound_batch: Optional["StepBatch"] = None    # the ragged step's (recurrent layers)
        self._expected_positions: Optional[np.ndarray] = None
        self._num_stored_tokens = 0
        self._mamba2_pending: Dict[int, Any] = {}           # layer -> (conv states, ssm before)

    def __repr__(self) -> str:
        return (f"PagedCache({self.attention_config.model_type}, {len(self.rows)} rows of "
                f"width {self.get_seq_length()}, kv={self.kv!r})")

    # -- what transformers asks of a cache ---------------------------------------------
    def update(self, key_states: "torch.Tensor", value_states: "torch.Tensor", layer_idx: int,
               *args: Any, **kwargs: Any) -> "Tuple[torch.Tensor, torch.Tensor]":
        """Take a layer's new ``key_states`` / ``value_states`` ``[B, num_kv_heads, q, head_dim]``.

        They are stored by the attention call that follows (which learns from
        the mask which tokens are padding); returned unchanged.  Latent
        attention passes its normalised latent ``[B, 1, q, kv_lora_rank]`` and
        rotary key ``[B, 1, q, qk_rope_head_dim]`` instead: they are kept as
        one latent row.

        Raises
        ------
        ValueError
            The previous layer's update never reached the ``"pagedkv"``
            attention: the model computes attention another way, which would
            see this pass's tokens only.
        """
        cache, layer, _, _ = getattr(_pending, "update", (None, None, None, None))
        if cache is self and layer == layer_idx - 1:
            raise ValueError(
                f"past_key_values: a pagedkv.hf.PagedCache needs the model's attention to be "
                f"\"pagedkv\" (layer {layer} computed it another way); load the model with "
                f"attn_implementation=\"pagedkv\" after import pagedkv.hf, or call "
                f"model.set_attn_implementation(\"pagedkv\")")
        rows = None
        latent = self.attention_config.latent
        if latent is not None:
            want = (latent.kv_lora_rank, latent.qk_rope_head_dim)
            got = (key_states.shape[-1], value_states.shape[-1])
            if got != want or key_states.shape[:-1] != value_states.shape[:-1]:
                raise ValueError(f"key_states, value_states: latent attention updates the cache "
                                 f"with its latent and rotary key of widths {want}, got "
                                 f"shapes {list(key_states.shape)} and "
                                 f"{list(value_states.shape)}")
            import torch
            rows = torch.cat([key_states, value_states], dim=-1)
        _pending.update = (self, layer_idx, key_states, rows)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The padded width: columns of the padded batch seen so far."""
        return self._columns.shape[1]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> Tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1 if self.kv.max_seq_len is None else self.kv.max_seq_len

    def reset(self) -> None:
        """Free every row's sequence (the cache is then as new; the prefix cache stays)."""
        for seq_id in self.rows:
            self.kv.free(seq_id)
        self.rows = []
        self._columns = np.zeros((0, 0), dtype=bool)
        self._step = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns of the padded batch (a negative int)."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) \
                or tokens_to_remove > 0 or -tokens_to_remove > self.get_seq_length():
            raise ValueError(f"tokens_to_remove: expected an int in [-{self.get_seq_length()}, "
                             f"0] (minus the columns to drop), got {tokens_to_remove!r}")
        self._roll_back_unfinished_pass()
        if tokens_to_remove == 0:
            return
        keep = self.get_seq_length() + tokens_to_remove
        dropped = self._columns[:, keep:].sum(axis=1)
        for seq_id, num in zip(self.rows, dropped.tolist()):
            self.kv.truncate(seq_id, self.kv.seq_len(seq_id) - num)
        self._columns = self._columns[:, :keep]

    def _remap_rows(self, sources: Sequence[int]) -> None:
        """Rows become forks of ``sources`` (old row indices); the old rows are freed."""
        self._roll_back_unfinished_pass()
        if not self.rows:
            return
        forks = [self.kv.fork(self.rows[i]) for i in sources]
        for seq_id in self.rows:
            self.kv.free(seq_id)
        self.rows = forks
        self._columns = self._columns[np.asarray(sources, dtype=np.intp)]

    def reorder_cache(self, beam_idx: "torch.LongTensor") -> None:
        """Beam search: row ``i`` becomes a copy-on-write fork of row ``beam_idx[i]``."""
        self._remap_rows([int(i) for i in beam_idx])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._remap_rows([i for i in range(len(self.rows)) for _ in range(int(repeats))])

    def batch_select_indices(self, indices: "torch.Tensor") -> None:
        self._remap_rows([int(i) for i in indices])

    # -- ragged steps ------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, batch: "StepBatch") -> Iterator["PagedCache"]:
        """Run the forward passes inside on a step you appended to :attr:`kv`.

        Parameters
        ----------
        batch : pagedkv.StepBatch
            From ``cache.kv.append(seq_ids, num_new_tokens)``.  The model gets
            the step's ``batch.num_tokens`` tokens packed into one row
            (``input_ids`` ``[1, num_tokens]``, sequence after sequence as in
            ``batch.seq_ids``), with ``position_ids`` ``[1, num_tokens]``
            holding each token's position in its sequence, and no attention
            mask.  A hybrid model's recurrent layers advance each sequence's
            state by its rows of the step (``batch.query_start``).

        Examples
        --------
        >>> batch = cache.kv.append([a, b], [len(prompt_a), len(prompt_b)])
        >>> with cache.step(batch):
        ...     logits = model(input_ids=ids, position_ids=positions,
        ...                    past_key_values=cache).logits
        """
        seq_lens = np.asarray(batch.seq_lens, dtype=np.int64)
        query_start = np.asarray(batch.query_start, dtype=np.int64)
        counts = query_start[1:] - query_start[:-1]
        starts = np.repeat(seq_lens - counts, counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        kv = self.kv

        def attend(layer: int, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor",
                   **variants: Any) -> "torch.Tensor":
            kv.store(layer, batch, k, v)
            return kv.attention(layer, batch, q, **variants)

        with self.bind(attend, batch):
            self._expected_positions = starts + offsets
            try:
                yield self
            finally:
                self._expected_positions = None

    @contextlib.contextmanager
    def bind(self, attend: Attend, batch: "Optional[StepBatch]" = None) -> Iterator["PagedCache"]:
        """Route the forward passes inside through ``attend(layer, q, k, v, **variants)``.

        The engine's hook (``pagedkv.models.engine.paged_attend`` of a step):
        ``q`` ``[num_tokens, num_heads, head_dim]``, ``k``/``v``
        ``[num_tokens, num_kv_heads, head_dim]`` (torch tensors, packed as in
        :meth:`step`), ``variants`` the keyword arguments of
        ``PagedKVCache.attention`` (``scale``, ``logits_soft_cap``, ``sinks``).

        Parameters
        ----------
        attend : callable
        batch : pagedkv.StepBatch, optional
            The step's batch (from ``kv.append``); a hybrid model's recurrent
            layers need it (their rows follow ``batch.query_start``).
        """
        if self._attend is not None:
            raise RuntimeError("PagedCache: a step is already bound; steps do not nest")
        self._attend = attend
        self._bound_batch = batch
        try:
            yield self
        finally:
            self._attend = None
            self._bound_batch = None
            self._mamba2_pending.clear()

    # -- the attention call ---------------------------------------------------------------
    def attend(self, layer: int, query: "torch.Tensor", key: "torch.Tensor",
               value: "torch.Tensor", padding: "Optional[torch.Tensor]",
               variants: Dict[str, Any],
               position_ids: "Optional[torch.Tensor]" = None) -> "torch.Tensor":
        """Store one layer's new K/V and return its attention (the registered function's body).

        Parameters
        ----------
        layer : int
        query : torch.Tensor, shape [B, num_heads, q, head_dim]
        key, value : torch.Tensor, shape [B, num_kv_heads, q, head_dim]
            Latent attention: ``key`` the latent rows, ``value`` None.
        padding : torch.Tensor, shape [B, q], bool, or None
            True for the new tokens that are real (from the mask function);
            None: every one is.
        variants : dict
            Keyword arguments of ``PagedKVCache.attention``.
        position_ids : torch.Tensor, shape [B, q], optional
            Checked against the step's positions inside :meth:`step`.

        Returns
        -------
        torch.Tensor, shape [B, q, num_heads, v_head_dim], ``query.dtype``
            Zeros in the rows of padding tokens (``v_head_dim``: the cache's).
        """
        # inference only: a plain model(...) call outside no_grad gives tensors that need grad
        query, key = query.detach(), key.detach()
        value = None if value is None else value.detach()
        if self._attend is not None:
            return self._attend_packed(self._attend, layer, query, key, value, padding,
                                       variants, position_ids)
        return self._attend_padded(layer, query, key, value, padding, variants)

    def _attend_packed(self, attend: Attend, layer: int, query: "torch.Tensor",
                       key: "torch.Tensor", value: "torch.Tensor",
                       padding: "Optional[torch.Tensor]", variants: Dict[str, Any],
                       position_ids: "Optional[torch.Tensor]") -> "torch.Tensor":
        if query.shape[0] != 1 or padding is not None:
            raise ValueError(f"input_ids: a step runs its tokens packed into one row with no "
                             f"padding (input_ids [1, num_tokens], no attention_mask), got "
                             f"{query.shape[0]} rows{' with padding' if padding is not None else ''}")
        expected = self._expected_positions
        if expected is not None:
            got = None if position_ids is None else position_ids.reshape(-1).cpu().numpy()
            if got is None or got.shape != expected.shape or not np.array_equal(got, expected):
                raise ValueError(f"position_ids: expected the step's positions {expected[:8]}"
                                 f"{'...' if len(expected) > 8 else ''} (shape [1, "
                                 f"{len(expected)}]), got "
                                 f"{None if got is None else got[:8]}")
            self._expected_positions = None     # checked once per step
        out = attend(layer, query[0].transpose(0, 1), key[0].transpose(0, 1),
                     None if value is None else value[0].transpose(0, 1), **variants)
        if layer == 0:
            self._num_stored_tokens += query.shape[2]
        return out.unsqueeze(0).to(query.dtype)

    def _attend_padded(self, layer: int, query: "torch.Tensor", key: "torch.Tensor",
                       value: "torch.Tensor", padding: "Optional[torch.Tensor]",
                       variants: Dict[str, Any]) -> "torch.Tensor":
        batch_size, num_heads, q_len, head_dim = query.shape
        step = self._step
        if step is None or layer in step.stored:
            step = self._begin_padded_step(batch_size, q_len, padding)
            _take_padding(batch_size, q_len)      # the pass's own mask came with the call
        kv = self.kv
        q, k = query.transpose(1, 2), key.transpose(1, 2)
        v = None if value is None else value.transpose(1, 2)
        if padding is None:
            k = k.reshape(batch_size * q_len, -1, head_dim)
            v = None if v is None else v.reshape(batch_size * q_len, -1, v.shape[-1])
            q = q.reshape(batch_size * q_len, num_heads, head_dim)
        else:
            k, q = k[padding], q[padding]
            v = None if v is None else v[padding]
        kv.store(layer, step.batch, k, v)
        out = kv.attention(layer, step.batch, q, **variants).to(query.dtype)
        self._finish_padded_layer(step, layer)
        if padding is None:
            return out.view(batch_size, q_len, num_heads, out.shape[-1])
        full = query.new_zeros((batch_size, q_len, num_heads, out.shape[-1]))
        full[padding] = out
        return full

    def _finish_padded_layer(self, step: _PaddedStep, layer: int) -> None:
        step.stored.add(layer)
        if len(step.stored) == self.kv.num_layers:    # the pass is complete: its columns count
            self._columns = np.concatenate([self._columns, step.valid], axis=1)
            self._num_stored_tokens += int(step.valid.sum())
            self._step = None

    def _roll_back_unfinished_pass(self) -> None:
        """A pass that stopped part way (an exception) leaves no tokens behind.

        Raises
        ------
        ValueError
            A hybrid model's pass advanced some recurrent states by more tokens
            than ``state_rollback_tokens`` can take back: the rows are freed
            (as :meth:`reset` does), since their states no longer match.
        """
        step, self._step = self._step, None
        self._mamba2_pending.clear()
        if step is None:
            return
        try:
            for seq_id, length in zip(self.rows, step.lengths_before):
                self.kv.truncate(seq_id, length)
        except ValueError as exc:
            self.reset()
            raise ValueError(
                f"state_rollback_tokens: a forward pass stopped part way after some recurrent "
                f"layers had advanced, and this PagedCache keeps {self.state_rollback_tokens} "
                f"token(s) of states to roll back ({exc}); its rows were freed: start the "
                f"generation again") from exc

    def _begin_padded_step(self, batch_size: int, q_len: int,
                           padding: "Optional[torch.Tensor]") -> _PaddedStep:
        self._roll_back_unfinished_pass()
        if not self.rows:
            self.rows = [self.kv.add_sequence() for _ in range(batch_size)]
            self._columns = np.zeros((batch_size, 0), dtype=bool)
        elif len(self.rows) != batch_size:
            raise ValueError(f"input_ids: this PagedCache holds a batch of {len(self.rows)} "
                             f"rows, got {batch_size}; use a new cache (or cache.reset()) for "
                             f"another batch")
        if padding is None:
            valid = np.ones((batch_size, q_len), dtype=bool)
        else:
            if tuple(padding.shape) != (batch_size, q_len):
                raise ValueError(f"attention_mask: expected the new tokens' mask of shape "
                                 f"{[batch_size, q_len]}, got {list(padding.shape)}")
            valid = padding.cpu().numpy()
        counts = valid.sum(axis=1)
        lengths = [self.kv.seq_len(s) for s in self.rows]
        batch = self.kv.append(self.rows, counts)
        self._step = _PaddedStep(batch, valid, lengths)
        return self._step

    # -- recurrent layers (hybrid models) ---------------------------------------------------
    # What transformers' mixers ask of a cache.  The states live in the pool; the
    # functions pagedkv.hf.recurrent routes read and write them there, so nothing here
    # hands a state tensor out or takes one in.
    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> None:
        """None: the pool holds the state, which the routed calls read themselves."""
        self._recurrent_layer(layer_idx)
        return None

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> Any:
        """Nothing to store: the routed call wrote the state into the pool already."""
        if recurrent_states is not None:
            raise ValueError(f"layer {layer_idx}: a recurrent state computed outside pagedkv "
                             f"reached a PagedCache (transformers' own kernel ran instead of "
                             f"the one pagedkv.hf routes)")
        return None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Any:
        raise ValueError(f"layer {layer_idx}: a PagedCache keeps the convolution state in its "
                         f"pool; the convolution must run through pagedkv.hf (its "
                         f"causal_conv1d_forward), not transformers' own")

    def update_conv_state(self, conv_states: Any, layer_idx: int, state_idx: int = 0,
                          **kwargs: Any) -> Any:
        return self.get_conv_state(layer_idx, state_idx)

    def has_previous_state(self, layer_idx: Optional[int] = None,
                           state_idx: Optional[int] = None) -> bool:
        """True once a forward pass went through (the rows hold tokens)."""
        return self.get_seq_length() > 0

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        pass

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: Optional[int] = None) -> int:
        """0: the pool keeps the states a rollback needs itself (``state_rollback_tokens``)."""
        return 0

    def activate_past_recording(self, recurrent_states_to_keep: Optional[int] = None,
                                **kwargs: Any) -> None:
        """Check that ``crop`` can take back ``recurrent_states_to_keep`` tokens (assisted decoding).

        Raises
        ------
        ValueError
            A hybrid model's cache built with fewer ``state_rollback_tokens``, or
            one with Mamba2 layers (their states are written once per pass).
        """
        if not self.attention_config.is_hybrid:
            return
        mamba2 = [i for i, state in enumerate(self.attention_config.layer_states)
                  if state is not None and state.kind == "mamba2"]
        if mamba2:
            # its states reach the pool through write_states, once per step: a crop into
            # the middle of a verified draft would find no state there
            raise ValueError(f"assisted decoding: layer {mamba2[0]} of this "
                             f"{self.attention_config.model_type} is a Mamba2 layer, whose "
                             f"state pagedkv keeps at the end of each forward pass only, so "
                             f"a rejected draft cannot be cropped; decode without an "
                             f"assistant")
        need = 1 if recurrent_states_to_keep is None else int(recurrent_states_to_keep)
        have = self.state_rollback_tokens
        if need > have:
            raise ValueError(f"state_rollback_tokens: this generation may roll back {need} "
                             f"tokens (assisted decoding's draft), the PagedCache keeps "
                             f"{have}; build it with state_rollback_tokens >= {need}")

    def _recurrent_layer(self, layer: int) -> Any:
        states = self.attention_config.layer_states
        if not 0 <= layer < len(states) or states[layer] is None:
            raise ValueError(f"layer {layer}: not a recurrent layer of this "
                             f"{self.attention_config.model_type} (its config's layer_types)")
        return states[layer]

    def _state_rows(self, layer: int, batch_size: int,
                    q_len: int) -> "Tuple[StepBatch, Optional[torch.Tensor]]":
        """The step a recurrent layer's call belongs to, and which of its tokens are real.

        Returns
        -------
        batch : pagedkv.StepBatch
        valid : torch.Tensor, shape [batch_size, q_len], bool, or None
            None: every token is (a packed step, or a pass without padding).
        """
        if self._attend is not None:
            if batch_size != 1:
                raise ValueError(f"input_ids: a step runs its tokens packed into one row with "
                                 f"no padding (input_ids [1, num_tokens]), got {batch_size} rows")
            if self._bound_batch is None:
                raise ValueError(f"layer {layer}: a recurrent layer needs the step's batch: use "
                                 f"cache.step(batch), or cache.bind(attend, batch)")
            if self._bound_batch.num_tokens != q_len:
                raise ValueError(f"input_ids: the step has {self._bound_batch.num_tokens} new "
                                 f"tokens, the forward pass {q_len}")
            return self._bound_batch, None
        step = self._step
        if step is None or layer in step.stored:
            step = self._begin_padded_step(batch_size, q_len, _take_padding(batch_size, q_len))
        if (step.valid.shape != (batch_size, q_len)):
            raise ValueError(f"hidden_states: layer {layer} got {[batch_size, q_len]} tokens "
                             f"in a pass of {list(step.valid.shape)}")
        if step.valid.all():
            return step.batch, None
        import torch
        return step.batch, torch.from_numpy(step.valid)

    def _layer_done(self, layer: int, batch: "StepBatch") -> None:
        if self._attend is not None:
            if layer == 0:
                self._num_stored_tokens += int(batch.num_tokens)
        elif self._step is not None:
            self._finish_padded_layer(self._step, layer)

    @staticmethod
    def _pack(x: "torch.Tensor", valid: "Optional[torch.Tensor]") -> "torch.Tensor":
        """``[B, T, ...]`` -> the real tokens' rows ``[n, ...]``, sequence after sequence."""
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]) if valid is None else x[valid]

    @staticmethod
    def _unpack(y: "torch.Tensor", valid: "Optional[torch.Tensor]", batch_size: int,
                q_len: int) -> "torch.Tensor":
        """Rows ``[n, ...]`` -> ``[B, T, ...]``, zeros at padding."""
        if valid is None:
            return y.reshape(batch_size, q_len, *y.shape[1:])
        full = y.new_zeros((batch_size, q_len, *y.shape[1:]))
        full[valid] = y
        return full

    def recurrent_conv(self, layer: int, conv1d: Any, hidden_states: "torch.Tensor",
                       activation: Optional[str], state_idx: int = 0) -> "torch.Tensor":
        """A recurrent layer's causal depthwise convolution over its pooled state.

        Parameters
        ----------
        layer : int
        conv1d : torch.nn.Conv1d
            The mixer's convolution (weight ``[channels, 1, kernel]``, bias
            ``[channels]`` or None).
        hidden_states : torch.Tensor, shape [B, channels, q]
        activation : {None, "silu"}
        state_idx : int
            Which of the layer's state arrays is the convolution's (0).

        Returns
        -------
        torch.Tensor, shape [B, channels, q], ``hidden_states.dtype``
            Zeros at padding tokens (which leave the state as it was).
        """
        spec = self._recurrent_layer(layer)
        if activation not in (None, "silu"):
            raise UnsupportedModelError(f"config.hidden_act: layer {layer}'s convolution "
                                        f"activates with {activation!r}; pagedkv's takes None "
                                        f"or 'silu'")
        batch_size, channels, q_len = hidden_states.shape
        batch, valid = self._state_rows(layer, batch_size, q_len)
        x = self._pack(hidden_states.detach().transpose(1, 2), valid).float().contiguous()
        weight = conv1d.weight.detach()[:, 0, :].float().contiguous()
        bias = None if conv1d.bias is None else conv1d.bias.detach().float()
        if spec.kind == "mamba2":
            y = self._mamba2_conv(layer, batch, x, weight, bias, activation)
        else:
            y = self.kv.causal_conv1d(layer, batch, x, weight, bias=bias, activation=activation,
                                      state=state_idx)
            if spec.kind == "short_conv":       # the layer's only state call
                self._layer_done(layer, batch)
        out = self._unpack(y, valid, batch_size, q_len)
        return out.transpose(1, 2).to(hidden_states.dtype)

    def recurrent_delta_rule(self, layer: int, query: "torch.Tensor", key: "torch.Tensor",
                             value: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
                             qk_l2norm: bool, scale: Optional[float] = None) -> "torch.Tensor":
        """A gated DeltaNet layer's delta rule over its pooled state.

        Parameters
        ----------
        query, key : torch.Tensor, shape [B, q, num_k_heads, k_head_dim]
        value : torch.Tensor, shape [B, q, num_v_heads, v_head_dim]
        g, beta : torch.Tensor, shape [B, q, num_v_heads]
            The log decay and the write strength.
        qk_l2norm : bool
            L2-normalise the queries and keys per head first.
        scale : float, optional
            Default ``k_head_dim ** -0.5``.

        Returns
        -------
        torch.Tensor, shape [B, q, num_v_heads, v_head_dim], ``value.dtype``
        """
        spec = self._recurrent_layer(layer)
        if spec.kind != "gated_delta_net":
            raise ValueError(f"layer {layer}: a gated delta rule in a {spec.kind} layer")
        batch_size, q_len = query.shape[:2]
        batch, valid = self._state_rows(layer, batch_size, q_len)
        q, k, v, g, beta = (self._pack(t.detach(), valid).float().contiguous()
                            for t in (query, key, value, g, beta))
        out = self.kv.gated_delta_rule(layer, batch, q, k, v, g, beta, scale=scale,
                                       qk_l2norm=qk_l2norm, state=1)
        self._layer_done(layer, batch)
        return self._unpack(out, valid, batch_size, q_len).to(value.dtype)

    def _mamba2_conv(self, layer: int, batch: "StepBatch", x: "torch.Tensor",
                     weight: "torch.Tensor", bias: "Optional[torch.Tensor]",
                     activation: Optional[str]) -> "torch.Tensor":
        """Mamba2's convolution, per sequence over its state from ``read_states``.

        ``x`` ``[n, channels]`` rows -> ``[n, channels]``; the new convolution
        states and the SSM states before the step wait for the scan
        (:meth:`recurrent_mamba2_scan`), which writes both.
        """
        import torch
        import torch.nn.functional as F
        conv_states, ssm_states = (_as_float_tensor(a) for a in self.kv.read_states(layer, batch))
        kernel = weight.shape[1]
        starts = np.asarray(batch.query_start, dtype=np.int64)
        y = x.new_empty(x.shape)
        new_conv = conv_states.clone()
        for b in range(len(starts) - 1):
            start, end = int(starts[b]), int(starts[b + 1])
            if start == end:
                continue
            # the sequence's input history: its state (last kernel-1 inputs) then the new rows
            u = torch.cat([conv_states[b].transpose(0, 1), x[start:end]], dim=0)
            y[start:end] = F.conv1d(u.transpose(0, 1)[None], weight[:, None, :], bias,
                                    groups=weight.shape[0])[0].transpose(0, 1)
            new_conv[b] = u[u.shape[0] - (kernel - 1):].transpose(0, 1)
        if activation == "silu":
            y = F.silu(y)
        self._mamba2_pending[layer] = (new_conv, ssm_states)
        return y

    def recurrent_mamba2_scan(self, module: Any, hidden_states: "torch.Tensor",
                              B: "torch.Tensor", C: "torch.Tensor", dt: "torch.Tensor",
                              scan: Callable[..., Any]) -> "torch.Tensor":
        """Mamba2's selective scan, per sequence from its pooled SSM state, with
        transformers' own math (``scan``: its ``mamba2_scan_forward``).

        Parameters
        ----------
        module : torch.nn.Module
            The mixer (``layer_idx``, ``A_log``, ``D``, ``dt_bias``, widths).
        hidden_states : torch.Tensor, shape [B, q, num_heads * head_dim]
        B, C : torch.Tensor, shape [B, q, n_groups * state_size]
        dt : torch.Tensor, shape [B, q, num_heads]

        Returns
        -------
        torch.Tensor, shape [B, q, num_heads * head_dim], including the ``D`` skip
        """
        layer = int(module.layer_idx)
        self._recurrent_layer(layer)
        batch_size, q_len = hidden_states.shape[:2]
        batch, valid = self._state_rows(layer, batch_size, q_len)
        pending = self._mamba2_pending.pop(layer, None)
        if pending is None:
            raise ValueError(f"layer {layer}: Mamba2's scan ran without its convolution "
                             f"through pagedkv.hf first")
        new_conv, ssm_states = pending
        xs, bs, cs, dts = (self._pack(t.detach(), valid) for t in (hidden_states, B, C, dt))
        starts = np.asarray(batch.query_start, dtype=np.int64)
        counts = starts[1:] - starts[:-1]
        out = xs.new_zeros(xs.shape)
        new_ssm = ssm_states.clone()
        # decoding rows (one token each) in one call: transformers' recurrent form
        singles = np.flatnonzero(counts == 1)
        if len(singles):
            rows = starts[singles]
            shim = recurrent.StateShim(ssm_states[singles].to(xs.dtype))
            step = scan(module, xs[rows, None], bs[rows, None], cs[rows, None], dts[rows, None],
                        shim)
            out[rows] = step[:, 0]
            new_ssm[singles] = shim.final.float()
        # prefill chunks one sequence at a time: transformers' chunked form from the state
        for b in np.flatnonzero(counts > 1):
            start, end = int(starts[b]), int(starts[b + 1])
            shim = recurrent.StateShim(ssm_states[b:b + 1].to(xs.dtype))
            out[start:end] = scan(module, xs[None, start:end], bs[None, start:end],
                                  cs[None, start:end], dts[None, start:end], shim)[0]
            new_ssm[b] = shim.final[0].float()
        self.kv.write_states(layer, batch, (new_conv.contiguous(), new_ssm.contiguous()))
        self._layer_done(layer, batch)
        return self._unpack(out, valid, batch_size, q_len).to(hidden_states.dtype)

    # -- counters ------------------------------------------------------------------------------
    def stats(self) -> Dict[str, Union[int, float]]:
        """``kv.stats()`` plus ``num_stored_tokens``: tokens whose K/V this cache computed and stored.

        Returns
        -------
        dict
            With prefix caching, a prompt whose prefix was cached stores only
            the tokens after it: its reused tokens are not counted here
            (``prefix_hit_rate`` counts them).
        """
        stats = self.kv.stats()
        stats["num_stored_tokens"] = self._num_stored_tokens
        return stats

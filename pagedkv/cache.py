"""``PagedKVCache``: the facade an inference engine uses.

It owns the page allocator and the page tables (sequences, lengths, sharing)
and one backend (the page pools and kernels), validates every argument, and
keeps the two in step.  A typical engine step::

    batch = cache.append(seq_ids, num_new_tokens)
    for layer in range(num_layers):
        cache.store(layer, batch, k, v)
        out = cache.attention(layer, batch, q)
"""
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from pagedkv._allocator import PageAllocator
from pagedkv._arrays import array_or_as_given, is_torch_tensor
from pagedkv._exclusive import Guard, exclusive
from pagedkv._memory import check_fits
from pagedkv._placement import Placement
from pagedkv._prefix_chains import PrefixChains
from pagedkv.pools import page_tables_of, pool_specs
from pagedkv._validate import check_int, check_int_vector, check_seq_id, check_tensor
from pagedkv.attention_spec import MAX_WINDOW, AttentionSpec
from pagedkv.backends import backend_class, resolve_backend
from pagedkv.cascade import CascadeAttention, check_mode as check_cascade_mode
from pagedkv.checkpoint import Checkpoint, CheckpointBook
from pagedkv.errors import ArgumentTypeError
from pagedkv.holdings import CacheHoldings
from pagedkv import recurrent
from pagedkv.state_pool import StatePool, StatePoolSpec
from pagedkv.state_spec import StateSpec
from pagedkv.step import StepBatch
from pagedkv.storage import NAMES as _STORAGE_NAMES, storage_format
from pagedkv import transfer
from pagedkv.transfer import SequenceKV

# What the page allocator keeps per page (ref count, free-queue links, hash,
# cache entries) and, with prefix caching, per cached token.
_ALLOCATOR_BYTES_PER_PAGE = 3 * 4 + 3 * 8
_ALLOCATOR_BYTES_PER_CACHED_TOKEN = 4


def _check_token_ids(name: str, token_ids: Sequence[int],
                     length: Optional[int] = None) -> np.ndarray:
    """Token ids as an int32 array (they are stored and compared as int32)."""
    tokens = check_int_vector(name, token_ids, minimum=-2**31)
    if length is not None and len(tokens) != length:
        raise ValueError(f"{name}: expected {length} token ids (the step's new tokens), "
                         f"got {len(tokens)}")
    if len(tokens) and tokens.max() >= 2**31:
        raise ValueError(f"{name}: token id {int(tokens.max())} does not fit in int32")
    return tokens.astype(np.int32)


class PagedKVCache:
    """A paged KV cache for ``num_layers`` layers of ``num_kv_heads`` x ``head_dim``.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model shape; the K and V pools of each layer are
        ``[num_pages, num_kv_heads, page_size, head_dim]``.
    num_pages : int
        Pages in the pool, shared by every sequence.
    page_size : int, default 16
        Tokens per page.
    dtype : str, default "float32"
        Storage dtype, one of :data:`pagedkv.storage.NAMES` (each described
        in :mod:`pagedkv.storage`); arithmetic is float32 whatever it is.
        float16 rounds on store.  int8 keeps each row (one token, one KV
        head) as int8 values and one float32 scale (``amax / 127``), in a
        basis rotated by an orthonormal Hadamard transform that ``attention``
        and ``gather`` undo: 0.26x float32's memory at head_dim 128, about 1%
        of a row's L2 norm lost to rounding.
    max_seq_len : int, optional
        Cap on any sequence's length; ``append`` past it is a ``ValueError``.
    backend : {"auto", "host", "opencl"}
        ``"auto"`` takes ``$PAGEDKV_BACKEND`` if set, else opencl when a device
        is usable, else host.
    device : optional
        opencl only: a pyopencl ``Device`` or ``Context``, or a ``"P:D"`` string.
    enable_prefix_caching : bool, default False
        Remember full pages by a hash chain of their token ids, so that
        ``add_sequence(token_ids=...)`` reuses the KV of a prompt's cached
        prefix; freed cached pages stay reusable until evicted (LRU).
    prefix_hash : callable, optional
        ``prefix_hash(parent_hash: int, token_ids: tuple) -> int`` replaces the
        default deterministic page hash.  Hits are confirmed by comparing token
        ids, so even a constant function returns no wrong KV.
    layer_windows : sequence of (int or None), shape [num_layers], optional
        A list, tuple or 1-d ndarray.
        ``W`` makes a layer a sliding-window layer: its ``attention`` uses
        ``sliding_window=W`` (or a smaller one passed to it), and its K/V live
        in a second pool whose pages go back as soon as no later query can see
        them, so such a layer holds about ``(W + new tokens of the step) /
        page_size + 2`` pages per sequence, whatever its length.  ``None``
        (the default for every layer) keeps full attention.  A window at
        least as long as a sequence sees all of it, as full attention does,
        and gives none of its pages back (so any rollback works); a window
        beyond the int32 positions of the tables counts as ``2**31 - 1``.
    num_window_pages : int, optional
        Pages of the windowed layers' pool, shared by every windowed layer
        (default ``num_pages``; unused when no layer is windowed).
    window_rollback_tokens : int, default 1
        How far back ``truncate``/``restore`` can always roll a sequence:
        window pages are kept for queries up to this many tokens before the
        sequence's end.  Speculative decoding with ``k`` draft tokens wants
        ``k + 1``.  A rollback further back than the kept pages allow is a
        ``ValueError`` (rolling back to 0 always works).
    kv_rotation : bool, default True
        int8 only: rotate rows before quantizing (False: plain per-row int8,
        which an outlier channel hurts more).
    backend_options : dict, optional
        Settings of the chosen backend.  opencl: ``{"layout": {...}}`` forces
        attributes of its kernel layout (``KernelLayout``), e.g. the shape a
        GPU gets, on any device.  host: none.
    cascade : {"auto", "off"}, default "auto"
        Shared-prefix attention: with "auto", pages that several sequences of
        a step share (fork, prefix-cache hits) are read once for all their
        queries wherever the backend's measured policy says it pays
        (docs/cascade.md); "off" reads them once per sequence.  Results
        agree within float32 rounding.  ``StepBatch.sharing`` says what a
        step shares.
    kv_layout : {"separate", "latent"}, default "separate"
        ``"separate"``: a K pool and a V pool per layer.  ``"latent"``
        (multi-head latent attention, DeepSeek V2/V3): one pool of rows of
        ``head_dim`` values per layer, whose first ``v_head_dim`` columns are
        the values, read in place; ``num_kv_heads`` must be 1, ``store`` takes
        ``v=None`` and ``attention`` returns ``v_head_dim`` columns per head
        (``docs/latent.md``).
    v_head_dim : int, optional
        The values' width (default ``head_dim``).  ``"latent"``: at most
        ``head_dim``.  ``"separate"``: any width >= 1, the V pool's rows
        (e.g. 128 beside a head_dim of 192, as DeepSeek's non-absorbed heads):
        ``store`` takes ``v`` of that width, ``attention`` returns it per head
        and ``memory_bytes`` counts ``head_dim + v_head_dim`` values per token,
        KV head and layer.  int8 rotates rows in blocks of the largest power
        of two dividing both widths.
    layer_states : sequence of (StateSpec or None), shape [num_layers], optional
        Hybrid models: a :class:`pagedkv.StateSpec` makes layer ``l`` a
        recurrent layer (gated DeltaNet, a short convolution, Mamba2), which
        keeps a fixed-size state per sequence in the state pool instead of
        K/V: its calls are ``causal_conv1d``, ``gated_delta_rule``,
        ``read_states`` and ``write_states`` (``docs/hybrid.md``).  None (the
        default for every layer) keeps attention.  ``layer_windows[l]`` must
        be None where ``layer_states[l]`` is set.
    num_state_slots : int, optional
        Slots of the state pool; a slot holds one copy of every recurrent
        layer's state.  A sequence holds one from its first tokens, up to
        ``state_rollback_tokens`` more while it can roll back, and a prefix
        snapshot one.  Default: ``num_pages // 16``, at least 4.
    state_rollback_tokens : int, default 0
        Tokens a recurrent layer can always be rolled back by: ``truncate``
        and ``restore`` to any of a sequence's last this many lengths
        restore its state after that token (a slot each).
    state_snapshot_interval : int, optional
        With prefix caching: tokens between snapshots of a sequence's
        states (default ``16 * page_size``; a multiple of ``page_size``).  A
        prompt starts on the longest cached prefix that every layer can
        serve: attention pages and a snapshot at that length.

    Raises
    ------
    ValueError
        A bad argument (the message names it).
    MemoryError
        The pools and their bookkeeping need more memory than this machine
        (physical memory, a container limit or ``ulimit -v``) or the OpenCL
        device has; nothing is allocated.

    Notes
    -----
    With prefix caching, the pages a step fills join the prefix cache once
    that step's K/V is stored in every layer; a step abandoned before (the
    engine truncates, frees or appends again) leaves nothing reusable.

    Threads: every method runs under the cache's lock, so threads may share a
    cache; the kernels run without the GIL meanwhile.  A call on the cache
    from inside one of its callbacks (``prefix_hash``) raises
    ``RuntimeError``.  After ``os.fork()``, a host cache works in the child
    (single-threaded kernels); an opencl cache raises ``RuntimeError`` there:
    create caches in the child, or use the ``"spawn"`` start method.  A cache
    cannot be copied or pickled.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_pages: int,
                 page_size: int = 16, dtype: Any = "float32", max_seq_len: Optional[int] = None,
                 backend: str = "auto", device: Any = None, enable_prefix_caching: bool = False,
                 prefix_hash: Optional[Callable[[int, tuple], int]] = None,
                 layer_windows: Optional[Sequence[Optional[int]]] = None,
                 num_window_pages: Optional[int] = None, window_rollback_tokens: int = 1,
                 kv_rotation: bool = True, backend_options: Optional[dict] = None,
                 cascade: str = "auto", kv_layout: str = "separate",
                 v_head_dim: Optional[int] = None,
                 layer_states: Optional[Sequence[Optional[StateSpec]]] = None,
                 num_state_slots: Optional[int] = None, state_rollback_tokens: int = 0,
                 state_snapshot_interval: Optional[int] = None):
        self._guard = Guard()
        self.num_layers = check_int("num_layers", num_layers, minimum=1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        num_pages = check_int("num_pages", num_pages, minimum=1, maximum=2**31 - 1)
        self.page_size = check_int("page_size", page_size, minimum=1, maximum=2**20)
        if num_pages * self.page_size > 2**62:
            raise ValueError(f"num_pages * page_size: expected <= 2**62 slots, got "
                             f"{num_pages * self.page_size}")
        if not isinstance(kv_rotation, bool):
            raise ArgumentTypeError(f"kv_rotation: expected a bool, got {kv_rotation!r}")
        #: ``"separate"`` (K and V pools) or ``"latent"`` (one pool of latent rows).
        self.kv_layout = self._check_layout(kv_layout)
        #: The values' width: of V rows, or the leading columns of a latent row.
        self.v_head_dim = self._check_v_head_dim(v_head_dim)
        #: The storage format (:class:`pagedkv.storage.StorageFormat`).
        self.storage = storage_format(self._check_dtype(dtype), self.head_dim, kv_rotation,
                                      latent=self.kv_layout == "latent",
                                      v_head_dim=self.v_head_dim)
        self.kv_rotation = kv_rotation
        self.dtype = self.storage.element
        self.max_seq_len = None if max_seq_len is None else \
            check_int("max_seq_len", max_seq_len, minimum=1, maximum=2**31 - 1)
        if not isinstance(backend, str):
            raise ArgumentTypeError(f"backend: expected a str, got {type(backend).__name__}")
        if not isinstance(enable_prefix_caching, bool):
            raise ArgumentTypeError(f"enable_prefix_caching: expected a bool, "
                                    f"got {enable_prefix_caching!r}")
        if prefix_hash is not None and not callable(prefix_hash):
            raise ArgumentTypeError(f"prefix_hash: expected a callable, got {prefix_hash!r}")
        #: ``"auto"`` or ``"off"``: whether attention reads pages that several
        #: sequences of a step share once for all of them (shared-prefix attention).
        self.cascade = check_cascade_mode(cascade)
        if backend_options is not None and not isinstance(backend_options, dict):
            raise ArgumentTypeError(f"backend_options: expected a dict, got "
                                    f"{type(backend_options).__name__}")
        self.layer_windows = self._check_windows(layer_windows)
        num_window_pages = num_pages if num_window_pages is None else \
            check_int("num_window_pages", num_window_pages, minimum=1, maximum=2**31 - 1)
        rollback = check_int("window_rollback_tokens", window_rollback_tokens, minimum=1,
                             maximum=2**31 - 1)
        state_spec = self._state_pool_spec(layer_states, num_pages, num_state_slots,
                                           state_rollback_tokens, state_snapshot_interval,
                                           enable_prefix_caching)
        #: Each layer's StateSpec (a recurrent layer) or None (attention).
        self.layer_states = state_spec.layer_states
        recurrent_layers = state_spec.layers
        pools = pool_specs(self.layer_windows, num_pages, num_window_pages, rollback,
                           recurrent_layers)
        layer_pages = [0] * self.num_layers
        for pool in pools:
            for layer in pool.layers:
                layer_pages[layer] = pool.num_pages
        page_bytes = self.storage.page_bytes(self.num_kv_heads, self.page_size, self.head_dim)
        per_page = _ALLOCATOR_BYTES_PER_PAGE + enable_prefix_caching * self.page_size \
            * _ALLOCATOR_BYTES_PER_CACHED_TOKEN
        check_fits(page_bytes * sum(layer_pages)
                   + per_page * sum(pool.num_pages for pool in pools)
                   + state_spec.num_slots * state_spec.slot_bytes,
                   f"num_pages: {num_pages} pages of {self.num_layers} layers"
                   + "".join(f" and {pool.num_pages} {pool.name} pages" for pool in pools[1:])
                   + (f" and {state_spec.num_slots} state slots" if recurrent_layers else ""))
        self.backend = resolve_backend(backend)
        self._backend = backend_class(self.backend)(
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, layer_pages=layer_pages,
            page_size=self.page_size, storage=self.storage, device=device,
            options=backend_options)
        self._attend = CascadeAttention(self._backend, enabled=self.cascade == "auto")
        self._states = StatePool(state_spec, self._backend.state_store(
            state_spec.shapes, state_spec.num_slots), enable_prefix_caching) \
            if recurrent_layers else None
        # a step's pages join the prefix cache once these layers are stored
        self._num_kv_layers = self.num_layers - len(recurrent_layers)
        self.prefix_caching = enable_prefix_caching
        self._tables, self._pools = page_tables_of(
            pools, [PageAllocator(pool.num_pages, self.page_size, enable_prefix_caching)
                    for pool in pools], prefix_hash)
        self._allocator = self._pools[0].allocator
        self._placement = Placement(self._tables)
        layer_pool = [self._pools[0]] * self.num_layers     # each layer's pool manager
        for manager in self._pools:
            for layer in manager.layers:
                layer_pool[layer] = manager
        self._layer_pool = tuple(layer_pool)
        self._checkpoints = CheckpointBook(self)
        self._generation = 0
        self._swapped: Dict[int, SequenceKV] = {}   # swapped-out id -> its K/V in host memory
        # what transfer, files and a step's batch reach of this cache: these same objects
        self._holdings = CacheHoldings(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            page_size=self.page_size, storage=self.storage, kv_rotation=self.kv_rotation,
            kv_layout=self.kv_layout, v_head_dim=self.v_head_dim,
            layer_windows=self.layer_windows, window_rollback_tokens=rollback,
            max_seq_len=self.max_seq_len,
            prefix_caching=self.prefix_caching, tables=self._tables,
            placement=self._placement, chains=PrefixChains(self._tables), pools=self._pools,
            layer_pool=self._layer_pool, backend=self._backend, swapped=self._swapped,
            states=self._states)

    def __copy__(self):
        raise TypeError("PagedKVCache cannot be copied: two facades over one page table "
                        "would hand out conflicting pages; fork() sequences instead")

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce__(self):
        raise TypeError("PagedKVCache cannot be pickled: its pools live in this process "
                        "(or on its OpenCL device)")

    def _check_windows(self, layer_windows):
        """``layer_windows`` as a tuple of ``num_layers`` entries, None or an int >= 1."""
        if layer_windows is None:
            return (None,) * self.num_layers
        # a dict (or set, or str) has a length too, but no order of layers: refused
        if not isinstance(layer_windows, (list, tuple, np.ndarray)) or \
                isinstance(layer_windows, np.ndarray) and layer_windows.ndim != 1:
            raise ArgumentTypeError(f"layer_windows: expected a list, tuple or 1-d ndarray of "
                                    f"{self.num_layers} entries (None or an int >= 1), got "
                                    f"{type(layer_windows).__name__} {layer_windows!r}"[:200])
        if len(layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows: expected {self.num_layers} entries (one per "
                             f"layer), got {len(layer_windows)}")
        windows = []
        for layer, w in enumerate(layer_windows):
            if w is not None:
                w = check_int(f"layer_windows[{layer}]", w, minimum=1)
                w = min(w, MAX_WINDOW)
            windows.append(w)
        return tuple(windows)

    def _state_pool_spec(self, layer_states, num_pages, num_state_slots, rollback, interval,
                         prefix_caching):
        """The state pool's spec from the constructor's state arguments, checked."""
        if layer_states is None:
            layer_states = (None,) * self.num_layers
        if not isinstance(layer_states, (list, tuple)):
            raise ArgumentTypeError(f"layer_states: expected a list or tuple of "
                                    f"{self.num_layers} entries (None or a StateSpec), got "
                                    f"{type(layer_states).__name__}")
        if len(layer_states) != self.num_layers:
            raise ValueError(f"layer_states: expected {self.num_layers} entries (one per "
                             f"layer), got {len(layer_states)}")
        for layer, spec in enumerate(layer_states):
            if spec is not None and not isinstance(spec, StateSpec):
                raise ArgumentTypeError(f"layer_states[{layer}]: expected None or a "
                                        f"pagedkv.StateSpec, got {type(spec).__name__}")
            if spec is not None and self.layer_windows[layer] is not None:
                raise ValueError(f"layer_states[{layer}]: layer {layer} has a sliding window "
                                 f"(layer_windows[{layer}]={self.layer_windows[layer]}); a "
                                 f"recurrent layer keeps no K/V, so its window must be None")
        num_state_slots = max(4, num_pages // 16) if num_state_slots is None else \
            check_int("num_state_slots", num_state_slots, minimum=1, maximum=2**31 - 1)
        rollback = check_int("state_rollback_tokens", rollback, minimum=0, maximum=2**31 - 1)
        if interval is None:
            interval = 16 * self.page_size
        else:
            interval = check_int("state_snapshot_interval", interval, minimum=1,
                                 maximum=2**31 - 1)
            if interval % self.page_size:
                raise ValueError(f"state_snapshot_interval: expected a multiple of "
                                 f"page_size={self.page_size}, got {interval}")
        return StatePoolSpec(num_state_slots, tuple(layer_states), rollback,
                             interval if prefix_caching else None)

    def _check_layout(self, kv_layout):
        """``kv_layout``, checked (and ``num_kv_heads`` against it)."""
        if kv_layout not in ("separate", "latent"):
            raise ValueError(f"kv_layout: expected 'separate' or 'latent', got {kv_layout!r}"
                             [:200])
        if kv_layout == "latent" and self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads: kv_layout='latent' keeps one latent row per "
                             f"token (one KV head), expected 1, got {self.num_kv_heads}")
        return kv_layout

    def _check_v_head_dim(self, v_head_dim):
        """``v_head_dim`` (default ``head_dim``), checked against the layout."""
        if v_head_dim is None:
            return self.head_dim
        if self.kv_layout == "latent":
            return check_int("v_head_dim", v_head_dim, minimum=1, maximum=self.head_dim)
        # the separate layout's V rows have a pool of their own, of any width
        return check_int("v_head_dim", v_head_dim, minimum=1)

    @staticmethod
    def _check_dtype(dtype):
        """The storage format's name of ``dtype`` (a name or a numpy dtype)."""
        if isinstance(dtype, str) and dtype in _STORAGE_NAMES:
            return dtype    # by name first: not every format is a numpy dtype
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
        if name not in _STORAGE_NAMES:
            raise ValueError(f"dtype: expected one of {', '.join(map(repr, _STORAGE_NAMES))}, "
                             f"got {dtype!r}")
        return name

    # -- pool ----------------------------------------------------------------------
    @property
    @exclusive
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self._allocator.num_pages

    @property
    @exclusive
    def num_free_pages(self) -> int:
        """Pages an ``append`` can take now."""
        return self._allocator.num_free

    @property
    @exclusive
    def num_window_pages(self) -> int:
        """Pages in the windowed layers' pool (0 when no layer is windowed)."""
        window = self._holdings.window_pool
        return window.allocator.num_pages if window else 0

    @property
    @exclusive
    def num_free_window_pages(self) -> int:
        """Window pages an ``append`` can take now (0 when no layer is windowed)."""
        window = self._holdings.window_pool
        return window.allocator.num_free if window else 0

    @property
    def memory_bytes(self) -> int:
        """Bytes of K/V page storage (all layers, K and V, both pools; latent:
        ``head_dim`` values, and int8 one scale, per token per layer) and of
        the state pool (every slot of every recurrent layer's arrays)."""
        states = self._states.store.memory_bytes if self._states is not None else 0
        return self._backend.memory_bytes + states

    @property
    @exclusive
    def num_state_slots(self) -> int:
        """Slots in the state pool (0 when no layer is recurrent)."""
        return self._states.num_slots if self._states is not None else 0

    @property
    @exclusive
    def num_free_state_slots(self) -> int:
        """State slots an ``append`` can take now: free ones and those of prefix
        snapshots no sequence uses (0 when no layer is recurrent)."""
        return self._states.num_free if self._states is not None else 0

    @exclusive
    def page_count(self, seq_id: int) -> int:
        """Pages the sequence holds (shared ones included)."""
        return len(self._tables.pages(seq_id))

    def token_capacity(self, seq_id: int) -> int:
        """Tokens the sequence's pages can hold: ``page_count * page_size``."""
        return self.page_count(seq_id) * self.page_size

    @exclusive
    def page_ids(self, seq_id: int) -> np.ndarray:
        """The sequence's page ids in order; ndarray, shape [page_count], int32."""
        return self._tables.pages(seq_id)

    @exclusive
    def window_page_count(self, seq_id: int) -> int:
        """Pages the sequence holds in the window pool (0 when no layer is windowed)."""
        window = self._holdings.window_pool
        return window.held_pages(seq_id) if window else 0

    @exclusive
    def window_page_ids(self, seq_id: int) -> np.ndarray:
        """The sequence's window-pool page ids in position order, -1 for pages given
        back; ndarray, shape [page_count], int32 (empty when no layer is windowed)."""
        window = self._holdings.window_pool
        if window is None:
            self._tables.pages(seq_id)          # (an unknown id raises all the same)
            return np.zeros(0, np.int32)
        return window.page_ids(seq_id)

    @exclusive
    def refcount(self, page_id: int) -> int:
        """How many sequences hold page ``page_id`` (0 = free)."""
        page_id = check_int("page_id", page_id, minimum=0, maximum=self._allocator.num_pages - 1)
        return self._allocator.refcount(page_id)

    # -- sequences -------------------------------------------------------------
    @exclusive
    def add_sequence(self, token_ids: Optional[Sequence[int]] = None) -> int:
        """Create a sequence; return its id (ids are never reused).

        Parameters
        ----------
        token_ids : sequence of int, shape [prompt_len], optional
            The prompt.  With prefix caching the sequence starts on the
            longest cached chain of its full pages (never the prompt's last
            token, whose logits the engine needs); ``seq_len`` then tells how
            many tokens already have K/V, and the engine appends the rest.
            Without prefix caching it is accepted and ignored.

        Raises
        ------
        TypeError
            ``prefix_hash`` returned something other than an int; nothing changed.
        """
        tokens = None if token_ids is None else _check_token_ids("token_ids", token_ids)
        if not self.prefix_caching:
            tokens = None
        states = self._states
        if states is None:
            return self._tables.add(tokens)
        digests = allowed = None
        if tokens is not None:
            # a hit must also end where a state snapshot is
            digests = states.prompt_digests(tokens)
            allowed = states.allowed_hits(digests, self.page_size)
        seq_id = self._tables.add(tokens, allowed)
        states.start(seq_id, self._tables.seq_len(seq_id), digests)
        return seq_id

    @exclusive
    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every page (and recurrent state) of ``seq_id``;
        copies happen on divergent writes."""
        child = self._tables.fork(seq_id)
        if self._states is not None:
            self._states.fork(int(seq_id), child)
        return child

    @exclusive
    def free(self, seq_id: int) -> None:
        """Drop the sequence (swapped out or not); its pages return to the pool once no
        sequence uses them."""
        # one call that raises before it changes anything, and drops the
        # sequence from the facade's records too
        self._tables.free(seq_id, (self._swapped, self._checkpoints._stamps))
        if self._states is not None:
            self._states.free(int(seq_id))
        self._generation += 1

    @exclusive
    def seq_len(self, seq_id: int) -> int:
        """Tokens stored in the sequence."""
        return self._tables.seq_len(seq_id)

    @exclusive
    def seq_ids(self) -> List[int]:
        """Ids of the live sequences, ascending."""
        return self._tables.ids()

    @exclusive
    def truncate(self, seq_id: int, new_len: int) -> None:
        """Roll the sequence back to its first ``new_len`` tokens; pages past them are released.

        Checkpoints of the sequence beyond ``new_len`` become void.
        """
        self._truncate(seq_id, new_len)

    def _truncate(self, seq_id, new_len):
        length = self._tables.seq_len(seq_id)
        new_len = check_int("new_len", new_len, minimum=0, maximum=length)
        voided = self._checkpoints.beyond(int(seq_id), new_len)   # (changes nothing)
        if self._states is not None:
            self._states.check_truncate(int(seq_id), new_len, length)
        self._tables.truncate(seq_id, new_len)     # raises before it changes anything
        if self._states is not None:
            self._states.truncate(int(seq_id), new_len)
        # from here on no Python-level call, so nothing can raise in between
        self._generation += 1
        for stamp in voided:
            stamp.valid = False

    @exclusive
    def checkpoint(self, seq_id: int) -> Checkpoint:
        """Record the sequence's length for a later ``restore`` (keeps no pages alive)."""
        seq_id = check_seq_id("seq_id", seq_id)
        return self._checkpoints.make(seq_id, self._tables.seq_len(seq_id))

    @exclusive
    def restore(self, checkpoint: Checkpoint) -> None:
        """Truncate the checkpoint's sequence back to the checkpointed length.

        Raises
        ------
        UnknownSequenceError
            The sequence was freed.
        ValueError
            The checkpoint is another cache's, or the sequence was truncated
            below it since (even if it grew past it again: its tokens there
            are no longer the checkpoint's).  Nothing changed.
        """
        if not isinstance(checkpoint, Checkpoint):
            raise ArgumentTypeError(
                f"checkpoint: expected a Checkpoint from cache.checkpoint(), "
                f"got {type(checkpoint).__name__}")
        self._checkpoints.check_owner(checkpoint)
        length = self._tables.seq_len(checkpoint.seq_id)     # a freed sequence: unknown
        self._checkpoints.check_valid(checkpoint)
        if checkpoint.seq_len > length:   # (a void stamp says this first; kept as a guard)
            raise ValueError(
                f"checkpoint: sequence {checkpoint.seq_id} has {length} tokens, fewer than the "
                f"checkpoint's {checkpoint.seq_len}; it was truncated below the checkpoint")
        self._truncate(checkpoint.seq_id, checkpoint.seq_len)

    @exclusive
    def clear(self) -> None:
        """Free every sequence."""
        self._tables.clear((self._swapped, self._checkpoints._stamps))
        if self._states is not None:
            self._states.clear()
        self._generation += 1

    # -- one step ------------------------------------------------------------------
    @exclusive
    def append(self, seq_ids: Sequence[int], num_new_tokens: Union[int, Sequence[int]],
               token_ids: Optional[Sequence[int]] = None) -> StepBatch:
        """Reserve slots for this step's new tokens; all or nothing.

        Parameters
        ----------
        seq_ids : sequence of int, shape [B]
            Distinct live sequences.
        num_new_tokens : int or sequence of int, shape [B]
            New tokens per sequence (an int applies to all).
        token_ids : sequence of int, shape [total_new], optional
            The new tokens, flat in ``seq_ids`` order.  With prefix caching,
            the pages they fill join the cache once the step is stored in
            every layer; without it they are ignored.

        Returns
        -------
        StepBatch
            Slots and page tables for ``store`` and ``attention``.

        Raises
        ------
        OutOfPagesError
            Not enough free pages (or state slots); nothing changed.
        """
        ids = check_int_vector("seq_ids", seq_ids)
        counts = check_int_vector("num_new_tokens", num_new_tokens, length=len(ids), minimum=0)
        tokens = None if token_ids is None else \
            _check_token_ids("token_ids", token_ids, length=int(counts.sum()))
        state_plan = None
        if self._states is not None:
            # planned before the tables commit (it raises with nothing changed),
            # committed after everything else
            state_plan = self._states.plan(
                ids, counts, [self._tables.seq_len(s) for s in ids.tolist()],
                self._tables.known_tokens if self.prefix_caching else None,
                tokens if self.prefix_caching else None)
        t = None
        try:
            t = self._tables.append(ids, counts, self.max_seq_len,
                                    tokens if self.prefix_caching else None)
            batch = StepBatch(self, self._holdings, self._attend, self._generation + 1, ids, t)
            for pool in self._pools:
                if pool.layers:
                    self._backend.prepare_step(pool.step_tables(batch))
            # the copies last: they write only pages this step took, which the
            # undo below gives back
            for pool in self._pools:
                copy_src, copy_dst = pool.copies(t)
                if len(copy_src):
                    self._backend.copy_pages(copy_src, copy_dst, pool.layers)
            if state_plan is not None:
                batch._state_step = self._states.commit(state_plan)   # type: ignore[union-attr]
            if not self._num_kv_layers and self._tables.has_open_step:
                self._tables.close_step()       # no K/V to store: its pages are complete
        except BaseException:
            # whatever failed after the tables committed (an interrupt, a device
            # error, MemoryError): nothing of this step stays
            if t is not None:
                self._tables.undo_append()
            raise
        self._generation += 1
        return batch

    def _check_kv_layer(self, layer):
        if self.layer_states[layer] is not None:
            raise ValueError(f"layer: layer {layer} is a recurrent layer (layer_states[{layer}] "
                             f"is set); it keeps states, not K/V")

    def _check_step(self, layer, batch):
        layer = check_int("layer", layer, minimum=0, maximum=self.num_layers - 1)
        if not isinstance(batch, StepBatch) or batch._cache is not self:
            raise ArgumentTypeError(f"batch: expected a StepBatch from this cache's append(), "
                                    f"got {type(batch).__name__}")
        if batch._generation != self._generation:
            swapped = [s for s in batch._private["seq_ids"].tolist() if s in self._swapped]
            if swapped:
                raise ValueError(f"batch: stale; sequence {swapped[0]} of this batch is swapped "
                                 f"out (swap_in and append again)")
            raise ValueError("batch: stale; the cache's pages changed since this append() "
                             "(append, truncate, restore, free, swap_out or clear); append again")
        return layer


    @exclusive
    def store(self, layer: int, batch: StepBatch, k: Any, v: Any = None) -> None:
        """Write the step's new K and V of one layer into their slots.

        Once every layer of the step is stored, the pages it filled join the
        prefix cache (with prefix caching on).

        Parameters
        ----------
        layer : int
        batch : StepBatch
        k : array, shape [total_new, num_kv_heads, head_dim], float
            numpy arrays, torch CPU tensors, CPU ``__dlpack__`` objects (float16,
            bfloat16, float32 or float64, any strides), or the backend's device
            arrays (opencl: ``pyopencl.array.Array``).  Rounded to the storage
            dtype.  ``kv_layout="latent"``: the latent rows.
        v : array, shape [total_new, num_kv_heads, v_head_dim], float
            The kinds ``k`` takes; ``kv_layout="latent"``: None (the values
            are the first ``v_head_dim`` columns of ``k``).
        """
        layer = self._check_step(layer, batch)
        self._check_kv_layer(layer)
        shape = (batch.num_tokens, self.num_kv_heads, self.head_dim)
        native = self._backend.array_types
        if self.kv_layout == "latent" and v is not None:
            raise ValueError("v: kv_layout='latent' stores one latent row per token, whose "
                             "first v_head_dim columns are the values; pass v=None")
        if self.kv_layout == "separate" and v is None:
            raise ValueError(f"v: expected an array of shape [{batch.num_tokens}, "
                             f"{self.num_kv_heads}, {self.v_head_dim}], got None")
        k = check_tensor("k", k, shape, native_types=native)
        if v is not None:
            v = check_tensor("v", v, shape[:2] + (self.v_head_dim,), native_types=native)
        self._backend.store(layer, self._layer_pool[layer].step_tables(batch), k, v)
        batch._stored_layers.add(layer)
        if len(batch._stored_layers) == self._num_kv_layers and self._tables.has_open_step:
            self._tables.close_step()

    @exclusive
    def attention(self, layer: int, batch: StepBatch, q: Any, *, scale: Optional[float] = None,
                  sliding_window: Optional[int] = None,
                  logits_soft_cap: Optional[float] = None, sinks: Any = None,
                  attention_chunk_size: Optional[int] = None,
                  alibi_slopes: Any = None) -> Any:
        """Attention of the step's new tokens over their sequences' stored K/V.

        For query head ``h`` of the new token at position ``p`` (new token
        ``i`` of sequence ``b`` sits at ``p = seq_lens[b] - n_b + i``), with
        logits ``x_j = scale * q . k_j`` (then capped, then ALiBi's bias added)
        over its visible positions ``j``::

            out = sum_j exp(x_j) v_j / (sum_j exp(x_j) + exp(sinks[h]))

        Parameters
        ----------
        layer : int
        batch : StepBatch
            ``store(layer, batch, ...)`` must have run first.
        q : array, shape [total_new, num_heads, head_dim], float
            ``num_heads`` a multiple of ``num_kv_heads`` (GQA/MQA); the array
            kinds ``store`` takes.
        scale : float, default ``1/sqrt(head_dim)``
        sliding_window : int >= 1, optional
            ``W``: position ``p`` sees positions ``max(0, p - W + 1) .. p``, its
            ``W`` most recent ones itself included (Hugging Face's
            ``sliding_window``; FlashInfer's ``window_left`` is ``W - 1``).
            Default: every position ``0 .. p`` (causal), or the layer's own
            window (``layer_windows``), which a larger value may not exceed.
        logits_soft_cap : float > 0, optional
            ``c``: each logit becomes ``c * tanh(x / c)`` before the softmax
            (Gemma 2's ``attn_logit_softcapping``; FlashInfer's ``logits_soft_cap``).
        sinks : array-like, shape [num_heads], float, optional
            Learned attention sinks (gpt-oss; FlashInfer's and vLLM's ``sinks``):
            ``exp(sinks[h])`` joins head ``h``'s denominator, unscaled, and adds
            nothing to the numerator.
        attention_chunk_size : int >= 1, optional
            ``C``: position ``p`` sees only positions ``C * floor(p / C) .. p``,
            its chunk up to itself (Llama 4's ``attention_chunk_size``; vLLM's
            chunked local attention); with ``sliding_window`` too, the
            positions both allow.  Pages no query of the step sees are not read.
        alibi_slopes : array-like, shape [num_heads], float, optional
            ALiBi (vLLM's and FlashInfer's ``alibi_slopes``): the logit of query
            head ``h`` at position ``p`` for the key at position ``j`` gains
            ``alibi_slopes[h] * (j - p)`` after ``scale`` and the soft cap
            (``j - p`` an integer, made a float only to be multiplied).
            ``|slope| * (max_seq_len - 1)`` must stay within a quarter of
            float32's range (the int32 limit stands in for an unset ``max_seq_len``).

        Returns
        -------
        out : shape [total_new, num_heads, v_head_dim], float32
            A torch tensor when ``q`` is one, a ``pyopencl.array.Array`` when
            ``q`` is one, else a numpy array.

        Raises
        ------
        ValueError
            A bad shape, a layer not stored this step, or a variant argument
            out of range (``sliding_window < 1``, ``attention_chunk_size < 1``,
            ``logits_soft_cap <= 0``, a
            scale or cap not finite in float32, ``sinks`` or ``alibi_slopes``
            of another shape or not finite, slopes too steep for
            ``max_seq_len``); the message names the argument.  Nothing changes.
        """
        layer = self._check_step(layer, batch)
        self._check_kv_layer(layer)
        as_torch = is_torch_tensor(q)
        q = check_tensor("q", q, (batch.num_tokens, None, self.head_dim),
                         native_types=self._backend.array_types)
        num_heads = q.shape[1]
        if num_heads == 0 or num_heads % self.num_kv_heads:
            raise ValueError(f"q: expected num_heads a positive multiple of num_kv_heads="
                             f"{self.num_kv_heads}, got {num_heads}")
        spec = AttentionSpec.from_arguments(
            head_dim=self.head_dim, num_heads=num_heads, scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
            attention_chunk_size=attention_chunk_size, alibi_slopes=alibi_slopes,
            as_numpy=array_or_as_given, max_seq_len=self.max_seq_len)
        pool = self._layer_pool[layer]
        spec = pool.layer_spec(layer, spec, self.layer_windows[layer])
        tables = pool.step_tables(batch)
        if layer not in batch._stored_layers and batch.num_tokens:
            raise ValueError(f"layer: K/V of layer {layer} were not stored for this step; "
                             f"call store({layer}, batch, k, v) first")
        if self.kv_layout == "latent":
            return self._values_of(self._attend(layer, tables, q, spec), as_torch)
        if not as_torch:
            return self._attend(layer, tables, q, spec)
        out = sys.modules["torch"].empty(tuple(q.shape[:2]) + (self.v_head_dim,),
                                         dtype=sys.modules["torch"].float32)
        self._attend(layer, tables, q, spec, out=out.numpy())
        return out

    def _values_of(self, out, as_torch):
        """The first ``v_head_dim`` columns of latent attention's ``out``
        [total_new, num_heads, head_dim] (the kernels sum whole latent rows,
        whose leading columns are the values), C-contiguous, of ``out``'s kind."""
        values = self._backend.leading_columns(out, self.v_head_dim)
        return sys.modules["torch"].from_numpy(values) if as_torch else values

    # -- recurrent layers ----------------------------------------------------------
    def _state_call(self, layer, batch):
        """The checked layer of a state call on ``batch``, and the state pool."""
        layer = self._check_step(layer, batch)
        recurrent.layer_spec(self.layer_states, layer)
        return layer, self._states

    @exclusive
    def causal_conv1d(self, layer: int, batch: StepBatch, x: Any, weight: Any, bias: Any = None,
                      activation: Optional[str] = None, state: int = 0) -> Any:
        """A short causal convolution over the step's new rows, each sequence's rows
        continuing its own input history (state array ``state`` of ``layer``).

        For sequence ``b``'s new row ``t`` and channel ``c``::

            y[t, c] = act(bias[c] + sum_j weight[c, j] * u[t + j - kernel + 1, c])

        where ``u`` is the sequence's earlier inputs (the state holds the last
        ``kernel - 1``, zeros at first) followed by its new rows.  The state
        then holds its last ``kernel - 1`` inputs, oldest first.

        Parameters
        ----------
        layer : int
            A recurrent layer whose state array ``state`` has shape
            ``[channels, kernel - 1]``.
        batch : StepBatch
        x : array, shape [total_new, channels], float
            numpy, torch CPU tensors, or the backend's device arrays (opencl:
            a float32 ``pyopencl.array.Array``).
        weight : array-like, shape [channels, kernel], float
        bias : array-like, shape [channels], float, optional
        activation : {None, "silu"}
        state : int, default 0
            Which of the layer's state arrays.

        Returns
        -------
        y : shape [total_new, channels], float32
            Of ``x``'s kind.

        Raises
        ------
        ValueError
            An attention layer, a state array of another shape, a bad shape or
            activation, or the array already advanced this step; nothing changes.
        """
        layer, states = self._state_call(layer, batch)
        return recurrent.causal_conv1d(self._backend, states, layer, batch, x, weight, bias,
                                       activation, state)

    @exclusive
    def gated_delta_rule(self, layer: int, batch: StepBatch, q: Any, k: Any, v: Any, g: Any,
                         beta: Any, scale: Optional[float] = None, qk_l2norm: bool = False,
                         state: int = 1) -> Any:
        """The gated delta rule (gated DeltaNet: Qwen3.5, Qwen3-Next) over the step's
        new rows, each sequence continuing its own state (array ``state`` of ``layer``,
        ``S`` of shape ``[num_v_heads, k_dim, v_dim]``).

        Per sequence, token by token, for v-head ``h`` (k-head ``h // (num_v_heads
        // num_k_heads)``): with ``qk_l2norm``, ``q_t`` and ``k_t`` are first
        L2-normalised per head (eps 1e-6); then ``S *= exp(g[t, h])``; ``S +=
        outer(k_t, beta[t, h] * (v_t - S^T k_t))``; ``o[t, h] = S^T (scale * q_t)``
        (transformers' ``torch_recurrent_gated_delta_rule``).  Long runs of a
        sequence's rows use the chunked form, equal within float32 rounding.

        Parameters
        ----------
        q, k : array, shape [total_new, num_k_heads, k_dim], float
        v : array, shape [total_new, num_v_heads, v_dim], float
        g, beta : array, shape [total_new, num_v_heads], float
            The decay's log (``S *= exp(g)``) and the write strength.
        scale : float, default ``k_dim ** -0.5``
        qk_l2norm : bool, default False
        state : int, default 1
            Which of the layer's state arrays.

        Returns
        -------
        o : shape [total_new, num_v_heads, v_dim], float32
            Of ``q``'s kind (numpy, torch, or the backend's device arrays).

        Raises
        ------
        ValueError
            As ``causal_conv1d``; ``num_k_heads`` must divide ``num_v_heads``.
        """
        layer, states = self._state_call(layer, batch)
        return recurrent.gated_delta_rule(self._backend, states, layer, batch, q, k, v, g,
                                          beta, scale, qk_l2norm, state)

    @exclusive
    def read_states(self, layer: int, batch: StepBatch) -> Tuple[np.ndarray, ...]:
        """The states of the step's sequences before the step, to run another
        recurrence (Mamba2) outside the cache.

        Returns
        -------
        tuple of ndarray
            Per state array of the layer, ``[B, *shape]`` float32 (zeros for a
            sequence without a state yet).

        Raises
        ------
        ValueError
            An attention layer, or the layer already advanced this step.
        """
        layer, states = self._state_call(layer, batch)
        return recurrent.read_states(states, layer, batch)

    @exclusive
    def write_states(self, layer: int, batch: StepBatch, states: Sequence[Any]) -> None:
        """Write the states after the step (what ``read_states`` gave, advanced by
        the engine's own recurrence).

        Parameters
        ----------
        states : tuple of array-like
            Per state array of the layer, ``[B, *shape]``, float.  Rows of
            sequences without new tokens this step are ignored (they keep
            their state).  Only the step's end is kept: a later rollback into
            the step is refused.
        """
        layer, pool = self._state_call(layer, batch)
        recurrent.write_states(pool, layer, batch, states)

    @exclusive
    def read_state(self, layer: int, seq_id: int) -> Tuple[np.ndarray, ...]:
        """The sequence's state arrays of a recurrent layer now, after its last
        token; a tuple of float32 copies of the layer's shapes (zeros while it
        has no state)."""
        layer = check_int("layer", layer, minimum=0, maximum=self.num_layers - 1)
        recurrent.layer_spec(self.layer_states, layer)
        self._tables.seq_len(seq_id)                # an unknown or swapped id raises
        if self._tables.is_swapped(seq_id):
            raise ValueError(f"seq_id: sequence {seq_id} is swapped out (swap_in first)")
        return recurrent.read_state(self._states, layer, int(seq_id))  # type: ignore[arg-type]

    # -- prefix cache ------------------------------------------------------------------
    @exclusive
    def stats(self) -> Dict[str, Union[int, float]]:
        """Page and prefix-cache counters.

        Returns
        -------
        dict
            ``num_free_pages`` (what an allocation can take, evictable cached
            pages included), ``num_used_pages`` (held by a sequence),
            ``num_shared_pages`` (held by more than one), ``num_cached_pages``
            (free but still holding a cached prefix: evictable),
            ``prefix_hit_rate`` (tokens reused / prompt tokens passed to
            ``add_sequence``), ``num_evictions``; with windowed layers, the
            same for the window pool: ``num_free_window_pages``,
            ``num_used_window_pages``, ``num_shared_window_pages``,
            ``num_cached_window_pages``, ``num_window_evictions``;
            ``num_swapped_sequences`` and ``swapped_bytes`` (their K/V waiting
            in host memory, see ``swap_out``); with recurrent layers,
            ``num_free_state_slots``, ``num_used_state_slots``,
            ``num_shared_state_slots``, ``num_cached_state_slots`` (prefix
            snapshots no sequence uses: evictable) and ``num_state_evictions``.
        """
        prompt = self._tables.num_prompt_tokens
        stats: Dict[str, Union[int, float]] = {}
        for pool in self._pools:
            prefix = "" if pool.name == "full" else pool.name + "_"
            stats.update(self._pool_stats(pool.allocator, prefix + "pages"))
            if pool.name == "full":
                stats["prefix_hit_rate"] = self._tables.num_reused_tokens / prompt \
                    if prompt else 0.0
            stats[f"num_{prefix}evictions"] = int(pool.allocator.num_evictions)
        if self._states is not None:
            stats.update(self._states.stats())
        stats["num_swapped_sequences"] = len(self._swapped)
        stats["swapped_bytes"] = sum(kv.nbytes for kv in self._swapped.values())
        return stats

    @staticmethod
    def _pool_stats(allocator, suffix):
        refcounts = allocator.refcount(np.arange(allocator.num_pages))
        return {f"num_free_{suffix}": allocator.num_free,
                f"num_used_{suffix}": int((refcounts > 0).sum()),
                f"num_shared_{suffix}": int((refcounts > 1).sum()),
                f"num_cached_{suffix}": allocator.num_cached_free}

    @exclusive
    def reset_prefix_cache(self) -> int:
        """Drop every cached page (and state snapshot) that no sequence uses; return
        how many pages and snapshots."""
        dropped = sum(pool.allocator.reset_prefix_cache() for pool in self._pools)
        return dropped + (self._states.reset_snapshots() if self._states is not None else 0)

    # -- reading back ----------------------------------------------------------------
    @exclusive
    def gather(self, layer: int, seq_id: int, start: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """The sequence's K and V of one layer, contiguous, from position ``start`` on.

        A windowed layer holds only its recent positions: asking for positions
        it gave back is a ``ValueError`` that says from where it holds them.

        Returns
        -------
        k : ndarray, shape [seq_len - start, num_kv_heads, head_dim], float32
        v : ndarray, shape [seq_len - start, num_kv_heads, v_head_dim], float32
            ``kv_layout="latent"``: ``k[..., :v_head_dim]`` (a view).
        """
        layer = check_int("layer", layer, minimum=0, maximum=self.num_layers - 1)
        self._check_kv_layer(layer)
        length = self._tables.seq_len(seq_id)
        start = check_int("start", start, minimum=0, maximum=length)
        return self._gathered(layer, self._slots(layer, seq_id, start, length, "start"))

    def _gathered(self, layer, slots):
        """K and V at ``slots`` of ``layer`` (latent: V a view of K's leading columns)."""
        k, v = self._backend.gather(layer, slots)
        return (k, k[..., :self.v_head_dim]) if self.kv_layout == "latent" else (k, v)

    def _slots(self, layer, seq_id, start, stop, name):
        """Slots of positions start:stop in the layer's pool; a windowed layer's
        positions given back are a ValueError naming ``name``."""
        pool = self._layer_pool[layer]
        if start < stop:
            held_from = pool.held_from(seq_id)
            if start < held_from:
                raise ValueError(
                    f"{name}: layer {layer} (sliding window {self.layer_windows[layer]}) holds "
                    f"K/V of sequence {seq_id} only from position {held_from}; earlier ones "
                    f"were given back, got {start}")
        return pool.slots(seq_id, start, stop)

    @exclusive
    def read_token(self, layer: int, seq_id: int, pos: int) -> Tuple[np.ndarray, np.ndarray]:
        """K and V of one token (a windowed layer: only positions it still holds).

        Returns
        -------
        k : ndarray, shape [num_kv_heads, head_dim], float32
        v : ndarray, shape [num_kv_heads, v_head_dim], float32
        """
        layer = check_int("layer", layer, minimum=0, maximum=self.num_layers - 1)
        self._check_kv_layer(layer)
        length = self._tables.seq_len(seq_id)
        pos = check_int("pos", pos, minimum=0, maximum=length - 1)
        k, v = self._gathered(layer, self._slots(layer, seq_id, pos, pos + 1, "pos"))
        return k[0], v[0]

    # -- sequences that leave the cache (pagedkv.transfer, pagedkv.kv_file) -------------
    @exclusive
    def export_sequence(self, seq_id: int) -> SequenceKV:
        """A self-contained copy of the sequence's K/V (swapped out or not).

        Returns
        -------
        SequenceKV
            Per layer, K and V of the positions the layer holds (every
            position; a windowed layer only those it still holds), as
            ``[num_tokens - layer_start[l], num_kv_heads, head_dim]`` arrays of
            the stored bits, plus int8's row scales and, with prefix caching,
            the token ids.  Numpy and plain metadata only: it pickles and is
            independent of backend, page size and process.
        """
        return transfer.export_sequence(self._holdings, seq_id)

    @exclusive
    def import_sequence(self, kv: SequenceKV) -> int:
        """A new sequence holding ``kv``'s K/V; returns its id.  All or nothing.

        ``kv`` may come from any cache of the same ``num_layers``,
        ``num_kv_heads`` and ``head_dim``, whatever its backend, page size or
        storage dtype.  The same dtype (and rotation) imports bit-exactly:
        ``gather`` of the new sequence equals the old one's bit for bit.
        Another dtype converts as ``store`` would convert the exported values
        (``gather`` of the source).  A windowed layer keeps only what its
        window needs.  With prefix caching and ``kv.token_ids``, the full
        pages join the prefix cache as if stored here.

        Raises
        ------
        ValueError
            ``kv`` is inconsistent or of another shape (the message names the
            field), or a layer of this cache needs positions ``kv`` does not
            hold (a full layer, or a larger window, than the source layer
            had; the message names the layer).
        OutOfPagesError
            Too few free pages in either pool.  Nothing changed.
        """
        return transfer.import_sequence(self._holdings, transfer.check_fits(self._holdings, kv))

    @exclusive
    def swap_out(self, seq_id: int) -> None:
        """Preempt the sequence without losing its K/V: they move to host memory
        (off the device, on opencl) and its pages go back to their pools (pages
        shared with other sequences stay with them).  Makes earlier batches stale.

        Until ``swap_in``, ``append``, ``store``, ``attention``, ``gather``,
        ``read_token``, ``fork``, ``truncate`` and ``restore`` involving it are
        a ``ValueError`` saying it is swapped out; ``seq_len``, ``free``,
        ``checkpoint`` and ``export_sequence`` work.
        """
        transfer.swap_out(self._holdings, seq_id)
        self._generation += 1

    @exclusive
    def swap_in(self, seq_id: int) -> None:
        """Bring a swapped-out sequence back on new pages, with the same id, length
        and K/V (``gather`` returns the same bits as before ``swap_out``).

        Raises
        ------
        ValueError
            It is not swapped out.
        OutOfPagesError
            Too few free pages; it stays swapped out and nothing changed.
        """
        transfer.swap_in(self._holdings, seq_id)

    @exclusive
    def is_swapped(self, seq_id: int) -> bool:
        """Whether the sequence is swapped out."""
        return self._tables.is_swapped(seq_id)

    @exclusive
    def save(self, path: Any, seq_ids: Optional[Sequence[int]] = None) -> None:
        """Write sequences and, with prefix caching, every cached page chain to one
        safetensors file at ``path``, atomically.

        Parameters
        ----------
        path : str or os.PathLike
        seq_ids : sequence of int, optional
            The sequences to save, in this order (default: every live one,
            ascending; swapped-out ones included).  With prefix caching the
            cached chains (also those of freed sequences still cached) are
            saved whatever ``seq_ids`` is.

        Notes
        -----
        The file's metadata carry ``pagedkv_format_version``, a ``checksum``
        (``"crc32:<hex>"`` over every tensor's name, dtype, shape and bytes and
        the other metadata) and this cache's configuration under the
        constructor's argument names.  It is written to a temporary file in
        the same folder, flushed to disk and renamed over ``path``: a failure
        part way leaves an earlier file at ``path`` as it was and no
        temporary file behind.

        Raises
        ------
        OSError
            The file could not be written (nothing at ``path`` changed).
        """
        from pagedkv import kv_file
        kv_file.save(self._holdings, path, seq_ids)

    @exclusive
    def load(self, path: Any) -> List[int]:
        """Import the sequences of a file ``save`` wrote, and make its cached page
        chains prefix-cache hits here.  All or nothing.

        The file loads into any cache that ``import_sequence`` would accept
        (page size and dtype may differ and convert the same way); a cache
        without prefix caching takes its sequences only.  Nothing in it is
        executed.

        Returns
        -------
        list of int
            The new sequences' ids, in the saved order.

        Raises
        ------
        ValueError
            The file is missing, truncated, corrupted, not a pagedkv file, or
            does not fit this cache; the message names the path and the
            problem.
        OutOfPagesError
            Too few free pages.  Either way nothing changed.
        """
        from pagedkv import kv_file
        return kv_file.load(self._holdings, path)

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, num_pages={self._allocator.num_pages}, "
                f"page_size={self.page_size}, dtype={self.storage.name!r}, backend={self.backend!r})")

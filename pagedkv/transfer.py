"""Sequences that leave the cache: ``SequenceKV``, export, import and swap.

A :class:`SequenceKV` is one sequence's K/V as the cache stored them, in
numpy arrays of the storage dtype, one contiguous ``[tokens, num_kv_heads,
head_dim]`` array per layer for K and for V (plus each row's scale for int8),
and plain metadata.  It knows nothing of backends, pages or processes, so it
pickles, crosses Ray's object store and fills a safetensors file
(:mod:`pagedkv.kv_file`).

Placing one in a cache (:func:`import_sequence`, ``swap_in``, ``load``) takes
new pages for its tokens (``Placement.adopt``), writes every layer's rows
and commits (``Placement.commit``; ``Placement.undo`` if the writing
fails).  The rows written are the stored bits themselves when the formats
agree, so that ``gather`` returns the same bits; otherwise the exported
values as float32 (what the source's ``gather`` returns) through the
target's ``store``, so that they convert exactly as stored values would.  A windowed layer keeps only the
positions its window still needs; its window pages before them are never
taken, so a long sequence fits a small window pool.
"""
from dataclasses import dataclass, replace
from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np
import numpy.typing as npt

from pagedkv.backends.base import StepTables, StoredRows
from pagedkv.backends.host import decode_rows
from pagedkv.errors import ArgumentTypeError, OutOfPagesError
from pagedkv.holdings import CacheHoldings
from pagedkv.storage import NAMES as STORAGE_NAMES, StorageFormat, storage_format


@dataclass(frozen=True, eq=False)
class SequenceKV:
    """One sequence's K/V outside any cache: numpy arrays and plain metadata.

    Made by ``PagedKVCache.export_sequence``; placed by ``import_sequence``.
    It pickles, and it depends on no backend, page size, page id or process.

    Attributes
    ----------
    num_tokens : int
        The sequence's length.
    num_kv_heads, head_dim : int
    dtype : str
        The storage dtype it was exported from (``"float32"``, ``"float16"``, ``"int8"``).
    rotation_block : int
        int8: the Hadamard block its rows are rotated by (0: not rotated;
        see :mod:`pagedkv.storage`).  0 for float dtypes.
    layer_start : tuple of int, shape [num_layers]
        First position held per layer: 0, or later for a windowed layer that
        had given older positions back.
    keys, values : tuple of ndarray, shape [num_layers]
        Layer ``l``'s K and V rows of positions ``layer_start[l]:num_tokens``,
        each C-contiguous, shape ``[num_tokens - layer_start[l], num_kv_heads,
        head_dim]`` (values: ``v_head_dim``), in the storage dtype (float16 as ``numpy.float16``,
        int8 as the stored integers).  ``values`` is None in the latent layout
        (the values are the keys' first ``v_head_dim`` columns).
    key_scales, value_scales : tuple of ndarray or None
        int8: each row's float32 scale, shape ``[num_tokens - layer_start[l],
        num_kv_heads]`` per layer; None for float dtypes (``value_scales``:
        and in the latent layout).
    token_ids : ndarray, shape [num_tokens], int32, or None
        The sequence's token ids when the cache knew them (prefix caching).
    kv_layout : {"separate", "latent"}
        The layout of the cache it came from (``PagedKVCache(kv_layout=...)``).
    v_head_dim : int or None
        The values' width; None: ``head_dim``.
    states : tuple or None, shape [num_layers]
        Hybrid models: per layer, None (an attention layer) or the recurrent
        layer's state arrays after the sequence's last token (a tuple of
        float32 arrays of its ``StateSpec``'s shapes); a recurrent layer holds
        no K/V (``layer_start`` is ``num_tokens``).  None: no recurrent layer.
    """
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    rotation_block: int
    layer_start: Tuple[int, ...]
    keys: Tuple[np.ndarray, ...]
    values: Optional[Tuple[np.ndarray, ...]]
    key_scales: Optional[Tuple[np.ndarray, ...]] = None
    value_scales: Optional[Tuple[np.ndarray, ...]] = None
    token_ids: Optional[np.ndarray] = None
    kv_layout: str = "separate"
    v_head_dim: Optional[int] = None
    states: Optional[Tuple[Optional[Tuple[np.ndarray, ...]], ...]] = None

    def __post_init__(self):
        # sequences given as lists become the tuples a frozen object keeps
        for name in ("layer_start", "keys", "values", "key_scales", "value_scales", "states"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    @property
    def num_layers(self) -> int:
        return len(self.layer_start)

    @property
    def arrays(self) -> Tuple[np.ndarray, ...]:
        """Every layer's arrays of rows: keys, values and scales (those it has)."""
        return self.keys + (self.values or ()) + (self.key_scales or ()) + \
            (self.value_scales or ())

    @property
    def state_arrays(self) -> Tuple[np.ndarray, ...]:
        """Every recurrent layer's state arrays, in layer order."""
        return tuple(a for arrays in self.states or () for a in arrays or ())

    @property
    def nbytes(self) -> int:
        """Bytes held: K/V values and scales of every layer, and the states."""
        return sum(a.nbytes for a in self.arrays) + sum(a.nbytes for a in self.state_arrays)

    @property
    def storage(self):
        """The :class:`pagedkv.storage.StorageFormat` its rows are in."""
        return storage_format(self.dtype, self.head_dim, self.rotation_block != 0,
                              latent=self.kv_layout == "latent", v_head_dim=self.v_head_dim)

    def rows(self, layer, start=None):
        """Layer ``layer``'s rows from position ``start`` (default: all held), as
        :class:`pagedkv.backends.base.StoredRows`."""
        skip = 0 if start is None else start - self.layer_start[layer]

        def rows_of(arrays):
            return None if arrays is None else arrays[layer][skip:]
        return StoredRows(rows_of(self.keys), rows_of(self.values), rows_of(self.key_scales),
                          rows_of(self.value_scales))

    def __repr__(self):
        return (f"SequenceKV(num_tokens={self.num_tokens}, num_layers={self.num_layers}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype!r}, kv_layout={self.kv_layout!r}, nbytes={self.nbytes})")

    def copy(self) -> "SequenceKV":
        """A copy whose arrays are its own (writable, in one new buffer)."""
        rows = rows_in_one_buffer(self.storage, [self.num_tokens - s for s in self.layer_start],
                                  self.num_kv_heads, self.head_dim)
        for layer, copies in enumerate(rows):
            for target, source in zip(copies, self.rows(layer)):   # both None where absent
                if target is not None:
                    target[...] = source
        states = None if self.states is None else tuple(
            None if arrays is None else tuple(a.copy() for a in arrays) for arrays in self.states)
        return replace(self, **layer_arrays(self.storage, rows),
                       token_ids=None if self.token_ids is None else self.token_ids.copy(),
                       states=states)

    def check(self, name="kv"):
        """Raise ValueError (naming the field) unless every field is consistent.

        Import and load call this: an unpickled or hand-made object skips
        ``__init__``, and nothing inconsistent may reach the kernels.  What
        they place is the object returned: the same content with plain ints
        and plain, C-contiguous ndarrays, whose real buffers were checked (an
        ndarray subclass may say anything of its ``shape`` or ``dtype``).
        """
        for field in ("num_tokens", "num_kv_heads", "head_dim", "rotation_block"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name}.{field}: expected an int >= 0, got {value!r}"[:200])
        self = replace(self, num_tokens=int(self.num_tokens), num_kv_heads=int(self.num_kv_heads),
                       head_dim=int(self.head_dim), rotation_block=int(self.rotation_block))
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"{name}: expected num_kv_heads and head_dim >= 1, got "
                             f"{self.num_kv_heads} and {self.head_dim}")
        if self.kv_layout not in ("separate", "latent"):
            raise ValueError(f"{name}.kv_layout: expected 'separate' or 'latent', got "
                             f"{self.kv_layout!r}"[:200])
        v_head_dim = self.head_dim if self.v_head_dim is None else self.v_head_dim
        # latent rows' values are their leading columns; separate V rows any width
        if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, (int, np.integer)) or \
                v_head_dim < 1 or self.kv_layout == "latent" and v_head_dim > self.head_dim:
            raise ValueError(f"{name}.v_head_dim: expected None or an int >= 1 (at most "
                             f"head_dim={self.head_dim} in the latent layout), "
                             f"got {self.v_head_dim!r}"[:200])
        self = replace(self, v_head_dim=int(v_head_dim))
        if self.dtype not in STORAGE_NAMES:
            raise ValueError(f"{name}.dtype: expected one of {STORAGE_NAMES}, got {self.dtype!r}")
        storage = self.storage
        if storage.rotation_block != self.rotation_block:
            raise ValueError(f"{name}.rotation_block: {self.dtype} rows of head_dim "
                             f"{self.head_dim} (v_head_dim {self.v_head_dim}) are rotated by "
                             f"blocks of "
                             f"{storage.rotation_block} or not at all (0), got "
                             f"{self.rotation_block}")
        starts = self.layer_start
        if not isinstance(starts, tuple) or not starts or any(
                isinstance(s, bool) or not isinstance(s, (int, np.integer))
                or not 0 <= s <= self.num_tokens for s in starts):
            raise ValueError(f"{name}.layer_start: expected a non-empty tuple of ints in "
                             f"[0, num_tokens={self.num_tokens}], got {starts!r}"[:200])
        starts = tuple(int(s) for s in starts)
        parts = {part.field: part for part in storage.copy_set(self.head_dim)}
        arrays = {}
        for field, part in _LAYER_FIELDS.items():
            given = getattr(self, field)
            if part in parts:
                arrays[field] = (given, parts[part].dtype, parts[part].row_shape)
            elif given is not None:
                raise ValueError(f"{name}.{field}: {self.dtype} rows of the {self.kv_layout} "
                                 f"layout have none; expected None")
        plain: Dict[str, Tuple[np.ndarray, ...]] = {}
        for field, (given, dtype, row_shape) in arrays.items():
            if not isinstance(given, tuple) or len(given) != len(starts):
                raise ValueError(f"{name}.{field}: expected a tuple of {len(starts)} arrays "
                                 f"(one per layer), got {type(given).__name__}")
            checked = []
            for layer, (array, start) in enumerate(zip(given, starts)):
                shape = (self.num_tokens - start, self.num_kv_heads) + row_shape
                real = _real_array(array)
                if real is None or real.dtype != dtype or real.shape != shape:
                    got = type(array).__name__ if real is None else \
                        f"{real.dtype} {list(real.shape)}"
                    raise ValueError(f"{name}.{field}[{layer}]: expected a {dtype} array of "
                                     f"shape {list(shape)}, got {got}")
                checked.append(np.require(real, requirements=("C", "A")))
            plain[field] = tuple(checked)
        if self.states is not None and (not isinstance(self.states, tuple)
                                        or len(self.states) != len(starts)):
            raise ValueError(f"{name}.states: expected None or a tuple of {len(starts)} "
                             f"entries (one per layer), got {type(self.states).__name__}")
        ids = None if self.token_ids is None else _real_array(self.token_ids)
        if self.token_ids is not None and (ids is None or ids.dtype != np.int32 or
                                           ids.shape != (self.num_tokens,)):
            raise ValueError(f"{name}.token_ids: expected None or an int32 array of shape "
                             f"[{self.num_tokens}]")
        return replace(self, layer_start=starts, keys=plain["keys"], values=plain.get("values"),
                       key_scales=plain.get("key_scales"), value_scales=plain.get("value_scales"),
                       token_ids=None if ids is None else np.require(ids, requirements=("C", "A")))


def _real_array(value):
    """``value`` as a plain ndarray over its real buffer (what the array is, whatever
    a subclass says of its ``shape`` or ``dtype``); None if it is not an ndarray."""
    return np.asarray(value) if isinstance(value, np.ndarray) else None


#: SequenceKV's per-layer fields, and the StoredRows field each holds.
_LAYER_FIELDS = {"keys": "k", "values": "v", "key_scales": "k_scales",
                 "value_scales": "v_scales"}


def layer_arrays(storage, rows):
    """SequenceKV's ``keys``, ``values``, ``key_scales`` and ``value_scales`` from
    per-layer StoredRows ``rows`` in ``storage``: a tuple of arrays (one a layer)
    for each pool of its copy set, None for the others."""
    fields = storage.fields
    return {field: tuple(getattr(r, part) for r in rows) if part in fields else None
            for field, part in _LAYER_FIELDS.items()}


def rows_in_one_buffer(storage, counts, num_kv_heads, head_dim):
    """Empty StoredRows of ``counts[l]`` rows per layer, views of one new buffer.

    One allocation instead of one per array: the kernel backs a large one
    with huge pages (numpy advises it), where many arrays of a few MB fault
    in 4 KiB at a time (export of 189 MB: 46,000 page faults, most of its
    time, against some 700).
    """
    shapes = []                        # per layer: k, v (and their scales), as StoredRows
    for n in counts:
        values = (n, num_kv_heads, head_dim)
        shapes.append([(values[:2] + part.row_shape, part.dtype)
                       for part in storage.copy_set(head_dim)])
    sizes = [-(-int(np.prod(shape)) * dtype.itemsize // 64) * 64      # 64-byte aligned
             for layer in shapes for shape, dtype in layer]
    buffer = np.empty(sum(sizes), np.uint8)
    at = 0
    rows = []
    for layer in shapes:
        arrays = []
        for shape, dtype in layer:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            arrays.append(buffer[at:at + nbytes].view(dtype).reshape(shape))
            at += -(-nbytes // 64) * 64
        rows.append(StoredRows(**dict(zip(storage.fields, arrays))))
    return rows


def export_sequence(holdings: CacheHoldings, seq_id: int, copy: bool = True) -> SequenceKV:
    """``cache.export_sequence``: a copy of the sequence's stored rows.

    ``copy=False``: a swapped-out sequence's K/V as the cache holds them
    (read-only), for a caller that reads them and hands them to nobody.
    """
    tables = holdings.tables
    if tables.is_swapped(seq_id):
        kv = holdings.swapped[int(seq_id)]
        return kv.copy() if copy else kv
    length = tables.seq_len(seq_id)
    held_from = {pool.name: pool.held_from(seq_id) for pool in holdings.pools}
    slots = {pool.name: pool.slots(seq_id, held_from[pool.name], length)
             for pool in holdings.pools}
    recurrent = holdings.recurrent_layers     # hold states, no K/V
    layer_start = [length if layer in recurrent else held_from[pool.name]
                   for layer, pool in enumerate(holdings.layer_pool)]
    rows = rows_in_one_buffer(holdings.storage, [length - start for start in layer_start],
                              holdings.num_kv_heads, holdings.head_dim)
    for layer, pool in enumerate(holdings.layer_pool):
        if layer not in recurrent:
            holdings.backend.read_rows(layer, slots[pool.name], rows[layer])
    tokens = tables.known_tokens(seq_id) if holdings.prefix_caching else None
    return SequenceKV(
        num_tokens=length, num_kv_heads=holdings.num_kv_heads, head_dim=holdings.head_dim,
        dtype=holdings.storage.name, rotation_block=holdings.storage.rotation_block,
        layer_start=tuple(layer_start), **layer_arrays(holdings.storage, rows),
        token_ids=tokens if tokens is not None and len(tokens) == length else None,
        kv_layout=holdings.kv_layout, v_head_dim=holdings.v_head_dim,
        states=None if holdings.states is None else holdings.states.export(int(seq_id)))


def check_fits(holdings: CacheHoldings, kv: object, name: str = "kv") -> SequenceKV:
    """ValueError (naming the field) unless ``kv`` is a consistent SequenceKV of
    this cache's shape; returns what :meth:`SequenceKV.check` returns, which
    is what to place."""
    if not isinstance(kv, SequenceKV):
        raise ArgumentTypeError(f"{name}: expected a pagedkv.SequenceKV (from "
                                f"export_sequence), got {type(kv).__name__}")
    checked = kv.check(name)
    for field in ("num_layers", "num_kv_heads", "head_dim", "kv_layout", "v_head_dim"):
        if getattr(checked, field) != getattr(holdings, field):
            raise ValueError(f"{name}.{field}: this cache has {field}="
                             f"{getattr(holdings, field)}, the sequence's K/V "
                             f"{getattr(checked, field)}")
    if holdings.states is not None:
        if checked.states is None:
            raise ValueError(f"{name}.states: this cache has recurrent layers "
                             f"{list(holdings.recurrent_layers)}; the sequence carries no "
                             f"states (it comes from a cache without them)")
        checked = replace(checked, states=holdings.states.check_import(f"{name}.states",
                                                                        checked.states))
    elif checked.states is not None and any(s is not None for s in checked.states):
        layer = next(i for i, s in enumerate(checked.states) if s is not None)
        raise ValueError(f"{name}.states[{layer}]: layer {layer} is an attention layer of this "
                         f"cache; the sequence carries a recurrent state for it")
    limit = min(holdings.max_seq_len or 2**31 - 1, 2**31 - 1)
    if checked.num_tokens > limit:
        raise ValueError(f"{name}.num_tokens: {checked.num_tokens} tokens, over this cache's "
                         + (f"max_seq_len={holdings.max_seq_len}" if holdings.max_seq_len
                            else "int32 limit of the tables"))
    return checked


def window_start(holdings: CacheHoldings, kv: SequenceKV, trim: bool = True) -> int:
    """The first position the windowed layers of the cache hold of ``kv``, or
    ValueError naming a layer that needs positions ``kv`` lacks.

    Full-attention layers hold every position.  Windowed layers hold the rows
    from the first position ``kv`` holds in every windowed layer, which may
    lie inside a page (the window pool then holds that page without its
    earlier rows, and refuses a rollback that would need them); with
    ``trim``, not before the page of what a decode step would keep (the
    window and ``window_rollback_tokens``), so that no window page is taken
    for positions no query can see.
    """
    length, page_size = kv.num_tokens, holdings.page_size
    windows = holdings.layer_windows
    recurrent = holdings.recurrent_layers
    for layer, window in enumerate(windows):
        if window is None and kv.layer_start[layer] > 0 and layer not in recurrent:
            raise ValueError(
                f"layer_start: layer {layer} is a full-attention layer of this cache and needs "
                f"K/V from position 0; the sequence's K/V of layer {layer} start at position "
                f"{kv.layer_start[layer]}")
    window_pool = holdings.window_pool
    if window_pool is None:
        return 0
    windowed = window_pool.layers
    held = start = max(kv.layer_start[layer] for layer in windowed)
    if trim:
        keep = window_pool.keep_from(length, length)
        start = max(start, keep // page_size * page_size)
    for layer in windowed:
        window = windows[layer]
        assert window is not None       # the window pool's layers are the windowed ones
        need = max(0, length - window + 1)
        if start > need:
            raise ValueError(
                f"layer_start: layer {layer} (sliding window {window}) needs K/V from "
                f"position {need} of {length}; the sequence's K/V of layer "
                f"{max(windowed, key=lambda w: kv.layer_start[w])} start at position {held}")
    return min(start, length)


def write_rows(holdings: CacheHoldings, layer: int, slots: npt.NDArray[np.int64],
               rows: StoredRows, storage: StorageFormat) -> None:
    """Write stored rows of format ``storage`` at ``slots`` of ``layer``: the bits
    as they are when the formats agree, else their float32 values through
    ``store`` (converted as stored values are)."""
    if not len(slots):
        return
    if storage == holdings.storage:
        holdings.backend.write_rows(layer, slots, rows)
        return
    k = decode_rows(storage, rows.k, rows.k_scales)
    v = None if rows.v is None else decode_rows(storage, rows.v, rows.v_scales)
    n = len(slots)
    tables = StepTables(query_start=np.array([0, n], np.int32),
                        seq_lens=np.array([n], np.int32), slot_mapping=slots,
                        page_indptr=np.zeros(2, np.int32), page_indices=np.zeros(0, np.int32))
    holdings.backend.prepare_step(tables)
    holdings.backend.store(layer, tables, k, v)


def write_sequence(holdings: CacheHoldings, kv: SequenceKV, seq_id: int, start: int) -> None:
    """Fill the placed sequence ``seq_id`` from ``kv``; windowed layers from ``start``."""
    storage = kv.storage
    first = {pool.name: pool.import_start(start) for pool in holdings.pools}
    slots = {pool.name: pool.slots(seq_id, first[pool.name], kv.num_tokens)
             for pool in holdings.pools}
    recurrent = holdings.recurrent_layers
    for layer, pool in enumerate(holdings.layer_pool):
        if layer not in recurrent:
            write_rows(holdings, layer, slots[pool.name], kv.rows(layer, first[pool.name]),
                       storage)
    if holdings.states is not None:
        assert kv.states is not None            # check_fits made sure
        holdings.states.place(int(seq_id), kv.num_tokens, kv.states,
                              kv.token_ids if holdings.prefix_caching else None)


def import_sequence(holdings: CacheHoldings, kv: SequenceKV, start: Optional[int] = None) -> int:
    """``cache.import_sequence``: a new sequence holding ``kv``'s K/V (checked
    already; ``start``: its :func:`window_start`, when known)."""
    first = window_start(holdings, kv) if start is None else start
    tokens = kv.token_ids if holdings.prefix_caching else None
    if holdings.states is not None:
        holdings.states.check_room(1 if kv.num_tokens else 0, "the sequence's state")
    placement = holdings.placement
    # the reserve inside the try, and no Python call between the write and the
    # commit (the placement's own calls are compiled): whatever raises, even an
    # interrupt, finds the placing undone or committed, never left open
    try:
        seq_id = placement.adopt(kv.num_tokens, tokens, first // holdings.page_size,
                                 first_row=first)
        write_sequence(holdings, kv, seq_id, first)
    except BaseException:
        placement.undo()             # (a no-op when adopt itself raised)
        raise
    placement.commit()
    return seq_id


def swap_out(holdings: CacheHoldings, seq_id: int) -> None:
    """``cache.swap_out``: the sequence's K/V to host memory, its pages to the pools."""
    kv = export_sequence(holdings, seq_id)
    for array in kv.arrays + kv.state_arrays + \
            ((kv.token_ids,) if kv.token_ids is not None else ()):
        array.setflags(write=False)       # the cache's own: nothing may change them
    holdings.tables.swap_out(seq_id)
    if holdings.states is not None:
        holdings.states.free(int(seq_id))
    holdings.swapped[int(seq_id)] = kv


def swap_in(holdings: CacheHoldings, seq_id: int) -> None:
    """``cache.swap_in``: the sequence's K/V back on new pages, as they were."""
    if not holdings.tables.is_swapped(seq_id):
        raise ValueError(f"seq_id: sequence {seq_id} is not swapped out")
    kv = holdings.swapped[int(seq_id)]
    start = window_start(holdings, kv, trim=False)
    if holdings.states is not None:
        holdings.states.check_room(1 if kv.num_tokens else 0, "swap_in")
    placement = holdings.placement
    try:            # as in import_sequence
        placement.swap_in(seq_id, start // holdings.page_size, first_row=start)
        write_sequence(holdings, kv, int(seq_id), start)
    except BaseException:
        placement.undo()
        raise
    placement.commit()
    del holdings.swapped[int(seq_id)]


class CachedChains(NamedTuple):
    """Cached page chains outside any cache (the prefix cache of a file).

    Attributes
    ----------
    page_size : int
    storage : StorageFormat
        The format of ``rows``.
    token_ids : ndarray, shape [N, page_size], int32
    parents : ndarray, shape [N], int64
        Each page's parent, an earlier page, or -1 for a prompt's first page.
    has_window : ndarray, shape [N], bool
        Whether the windowed layers' K/V of the page are held.
    layer_windowed : tuple of bool, shape [num_layers]
        Whether the layer's ``rows`` are those of the ``has_window`` pages only.
    rows : tuple of StoredRows, shape [num_layers]
        ``page_size`` rows per page, pages in order.
    """
    page_size: int
    storage: StorageFormat
    token_ids: np.ndarray
    parents: np.ndarray
    has_window: np.ndarray
    layer_windowed: Tuple[bool, ...]
    rows: Tuple[StoredRows, ...]


class _Recut(NamedTuple):
    """The pages of another page size that cached chains' token prefixes fill, one
    entry per new page (no per-position table yet: there can be far more new
    positions than the chains hold when the new pages are larger).

    Attributes
    ----------
    end : ndarray, shape [M], int64
        The chain page holding the new page's last position.
    first : ndarray, shape [M], int64
        The new page's first position along its prefix.
    parents : ndarray, shape [M], int64
        Each new page's parent, an earlier new page, or -1.
    held : ndarray, shape [M], bool
        Whether the chains hold the rows of every position up to the new
        page's end in every layer of ``needed`` (then its parent is held too).
    held_window : ndarray, shape [M], bool
        Whether they hold the rows of the new page's own positions in every
        layer of ``needed_window``.
    prefix : ndarray, shape [M], int64
        A number for the new page's token prefix (the tokens of its positions
        and all before): new pages of one prefix are one page.  The chains
        hold one when two branches part inside a chain page after the end of
        a new page, or when a file lists a chain page twice.
    depth : ndarray, shape [N], int64
        Each chain page's place along its prefix (its first position over the
        chains' page size).
    """
    end: np.ndarray
    first: np.ndarray
    parents: np.ndarray
    held: np.ndarray
    held_window: np.ndarray
    prefix: np.ndarray
    depth: np.ndarray


def _recut(chains, page_size, needed, needed_window):
    """The chains cut into pages of ``page_size`` tokens: a :class:`_Recut`, in time
    linear in the chains' tokens and the number of new pages.

    ``needed``, ``needed_window``: the layers whose rows a new page must have
    to be entered, and those its window pages need.
    """
    ps, parents = chains.page_size, chains.parents
    n = len(parents)

    def rows_in(layers):       # whether each chain page has rows in all of ``layers``
        out = np.ones(n, bool)
        for layer in layers:
            if chains.layer_windowed[layer]:
                out &= chains.has_window
        return out

    usable, usable_window = rows_in(needed), rows_in(needed_window)
    depth = np.empty(n, np.int64)
    path_held = np.empty(n, bool)      # the page and all its ancestors usable
    window_run = np.empty(n, np.int64)  # usable_window pages ending the path at it
    last_new = np.empty(n, np.int64)   # the last new page ending at it or an ancestor
    counts = np.empty(n, np.int64)
    # each position's token prefix, numbered: a trie of the chains' tokens
    prefix_of: list = []
    trie: dict = {}
    index = 0
    # one pass, parents first (the file's order, checked on reading)
    for i, (parent, ok, ok_window, tokens) in enumerate(zip(
            parents.tolist(), usable.tolist(), usable_window.tolist(),
            chains.token_ids.tolist())):
        node = -1 if parent < 0 else prefix_of[parent][-1]
        prefixes = []
        for token in tokens:
            node = trie.setdefault((node, token), len(trie))
            prefixes.append(node)
        prefix_of.append(prefixes)
        d = 0 if parent < 0 else int(depth[parent]) + 1
        depth[i] = d
        path_held[i] = ok and (parent < 0 or bool(path_held[parent]))
        window_run[i] = (1 + (0 if parent < 0 else int(window_run[parent]))) if ok_window else 0
        counts[i] = count = (d + 1) * ps // page_size - d * ps // page_size
        index += count
        last_new[i] = index - 1 if count else (-1 if parent < 0 else last_new[parent])
    starts = np.cumsum(counts) - counts
    end = np.repeat(np.arange(n, dtype=np.int64), counts)
    m = len(end)
    nth = np.arange(m, dtype=np.int64) - starts[end]
    first = (depth[end] * ps // page_size + nth) * page_size
    before = np.where(parents >= 0, last_new[np.maximum(parents, 0)], -1)
    new_parents = np.where(nth > 0, np.arange(m, dtype=np.int64) - 1, before[end])
    # the chain pages a new page spans: from the one holding its first position to `end`
    spans = depth[end] - first // ps + 1
    last = first + page_size - 1 - depth[end] * ps         # its last position in `end`
    prefix = np.array([prefix_of[e][o] for e, o in zip(end.tolist(), last.tolist())],
                      np.int64).reshape(m)
    return _Recut(end, first, new_parents, path_held[end], window_run[end] >= spans, prefix,
                  depth)


def _positions(chains, depth, end, first, page_size):
    """Where each position of the new pages (``end`` and ``first`` of a
    :class:`_Recut`, K pages) comes from: ``node`` (a chain page) and ``offset`` (a
    position in it), each ndarray, shape [K, page_size], int64.

    Walks up from each page's last chain page, one chain page per round for
    all new pages at once: work in proportion to the K * page_size positions.
    """
    ps, parents = chains.page_size, chains.parents
    node = np.empty((len(end), page_size), np.int64)
    offset = np.empty((len(end), page_size), np.int64)
    at = end.copy()
    todo = np.arange(len(end), dtype=np.int64)
    while len(todo):
        chain_page, begin = at[todo], first[todo]
        low = np.maximum(depth[chain_page] * ps, begin)     # the positions it holds
        high = np.minimum((depth[chain_page] + 1) * ps, begin + page_size)
        lengths = high - low
        rows = np.repeat(todo, lengths)
        positions = np.arange(int(lengths.sum()), dtype=np.int64) \
            - np.repeat(np.cumsum(lengths) - lengths - low, lengths)
        node[rows, positions - first[rows]] = np.repeat(chain_page, lengths)
        offset[rows, positions - first[rows]] = positions - np.repeat(depth[chain_page] * ps,
                                                                      lengths)
        more = low > begin
        todo = todo[more]
        at[todo] = parents[chain_page[more]]
    return node, offset


def reserve_cached_chains(holdings: CacheHoldings, chains: CachedChains, reserve: int,
                          reserve_window: int) -> None:
    """Reserve the pages that enter ``chains`` in the cache's prefix cache, cut into
    its page size, and write their K/V, converted to its format; only pages
    whose K/V every layer here needs are held (and then their descendants).
    ``reserve``: pages kept free for what comes next.  The caller then
    commits (``holdings.chains.commit()``: they join the prefix cache) or
    undoes (``holdings.chains.undo()``); if this raises, nothing is left
    reserved.

    Chains that cannot fit are refused (``OutOfPagesError``) before any work in
    proportion to the pages they would fill.
    """
    page_size = holdings.page_size
    full_layers = holdings.full_pool.layers
    window_pool = holdings.window_pool
    windowed = window_pool.layers if window_pool is not None else ()
    recut = _recut(chains, page_size, full_layers, windowed)
    held = np.flatnonzero(recut.held)
    # one page per token prefix: the first held one (its parent is held, and of
    # the parent's prefix)
    keep = np.sort(held[np.unique(recut.prefix[held], return_index=True)[1]])
    has_window = recut.held_window[keep] if windowed else np.zeros(len(keep), bool)
    # A page already cached here needs no new page, and there are at most
    # num_pages of those: chains beyond that and the free pages cannot fit.
    for pool, count, reserved in ((holdings.full_pool, len(keep), reserve),
                                  (window_pool, int(has_window.sum()), reserve_window)):
        if pool is not None and count > pool.allocator.num_pages + pool.allocator.num_free \
                - reserved:
            raise OutOfPagesError(
                f"load: the prefix cache's chains fill {count} pages of {page_size} tokens "
                f"besides the sequences' {reserved}; this cache's pool {pool.name!r} has "
                f"{pool.allocator.num_pages} pages, {pool.allocator.num_free} free")
    if not len(keep):
        return
    renumber = np.full(int(recut.prefix.max()) + 1, -1, np.int64)     # by prefix
    renumber[recut.prefix[keep]] = np.arange(len(keep))
    parents = np.where(recut.parents[keep] >= 0,
                       renumber[recut.prefix[np.maximum(recut.parents[keep], 0)]], -1)
    node, offset = _positions(chains, recut.depth, recut.end[keep], recut.first[keep],
                              page_size)
    # per layer of the chains: where a page's rows start in ``rows``, -1 where it has none
    windowed_rank = np.where(chains.has_window, np.cumsum(chains.has_window) - 1, -1)
    full_rank = np.arange(len(chains.parents), dtype=np.int64)
    rank = [windowed_rank if windowed_layer else full_rank
            for windowed_layer in chains.layer_windowed]
    rows_at = [rank[layer][node] * chains.page_size + offset for layer in range(len(rank))]
    token_ids = np.ascontiguousarray(chains.token_ids[node, offset])
    offsets = np.arange(page_size, dtype=np.int64)
    held_in = np.ones((len(holdings.pools), len(keep)), bool)     # per pool: pages that come
    reserves = [reserve] * len(holdings.pools)
    if window_pool is not None:
        held_in[window_pool.index] = has_window
        reserves[window_pool.index] = reserve_window
    try:            # as in import_sequence
        pages = holdings.chains.reserve(token_ids, np.ascontiguousarray(parents), held_in,
                                        reserves)
        recurrent = holdings.recurrent_layers      # no K/V rows
        for layer, pool in enumerate(holdings.layer_pool):
            if layer in recurrent:
                continue
            targets = pages[pool.index]
            chosen = np.flatnonzero(targets >= 0)
            slots = (targets[chosen, None].astype(np.int64) * page_size + offsets).ravel()
            at = rows_at[layer][chosen].ravel()
            if len(at) and at[-1] - at[0] == len(at) - 1 and \
                    np.array_equal(at, np.arange(at[0], at[0] + len(at))):
                at = slice(int(at[0]), int(at[0]) + len(at))     # in order: views, no copy
            rows = StoredRows(*(None if a is None else a[at]     # type: ignore[arg-type]
                                for a in chains.rows[layer]))
            write_rows(holdings, layer, slots, rows, chains.storage)
    except BaseException:
        holdings.chains.undo()
        raise

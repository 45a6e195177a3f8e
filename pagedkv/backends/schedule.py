"""Work lists for paged attention, shared by the backends.

A work item (its columns are defined once, in ``opencl/pkv_work_item.h``;
``ITEM`` below names them) is query rows ``ROW0:ROW1`` of one sequence, for the
query heads of one KV head (or head group), against that sequence's keys at
positions ``KEY0:KEY1``; row ``ROW0 + i`` sees the keys in
``[BAND_LO + i, BAND_HI + i)``.  The band is where the attention variant
lives: causal attention is ``[-inf, p + 1)`` for the row at position ``p``,
a sliding window of ``W`` keys ``[p - W + 1, p + 1)``; an attention chunk of
``C`` (``BAND_CHUNK``) raises each row's lower end to ``C * floor(p / C)``
(``opencl/pkv_variant.h``).  The kernels apply the band and know no other
mask.

Rows are cut into blocks of ``rows_per_block``.  A block's keys are the
union of its rows' bands, so a window never reads pages older than its
oldest row can see.  When the batch has too few blocks to fill the device
(decode of a few long sequences), a block's key range is split into
page-aligned parts (split-K), and a merge combines the parts: such items
carry their partial-result slot in ``PART`` (else -1).  Items of one (block,
kv head) are contiguous, and ``item_offsets`` marks them.

A :class:`KeyCut` narrows the keys of each sequence further: shared-prefix
(cascade) attention (:mod:`pagedkv.cascade`) reads a shared run of keys in
one call (``keep``) and the rest of each sequence's keys in another (not
``keep``); the kernels see only the items' key ranges.
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Tuple

import numpy as np
import numpy.typing as npt

from pagedkv.backends.kernel_source import work_item_fields

if TYPE_CHECKING:   # annotations only: importing it here would be circular
    from pagedkv.attention_spec import Band

#: The work-item columns, e.g. ``ITEM.KEY0``; ``ITEM.COUNT`` is their count.
ITEM = work_item_fields()


@dataclass(frozen=True, eq=False)
class KeyCut:
    """Key positions ``lo[b]:hi[b]`` of each sequence ``b`` of a step: the only
    keys its rows read (``keep``), or keys they skip (not ``keep``).

    Attributes
    ----------
    lo, hi : ndarray, shape [B], int64
    keep : bool
    """
    lo: np.ndarray
    hi: np.ndarray
    keep: bool


def plan_attention(query_start: npt.ArrayLike, seq_lens: npt.ArrayLike, *, num_kv_heads: int,
                   page_size: int, rows_per_block: int, target_items: int,
                   min_part_tokens: int, heads_per_item: int = 1,
                   band: "Optional[Band]" = None,
                   max_part_keys: Optional[Callable[[np.ndarray], npt.ArrayLike]] = None,
                   max_parts: Optional[Callable[[np.ndarray], npt.ArrayLike]] = None,
                   key_cut: Optional[KeyCut] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Plan the work items of one step.

    Parameters
    ----------
    query_start : ndarray, shape [B+1], int32
    seq_lens : ndarray, shape [B], int32
    rows_per_block : int
        Query rows per item.
    target_items : int
        Split key ranges until about this many items exist.
    min_part_tokens : int
        Never split a key range into parts shorter than this.
    heads_per_item : int, default 1
        KV heads per item (a divisor of ``num_kv_heads``): an item's
        ``KV_HEAD`` is then the first of ``heads_per_item`` heads.
    band : pagedkv.attention_spec.Band, optional
        Which positions each row sees besides causality: with
        ``band.sliding_window = W``, the row at position ``p`` sees positions
        ``max(0, p - W + 1) .. p``, with ``band.chunk_size = C`` none before
        ``C * floor(p / C)``; default (None): all of ``0 .. p``.
    max_part_keys : callable, optional
        ``max_part_keys(rows)``: for an array of block row counts, the most
        keys one item of such a block may cover; longer key ranges are split
        (even when the device is full), so that an item's work is bounded
        whatever the context length.  Default: no bound.
    max_parts : callable, optional
        ``max_parts(rows)``: the most parts a merge may combine; a key range
        that would need more gets longer parts instead.  Default: no bound.
    key_cut : KeyCut, optional
        Narrow each sequence's keys further (every row of a sequence sees all
        of a kept or skipped range, which the caller ensures).

    Returns
    -------
    items : ndarray, shape [num_items, ITEM.COUNT], int32
    item_offsets : ndarray, shape [num_blocks * num_kv_heads / heads_per_item + 1], int32
        Items ``item_offsets[m]:item_offsets[m+1]`` belong to (query block, head) ``m``.
    """
    query_start = np.asarray(query_start, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    num_rows = np.diff(query_start)
    blocks_per_seq = -(-num_rows // rows_per_block)
    seq = np.repeat(np.arange(len(seq_lens)), blocks_per_seq)
    first_block = np.repeat(np.cumsum(blocks_per_seq) - blocks_per_seq, blocks_per_seq)
    row0 = query_start[seq] + (np.arange(len(seq)) - first_block) * rows_per_block
    row1 = np.minimum(row0 + rows_per_block, query_start[seq + 1])
    rows = row1 - row0
    # positions: a step's rows are its sequence's newest tokens
    first_pos = seq_lens[seq] - (query_start[seq + 1] - row0)
    key_end = first_pos + rows                   # one past the last row's position
    band_hi = first_pos + 1
    sliding_window = None if band is None else band.sliding_window
    chunk = None if band is None else band.chunk_size
    if sliding_window is None:
        band_lo = -rows                          # below every key of every row: no bound
    else:
        band_lo = np.maximum(first_pos - sliding_window + 1, -rows)
    # a block's first row sees the earliest keys
    key_begin = np.zeros_like(first_pos) if band is None else band.first_visible(first_pos)
    inner_skip = None
    if key_cut is not None:
        cut_lo, cut_hi = key_cut.lo[seq], key_cut.hi[seq]
        if key_cut.keep:
            key_begin = np.maximum(key_begin, cut_lo)
            key_end = np.maximum(np.minimum(key_end, cut_hi), key_begin)
        else:
            # a skipped range at the start (or end) of a block's keys narrows
            # them; one inside them is cut out of its items below
            at_start = (cut_lo <= key_begin) & (cut_hi > key_begin)
            key_begin = np.where(at_start, np.minimum(cut_hi, key_end), key_begin)
            at_end = ~at_start & (cut_lo < key_end) & (cut_hi >= key_end)
            key_end = np.where(at_end, np.maximum(cut_lo, key_begin), key_end)
            inside = ~at_start & ~at_end & (cut_lo < cut_hi) & (cut_lo > key_begin) & \
                (cut_hi < key_end)
            if inside.any():
                inner_skip = (np.where(inside, cut_lo, 0), np.where(inside, cut_hi, 0))

    num_head_groups = num_kv_heads // heads_per_item
    num_blocks = len(seq) * num_head_groups
    span = key_end - key_begin
    parts = np.ones(len(seq), dtype=np.int64)
    if 0 < num_blocks < target_items:
        wanted = -(-target_items // num_blocks)
        parts = np.clip(span // max(min_part_tokens, 1), 1, wanted)
    part_len = -(-span // parts)
    part_len = -(-part_len // page_size) * page_size
    if max_part_keys is not None:
        cap = np.maximum(np.asarray(max_part_keys(rows), dtype=np.int64), 1)
        cap = np.where(cap >= page_size, cap // page_size * page_size, cap)  # whole pages if it can
        if max_parts is not None:
            # one part fewer than the merge takes: the count below may add one
            # (and an inner skip another)
            spare = 1 if inner_skip is None else 2
            most = np.maximum(np.asarray(max_parts(rows), dtype=np.int64) - spare, 1)
            cap = np.maximum(cap, -(-span // most))
        part_len = np.minimum(part_len, cap)
    part_len = np.maximum(part_len, 1)
    # parts start on page boundaries, counted from the page of the first key
    base = key_begin // page_size * page_size
    parts = -(-(key_end - base) // part_len)

    # expand: block -> kv head -> part, so the parts of one (block, head) are adjacent
    per_block = parts * num_head_groups
    blk = np.repeat(np.arange(len(seq)), per_block)
    within = np.arange(len(blk)) - np.repeat(np.cumsum(per_block) - per_block, per_block)
    head = within // parts[blk]
    part = within % parts[blk]
    items = np.empty((len(blk), ITEM.COUNT), dtype=np.int32)
    items[:, ITEM.SEQ] = seq[blk]
    items[:, ITEM.KV_HEAD] = head * heads_per_item
    items[:, ITEM.ROW0] = row0[blk]
    items[:, ITEM.ROW1] = row1[blk]
    items[:, ITEM.KEY0] = np.maximum(base[blk] + part * part_len[blk], key_begin[blk])
    items[:, ITEM.KEY1] = np.minimum(base[blk] + (part + 1) * part_len[blk], key_end[blk])
    items[:, ITEM.BAND_LO] = band_lo[blk]
    items[:, ITEM.BAND_HI] = band_hi[blk]
    items[:, ITEM.BAND_CHUNK] = 0 if chunk is None else chunk
    counts = np.repeat(parts, num_head_groups)
    if inner_skip is not None:
        items, counts = _cut_out(items, counts, inner_skip[0][blk], inner_skip[1][blk])
    in_split = np.repeat(counts > 1, counts)
    items[:, ITEM.PART] = -1
    items[in_split, ITEM.PART] = np.arange(int(in_split.sum()), dtype=np.int32)
    item_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return items, item_offsets


def _cut_out(items: np.ndarray, counts: np.ndarray, skip_lo: np.ndarray,
             skip_hi: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Items without the keys ``skip_lo[i]:skip_hi[i]`` (per item), and the new
    item count of each (block, head): an item around the range becomes two,
    one inside it none.  A block keeps at least one item (its rows' own
    tokens lie outside every skipped range)."""
    key0, key1 = items[:, ITEM.KEY0].astype(np.int64), items[:, ITEM.KEY1].astype(np.int64)
    left_end = np.minimum(key1, skip_lo)
    right_start = np.maximum(key0, skip_hi)
    has_left = (left_end > key0) | (skip_lo >= skip_hi)
    has_right = (right_start < key1) & (skip_lo < skip_hi)
    pieces = has_left.astype(np.int64) + has_right
    out = np.repeat(items, pieces, axis=0)
    first = np.cumsum(pieces) - pieces        # each item's first piece
    left_at = first[has_left]
    out[left_at, ITEM.KEY1] = np.where(skip_lo < skip_hi, left_end, key1)[has_left]
    right_at = first[has_right] + has_left[has_right]
    out[right_at, ITEM.KEY0] = right_start[has_right]
    block = np.repeat(np.arange(len(counts)), counts)
    return out, np.bincount(block, weights=pieces, minlength=len(counts)).astype(np.int64)

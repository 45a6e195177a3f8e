"""Work lists for paged attention, shared by the backends.

A work item is ``(seq, kv_head, row0, row1, key0, key1)``: query rows
``row0:row1`` (absolute rows of ``q``, all of one sequence) against that
sequence's keys at positions ``key0:key1``, for every query head of KV head
``kv_head``.  Rows are cut into blocks of ``rows_per_block``; when the batch
has too few blocks to fill the device (decode of a few long sequences), each
block's key range is split into page-aligned parts (split-K), and a merge
combines the parts.  Items of one (block, kv head) are contiguous, and
``item_offsets`` marks them.
"""
import numpy as np

ITEM_FIELDS = 6


def plan_attention(query_start, seq_lens, *, num_kv_heads, page_size, rows_per_block,
                   target_items, min_part_tokens, heads_per_item=1):
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
        ``kv_head`` field is then the first of ``heads_per_item`` heads.

    Returns
    -------
    items : ndarray, shape [W, 6], int32
    item_offsets : ndarray, shape [M+1], int32
        Items ``item_offsets[m]:item_offsets[m+1]`` belong to query block ``m``.
    """
    query_start = np.asarray(query_start, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    num_rows = np.diff(query_start)
    blocks_per_seq = -(-num_rows // rows_per_block)
    seq = np.repeat(np.arange(len(seq_lens)), blocks_per_seq)
    first_block = np.repeat(np.cumsum(blocks_per_seq) - blocks_per_seq, blocks_per_seq)
    row0 = query_start[seq] + (np.arange(len(seq)) - first_block) * rows_per_block
    row1 = np.minimum(row0 + rows_per_block, query_start[seq + 1])
    # keys up to and including the position of the block's last row
    key_end = seq_lens[seq] - (query_start[seq + 1] - row1)

    num_head_groups = num_kv_heads // heads_per_item
    num_blocks = len(seq) * num_head_groups
    parts = np.ones(len(seq), dtype=np.int64)
    if 0 < num_blocks < target_items:
        wanted = -(-target_items // num_blocks)
        parts = np.clip(key_end // max(min_part_tokens, 1), 1, wanted)
    part_len = -(-key_end // parts)
    part_len = -(-part_len // page_size) * page_size
    parts = -(-key_end // part_len)

    # expand: block -> kv head -> part, so the parts of one (block, head) are adjacent
    per_block = parts * num_head_groups
    blk = np.repeat(np.arange(len(seq)), per_block)
    within = np.arange(len(blk)) - np.repeat(np.cumsum(per_block) - per_block, per_block)
    head = within // parts[blk]
    part = within % parts[blk]
    items = np.empty((len(blk), ITEM_FIELDS), dtype=np.int32)
    items[:, 0] = seq[blk]
    items[:, 1] = head * heads_per_item
    items[:, 2] = row0[blk]
    items[:, 3] = row1[blk]
    items[:, 4] = part * part_len[blk]
    items[:, 5] = np.minimum((part + 1) * part_len[blk], key_end[blk])
    item_offsets = np.concatenate(
        [[0], np.cumsum(np.repeat(parts, num_head_groups))]).astype(np.int32)
    return items, item_offsets

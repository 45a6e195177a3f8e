"""The step tables ``append`` builds, against an independent computation from page lists."""
import numpy as np
import pytest

import pagedkv


def expected_tables(cache, seq_ids, counts):
    """Slot mapping, CSR and block table from each sequence's page list."""
    ps = cache.page_size
    slots, indices, indptr, last, query_start, lens = [], [], [0], [], [0], []
    for s, n in zip(seq_ids, counts):
        pages = cache.page_ids(s)
        length = cache.seq_len(s)
        slots += [int(pages[p // ps]) * ps + p % ps for p in range(length - n, length)]
        indices += list(pages)
        indptr.append(len(indices))
        last.append(length - (len(pages) - 1) * ps)
        query_start.append(query_start[-1] + n)
        lens.append(length)
    width = max((len(cache.page_ids(s)) for s in seq_ids), default=0)
    table = np.full((len(seq_ids), width), -1)
    for b, s in enumerate(seq_ids):
        table[b, :len(cache.page_ids(s))] = cache.page_ids(s)
    return slots, indices, indptr, last, query_start, lens, table


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_step_tables(page_size):
    cache = pagedkv.PagedKVCache(1, 1, 4, num_pages=64, page_size=page_size, backend="host")
    seqs = [cache.add_sequence() for _ in range(3)]
    for counts in ([3, 17, 1], [1, 1, 1], [0, 4, 9]):
        batch = cache.append(seqs, counts)
        slots, indices, indptr, last, qs, lens, table = expected_tables(cache, seqs, counts)
        assert batch.slot_mapping.dtype == np.int64 and list(batch.slot_mapping) == slots
        for name in ("page_indices", "page_indptr", "last_page_len", "query_start",
                     "seq_lens", "block_table"):
            assert getattr(batch, name).dtype == np.int32, name
        assert list(batch.page_indices) == indices
        assert list(batch.page_indptr) == indptr
        assert list(batch.last_page_len) == last
        assert list(batch.query_start) == qs
        assert list(batch.seq_lens) == lens
        np.testing.assert_array_equal(batch.block_table, table)
        assert list(batch.seq_ids) == seqs
    # slots of live tokens never collide
    all_slots = np.concatenate([
        [int(cache.page_ids(s)[p // page_size]) * page_size + p % page_size
         for p in range(cache.seq_len(s))] for s in seqs])
    assert len(np.unique(all_slots)) == len(all_slots)


def test_seed_page_accounting():
    cache = pagedkv.PagedKVCache(1, 1, 4, num_pages=8, page_size=16, backend="host")
    s = cache.add_sequence()
    assert cache.page_count(s) == 0 and cache.token_capacity(s) == 0
    cache.append([s], 17)
    assert cache.page_count(s) == 2 and cache.token_capacity(s) == 32
    assert cache.num_free_pages == 6
    cache.free(s)
    assert cache.num_free_pages == 8


def test_ids_are_never_reused():
    cache = pagedkv.PagedKVCache(1, 1, 4, num_pages=8, backend="host")
    a = cache.add_sequence()
    cache.free(a)
    b = cache.add_sequence()
    assert b != a
    with pytest.raises(pagedkv.UnknownSequenceError):
        cache.seq_len(a)


def test_shared_page_written_by_all_holders_copies_only_as_needed():
    cache = pagedkv.PagedKVCache(1, 1, 4, num_pages=8, page_size=4, backend="host")
    a = cache.add_sequence()
    cache.append([a], 2)
    b = cache.fork(a)
    batch = cache.append([a, b], 1)          # one copy; the last writer keeps the page
    assert cache.num_free_pages == 6
    assert len({int(cache.page_ids(a)[0]), int(cache.page_ids(b)[0])}) == 2
    assert batch.slot_mapping[0] // 4 != batch.slot_mapping[1] // 4


@pytest.mark.parametrize("as_given", [
    list, tuple, np.array,
    lambda ids: [np.int64(i) for i in ids],
    lambda ids: [int(i) for i in ids[:1]] + [np.int32(i) for i in ids[1:]],   # mixed
])
def test_append_takes_ids_and_counts_in_any_int_form(as_given):
    # plain-int lists take a C path, the rest numpy's: the tables must not differ
    def tables(convert):
        cache = pagedkv.PagedKVCache(1, 1, 8, num_pages=16, page_size=4, backend="host")
        seqs = [cache.add_sequence() for _ in range(3)]
        batch = cache.append(convert(seqs), convert([5, 1, 7]))
        return batch.slot_mapping.tolist(), batch.page_indptr.tolist(), batch.seq_ids.tolist()
    assert tables(as_given) == tables(list)

"""The pools as data (pagedkv/pools.py): specs, keep_from, and each layer's manager."""
import itertools

import numpy as np
import pytest

import pagedkv
from pagedkv._allocator import PageAllocator
from pagedkv._page_table import PageTables
from pagedkv._pool import Pool
from pagedkv.pools import (FULL, SLIDING_WINDOW, FullAttentionManager, PoolNames, PoolSpec,
                           SlidingWindowManager, page_tables_of, pool_specs)


def first_needed(old_len, new_len, window, rollback):
    """Brute force: the earliest position any query from the step on can see; a
    query at ``q`` sees ``q - window + 1 .. q``, and after a rollback of up to
    ``rollback`` tokens the queries start at ``new_len - rollback``."""
    first_query = max(0, min(old_len, new_len - rollback))
    return min(max(0, q - window + 1) for q in range(first_query, new_len + 1))


@pytest.mark.parametrize("window, rollback", [(1, 1), (3, 1), (4, 2), (16, 5)])
def test_keep_from_is_the_first_position_a_later_query_sees(window, rollback):
    specs = (PoolSpec("full", 8, (0,)), PoolSpec("window", 8, (1,), SLIDING_WINDOW, window,
                                                 rollback))
    _, (_, manager) = page_tables_of(specs, [PageAllocator(8, 4), PageAllocator(8, 4)])
    for old_len, added in itertools.product(range(0, 40), range(0, 6)):
        assert manager.keep_from(old_len, old_len + added) == \
            first_needed(old_len, old_len + added, window, rollback)


def test_full_attention_keeps_everything():
    spec = PoolSpec("full", 8, (0, 1))
    assert spec.attention == FULL and spec.window is None
    _, (manager,) = page_tables_of((spec,), [PageAllocator(8, 4)])
    assert all(manager.keep_from(a, a + b) == 0 for a in range(20) for b in range(3))


def test_any_number_of_pools():
    """The page tables hold as many pools as they are given: three here (one full,
    two windowed with their own spans), each sequence a page list in each."""
    names = PoolNames("pages", "", "the pool")
    pools = [Pool(PageAllocator(16, 4), 0, 0, 1, names),
             Pool(PageAllocator(6, 4), 1, 3, 1, names),
             Pool(PageAllocator(9, 4), 2, 8, 2, names)]
    tables = PageTables(pools)
    s = tables.add()
    step = tables.append(np.array([s]), np.array([14]))
    assert len(step.pools) == 3
    assert [len(tables.pages(s, p)) for p in range(3)] == [4, 4, 4]
    step = tables.append(np.array([s]), np.array([6]))       # 20 tokens: 5 pages each
    # span 3, rollback 1: keep from min(14, 19) - 2 = 12 (page 3); span 8, rollback 2:
    # from min(14, 18) - 7 = 7 (page 1)
    assert [tables.held_from(s, p) for p in range(3)] == [0, 12, 4]
    assert [tables.held_pages(s, p) for p in range(3)] == [5, 2, 4]
    assert tables.pages(s, 1).tolist()[:3] == [-1, -1, -1]
    assert step.pools[1].block_table[0, :3].tolist() == [-1, -1, -1]
    assert pools[1].allocator.num_free == 4 and pools[2].allocator.num_free == 5
    tables.undo_append()
    assert [tables.held_pages(s, p) for p in range(3)] == [4, 4, 4]
    with pytest.raises(ValueError, match="pool: expected an index of the 3 pools, got 3"):
        tables.pages(s, 3)


@pytest.mark.parametrize("pools, match", [
    ([], "pools"),
    ([Pool(PageAllocator(4, 4), 0, 2, 1, PoolNames("p", "", "q"))], "the first keeping"),
    ([Pool(PageAllocator(4, 4), 1, 0, 1, PoolNames("p", "", "q"))], "indexed 0, 1"),
    ([Pool(PageAllocator(4, 4), 0, 0, 1, PoolNames("p", "", "q")),
      Pool(PageAllocator(4, 2), 1, 0, 1, PoolNames("p", "", "q"))], "one page size"),
])
def test_page_tables_refuse_pools_they_cannot_hold(pools, match):
    with pytest.raises(ValueError, match=match):
        PageTables(pools)


def test_pool_specs_split_the_layers_by_attention_type():
    pools = pool_specs([None, 4, None, 8], num_pages=10, num_window_pages=6, rollback=2)
    assert pools == (PoolSpec("full", 10, (0, 2)),
                     PoolSpec("window", 6, (1, 3), SLIDING_WINDOW, 8, 2))
    assert pool_specs([None, None], 10, 6, 1) == (PoolSpec("full", 10, (0, 1)),)
    with pytest.raises(AttributeError):
        pools[0].num_pages = 3          # frozen


def test_each_layer_gets_its_pools_manager():
    cache = pagedkv.PagedKVCache(3, 1, 8, num_pages=8, page_size=4, backend="host",
                                 layer_windows=[None, 5, None], num_window_pages=4)
    full, window = cache._pools
    assert isinstance(full, FullAttentionManager) and isinstance(window, SlidingWindowManager)
    assert cache._layer_pool == (full, window, full)
    assert (full.spec.num_pages, window.spec.num_pages, window.spec.window) == (8, 4, 5)
    s = cache.add_sequence()
    cache.append([s], 12)
    assert full.held_from(s) == 0
    assert window.held_from(s) == cache._tables.held_from(s, 1)
    assert full.slots(s, 0, 12).tolist() == cache._tables.slots(s, 0, 12).tolist()

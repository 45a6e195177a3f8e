"""The pools as data (pagedkv/pools.py): specs, keep_from, and each layer's manager."""
import itertools

import pytest

import pagedkv
from pagedkv.pools import (FULL, SLIDING_WINDOW, FullAttentionManager, PoolSpec,
                           SlidingWindowManager, pool_specs)


def first_needed(old_len, new_len, window, rollback):
    """Brute force: the earliest position any query from the step on can see; a
    query at ``q`` sees ``q - window + 1 .. q``, and after a rollback of up to
    ``rollback`` tokens the queries start at ``new_len - rollback``."""
    first_query = max(0, min(old_len, new_len - rollback))
    return min(max(0, q - window + 1) for q in range(first_query, new_len + 1))


@pytest.mark.parametrize("window, rollback", [(1, 1), (3, 1), (4, 2), (16, 5)])
def test_keep_from_is_the_first_position_a_later_query_sees(window, rollback):
    spec = PoolSpec("window", 8, (0,), SLIDING_WINDOW, window, rollback)
    for old_len, added in itertools.product(range(0, 40), range(0, 6)):
        assert spec.keep_from(old_len, old_len + added) == \
            first_needed(old_len, old_len + added, window, rollback)


def test_full_attention_keeps_everything():
    spec = PoolSpec("full", 8, (0, 1))
    assert spec.attention == FULL and spec.window is None
    assert all(spec.keep_from(a, a + b) == 0 for a in range(20) for b in range(3))
    assert spec.sees_from(100) == 0


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
    assert window.held_from(s) == cache._tables.window_held_from(s)
    assert full.slots(s, 0, 12).tolist() == cache._tables.slots(s, 0, 12).tolist()

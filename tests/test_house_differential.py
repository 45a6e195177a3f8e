"""The page tables over pool specs against the page tables before them.

``tests/data/house_trace.json`` holds the digests of 6,000 random operations
(60 streams of 100 over six cache shapes: one pool or two, prefix caching on and
off, rollback margins, pools tight enough to run out) recorded on commit
27f6e6a, the last before the page tables were rebuilt over any number of
pools.  Each operation's result or error, the step tables of every pool,
every sequence's pages, every pool's free queue in order, every page's
reference count and prefix-cache flag, the counters and the final K/V must
be the same today (see ``house_trace.py``; its ``__main__`` re-records).
"""
import json
import os

import pytest

import house_trace

RECORDED = os.path.join(os.path.dirname(__file__), "data", "house_trace.json")


with open(RECORDED) as _f:
    EXPECTED = json.load(_f)


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_a_random_stream_does_what_it_did_before_the_rebuild(key):
    got = house_trace.outcome_strings(key)
    digests = [house_trace.digest(o) for o in got]
    for i, (want, have) in enumerate(zip(EXPECTED[key], digests)):
        assert want == have, f"stream {key}, operation {i}: {got[i][:2000]}"
    assert len(digests) == len(EXPECTED[key])

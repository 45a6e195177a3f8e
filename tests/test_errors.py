"""Bad input: every public call raises its specific exception, names the argument,
and changes nothing.  On every backend."""
import os
import tempfile

import numpy as np
import pytest

import pagedkv

H, D = 2, 8


@pytest.fixture
def setup(backend):
    cache = pagedkv.PagedKVCache(2, H, D, num_pages=8, page_size=4, backend=backend,
                                 max_seq_len=20)
    s = cache.add_sequence()
    batch = cache.append([s], 3)
    ones = np.ones((3, H, D), np.float32)
    cache.store(0, batch, ones, ones)
    return cache, s, batch


def snapshot(cache):
    return cache.num_free_pages, {s: (cache.seq_len(s), list(cache.page_ids(s)))
                                  for s in cache.seq_ids()}


def kv(n=3, h=H, d=D, dtype=np.float32):
    return np.zeros((n, h, d), dtype)


def exported(n=3, h=H):
    """A SequenceKV of ``n`` tokens from a host cache with ``h`` KV heads."""
    cache = pagedkv.PagedKVCache(2, h, D, num_pages=16, page_size=4, backend="host")
    s = cache.add_sequence()
    batch = cache.append([s], n)
    for layer in range(2):
        cache.store(layer, batch, kv(n, h), kv(n, h))
    return cache.export_sequence(s)


NEVER_WRITTEN = os.path.join(tempfile.gettempdir(), "pagedkv-test-never-written.safetensors")

BAD_CALLS = [
    # (description, call(cache, s, batch), exception, message fragment)
    ("unknown seq", lambda c, s, b: c.seq_len(99), pagedkv.UnknownSequenceError, "99"),
    ("seq id str", lambda c, s, b: c.fork("0"), pagedkv.UnknownSequenceError, "seq_id"),
    ("free unknown", lambda c, s, b: c.free(-5), KeyError, "-5"),
    ("truncate too long", lambda c, s, b: c.truncate(s, 4), ValueError, "new_len"),
    ("truncate negative", lambda c, s, b: c.truncate(s, -1), ValueError, "new_len"),
    ("truncate float", lambda c, s, b: c.truncate(s, 1.5), TypeError, "new_len"),
    ("restore junk", lambda c, s, b: c.restore((s, 1)), TypeError, "checkpoint"),
    ("append twice", lambda c, s, b: c.append([s, s], 1), ValueError, "more than once"),
    ("append unknown", lambda c, s, b: c.append([s, 42], 1), KeyError, "42"),
    ("append negative", lambda c, s, b: c.append([s], -1), ValueError, "num_new_tokens"),
    ("append count length", lambda c, s, b: c.append([s], [1, 2]), ValueError, "expected 1 entries"),
    ("append float ids", lambda c, s, b: c.append([0.5], 1), TypeError, "seq_ids"),
    ("append 2-D ids", lambda c, s, b: c.append([[s]], 1), ValueError, "seq_ids"),
    # lists of plain ints take a C path: anything else in one goes the general way
    ("append bool id after ints", lambda c, s, b: c.append([s, True], 1), TypeError, "bool"),
    ("append float count after ints", lambda c, s, b: c.append([s], [1.0]), TypeError,
     "num_new_tokens"),
    ("append id past int64", lambda c, s, b: c.append([s, 2 ** 64], 1), TypeError, "seq_ids"),
    ("append negative count", lambda c, s, b: c.append([s], -1), ValueError, "num_new_tokens"),
    ("append count past int64", lambda c, s, b: c.append([s], 2 ** 64), TypeError,
     "num_new_tokens"),
    ("append past max_seq_len", lambda c, s, b: c.append([s], 18), ValueError, "max_seq_len=20"),
    ("out of pages", lambda c, s, b: c.append([c.add_sequence(), s], [16, 14]),
     pagedkv.OutOfPagesError, "needs 8 new pages, 7 of 8 free"),
    ("huge seq id", lambda c, s, b: c.seq_len(2**70), KeyError, "no live sequence"),
    ("bool seq id", lambda c, s, b: c.seq_len(True), KeyError, "seq_id"),
    ("store layer range", lambda c, s, b: c.store(2, b, kv(), kv()), ValueError, "layer"),
    ("store layer bool", lambda c, s, b: c.store(True, b, kv(), kv()), TypeError, "layer"),
    ("store k rows", lambda c, s, b: c.store(0, b, kv(4), kv()), ValueError, "k: expected shape [3, 2, 8], got [4, 2, 8]"),
    ("store v heads", lambda c, s, b: c.store(0, b, kv(), kv(h=3)), ValueError, "v: expected shape"),
    ("store k int", lambda c, s, b: c.store(0, b, kv(dtype=np.int32), kv()), TypeError, "float dtype"),
    ("store k float128", lambda c, s, b: c.store(0, b, kv(dtype=np.longdouble), kv()), TypeError,
     "k: expected a float dtype (float16, bfloat16, float32 or float64)"),
    ("store k list", lambda c, s, b: c.store(0, b, [[1.0]], kv()), TypeError, "k: expected"),
    ("store bad batch", lambda c, s, b: c.store(0, "batch", kv(), kv()), TypeError, "batch"),
    ("attention heads", lambda c, s, b: c.attention(0, b, kv(h=3)), ValueError, "multiple of num_kv_heads=2"),
    ("attention dim", lambda c, s, b: c.attention(0, b, kv(h=4, d=7)), ValueError, "q: expected shape"),
    ("attention q float128", lambda c, s, b: c.attention(0, b, kv(h=4, dtype=np.longdouble)),
     TypeError, "q: expected a float dtype"),
    ("attention sinks float128",
     lambda c, s, b: c.attention(0, b, kv(h=4), sinks=np.zeros(4, np.longdouble)), TypeError,
     "sinks: expected float16, float32, float64 or int values"),
    ("attention scale", lambda c, s, b: c.attention(0, b, kv(h=4), scale=-1.0), ValueError, "scale"),
    ("attention scale nan", lambda c, s, b: c.attention(0, b, kv(h=4), scale=float("nan")), ValueError, "scale"),
    ("attention not stored", lambda c, s, b: c.attention(1, b, kv(h=4)), ValueError, "not stored"),
    ("gather layer", lambda c, s, b: c.gather(-1, s), ValueError, "layer"),
    ("gather unknown", lambda c, s, b: c.gather(0, 7), KeyError, "7"),
    ("read_token pos", lambda c, s, b: c.read_token(0, s, 3), ValueError, "pos"),
    ("refcount page", lambda c, s, b: c.refcount(8), ValueError, "page_id"),
    ("export unknown", lambda c, s, b: c.export_sequence(99), KeyError, "99"),
    ("import junk", lambda c, s, b: c.import_sequence({"keys": ()}), TypeError,
     "kv: expected a pagedkv.SequenceKV"),
    ("import other heads", lambda c, s, b: c.import_sequence(exported(h=1)), ValueError,
     "kv.num_kv_heads: this cache has num_kv_heads=2, the sequence's K/V 1"),
    ("import past max_seq_len", lambda c, s, b: c.import_sequence(exported(21)), ValueError,
     "max_seq_len=20"),
    ("swap_out unknown", lambda c, s, b: c.swap_out(42), KeyError, "42"),
    ("swap_in not swapped", lambda c, s, b: c.swap_in(s), ValueError, "not swapped out"),
    ("is_swapped unknown", lambda c, s, b: c.is_swapped(7), KeyError, "7"),
    ("save path type", lambda c, s, b: c.save(3.5), TypeError, "path: expected a str"),
    ("save unknown seq", lambda c, s, b: c.save(NEVER_WRITTEN, [s, 99]), KeyError, "99"),
    ("save seq twice", lambda c, s, b: c.save(NEVER_WRITTEN, [s, s]), ValueError, "distinct"),
    ("save float seq ids", lambda c, s, b: c.save(NEVER_WRITTEN, [0.5]), TypeError, "seq_ids"),
    ("save into no folder", lambda c, s, b: c.save("/nonexistent-folder/kv.safetensors"),
     OSError, "nonexistent-folder"),
    ("load missing", lambda c, s, b: c.load(NEVER_WRITTEN), ValueError, "no such file"),
    ("load path type", lambda c, s, b: c.load(None), TypeError, "path: expected a str"),
]


@pytest.mark.parametrize("desc,call,exc,fragment", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input(setup, desc, call, exc, fragment):
    cache, s, batch = setup
    before = snapshot(cache)
    with pytest.raises(exc) as info:
        call(cache, s, batch)
    assert fragment in str(info.value)
    if desc != "out of pages":                # that one adds a sequence before it fails
        assert snapshot(cache) == before


def test_every_type_error_is_also_a_value_error(setup):
    cache, s, batch = setup
    with pytest.raises(ValueError):
        cache.store(0, batch, [[1.0]], kv())


def test_stale_batch(setup):
    cache, s, batch = setup
    cache.append([s], 1)
    with pytest.raises(ValueError, match="stale"):
        cache.store(0, batch, kv(), kv())
    other = pagedkv.PagedKVCache(2, H, D, num_pages=8, page_size=4, backend=cache.backend)
    with pytest.raises(TypeError, match="this cache"):
        other.store(0, batch, kv(), kv())


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(num_layers=0), "num_layers"),
    (dict(num_kv_heads=-1), "num_kv_heads"),
    (dict(head_dim=2.0), "head_dim"),
    (dict(num_pages=0), "num_pages"),
    (dict(page_size=0), "page_size"),
    (dict(dtype="float8"), "dtype"),
    (dict(dtype="int4"), "dtype"),
    (dict(dtype="uint8"), "dtype"),
    (dict(max_seq_len=0), "max_seq_len"),
    (dict(backend="cuda"), "backend"),
    (dict(backend=3), "backend"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
    (dict(prefix_hash=42), "prefix_hash"),
])
def test_bad_constructor_arguments(kwargs, fragment):
    args = dict(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=4)
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        pagedkv.PagedKVCache(args.pop("num_layers"), args.pop("num_kv_heads"),
                             args.pop("head_dim"), **args)
    assert fragment in str(info.value)


def test_host_backend_takes_no_device():
    with pytest.raises(ValueError, match="device"):
        pagedkv.PagedKVCache(1, 1, 8, num_pages=4, backend="host", device="0:0")


def test_env_override_of_auto(monkeypatch):
    monkeypatch.setenv("PAGEDKV_BACKEND", "host")
    assert pagedkv.PagedKVCache(1, 1, 8, num_pages=4).backend == "host"
    monkeypatch.setenv("PAGEDKV_BACKEND", "tpu")
    with pytest.raises(ValueError, match="backend"):
        pagedkv.PagedKVCache(1, 1, 8, num_pages=4)

"""``v_head_dim`` in the separate layout: V rows of their own width (narrower than
K's, as DeepSeek's non-absorbed heads: keys 192 wide, values 128; or wider),
against the dense float64 NumPy reference on every backend and storage dtype."""
import numpy as np
import pytest

import pagedkv
from pagedkv.cascade import CascadePolicy
from reference import TOLERANCE, dense_attention, round_to_storage

NUM_KV_HEADS, NUM_HEADS = 2, 8          # GQA: four query heads per KV head
DTYPES = ["float32", "float16", "bfloat16", "int8"]
# (head_dim, v_head_dim): DeepSeek's non-absorbed heads, and values wider than keys
WIDTHS = [(192, 128), (64, 96)]
# int8 keeps about 1% of a row's norm: what it kept is checked against what was stored
INT8_ROW_ERROR = 0.02


class Separate:
    """A cache of V rows of their own width beside the dense rows it should hold."""

    def __init__(self, backend, dtype="float32", widths=WIDTHS[0], num_layers=2,
                 page_size=16, num_pages=64, **kwargs):
        self.head_dim, self.v_head_dim = widths
        self.cache = pagedkv.PagedKVCache(num_layers, NUM_KV_HEADS, self.head_dim,
                                          num_pages=num_pages, page_size=page_size, dtype=dtype,
                                          backend=backend, v_head_dim=self.v_head_dim, **kwargs)
        self.dtype = dtype
        self.rows = {}          # seq_id -> per layer, ([L, H, D], [L, H, Dv]) float32
        self.rng = np.random.default_rng(0)

    def add(self, token_ids=None):
        s = self.cache.add_sequence(token_ids)
        self.rows[s] = [(np.zeros((0, NUM_KV_HEADS, self.head_dim), np.float32),
                         np.zeros((0, NUM_KV_HEADS, self.v_head_dim), np.float32))
                        ] * self.cache.num_layers
        return s

    def fork(self, parent):
        child = self.cache.fork(parent)
        self.rows[child] = list(self.rows[parent])
        return child

    def kept(self, layer, batch, k, v):
        """What the cache keeps of ``k``, ``v``: the storage's rounding, or (int8)
        what it gathers back, checked to be within int8's error of them."""
        if self.dtype != "int8":
            return round_to_storage(k, self.dtype), round_to_storage(v, self.dtype)
        got = [self.cache.gather(layer, s, self.cache.seq_len(s) - n)
               for s, n in zip(batch.seq_ids, np.diff(batch.query_start))]
        out = []
        for i, want in enumerate((k, v)):
            rows = np.concatenate([g[i] for g in got])
            err = np.linalg.norm(rows - want, axis=-1) / np.linalg.norm(want, axis=-1)
            assert err.max() < INT8_ROW_ERROR
            out.append(rows)
        return tuple(out)

    def step(self, seq_ids, counts, token_ids=None, check=True, **variant):
        """One step of ``counts`` new tokens per sequence in every layer, checked
        (``check=False``: stored only, as a long prompt's keys for later steps)."""
        c = self.cache
        counts = [int(n) for n in np.broadcast_to(counts, (len(seq_ids),))]
        batch = c.append(seq_ids, counts, token_ids=token_ids)
        total = sum(counts)
        for layer in range(c.num_layers):
            k = self.rng.standard_normal((total, NUM_KV_HEADS, self.head_dim)).astype(np.float32)
            v = self.rng.standard_normal((total, NUM_KV_HEADS, self.v_head_dim)).astype(
                np.float32)
            q = self.rng.standard_normal((total, NUM_HEADS, self.head_dim)).astype(np.float32)
            c.store(layer, batch, k, v)
            kept_k, kept_v = self.kept(layer, batch, k, v)
            if not check:
                for s, n, at in zip(seq_ids, counts, batch.query_start):
                    old_k, old_v = self.rows[s][layer]
                    self.rows[s][layer] = (np.concatenate([old_k, kept_k[at:at + n]]),
                                           np.concatenate([old_v, kept_v[at:at + n]]))
                continue
            out = c.attention(layer, batch, q, **variant)
            assert out.shape == (total, NUM_HEADS, self.v_head_dim)
            at = 0
            for s, n in zip(seq_ids, counts):
                old_k, old_v = self.rows[s][layer]
                keys = np.concatenate([old_k, kept_k[at:at + n]])
                values = np.concatenate([old_v, kept_v[at:at + n]])
                self.rows[s][layer] = (keys, values)
                positions = np.arange(len(keys) - n, len(keys))
                want = dense_attention(q[at:at + n], keys, values, positions, **variant)
                np.testing.assert_allclose(out[at:at + n], want, **TOLERANCE[self.dtype])
                at += n
        return batch

    def check_gather(self):
        for s, layers in self.rows.items():
            for layer, (keys, values) in enumerate(layers):
                k, v = self.cache.gather(layer, s)
                np.testing.assert_allclose(k, keys, **TOLERANCE[self.dtype])
                np.testing.assert_allclose(v, values, **TOLERANCE[self.dtype])
                pos = len(keys) - 1
                k1, v1 = self.cache.read_token(layer, s, pos)
                np.testing.assert_array_equal(k1, k[pos])
                np.testing.assert_array_equal(v1, v[pos])


def position_bytes(dtype, head_dim, v_head_dim):
    """Bytes a token keeps per KV head and layer: both rows, and (int8) their scales."""
    return (head_dim + v_head_dim) * np.dtype(dtype).itemsize + (8 if dtype == "int8" else 0)


@pytest.mark.parametrize("widths", WIDTHS, ids=["192-128", "64-96"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_prefill_then_decode_and_memory(backend, dtype, widths):
    t = Separate(backend, dtype, widths)
    seqs = [t.add() for _ in range(3)]
    t.step(seqs, [37, 5, 1])
    for _ in range(2):
        t.step(seqs, 1)
    t.check_gather()
    assert t.cache.memory_bytes == 2 * 64 * 16 * NUM_KV_HEADS * position_bytes(
        t.cache.dtype, *widths)     # layers x slots x heads x both rows


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_split_k_long_decode(backend, dtype):
    t = Separate(backend, dtype, num_layers=1, page_size=32, num_pages=160)
    a, b = t.add(), t.add()
    t.step([a, b], [2500, 30], check=False)
    t.step([a, b], 1)      # one long sequence's keys over several work items, merged
    t.step([a], 1)


def test_variants_and_windows(backend):
    t = Separate(backend, widths=WIDTHS[1])
    seqs = [t.add() for _ in range(2)]
    t.step(seqs, [40, 9], logits_soft_cap=30.0, sinks=np.linspace(-1, 1, NUM_HEADS))
    t.step(seqs, 1, sliding_window=20, alibi_slopes=np.linspace(0.01, 0.1, NUM_HEADS))
    t.step(seqs, [3, 2], attention_chunk_size=16)


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_fork_prefix_hits_and_cascade(backend, dtype):
    t = Separate(backend, dtype, enable_prefix_caching=True)
    t.cache._backend.cascade_policy = CascadePolicy(min_run_bytes=0, min_shared_keys=1)
    prompt = list(range(40))
    a = t.add(prompt)
    t.step([a], 40, token_ids=prompt)
    b = t.add(prompt)                       # a prefix hit: two full pages
    assert t.cache.seq_len(b) == 32
    t.rows[b] = [(k[:32], v[:32]) for k, v in t.rows[a]]
    c = t.fork(a)
    t.step([c], 1)                          # copy-on-write of the shared last page
    batch = t.step([a, b, c], [1, 8, 2])    # three sequences over shared pages
    assert batch.sharing.num_groups >= 1
    t.check_gather()


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_export_import_swap_save_and_load(backend, dtype, tmp_path):
    t = Separate(backend, dtype, enable_prefix_caching=True)
    prompt = list(range(20))
    a = t.add(prompt)
    t.step([a], 20, token_ids=prompt)
    kv = t.cache.export_sequence(a)
    assert kv.v_head_dim == 128 and kv.values[0].shape == (20, NUM_KV_HEADS, 128)
    assert kv.nbytes == 2 * 20 * NUM_KV_HEADS * position_bytes(t.cache.dtype, 192, 128)
    b = t.cache.import_sequence(kv)
    t.rows[b] = list(t.rows[a])
    t.cache.swap_out(a)
    t.cache.swap_in(a)
    t.step([a, b], [1, 2])
    t.check_gather()
    path = tmp_path / "v_head_dim.safetensors"
    t.cache.save(path)
    other = Separate(backend, dtype, enable_prefix_caching=True)
    ids = other.cache.load(path)
    for old, new in zip([a, b], ids):
        for layer in range(2):
            for got, want in zip(other.cache.gather(layer, new), t.cache.gather(layer, old)):
                np.testing.assert_array_equal(got, want)
    other.rows.update({new: t.rows[old] for old, new in zip([a, b], ids)})
    other.step(ids, 1)
    # a cache of another v_head_dim (or of V as wide as K) refuses them by name
    for v_head_dim in (96, None):
        narrower = pagedkv.PagedKVCache(2, NUM_KV_HEADS, 192, num_pages=64, dtype=dtype,
                                        backend=backend, v_head_dim=v_head_dim)
        with pytest.raises(ValueError, match="v_head_dim"):
            narrower.import_sequence(kv)
        with pytest.raises(ValueError, match="v_head_dim"):
            narrower.load(path)
        assert narrower.seq_ids() == [] and narrower.num_free_pages == 64


def test_bad_arguments_name_themselves_and_change_nothing(backend):
    for v_head_dim, error in [(0, ValueError), (-3, ValueError), (1.5, TypeError),
                              (True, TypeError)]:
        with pytest.raises(error, match="v_head_dim"):
            pagedkv.PagedKVCache(1, NUM_KV_HEADS, 64, num_pages=4, backend=backend,
                                 v_head_dim=v_head_dim)
    t = Separate(backend, widths=WIDTHS[1])
    a = t.add()
    batch = t.cache.append([a], 4)
    k = np.ones((4, NUM_KV_HEADS, 64), np.float32)
    v = np.ones((4, NUM_KV_HEADS, 96), np.float32)
    for bad in (k, None, v[..., :95]):
        with pytest.raises(ValueError, match="v"):
            t.cache.store(0, batch, k, bad)
    with pytest.raises(ValueError, match="k"):
        t.cache.store(0, batch, v, v)
    # nothing was stored
    with pytest.raises(ValueError, match="were not stored"):
        t.cache.attention(0, batch, np.ones((4, NUM_HEADS, 64), np.float32))
    t.cache.store(0, batch, k, v)
    with pytest.raises(ValueError, match="q"):
        t.cache.attention(0, batch, np.ones((4, NUM_HEADS, 96), np.float32))
    # a hand-made SequenceKV whose values are not v_head_dim wide
    t.cache.store(1, batch, k, v)
    kv = t.cache.export_sequence(a)
    from dataclasses import replace
    bad = replace(kv, values=tuple(x[..., :64] for x in kv.values))
    with pytest.raises(ValueError, match="values"):
        t.cache.import_sequence(bad)


def test_odd_widths_and_torch(backend):
    import torch
    t = Separate(backend, "int8", widths=(40, 24))   # int8 rotates by blocks of 8
    assert t.cache.storage.rotation_block == 8
    a = t.add()
    t.step([a], 21)
    t.step([a], 1)
    batch = t.cache.append([a], 1)
    q = torch.randn(1, NUM_HEADS, 40)
    for layer in range(2):
        t.cache.store(layer, batch, torch.randn(1, NUM_KV_HEADS, 40),
                      torch.randn(1, NUM_KV_HEADS, 24))
        out = t.cache.attention(layer, batch, q)
        assert isinstance(out, torch.Tensor) and out.shape == (1, NUM_HEADS, 24)
        k, v = t.cache.gather(layer, a)
        want = dense_attention(q.numpy(), k, v, [len(k) - 1])
        np.testing.assert_allclose(out.numpy(), want, **TOLERANCE["int8"])

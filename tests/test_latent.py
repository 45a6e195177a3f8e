"""``kv_layout="latent"`` (multi-head latent attention, DeepSeek V2/V3): one row of
``head_dim`` values per token, whose first ``v_head_dim`` columns are the values,
against the dense float64 NumPy reference on every backend and storage dtype."""
import numpy as np
import pytest

import pagedkv
from pagedkv.cascade import CascadePolicy
from reference import TOLERANCE, dense_attention, round_to_storage

HEAD_DIM, V_HEAD_DIM, NUM_HEADS = 576, 512, 16     # DeepSeek-V2-Lite's shape
SCALE = 0.1352      # the models pass their own scale (192 ** -0.5 with yarn's mscale)
DTYPES = ["float32", "float16", "bfloat16", "int8"]
# int8 keeps about 1% of a row's norm: what it kept is checked against what was stored
INT8_ROW_ERROR = 0.02


class Latent:
    """A latent cache beside the dense rows it should hold (what its storage keeps)."""

    def __init__(self, backend, dtype="float32", num_layers=2, page_size=16, num_pages=64,
                 **kwargs):
        self.cache = pagedkv.PagedKVCache(num_layers, 1, HEAD_DIM, num_pages=num_pages,
                                          page_size=page_size, dtype=dtype, backend=backend,
                                          kv_layout="latent", v_head_dim=V_HEAD_DIM, **kwargs)
        self.dtype = dtype
        self.rows = {}          # seq_id -> per layer, [L, 1, HEAD_DIM] float32
        self.rng = np.random.default_rng(0)

    def add(self, token_ids=None):
        s = self.cache.add_sequence(token_ids)
        self.rows[s] = [np.zeros((0, 1, HEAD_DIM), np.float32)] * self.cache.num_layers
        return s

    def fork(self, parent):
        child = self.cache.fork(parent)
        self.rows[child] = list(self.rows[parent])
        return child

    def truncate(self, s, new_len):
        self.cache.truncate(s, new_len)
        self.rows[s] = [r[:new_len] for r in self.rows[s]]

    def kept(self, layer, batch, k):
        """What the cache keeps of ``k``: the storage's rounding, or (int8) what it
        gathers back, checked to be within int8's error of ``k``."""
        if self.dtype != "int8":
            return round_to_storage(k, self.dtype)
        got = np.concatenate([self.cache.gather(layer, s, self.cache.seq_len(s) - n)[0]
                              for s, n in zip(batch.seq_ids, np.diff(batch.query_start))])
        err = np.linalg.norm(got - k, axis=-1) / np.linalg.norm(k, axis=-1)
        assert err.max() < INT8_ROW_ERROR
        return got

    def step(self, seq_ids, counts, token_ids=None, **variant):
        """One step of ``counts`` new tokens per sequence in every layer, checked."""
        c = self.cache
        counts = [int(n) for n in np.broadcast_to(counts, (len(seq_ids),))]
        batch = c.append(seq_ids, counts, token_ids=token_ids)
        total = sum(counts)
        for layer in range(c.num_layers):
            k = self.rng.standard_normal((total, 1, HEAD_DIM)).astype(np.float32)
            q = self.rng.standard_normal((total, NUM_HEADS, HEAD_DIM)).astype(np.float32)
            c.store(layer, batch, k)
            kept = self.kept(layer, batch, k)
            out = c.attention(layer, batch, q, scale=SCALE, **variant)
            assert out.shape == (total, NUM_HEADS, V_HEAD_DIM)
            at = 0
            for s, n in zip(seq_ids, counts):
                self.rows[s][layer] = np.concatenate([self.rows[s][layer], kept[at:at + n]])
                rows = self.rows[s][layer]
                positions = np.arange(len(rows) - n, len(rows))
                windows = [w for w in (variant.get("sliding_window"), c.layer_windows[layer])
                           if w is not None]
                seen = dict(variant, sliding_window=min(windows) if windows else None)
                want = dense_attention(q[at:at + n], rows, rows[..., :V_HEAD_DIM], positions,
                                       scale=SCALE, **seen)
                np.testing.assert_allclose(out[at:at + n], want, **TOLERANCE[self.dtype])
                at += n
        return batch

    def check_gather(self):
        for s, layers in self.rows.items():
            for layer, rows in enumerate(layers):
                k, v = self.cache.gather(layer, s)
                np.testing.assert_allclose(k, rows, **TOLERANCE[self.dtype])
                assert v.shape == (len(rows), 1, V_HEAD_DIM)
                np.testing.assert_array_equal(v, k[..., :V_HEAD_DIM])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_prefill_then_decode_and_memory(backend, dtype):
    t = Latent(backend, dtype)
    seqs = [t.add() for _ in range(3)]
    t.step(seqs, [37, 5, 1])
    for _ in range(2):
        t.step(seqs, 1)
    t.check_gather()
    row_bytes = HEAD_DIM * np.dtype(t.cache.dtype).itemsize + (4 if dtype == "int8" else 0)
    assert t.cache.memory_bytes == 2 * 64 * 16 * row_bytes   # layers x slots x one row


def test_variants_and_windows(backend):
    t = Latent(backend, layer_windows=[None, 24])
    seqs = [t.add() for _ in range(2)]
    t.step(seqs, [40, 9], logits_soft_cap=30.0, sinks=np.linspace(-1, 1, NUM_HEADS))
    t.step(seqs, 1, sliding_window=20, alibi_slopes=np.linspace(0.01, 0.1, NUM_HEADS))
    t.step(seqs, [3, 2], attention_chunk_size=16)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_fork_rollback_prefix_hits_and_cascade(backend, dtype):
    t = Latent(backend, dtype, enable_prefix_caching=True)
    t.cache._backend.cascade_policy = CascadePolicy(min_run_bytes=0, min_shared_keys=1)
    prompt = list(range(40))
    a = t.add(prompt)
    t.step([a], 40, token_ids=prompt)
    b = t.add(prompt)                       # a prefix hit: two full pages
    assert t.cache.seq_len(b) == 32
    t.rows[b] = [r[:32] for r in t.rows[a]]
    c = t.fork(a)
    batch = t.step([a, b, c], [1, 8, 2])    # three sequences over shared pages
    assert batch.sharing.num_groups >= 1
    checkpoint = t.cache.checkpoint(c)
    t.step([c], 3)
    t.cache.restore(checkpoint)
    t.rows[c] = [r[:42] for r in t.rows[c]]
    t.truncate(a, 35)
    t.step([a, c], [2, 1])
    t.check_gather()


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_export_import_swap_save_and_load(backend, dtype, tmp_path):
    t = Latent(backend, dtype, enable_prefix_caching=True)
    prompt = list(range(20))
    a = t.add(prompt)
    t.step([a], 20, token_ids=prompt)
    kv = t.cache.export_sequence(a)
    assert kv.kv_layout == "latent" and kv.v_head_dim == V_HEAD_DIM and kv.values is None
    assert kv.nbytes == 2 * 20 * (HEAD_DIM * np.dtype(t.cache.dtype).itemsize
                                  + (4 if dtype == "int8" else 0))
    b = t.cache.import_sequence(kv)
    t.rows[b] = list(t.rows[a])
    t.cache.swap_out(a)
    t.cache.swap_in(a)
    t.step([a, b], [1, 2])
    t.check_gather()
    path = tmp_path / "latent.safetensors"
    t.cache.save(path)
    other = Latent(backend, dtype, enable_prefix_caching=True)
    ids = other.cache.load(path)
    for old, new in zip([a, b], ids):
        for layer in range(2):
            np.testing.assert_array_equal(other.cache.gather(layer, new)[0],
                                          t.cache.gather(layer, old)[0])
    # a prompt the loaded prefix cache holds
    hit = other.cache.add_sequence(prompt + [7])
    assert other.cache.seq_len(hit) == 16


def test_other_layouts_are_refused_by_name(backend, tmp_path):
    t = Latent(backend)
    a = t.add()
    t.step([a], 10)
    kv = t.cache.export_sequence(a)
    path = tmp_path / "latent.safetensors"
    t.cache.save(path)
    separate = pagedkv.PagedKVCache(2, 1, HEAD_DIM, num_pages=64, backend=backend)
    narrower = pagedkv.PagedKVCache(2, 1, HEAD_DIM, num_pages=64, backend=backend,
                                    kv_layout="latent", v_head_dim=448)
    for cache, field in [(separate, "kv_layout"), (narrower, "v_head_dim")]:
        with pytest.raises(ValueError, match=field):
            cache.import_sequence(kv)
        with pytest.raises(ValueError, match=field):
            cache.load(path)
        assert cache.seq_ids() == [] and cache.num_free_pages == 64
    # and a separate sequence does not go into the latent cache
    s = separate.add_sequence()
    batch = separate.append([s], 3)
    for layer in range(2):
        separate.store(layer, batch, *np.ones((2, 3, 1, HEAD_DIM), np.float32))
    with pytest.raises(ValueError, match="kv_layout"):
        t.cache.import_sequence(separate.export_sequence(s))


def test_bad_arguments_name_themselves_and_change_nothing(backend):
    make = pagedkv.PagedKVCache
    for kwargs, name in [(dict(kv_layout="mla"), "kv_layout"),
                         (dict(kv_layout="latent", num_kv_heads=2), "num_kv_heads"),
                         (dict(kv_layout="latent", v_head_dim=0), "v_head_dim"),
                         (dict(kv_layout="latent", v_head_dim=HEAD_DIM + 1), "v_head_dim"),
                         (dict(kv_layout="latent", v_head_dim=1.5), "v_head_dim"),
                         (dict(v_head_dim=0), "v_head_dim")]:
        args = dict(num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM, num_pages=4,
                    backend=backend)
        args.update(kwargs)
        with pytest.raises((ValueError, TypeError), match=name):
            make(**args)
    t = Latent(backend)
    a = t.add()
    batch = t.cache.append([a], 4)
    k = np.ones((4, 1, HEAD_DIM), np.float32)
    with pytest.raises(ValueError, match="v"):
        t.cache.store(0, batch, k, k[..., :V_HEAD_DIM])
    with pytest.raises(ValueError, match="k"):
        t.cache.store(0, batch, k[..., :V_HEAD_DIM])
    # nothing was stored
    with pytest.raises(ValueError, match="were not stored"):
        t.cache.attention(0, batch, np.ones((4, NUM_HEADS, HEAD_DIM), np.float32))
    t.cache.store(0, batch, k)
    with pytest.raises(ValueError, match="q"):
        t.cache.attention(0, batch, np.ones((4, NUM_HEADS, V_HEAD_DIM), np.float32))
    separate = make(1, 1, 64, num_pages=4, backend=backend)
    s = separate.add_sequence()
    sbatch = separate.append([s], 2)
    with pytest.raises(ValueError, match="v: expected"):
        separate.store(0, sbatch, np.ones((2, 1, 64), np.float32))
    with pytest.raises(ValueError, match="were not stored"):
        separate.attention(0, sbatch, np.ones((2, 1, 64), np.float32))


def test_import_converts_between_dtypes_and_torch_tensors_go_through(backend):
    import torch
    source = Latent(backend, "float16")
    a = source.add()
    source.step([a], 21)
    target = Latent(backend, "int8")
    b = target.cache.import_sequence(source.cache.export_sequence(a))
    for layer in range(2):
        want = source.cache.gather(layer, a)[0]
        got = target.cache.gather(layer, b)[0]
        err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
        assert err.max() < INT8_ROW_ERROR
    target.rows[b] = [target.cache.gather(layer, b)[0] for layer in range(2)]
    target.step([b], 2)
    # torch tensors in, a torch tensor of v_head_dim columns out
    batch = target.cache.append([b], 1)
    k = torch.randn(1, 1, HEAD_DIM)
    q = torch.randn(1, NUM_HEADS, HEAD_DIM)
    for layer in range(2):
        target.cache.store(layer, batch, k)
        out = target.cache.attention(layer, batch, q, scale=SCALE)
        assert isinstance(out, torch.Tensor) and out.shape == (1, NUM_HEADS, V_HEAD_DIM)
        rows = target.cache.gather(layer, b)[0]
        want = dense_attention(q.numpy(), rows, rows[..., :V_HEAD_DIM], [len(rows) - 1],
                               scale=SCALE)
        np.testing.assert_allclose(out.numpy(), want, **TOLERANCE["int8"])

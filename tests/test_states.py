"""Recurrent layers (``layer_states``): the state pool and the two built-in recurrences
through the cache, against the float64 NumPy reference (``recurrent_reference``), on
every backend: ragged steps, 0-token rows, long prefills (the chunked form), fork,
rollback, prefix snapshots and their eviction, transfer, files, bad input."""
import numpy as np
import pytest

import pagedkv
from pagedkv import kv_file
from recurrent_reference import conv_sequence, delta_rule_sequence

C, K = 6, 4                         # conv channels and kernel
HK, HV, DK, DV = 2, 4, 8, 8         # delta rule: k-heads, v-heads (GQA 2), widths
NUM_KV_HEADS, HEAD_DIM = 2, 8
TOL = dict(rtol=2e-4, atol=2e-4)
SPEC = pagedkv.StateSpec([(C, K - 1), (HV, DK, DV)])


class Hybrid:
    """A cache of [attention, recurrent, attention] layers and, per sequence, every
    input its recurrent layer got: the reference runs the whole history again."""

    def __init__(self, backend, **kwargs):
        kwargs.setdefault("num_pages", 64)
        kwargs.setdefault("page_size", 4)
        self.cache = pagedkv.PagedKVCache(3, NUM_KV_HEADS, HEAD_DIM, backend=backend,
                                          layer_states=[None, SPEC, None], **kwargs)
        self.rng = np.random.default_rng(0)
        self.weight = self.rng.standard_normal((C, K)).astype(np.float32)
        self.bias = self.rng.standard_normal(C).astype(np.float32)
        self.inputs = {}        # seq_id -> list of per-token input tuples
        self.tokens = {}        # seq_id -> token ids

    def add(self, token_ids=None):
        s = self.cache.add_sequence(token_ids)
        n = self.cache.seq_len(s)
        self.tokens[s] = list(token_ids[:n]) if token_ids is not None else []
        self.inputs[s] = None if n else []      # a prefix hit: set by the caller
        return s

    def fork(self, parent):
        child = self.cache.fork(parent)
        self.inputs[child] = list(self.inputs[parent])
        self.tokens[child] = list(self.tokens[parent])
        return child

    def truncate(self, s, new_len):
        self.cache.truncate(s, new_len)
        del self.inputs[s][new_len:]
        del self.tokens[s][new_len:]

    def new_rows(self, n):
        r = self.rng
        return [(r.standard_normal(C), r.standard_normal((HK, DK)), r.standard_normal((HK, DK)),
                 r.standard_normal((HV, DV)), -r.random(HV), r.random(HV)) for _ in range(n)]

    def expected(self, rows):
        """The reference outputs of every row of a history, and its final states."""
        if not rows:
            return (np.zeros((0, C)), np.zeros((0, HV, DV)), np.zeros((C, K - 1)),
                    np.zeros((HV, DK, DV)))
        x, q, k, v, g, beta = (np.array(a) for a in zip(*rows))
        y, conv_states = conv_sequence(np.zeros((C, K - 1)), x, self.weight, self.bias, True)
        o, states = delta_rule_sequence(np.zeros((HV, DK, DV)), q, k, v, g, beta, DK ** -0.5,
                                        True)
        return y, o, conv_states[-1], states[-1]

    def step(self, seq_ids, counts, with_tokens=False):
        """One step through all three layers; checks outputs and states."""
        rows = {s: self.new_rows(n) for s, n in zip(seq_ids, counts)}
        tokens = None
        if with_tokens:
            new = {s: self.rng.integers(0, 5, n).tolist() for s, n in zip(seq_ids, counts)}
            tokens = [t for s in seq_ids for t in new[s]]
        batch = self.cache.append(seq_ids, counts, tokens)
        if with_tokens:
            for s in seq_ids:
                self.tokens[s] += new[s]
        flat = [r for s in seq_ids for r in rows[s]]
        total = len(flat)
        for layer in (0, 2):
            kv = self.rng.standard_normal((total, NUM_KV_HEADS, HEAD_DIM))
            self.cache.store(layer, batch, kv, kv)
        x, q, k, v, g, beta = (np.array([r[i] for r in flat]).reshape((total,) + shape)
                               for i, shape in enumerate([(C,), (HK, DK), (HK, DK), (HV, DV),
                                                          (HV,), (HV,)]))
        y = self.cache.causal_conv1d(1, batch, x, self.weight, self.bias, activation="silu")
        o = self.cache.gated_delta_rule(1, batch, q, k, v, g, beta, qk_l2norm=True)
        at = 0
        for s, n in zip(seq_ids, counts):
            self.inputs[s] += rows[s]
            want_y, want_o, conv_state, delta_state = self.expected(self.inputs[s])
            np.testing.assert_allclose(y[at:at + n], want_y[len(want_y) - n:], **TOL)
            np.testing.assert_allclose(o[at:at + n], want_o[len(want_o) - n:], **TOL)
            self.check_state(s)
            at += n
        return batch

    def check_state(self, s):
        _, _, conv_state, delta_state = self.expected(self.inputs[s])
        got = self.cache.read_state(1, s)
        np.testing.assert_allclose(got[0], conv_state, **TOL)
        np.testing.assert_allclose(got[1], delta_state, **TOL)


def test_ragged_steps_match_the_reference(backend):
    h = Hybrid(backend)
    a, b, c = h.add(), h.add(), h.add()
    h.step([a, b, c], [5, 0, 3])
    h.step([a, b, c], [1, 1, 1])
    h.step([c, a, b], [0, 7, 2])
    h.step([a, b], [70, 1])         # a long run: the chunked form
    h.step([b, a, c], [1, 1, 1])
    assert h.cache.memory_bytes > 0 and h.cache.num_state_slots == 4


def test_a_prefill_split_anywhere_equals_one_step(backend):
    h = Hybrid(backend)
    a = h.add()
    for n in (3, 1, 66, 2, 9):
        h.step([a], [n])


def test_a_new_sequence_reads_zeros_and_rows_without_tokens_keep_their_state(backend):
    h = Hybrid(backend)
    a, b = h.add(), h.add()
    for array, shape in zip(h.cache.read_state(1, a), SPEC.shapes):
        assert array.shape == shape and not array.any()
    h.step([a], [4])
    before = h.cache.read_state(1, a)
    batch = h.step([a, b], [0, 3])
    assert all(np.array_equal(x, y) for x, y in zip(before, h.cache.read_state(1, a)))
    states = h.cache.stats()
    assert states["num_used_state_slots"] == 2
    assert batch.num_tokens == 3


def test_fork_shares_the_state_and_copies_on_write(backend):
    h = Hybrid(backend, num_state_slots=4)
    a = h.add()
    h.step([a], [6])
    b = h.fork(a)
    assert h.cache.stats()["num_shared_state_slots"] == 1
    h.step([b], [2])                # b writes its own slot; a keeps its state
    h.check_state(a)
    h.step([a, b], [1, 1])
    assert h.cache.stats()["num_shared_state_slots"] == 0


def test_rollback_restores_the_state_after_each_of_the_last_tokens(backend):
    h = Hybrid(backend, state_rollback_tokens=3, num_state_slots=12)
    a = h.add()
    h.step([a], [5])
    checkpoint = h.cache.checkpoint(a)
    h.step([a], [4])                # four draft tokens: states after 6, 7, 8 and 9 kept
    h.truncate(a, 7)
    h.check_state(a)
    h.step([a], [2])
    h.truncate(a, 8)
    h.check_state(a)
    with pytest.raises(ValueError, match="state_rollback_tokens=3"):
        h.cache.truncate(a, 3)
    assert h.cache.seq_len(a) == 8  # nothing changed
    h.check_state(a)
    with pytest.raises(ValueError, match="new_len"):
        h.cache.restore(checkpoint)     # 5 is beyond the rollback states kept
    h.truncate(a, 0)
    h.check_state(a)
    h.step([a], [3])


def test_after_write_states_only_a_steps_end_can_be_restored(backend):
    h = Hybrid(backend, state_rollback_tokens=4, num_state_slots=12)
    a = h.add()
    h.step([a], [3])
    batch = h.cache.append([a], [3])
    for layer in (0, 2):
        kv = np.zeros((3, NUM_KV_HEADS, HEAD_DIM))
        h.cache.store(layer, batch, kv, kv)
    conv_state, delta_state = h.cache.read_states(1, batch)
    assert conv_state.shape == (1, C, K - 1) and delta_state.shape == (1, HV, DK, DV)
    h.check_state(a)
    h.cache.write_states(1, batch, (conv_state + 1, delta_state * 2))
    with pytest.raises(ValueError, match="already advanced"):
        h.cache.write_states(1, batch, (conv_state, delta_state))
    with pytest.raises(ValueError, match="new_len"):
        h.cache.truncate(a, 4)      # inside the written step
    h.cache.truncate(a, 3)          # the last step's start (a step's end)
    h.check_state(a)


def test_out_of_state_slots_names_the_pool_and_changes_nothing(backend):
    h = Hybrid(backend, num_state_slots=2)
    a, b, c = h.add(), h.add(), h.add()
    h.step([a, b], [2, 2])
    pages = h.cache.num_free_pages
    with pytest.raises(pagedkv.OutOfPagesError, match="num_state_slots"):
        h.cache.append([a, c], [1, 1])
    assert h.cache.seq_len(a) == 2 and h.cache.seq_len(c) == 0
    assert h.cache.num_free_pages == pages
    h.step([a, b], [1, 1])          # the cache still works
    h.cache.free(b)
    h.step([c], [3])


def test_prefix_snapshots_give_hits_and_are_evicted_lru(backend):
    h = Hybrid(backend, enable_prefix_caching=True, state_snapshot_interval=8,
               num_state_slots=4)
    a = h.add()
    h.step([a], [11], with_tokens=True)
    h.step([a], [6], with_tokens=True)   # snapshots at 8 and 16
    prompt = h.tokens[a] + [1, 2]
    b = h.add(prompt)
    assert h.cache.seq_len(b) == 16     # the longest cached prefix with a snapshot
    h.inputs[b] = h.inputs[a][:16]
    h.check_state(b)
    h.step([b], [3], with_tokens=True)
    assert h.cache.stats()["prefix_hit_rate"] > 0
    # a prompt whose snapshot is not there: the hit is cut back to one that is
    h.cache.free(a)
    h.cache.free(b)
    stats = h.cache.stats()
    assert stats["num_cached_state_slots"] >= 2
    # new sequences need the slots: the snapshots go, least recently used first
    seqs = [h.add() for _ in range(4)]
    h.step(seqs, [1] * 4)
    assert h.cache.stats()["num_state_evictions"] >= 2
    for s in seqs:
        h.cache.free(s)
    c = h.add(prompt)
    assert h.cache.seq_len(c) == 0      # pages are cached, but no snapshot is left


def test_a_snapshot_inside_a_step_waits_for_every_array(backend):
    h = Hybrid(backend, enable_prefix_caching=True, state_snapshot_interval=4)
    a = h.add()
    tokens = list(range(9))
    batch = h.cache.append([a], [9], tokens)
    for layer in (0, 2):
        kv = np.zeros((9, NUM_KV_HEADS, HEAD_DIM))
        h.cache.store(layer, batch, kv, kv)
    h.cache.causal_conv1d(1, batch, np.ones((9, C)), h.weight)     # the delta rule never ran
    b = h.cache.add_sequence(tokens + [0])
    assert h.cache.seq_len(b) == 0


def test_export_import_swap_and_files_carry_the_states(backend, tmp_path):
    h = Hybrid(backend, enable_prefix_caching=True, state_snapshot_interval=8,
               num_state_slots=8)
    a = h.add()
    h.step([a], [19], with_tokens=True)
    kv = h.cache.export_sequence(a)
    assert kv.states[0] is None and kv.states[2] is None and len(kv.states[1]) == 2
    assert kv.layer_start[1] == kv.num_tokens
    b = h.cache.import_sequence(kv)
    h.inputs[b] = list(h.inputs[a])
    h.check_state(b)
    h.step([b], [2])
    h.cache.swap_out(a)
    assert h.cache.stats()["swapped_bytes"] >= kv.nbytes
    h.cache.swap_in(a)
    h.check_state(a)
    h.step([a], [1], with_tokens=True)
    path = tmp_path / "hybrid.safetensors"
    h.cache.save(path, [a])
    other = Hybrid(backend, enable_prefix_caching=True, state_snapshot_interval=8, page_size=8,
                   num_state_slots=8)
    (c,) = other.cache.load(path)
    other.inputs[c] = list(h.inputs[a])
    other.check_state(c)
    # the file's snapshots serve prompts in the new cache too
    d = other.add(h.tokens[a] + [3])
    assert other.cache.seq_len(d) == 16
    other.inputs[d] = h.inputs[a][:16]
    other.check_state(d)


def test_states_refuse_another_shape_and_a_file_without_states(backend, tmp_path):
    h = Hybrid(backend)
    a = h.add()
    h.step([a], [3])
    plain = pagedkv.PagedKVCache(3, NUM_KV_HEADS, HEAD_DIM, num_pages=16, page_size=4,
                                 backend=backend)
    with pytest.raises(ValueError, match=r"kv.states\[1\]"):
        plain.import_sequence(h.cache.export_sequence(a))
    s = plain.add_sequence()
    batch = plain.append([s], [2])
    for layer in range(3):
        plain.store(layer, batch, np.zeros((2, 2, 8)), np.zeros((2, 2, 8)))
    with pytest.raises(ValueError, match="no states"):
        h.cache.import_sequence(plain.export_sequence(s))
    plain.save(tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="layer_states"):
        h.cache.load(tmp_path / "plain.safetensors")


def test_a_file_from_before_recurrent_layers_still_loads(backend, tmp_path, monkeypatch):
    plain = pagedkv.PagedKVCache(2, NUM_KV_HEADS, HEAD_DIM, num_pages=16, page_size=4,
                                 backend=backend)
    s = plain.add_sequence()
    batch = plain.append([s], [5])
    k = np.arange(5 * 16, dtype=np.float32).reshape(5, 2, 8)
    for layer in range(2):
        plain.store(layer, batch, k, k)
    older = tuple(name for name in kv_file._CONFIGURATION if name != "layer_states")
    monkeypatch.setattr(kv_file, "_CONFIGURATION", older)
    plain.save(tmp_path / "old.safetensors")
    monkeypatch.undo()
    (t,) = plain.load(tmp_path / "old.safetensors")
    np.testing.assert_array_equal(plain.gather(1, t)[0], k)


def test_bad_arguments_name_themselves_and_change_nothing(backend):
    def make(**kwargs):
        return pagedkv.PagedKVCache(3, NUM_KV_HEADS, HEAD_DIM, num_pages=16, backend=backend,
                                    **kwargs)
    with pytest.raises(ValueError, match="layer_states: expected 3"):
        make(layer_states=[SPEC])
    with pytest.raises(TypeError, match=r"layer_states\[0\]"):
        make(layer_states=[(1, 2), None, None])
    with pytest.raises(ValueError, match=r"layer_states\[1\].*window"):
        make(layer_states=[None, SPEC, None], layer_windows=[None, 4, None])
    with pytest.raises(ValueError, match="num_state_slots"):
        make(layer_states=[None, SPEC, None], num_state_slots=0)
    with pytest.raises(ValueError, match="state_rollback_tokens"):
        make(layer_states=[None, SPEC, None], state_rollback_tokens=-1)
    with pytest.raises(ValueError, match="state_snapshot_interval"):
        make(layer_states=[None, SPEC, None], state_snapshot_interval=10)
    with pytest.raises(ValueError, match="shapes"):
        pagedkv.StateSpec([])
    with pytest.raises(ValueError, match="dtype"):
        pagedkv.StateSpec([(2, 2)], dtype="float16")
    with pytest.raises(TypeError, match=r"shapes\[0\]"):
        pagedkv.StateSpec([(2, -1)])

    h = Hybrid(backend)
    a = h.add()
    h.step([a], [3])
    before = h.cache.read_state(1, a)
    batch = h.cache.append([a], [2])
    x, w = np.zeros((2, C)), h.weight
    q, v, gb = np.zeros((2, HK, DK)), np.zeros((2, HV, DV)), np.zeros((2, HV))
    for call, match in [
            (lambda: h.cache.causal_conv1d(0, batch, x, w), "layer 0 is an attention layer"),
            (lambda: h.cache.causal_conv1d(1, batch, x, w, state=1), "state"),
            (lambda: h.cache.causal_conv1d(1, batch, x, w, state=2), "state"),
            (lambda: h.cache.causal_conv1d(1, batch, x[:1], w), "x: expected shape"),
            (lambda: h.cache.causal_conv1d(1, batch, x, w[:, :2]), "weight"),
            (lambda: h.cache.causal_conv1d(1, batch, x, w, bias=np.zeros(2)), "bias"),
            (lambda: h.cache.causal_conv1d(1, batch, x, w, activation="relu"), "activation"),
            (lambda: h.cache.gated_delta_rule(1, batch, q, q, v, gb, gb, state=0), "state"),
            (lambda: h.cache.gated_delta_rule(1, batch, np.zeros((2, 3, DK)), q, v, gb, gb),
             "q: expected num_k_heads"),
            (lambda: h.cache.gated_delta_rule(1, batch, q, q[:, :1], v, gb, gb), "k"),
            (lambda: h.cache.gated_delta_rule(1, batch, q, q, v, gb[:, :1], gb), "g"),
            (lambda: h.cache.gated_delta_rule(1, batch, q, q, v, gb, gb, scale=float("nan")),
             "scale"),
            (lambda: h.cache.gated_delta_rule(1, batch, q, q, v, gb, gb, qk_l2norm=1),
             "qk_l2norm"),
            (lambda: h.cache.read_states(2, batch), "layer 2 is an attention layer"),
            (lambda: h.cache.write_states(1, batch, (np.zeros((1, C, K - 1)),)), "states"),
            (lambda: h.cache.write_states(1, batch, (np.zeros((1, C, K)),
                                                     np.zeros((1, HV, DK, DV)))), "states"),
            (lambda: h.cache.read_state(0, a), "attention layer"),
            (lambda: h.cache.store(1, batch, np.zeros((2, 2, 8)), np.zeros((2, 2, 8))),
             "layer 1 is a recurrent layer"),
            (lambda: h.cache.attention(1, batch, np.zeros((2, 2, 8))), "recurrent layer"),
            (lambda: h.cache.gather(1, a), "recurrent layer")]:
        with pytest.raises(ValueError, match=match):
            call()
    after = h.cache.read_state(1, a)    # (the step's slot is a's own: nothing advanced)
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


def test_every_slot_comes_back(backend):
    h = Hybrid(backend, enable_prefix_caching=True, state_snapshot_interval=4,
               state_rollback_tokens=2, num_state_slots=24)
    a, b = h.add(), h.add()
    batch = h.cache.append([a, b], [9, 9], list(range(9)) * 2)   # one prompt twice
    for layer in (0, 2):
        kv = np.zeros((18, NUM_KV_HEADS, HEAD_DIM))
        h.cache.store(layer, batch, kv, kv)
    h.cache.write_states(1, batch, h.cache.read_states(1, batch))
    stats = h.cache.stats()
    assert stats["num_used_state_slots"] == 2 + 2 * 2       # their own and rollback states
    assert stats["num_cached_state_slots"] == 2             # snapshots at 4 and 8, once each
    c = h.fork(a)
    h.step([c, b], [3, 1])
    h.cache.swap_out(b)
    h.cache.truncate(c, 10)
    for s in (a, b, c):
        h.cache.free(s)
    h.cache.reset_prefix_cache()
    assert h.cache.num_free_state_slots == h.cache.num_state_slots == 24
    assert h.cache.stats()["num_used_state_slots"] == 0


def test_random_operations_keep_every_state(backend):
    """Random steps, forks, rollbacks, swaps, exports and frees against the model:
    each sequence's outputs and states follow the reference, and a rollback works
    exactly at the lengths the model says are kept."""
    rollback = 3
    h = Hybrid(backend, state_rollback_tokens=rollback, num_state_slots=64, num_pages=256)
    rng = np.random.default_rng(7)
    held = {}                   # seq_id -> lengths a truncate may go back to

    def add():
        s = h.add()
        held[s] = {0}
        return s
    for _ in range(3):
        add()
    for _ in range(60):
        live = [s for s in h.cache.seq_ids() if not h.cache.is_swapped(s)]
        op = rng.choice(["step", "step", "step", "fork", "truncate", "swap", "export", "free"])
        if op == "step" and live:
            chosen = [s for s in live if rng.random() < 0.7] or live[:1]
            counts = [int(rng.choice([0, 1, 1, 2, 4, 9, 67])) for _ in chosen]
            h.step(chosen, counts)
            for s, n in zip(chosen, counts):
                new = h.cache.seq_len(s)
                held[s] = {n_ for n_ in held[s] | set(range(new - n, new + 1))
                           if n_ >= new - rollback} | {0}
        elif op == "fork" and live:
            parent = int(rng.choice(live))
            held[h.fork(parent)] = set(held[parent])
        elif op == "truncate" and live:
            s = int(rng.choice(live))
            length = h.cache.seq_len(s)
            target = int(rng.integers(max(0, length - rollback - 2), length + 1))
            if target in held[s] or target == length:
                h.truncate(s, target)
                held[s] = {n for n in held[s] if n <= target}
                h.check_state(s)
            else:
                with pytest.raises(ValueError, match="new_len"):
                    h.cache.truncate(s, target)
                assert h.cache.seq_len(s) == length
        elif op == "swap" and live:
            s = int(rng.choice(live))
            h.cache.swap_out(s)
            h.cache.swap_in(s)
            held[s] = {0, h.cache.seq_len(s)}
            h.check_state(s)
        elif op == "export" and live:
            s = int(rng.choice(live))
            t = h.cache.import_sequence(h.cache.export_sequence(s))
            h.inputs[t], h.tokens[t] = list(h.inputs[s]), list(h.tokens[s])
            held[t] = {0, h.cache.seq_len(t)}
            h.check_state(t)
        elif op == "free" and len(live) > 1:
            s = int(rng.choice(live))
            h.cache.free(s)
            del held[s]
        if not h.cache.seq_ids():
            add()
    for s in h.cache.seq_ids():
        h.check_state(s)
        h.cache.free(s)
    assert h.cache.num_free_state_slots == 64

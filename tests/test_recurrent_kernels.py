"""The backends' recurrence kernels and state stores against the float64 reference.

Backend level: a backend (the ``backend`` fixture's, from a small cache), its
``state_store``, ``causal_conv1d`` and ``gated_delta_rule`` over ragged steps
(decode rows and prefill chunks of many sequences at once), with states in
slots, save rows, GQA, the options, and runs long enough for any chunked
path.  The oracle is ``recurrent_reference`` (float64, token by token).
"""
import importlib.resources
from types import SimpleNamespace

import numpy as np
import pytest

import pagedkv
import recurrent_reference as ref
from opencl_devices import TEST_DEVICES

NUM_SLOTS = 12


def make_backend(name):
    return pagedkv.PagedKVCache(1, 1, 8, num_pages=2, backend=name)._backend


def make_step(rows, slots, saves=()):
    """A step of sequences with ``rows[b]`` new rows in ``slots[b]``; ``saves``:
    (global row, save slot) pairs."""
    saves = sorted(saves)
    return SimpleNamespace(
        query_start=np.concatenate([[0], np.cumsum(rows)]).astype(np.int32),
        slots=np.asarray(slots, np.int32),
        save_rows=np.asarray([r for r, _ in saves], np.int32).reshape(-1),
        save_slots=np.asarray([s for _, s in saves], np.int32).reshape(-1))


def close(actual, expected, rtol=2e-4):
    """float32 results against the float64 reference: relative to the largest value."""
    expected = np.asarray(expected)
    atol = rtol * max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# -- gated delta rule ----------------------------------------------------------------------

class Delta:
    """One delta-rule layer (layer 1 of a store whose layer 0 is attention): random
    inputs, states in slots, and the reference's view of them."""

    def __init__(self, backend, Hk=2, Hv=4, dk=16, dv=40, l2norm=True, seed=0):
        self.rng = np.random.default_rng(seed)
        self.b = make_backend(backend)
        self.Hk, self.Hv, self.dk, self.dv, self.l2norm = Hk, Hv, dk, dv, l2norm
        self.shape = (Hv, dk, dv)
        # a conv array first, so that the delta rule's is index 1
        self.store = self.b.state_store([None, ((6, 3), self.shape)], NUM_SLOTS)
        self.scale = dk ** -0.5
        self.states = {}

    def seed_slots(self, slots):
        values = self.rng.normal(size=(len(slots),) + self.shape).astype(np.float32) * 0.3
        self.store.write(1, 1, np.asarray(slots, np.int32), values)
        self.states.update({s: values[i].astype(np.float64) for i, s in enumerate(slots)})

    def inputs(self, n):
        r = self.rng
        # without l2norm, keys of norm about 1 keep the recurrence stable (beta < 1)
        kscale = 1.0 if self.l2norm else self.dk ** -0.5
        q = r.normal(size=(n, self.Hk, self.dk)).astype(np.float32)
        k = (r.normal(size=(n, self.Hk, self.dk)) * kscale).astype(np.float32)
        v = r.normal(size=(n, self.Hv, self.dv)).astype(np.float32)
        g = -r.uniform(0.0, 0.7, size=(n, self.Hv)).astype(np.float32)
        beta = r.uniform(0.05, 0.95, size=(n, self.Hv)).astype(np.float32)
        return q, k, v, g, beta

    def run(self, step, inputs):
        return self.b.gated_delta_rule(self.store, 1, 1, step, *inputs, self.scale, self.l2norm)

    def expect(self, step, inputs):
        out, self.states = ref.delta_rule_step(step, self.states, *inputs, self.scale,
                                               self.l2norm, np.zeros(self.shape))
        return out

    def check_states(self, slots=None):
        slots = sorted(self.states) if slots is None else slots
        got = self.store.read(1, 1, np.asarray(slots, np.int32))
        for i, s in enumerate(slots):
            close(got[i], self.states[s])


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("dv", [40, 64])
def test_delta_rule_ragged_step(backend, group, l2norm, dv):
    d = Delta(backend, Hk=2, Hv=2 * group, dv=dv, l2norm=l2norm)
    d.seed_slots([3, 0, 5, 7])
    # decode rows, prefill chunks, a sequence without rows (slot -1) and one in a
    # slot of its own that has none this step
    step = make_step([1, 0, 7, 1, 0, 19], [3, -1, 0, 5, 7, 2], saves=[(3, 9), (8, 10)])
    inputs = d.inputs(28)
    before7 = d.states[7].copy()
    close(d.run(step, inputs), d.expect(step, inputs))
    d.check_states()
    close(d.store.read(1, 1, np.array([7], np.int32))[0], before7)


def test_delta_rule_split_prefill_equals_one_call(backend):
    one, split = Delta(backend, seed=3), Delta(backend, seed=3)
    n = 45
    inputs = one.inputs(n)
    whole = one.run(make_step([n], [4]), inputs)
    parts, start = [], 0
    for size in (5, 1, 20, 19):
        parts.append(split.run(make_step([size], [4]), [x[start:start + size] for x in inputs]))
        start += size
    close(np.concatenate(parts), whole, rtol=1e-5)
    close(split.store.read(1, 1, np.array([4], np.int32)), one.store.read(1, 1, np.array([4],
                                                                                          np.int32)),
          rtol=1e-5)
    close(whole, one.expect(make_step([n], [4]), inputs))


def test_delta_rule_save_rows(backend):
    d = Delta(backend, Hk=1, Hv=2, dk=8, dv=64, seed=5)
    d.seed_slots([1, 2])
    # saves inside runs, at a run's last row, at its first, two in one sequence
    step = make_step([6, 1, 9], [1, 2, 0], saves=[(0, 4), (5, 5), (6, 6), (9, 7), (15, 8)])
    inputs = d.inputs(16)
    close(d.run(step, inputs), d.expect(step, inputs))
    d.check_states([0, 1, 2, 4, 5, 6, 7, 8])


@pytest.mark.parametrize("n, saves", [(200, [17, 63, 64, 130, 199]), (300, [0, 150, 151, 298])])
def test_delta_rule_long_runs(backend, n, saves):
    d = Delta(backend, Hk=2, Hv=4, dk=16, dv=24, seed=n)
    d.seed_slots([0])
    # a long prefill (the chunked form's length) beside a decode row
    step = make_step([n, 1], [0, 3], saves=[(r, 4 + i) for i, r in enumerate(saves)])
    inputs = d.inputs(n + 1)
    close(d.run(step, inputs), d.expect(step, inputs), rtol=5e-4)
    d.check_states()


def test_delta_rule_state_untouched_without_rows(backend):
    d = Delta(backend, seed=7)
    d.seed_slots([2, 6])
    before = d.store.read(1, 1, np.array([2, 6], np.int32))
    out = d.run(make_step([0, 0], [2, -1]), d.inputs(0))
    assert out.shape == (0, d.Hv, d.dv)
    np.testing.assert_array_equal(d.store.read(1, 1, np.array([2, 6], np.int32)), before)


# -- causal conv1d -------------------------------------------------------------------------

class Conv:
    def __init__(self, backend, C=70, K=4, bias=True, silu=True, seed=0):
        self.rng = np.random.default_rng(seed)
        self.b = make_backend(backend)
        self.C, self.K, self.silu = C, K, silu
        self.shape = (C, K - 1)
        self.store = self.b.state_store([(self.shape, (2, 3, 4)), None], NUM_SLOTS)
        self.weight = self.rng.normal(size=(C, K)).astype(np.float32)
        self.bias = self.rng.normal(size=C).astype(np.float32) if bias else None
        self.states = {}

    def seed_slots(self, slots):
        values = self.rng.normal(size=(len(slots),) + self.shape).astype(np.float32)
        self.store.write(0, 0, np.asarray(slots, np.int32), values)
        self.states.update({s: values[i].astype(np.float64) for i, s in enumerate(slots)})

    def run(self, step, x):
        return self.b.causal_conv1d(self.store, 0, 0, step, x, self.weight, self.bias, self.silu)

    def expect(self, step, x):
        out, self.states = ref.conv_step(step, self.states, x, self.weight, self.bias,
                                         self.silu, np.zeros(self.shape))
        return out

    def check_states(self):
        slots = sorted(self.states)
        got = self.store.read(0, 0, np.asarray(slots, np.int32))
        for i, s in enumerate(slots):
            close(got[i], self.states[s])


@pytest.mark.parametrize("K", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("bias, silu", [(True, True), (False, False), (False, True)])
def test_conv_ragged_step(backend, K, bias, silu):
    c = Conv(backend, K=K, bias=bias, silu=silu, seed=K)
    c.seed_slots([1, 4, 8])
    # decode rows, a run shorter than the kernel, a longer one, no rows; saves
    # before the history is all new and at a run's last row
    step = make_step([1, 2, 0, 9, 1], [1, 4, -1, 3, 8], saves=[(1, 5), (3, 6), (5, 7),
                                                               (11, 9)])
    x = c.rng.normal(size=(13, c.C)).astype(np.float32)
    close(c.run(step, x), c.expect(step, x))
    c.check_states()


def test_conv_split_prefill_equals_one_call(backend):
    one, split = Conv(backend, K=4, seed=2), Conv(backend, K=4, seed=2)
    x = one.rng.normal(size=(30, one.C)).astype(np.float32)
    whole = one.run(make_step([30], [2]), x)
    parts, start = [], 0
    for size in (1, 2, 20, 7):
        parts.append(split.run(make_step([size], [2]), x[start:start + size]))
        start += size
    close(np.concatenate(parts), whole, rtol=1e-6)
    close(whole, one.expect(make_step([30], [2]), x))
    one.check_states()


def test_conv_long_run_with_saves(backend):
    c = Conv(backend, C=130, K=4, seed=9)
    c.seed_slots([0])
    step = make_step([300, 1], [0, 1], saves=[(0, 2), (150, 3), (299, 4)])
    x = c.rng.normal(size=(301, c.C)).astype(np.float32)
    close(c.run(step, x), c.expect(step, x))
    c.check_states()


# -- the state store -----------------------------------------------------------------------

def test_state_store(backend):
    b = make_backend(backend)
    shapes = [None, ((5, 3), (2, 4, 6)), ((7, 0),), None]
    store = b.state_store(shapes, 6)
    assert store.num_slots == 6
    assert store.memory_bytes == 4 * 6 * (15 + 48)
    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 5, 3)).astype(np.float32)
    s = rng.normal(size=(6, 2, 4, 6)).astype(np.float32)
    every = np.arange(6, dtype=np.int32)
    np.testing.assert_array_equal(store.read(1, 0, every), 0.0)   # zero-initialised
    store.write(1, 0, every, a)
    store.write(1, 1, every[::-1].copy(), s[::-1].copy())
    np.testing.assert_array_equal(store.read(1, 0, every), a)
    np.testing.assert_array_equal(store.read(1, 1, np.array([3, -1, 0], np.int32)),
                                  np.stack([s[3], np.zeros_like(s[0]), s[0]]))
    store.copy(np.array([0, 1], np.int32), np.array([4, 2], np.int32))
    a[[4, 2]], s[[4, 2]] = a[[0, 1]], s[[0, 1]]
    np.testing.assert_array_equal(store.read(1, 0, every), a)
    np.testing.assert_array_equal(store.read(1, 1, every), s)
    store.zero(np.array([5, 0], np.int32))
    a[[5, 0]], s[[5, 0]] = 0.0, 0.0
    np.testing.assert_array_equal(store.read(1, 0, every), a)
    np.testing.assert_array_equal(store.read(1, 1, every), s)
    assert store.read(2, 0, every).shape == (6, 7, 0)
    store.write(2, 0, every, np.zeros((6, 7, 0), np.float32))
    store.copy(np.zeros(0, np.int32), np.zeros(0, np.int32))


def test_state_store_too_large_names_num_state_slots(backend):
    b = make_backend(backend)
    with pytest.raises(MemoryError, match="num_state_slots"):
        b.state_store([((1 << 20, 1 << 10),)], 1 << 12)


def test_recurrent_kernels_ship_in_the_package():
    files = importlib.resources.files("pagedkv.opencl")
    assert "__kernel" in files.joinpath("recurrent.cl").read_text()


# -- pyopencl arrays in, pyopencl arrays out (the opencl backend's own arrays) ---------------

@pytest.mark.parametrize("device", TEST_DEVICES, ids=lambda d: d.id)
def test_opencl_takes_and_gives_device_arrays(device):
    import pyopencl.array as cl_array
    b = pagedkv.PagedKVCache(1, 1, 8, num_pages=2, backend="opencl",
                             device=device.device)._backend
    rng = np.random.default_rng(11)
    step = make_step([3, 1], [0, 1], saves=[(1, 2)])
    conv = ((4, 2),)
    delta = ((2, 8, 8),)
    x = rng.normal(size=(4, 4)).astype(np.float32)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    q, k = (rng.normal(size=(4, 1, 8)).astype(np.float32) for _ in "qk")
    v = rng.normal(size=(4, 2, 8)).astype(np.float32)
    g = -rng.uniform(0, 1, size=(4, 2)).astype(np.float32)
    beta = rng.uniform(0, 1, size=(4, 2)).astype(np.float32)
    outs = []
    for native in (False, True):
        store = b.state_store([conv, delta], 4)
        put = (lambda a: cl_array.to_device(b.queue, a)) if native else (lambda a: a)
        y = b.causal_conv1d(store, 0, 0, step, put(x), put(w), None, True)
        o = b.gated_delta_rule(store, 1, 0, step, put(q), put(k), put(v), put(g), put(beta),
                               0.3, True)
        assert isinstance(y, cl_array.Array) == native and isinstance(o, cl_array.Array) == native
        outs.append([np.asarray(y.get() if native else y), np.asarray(o.get() if native else o),
                     store.read(0, 0, np.arange(4, dtype=np.int32)),
                     store.read(1, 0, np.arange(4, dtype=np.int32))])
    for a, c in zip(*outs):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("device", TEST_DEVICES, ids=lambda d: d.id)
def test_opencl_one_column_per_work_item(device, monkeypatch):
    """The GPU layout (one state column or channel per work-item) on the test devices,
    which are CPUs and otherwise take a head (the delta rule) or a vector of
    channels per work-item."""
    from pagedkv.backends import _opencl_recurrent
    monkeypatch.setenv("PAGEDKV_DEVICE", device.index)
    monkeypatch.setattr(_opencl_recurrent, "_CPU_VECTOR", 1)
    monkeypatch.setattr(_opencl_recurrent, "_CPU_HEADS", False)
    d = Delta("opencl", Hk=1, Hv=2, dk=12, dv=24, seed=13)
    assert d.b._recurrent()._width(24) == 1
    d.seed_slots([1])
    step = make_step([5, 1], [1, 2], saves=[(2, 3)])
    inputs = d.inputs(6)
    close(d.run(step, inputs), d.expect(step, inputs))
    d.check_states()
    c = Conv("opencl", C=10, K=3, seed=13)
    c.seed_slots([1])
    x = c.rng.normal(size=(6, c.C)).astype(np.float32)
    close(c.run(step, x), c.expect(step, x))
    c.check_states()

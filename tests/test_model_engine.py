"""The paged, continuously batched engine against a dense full-sequence forward.

A tiny random Llama (2 layers, hidden 64, 4 query heads over 2 KV heads,
head_dim 16, vocabulary 97) runs ragged prompts through the engine with a
small page size and token budget, so prompts cross page boundaries and are
prefilled in chunks beside other requests' decodes.  Every logit vector the
engine samples from must match an independent float64 forward over the
whole sequence with no cache at all.
"""

import numpy as np
import pytest

import pagedkv
from pagedkv.models.engine import Engine
from pagedkv.models.llama import LayerWeights, LlamaConfig, LlamaModel, LlamaWeights
from pagedkv.models.sampling import sample
from python_child import run_python

# whole-model tests: the engine more than the kernels, so one OpenCL device is enough
pytestmark = pytest.mark.one_opencl_device

CONFIG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                     rms_norm_eps=1e-5, max_position=256)
# float32 engine vs float64 reference, relative to the logits' scale
LOGIT_TOLERANCE = 1e-5


def random_checkpoint(config, seed=0):
    """Raw ``[out, in]`` matrices, as a checkpoint would hold them (float64)."""
    rng = np.random.default_rng(seed)
    c = config

    def mat(rows, cols):
        return rng.standard_normal((rows, cols)) / np.sqrt(cols)

    layers = [dict(attn_norm=1 + 0.1 * rng.standard_normal(c.hidden_size),
                   wq=mat(c.q_size, c.hidden_size), wk=mat(c.kv_size, c.hidden_size),
                   wv=mat(c.kv_size, c.hidden_size), wo=mat(c.hidden_size, c.q_size),
                   ffn_norm=1 + 0.1 * rng.standard_normal(c.hidden_size),
                   w_gate=mat(c.intermediate_size, c.hidden_size),
                   w_up=mat(c.intermediate_size, c.hidden_size),
                   w_down=mat(c.hidden_size, c.intermediate_size))
              for _ in range(c.num_layers)]
    return dict(embedding=rng.standard_normal((c.vocab_size, c.hidden_size)),
                output_norm=1 + 0.1 * rng.standard_normal(c.hidden_size), layers=layers)


def dense_forward(checkpoint, config, tokens):
    """Logits at every position of one whole sequence: float64, no cache, plain causal attention.

    RoPE is written with complex numbers: adjacent pairs ``(x[2i], x[2i+1])``
    are one complex number turned by ``exp(1j * pos * theta**(-2i/d))``.

    Returns
    -------
    ndarray, shape [len(tokens), vocab_size], float64
    """
    c = config
    n = len(tokens)
    pos = np.arange(n)
    angle = pos[:, None] * c.rope_theta ** (-np.arange(0, c.head_dim, 2) / c.head_dim)
    turn = np.exp(1j * angle)[:, None, :]                          # [n, 1, D/2]

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps) * w

    def rope(x):                                                    # [n, heads, D]
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * turn
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out

    causal = np.tril(np.ones((n, n), dtype=bool))
    x = checkpoint["embedding"][np.asarray(tokens)]
    for layer in checkpoint["layers"]:
        h = norm(x, layer["attn_norm"])
        q = rope((h @ layer["wq"].T).reshape(n, c.num_heads, c.head_dim))
        k = rope((h @ layer["wk"].T).reshape(n, c.num_kv_heads, c.head_dim))
        v = (h @ layer["wv"].T).reshape(n, c.num_kv_heads, c.head_dim)
        out = np.empty_like(q)
        for head in range(c.num_heads):
            kv = head // (c.num_heads // c.num_kv_heads)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(c.head_dim)
            scores = np.where(causal, scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, head] = (weights / weights.sum(axis=1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(n, -1) @ layer["wo"].T
        h = norm(x, layer["ffn_norm"])
        gate = h @ layer["w_gate"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ layer["w_up"].T)) @ layer["w_down"].T
    return norm(x, checkpoint["output_norm"]) @ checkpoint["embedding"].T


def engine_model(checkpoint, config, layer_class=LayerWeights, model_class=LlamaModel):
    """The engine's float32 model of a raw checkpoint (tied embedding)."""
    layers = [layer_class.from_projections(**layer) for layer in checkpoint["layers"]]
    weights = LlamaWeights(token_embedding=checkpoint["embedding"].astype(np.float32),
                           layers=layers,
                           output_norm=checkpoint["output_norm"].astype(np.float32))
    return model_class(config, weights)


class RecordingCache:
    """A PagedKVCache that logs the token counts of every ``append``."""

    def __init__(self, cache):
        self._cache = cache
        self.appends = []

    def append(self, seq_ids, counts, **kwargs):
        self.appends.append(list(counts))
        return self._cache.append(seq_ids, counts, **kwargs)

    def __getattr__(self, name):
        return getattr(self._cache, name)


@pytest.fixture(scope="module")
def checkpoint():
    return random_checkpoint(CONFIG)


@pytest.fixture(scope="module")
def model(checkpoint):
    return engine_model(checkpoint, CONFIG)


def make_cache(backend, num_pages, page_size=4, **kwargs):
    return pagedkv.PagedKVCache(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim,
                                num_pages=num_pages, page_size=page_size, backend=backend,
                                **kwargs)


def run_and_collect(engine, arrivals):
    """Run the engine, adding ``arrivals[step]`` prompts before each step.

    Returns
    -------
    events : dict request_id -> list of TokenEvent
    prompts : dict request_id -> prompt ids
    """
    events, prompts, step = {}, {}, 0
    while engine.has_unfinished() or step in arrivals:
        for prompt, max_new in arrivals.pop(step, []):
            rid = engine.add_request(prompt, max_new_tokens=max_new)
            prompts[rid], events[rid] = prompt, []
        for event in engine.step():
            events[event.request_id].append(event)
        step += 1
        # a finished request's sequence is gone at once (a swapped-out one keeps its own)
        assert len(engine.cache.seq_ids()) == engine.num_running + len(engine.scheduler.swapped)
    return events, prompts


def assert_matches_dense(checkpoint, events, prompts):
    for rid, prompt in prompts.items():
        generated = [e.token_id for e in events[rid]]
        reference = dense_forward(checkpoint, CONFIG, prompt + generated)
        for i, event in enumerate(events[rid]):
            expected = reference[len(prompt) - 1 + i]
            scale = np.abs(expected).max()
            np.testing.assert_allclose(event.logits, expected, rtol=0,
                                       atol=LOGIT_TOLERANCE * scale,
                                       err_msg=f"request {rid}, generated token {i}")
            assert event.token_id == int(np.argmax(event.logits))


def test_dense_reference_is_causal(checkpoint):
    """The oracle itself: a prefix's logits do not depend on what follows it."""
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 12).tolist()
    np.testing.assert_allclose(dense_forward(checkpoint, CONFIG, tokens[:7]),
                               dense_forward(checkpoint, CONFIG, tokens)[:7], atol=1e-12)


def test_engine_matches_dense_forward_with_chunked_prefill(backend, checkpoint, model):
    rng = np.random.default_rng(2)

    def prompt(n):
        return rng.integers(0, CONFIG.vocab_size, n).tolist()

    # Ragged prompts crossing page boundaries (page_size 4); requests join at
    # steps 0, 2 and 5 and leave after different numbers of tokens.
    arrivals = {0: [(prompt(3), 6), (prompt(9), 4)],
                2: [(prompt(17), 5), (prompt(1), 3)],
                5: [(prompt(30), 4), (prompt(6), 7)]}
    cache = RecordingCache(make_cache(backend, num_pages=64))
    engine = Engine(model, cache, max_num_seqs=8, max_num_batched_tokens=8)
    events, prompts = run_and_collect(engine, arrivals)

    assert_matches_dense(checkpoint, events, prompts)
    assert all(len(e) == n for e, n in zip(events.values(), [6, 4, 5, 3, 4, 7]))
    # chunked prefill really ran next to decodes, within the token budget
    assert any(1 in counts and max(counts) > 1 for counts in cache.appends)
    assert max(sum(counts) for counts in cache.appends) <= 8
    assert cache.num_free_pages == cache.num_pages
    assert engine.stats.decode_tokens == sum(n - 1 for n in [6, 4, 5, 3, 4, 7])


class NoSwapCache(RecordingCache):
    """A cache without swap_out / swap_in: the engine preempts by recomputing."""

    def __getattr__(self, name):
        if name in ("swap_out", "swap_in"):
            raise AttributeError(name)
        return super().__getattr__(name)


@pytest.mark.parametrize("swaps", [True, False], ids=["swap", "recompute"])
def test_engine_preempts_when_pages_run_out(backend, checkpoint, model, swaps):
    """A pool too small for every request at once: the newest is preempted (swapped
    out to host memory and back in, or recomputed later), and every logit still
    matches the dense forward."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (10, 7, 12)]
    cache = make_cache(backend, num_pages=9)
    engine = Engine(model, cache if swaps else NoSwapCache(cache), max_num_seqs=4,
                    max_num_batched_tokens=16)
    events, collected = run_and_collect(engine, {0: [(p, 8) for p in prompts]})
    assert engine.stats.num_preemptions > 0
    assert engine.stats.num_swaps == (engine.stats.num_preemptions if swaps else 0)
    # the prompts' 29 tokens: each computed once with swap, some twice with recompute
    assert (engine.stats.prefill_tokens == 29) == swaps
    assert_matches_dense(checkpoint, events, collected)
    assert cache.num_free_pages == cache.num_pages and cache.stats()["swapped_bytes"] == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tight_pools_change_nothing_but_the_schedule(backend, model, seed):
    """Random arrivals into pools barely larger than the biggest request: the
    engine preempts, recomputes and still generates what a roomy pool does."""
    rng = np.random.default_rng(seed)
    arrivals = {}
    for _ in range(7):
        request = (rng.integers(0, CONFIG.vocab_size, rng.integers(1, 20)).tolist(),
                   int(rng.integers(1, 9)))
        arrivals.setdefault(int(rng.integers(0, 6)), []).append(request)
    largest = max(-(-(len(p) + n) // 4) for reqs in arrivals.values() for p, n in reqs)

    def run(num_pages, budget):
        engine = Engine(model, make_cache(backend, num_pages=num_pages), max_num_seqs=4,
                        max_num_batched_tokens=budget)
        events, prompts = run_and_collect(engine, {k: list(v) for k, v in arrivals.items()})
        assert engine.cache.num_free_pages == engine.cache.num_pages
        return [[e.token_id for e in events[r]] for r in sorted(prompts)], engine.stats

    roomy, _ = run(num_pages=256, budget=64)
    tight, stats = run(num_pages=largest, budget=int(rng.integers(1, 12)))
    assert stats.num_preemptions > 0
    assert tight == roomy


def test_engine_reuses_cached_prefixes(backend, checkpoint, model):
    """With a prefix-caching cache, later prompts sharing full pages with an
    earlier one compute only their new tokens, and the logits do not change."""
    rng = np.random.default_rng(4)
    shared = rng.integers(0, CONFIG.vocab_size, 13).tolist()         # 3 full pages + 1

    def prompt(n):
        return shared + rng.integers(0, CONFIG.vocab_size, n).tolist()

    # the first request finishes at step 2; its pages stay cached for the next two
    arrivals = {0: [(prompt(5), 3)], 3: [(prompt(3), 4), (shared[:9] + [1, 2], 3)]}
    cache = RecordingCache(make_cache(backend, num_pages=64, enable_prefix_caching=True))
    engine = Engine(model, cache, max_num_seqs=8, max_num_batched_tokens=64)
    events, prompts = run_and_collect(engine, arrivals)
    assert_matches_dense(checkpoint, events, prompts)
    # the late prompts (16 and 11 tokens) start on 3 and 2 cached pages
    assert cache.appends[0] == [18] and cache.appends[3] == [16 - 12, 11 - 8]
    assert cache.stats()["prefix_hit_rate"] == (12 + 8) / (18 + 16 + 11)


def test_forward_computes_logits_only_for_requested_rows(model):
    """``logit_rows`` selects rows; the dense rows agree with a full pass."""
    tokens = np.arange(10) % CONFIG.vocab_size
    calls = []

    def attend(layer, q, k, v):          # dense causal attention over the step itself
        calls.append(layer)
        group = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
        scores[:, ~np.tril(np.ones((len(q), len(q)), dtype=bool))] = -np.inf
        w = np.exp(scores - scores.max(-1, keepdims=True))
        return np.einsum("hqk,khd->qhd", w / w.sum(-1, keepdims=True), v).astype(np.float32)

    both = model.forward(tokens, np.arange(10), attend, np.array([4, 9]))
    last = model.forward(tokens, np.arange(10), attend, np.array([9]))
    assert both.shape == (2, CONFIG.vocab_size) and last.shape == (1, CONFIG.vocab_size)
    np.testing.assert_allclose(both[1], last[0], rtol=1e-5, atol=1e-5)  # float32 matmuls of 2 vs 1 rows
    assert calls == [0, 1, 0, 1]


def test_temperature_sampling_is_seeded(backend, model):
    prompts = [[5, 6, 7, 8, 9], [11, 12]]

    def run(seed):
        engine = Engine(model, make_cache(backend, num_pages=32), seed=seed)
        return engine.generate(prompts, max_new_tokens=6, temperature=20.0)

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sample_greedy_and_tempered():
    rng = np.random.default_rng(0)
    logits = np.array([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]], dtype=np.float32)
    assert sample(logits, [0.0, 0.0], rng).tolist() == [1, 0]
    draws = np.array([sample(logits[:1], [1.0], rng)[0] for _ in range(2000)])
    p = np.exp([0.0, 3.0, 1.0]) / np.exp([0.0, 3.0, 1.0]).sum()
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 2000, p, atol=0.04)
    with pytest.raises(ValueError, match="temperatures"):
        sample(logits, [-1.0, 0.0], rng)


def test_sample_top_k_and_top_p_keep_the_likeliest_tokens():
    """transformers' order: temperature, then top-k, then top-p over what is left."""
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]]))       # probabilities 0.1 0.4 0.2 0.3
    n = 4000

    def freqs(**options):
        draws = [sample(logits, [1.0], rng, **options)[0] for _ in range(n)]
        return np.bincount(draws, minlength=4) / n

    np.testing.assert_allclose(freqs(top_ks=[2]), [0, 4 / 7, 0, 3 / 7], atol=0.03)
    # top-p 0.6: 0.4 alone is short of it, 0.4 + 0.3 reaches it; the rest drops
    np.testing.assert_allclose(freqs(top_ps=[0.6]), [0, 4 / 7, 0, 3 / 7], atol=0.03)
    np.testing.assert_allclose(freqs(top_ps=[0.4]), [0, 1, 0, 0])   # 0.4 reaches 0.4
    # top-p after top-k: of {0.4, 0.3, 0.2} renormalized (4/9, 3/9, 2/9), 0.5 keeps two
    np.testing.assert_allclose(freqs(top_ks=[3], top_ps=[0.5]), [0, 4 / 7, 0, 3 / 7],
                               atol=0.03)
    assert sample(logits, [0.0], rng, top_ks=[1], top_ps=[0.1]).tolist() == [1]   # greedy
    for bad in (dict(top_ks=[-1]), dict(top_ps=[0.0]), dict(top_ps=[1.5]),
                dict(top_ks=[1, 2])):
        with pytest.raises(ValueError, match="top_"):
            sample(logits, [1.0], rng, **bad)


def test_engine_rejects_bad_requests(model):
    engine = Engine(model, make_cache("host", num_pages=8), max_seq_len=32)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request([], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request([CONFIG.vocab_size], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request([1] * 32, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1, 2], max_new_tokens=1, temperature=-0.5)
    with pytest.raises(ValueError, match="top_k"):
        engine.add_request([1, 2], max_new_tokens=1, temperature=1.0, top_k=-1)
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request([1, 2], max_new_tokens=1, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="pages"):
        Engine(model, make_cache("host", num_pages=2)).add_request([1] * 10, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        Engine(model, pagedkv.PagedKVCache(CONFIG.num_layers, 1, CONFIG.head_dim, num_pages=4))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(model, make_cache("host", num_pages=8), max_num_batched_tokens=0)


def test_generation_stops_at_stop_ids_and_max_seq_len(backend, model):
    engine = Engine(model, make_cache(backend, num_pages=32), max_seq_len=12)
    first = engine.generate([[1, 2, 3]], max_new_tokens=20)[0]
    assert len(first) == 12 - 3                    # capped by max_seq_len
    stop = first[2]
    engine = Engine(model, make_cache(backend, num_pages=32), max_seq_len=12)
    rid = engine.add_request([1, 2, 3], max_new_tokens=20, stop_ids=[stop])
    while engine.has_unfinished():
        engine.step()
    request = engine.requests[rid]
    assert request.output_ids == first[:first.index(stop) + 1]
    assert request.finish_reason == "stop"


def test_core_and_engine_need_none_of_the_demo_dependencies():
    """``import pagedkv`` and the engine work without the demo extra; the demo
    then says what to install instead of failing with a traceback."""
    code = ("import sys\n"
            "for name in ('gguf', 'tokenizers', 'rich', 'jinja2', 'threadpoolctl'):\n"
            "    sys.modules[name] = None\n"
            "import pagedkv, pagedkv.models\n"
            "from pagedkv.models import Engine, LlamaModel\n"
            "from pagedkv.models import demo\n"
            "sys.exit(demo.main(['--max-new-tokens', '1']))\n")
    result = run_python(code)
    assert result.returncode == 1, result.stderr
    assert 'pip install "pagedkv[demo]"' in result.stderr and "Traceback" not in result.stderr


def test_a_request_prefilled_elsewhere_decodes_as_if_prefilled_here(backend, checkpoint, model):
    """Disaggregation without Ray: one engine prefills (exporting each prompt's K/V as
    it finishes), another imports and decodes; the tokens match one engine's."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (9, 4, 14)]
    exported = {}
    prefill_cache = make_cache(backend, num_pages=32, enable_prefix_caching=True)
    prefill = Engine(model, prefill_cache, on_finish=lambda r: exported.__setitem__(
        r.request_id, prefill_cache.export_sequence(r.seq_id)))
    decode = Engine(model, make_cache(backend, num_pages=12, page_size=8))
    handed_over = []
    for prompt in prompts:
        rid = prefill.add_request(prompt, max_new_tokens=1)
        while prefill.has_unfinished():
            prefill.step()
        handed_over.append((prompt, exported.pop(rid), prefill.requests[rid].output_ids[0]))
    ids = [decode.add_prefilled_request(*given, max_new_tokens=6) for given in handed_over]
    while decode.has_unfinished():
        decode.step()
    alone = Engine(model, make_cache(backend, num_pages=32))
    assert [decode.requests[rid].output_ids for rid in ids] == \
        alone.generate(prompts, max_new_tokens=6)
    assert decode.stats.prefill_tokens == 0 and decode.cache.num_free_pages == 12
    done = decode.add_prefilled_request(*handed_over[0], max_new_tokens=1)
    assert decode.requests[done].finish_reason == "length" and not decode.has_unfinished()
    with pytest.raises(ValueError, match="kv: expected K/V of the prompt's 4 tokens, got 9"):
        decode.add_prefilled_request(prompts[1], handed_over[0][1], 1, max_new_tokens=2)


def run_samples(engine, prompts, num_samples, max_new_tokens, temperature=0.0):
    """Every completion of every prompt: {request id: (prompt, [TokenEvent])}."""
    events = {}
    for prompt in prompts:
        rid = engine.add_request(prompt, max_new_tokens=max_new_tokens,
                                 temperature=temperature, num_samples=num_samples)
        events[rid] = (prompt, [])
    while engine.has_unfinished():
        for event in engine.step():
            request = engine.requests[event.request_id]
            events.setdefault(event.request_id, (request.prompt_ids, []))[1].append(event)
    return events


@pytest.mark.parametrize("cascade", ["auto", "off"])
def test_forked_samples_decode_as_the_prompt_alone(backend, checkpoint, model, cascade):
    """num_samples forks the prompt's sequence once it is computed: greedy samples
    all equal the prompt's single completion, and every logit matches the dense
    forward; with cascade the samples' shared pages are read once."""
    from pagedkv.cascade import CascadePolicy
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (30, 17)]
    cache = make_cache(backend, num_pages=96, cascade=cascade)
    cache._backend.cascade_policy = CascadePolicy(min_run_bytes=0)   # a tiny model's pages
    engine = Engine(model, cache, max_num_seqs=8, max_num_batched_tokens=64)
    events = run_samples(engine, prompts, 3, 6)
    assert len(events) == 6
    assert_matches_dense(checkpoint, {r: e for r, (_, e) in events.items()},
                         {r: p for r, (p, _) in events.items()})
    single = Engine(model, make_cache(backend, num_pages=32)).generate(prompts, max_new_tokens=6)
    for prompt, got in events.values():
        assert [e.token_id for e in got] == single[prompts.index(prompt)]
    forks = [r for r in engine.requests.values() if r.parent_id is not None]
    assert sorted(r.sample for r in forks) == [1, 1, 2, 2]
    saved = engine.stats.shared_token_reads_saved
    assert saved > 0 if cascade == "auto" else saved == 0


def test_forks_share_the_prompts_pages(model):
    cache = make_cache("host", num_pages=32)
    engine = Engine(model, cache, max_num_seqs=4, max_num_batched_tokens=64)
    engine.add_request(list(range(1, 14)), max_new_tokens=4, num_samples=3)
    engine.step()                                    # the prompt, then two forks
    seqs = cache.seq_ids()
    assert len(seqs) == 3
    assert all(cache.refcount(int(p)) == 3 for p in cache.page_ids(seqs[0])[:3])


def test_sampled_forks_are_seeded(backend, model):
    def run(seed):
        engine = Engine(model, make_cache(backend, num_pages=64), seed=seed)
        events = run_samples(engine, [[5, 6, 7, 8, 9]], 4, 6, temperature=20.0)
        return [[e.token_id for e in got] for _, got in events.values()]

    first = run(7)
    assert first == run(7) and first != run(8)
    assert len({tuple(s) for s in first}) > 1          # the samples differ


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_num_samples(model, bad):
    engine = Engine(model, make_cache("host", num_pages=8))
    with pytest.raises(ValueError, match="num_samples"):
        engine.add_request([1, 2], max_new_tokens=2, num_samples=bad)
    assert not engine.requests

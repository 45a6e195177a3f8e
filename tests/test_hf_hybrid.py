"""pagedkv under transformers for hybrid models: layers that keep a recurrent state
(gated DeltaNet in Qwen3.5, Qwen3.5-MoE and Qwen3-Next, the short convolutions of
LFM2 and LFM2-MoE, Mamba2 in GraniteMoeHybrid) beside attention layers.

Tiny random float32 models of each family give, through a ``PagedCache``, the
greedy tokens of the same model with transformers' own cache, per prompt alone:
``model.generate`` on a left-padded batch (padding never reaches a state),
``generate_batch`` (continuous batching: ragged steps mixing prefill chunks and
decodes), and prefix reuse across ``generate_batch`` calls (a state snapshot
and cached pages stand in for a shared prefix), on every backend; a preempted
request resumes with its swapped-out states; beam search forks them and assisted
decoding crops them (within ``state_rollback_tokens``), and a pass that fails part
way leaves none advanced.  A hybrid model pagedkv cannot serve is an
``UnsupportedModelError`` naming the field.
"""
import numpy as np
import pytest

from hf_models import (HYBRID_FAMILIES, greedy_with_own_cache, one_torch_thread, padded,
                       require_hf, sdpa, tiny_hybrid, tiny_hybrid_config)

# whole models, so one OpenCL device is enough
pytestmark = pytest.mark.one_opencl_device

NEW_TOKENS = 6
PROMPTS = [np.random.default_rng(seed).integers(3, 300, n).tolist()
           for seed, n in [(1, 7), (2, 37), (3, 20)]]
# prompts that share a 40-token prefix (five pages of 8), for prefix reuse
SHARED = np.random.default_rng(4).integers(3, 300, 40).tolist()
PREFIXED = [SHARED + np.random.default_rng(seed).integers(3, 300, n).tolist()
            for seed, n in [(5, 3), (6, 9), (7, 5)]]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    require_hf()
    with one_torch_thread():
        yield


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid(request):
    """(model, its greedy tokens per prompt of PROMPTS + PREFIXED with transformers' cache)."""
    model = tiny_hybrid(request.param)
    return model, [greedy_with_own_cache(model, p, NEW_TOKENS) for p in PROMPTS + PREFIXED]


def paged_cache(model, backend, **options):
    import pagedkv.hf
    options.setdefault("num_pages", 64)
    options.setdefault("page_size", 8)
    return pagedkv.hf.PagedCache(model.config, backend=backend, **options)


# -- what the configs map onto ------------------------------------------------------------
@pytest.mark.parametrize("family, states", [
    ("qwen3_5", [((2 * 2 * 16 + 4 * 16, 3), (4, 16, 16)), None, ((128, 3), (4, 16, 16))]),
    ("qwen3_5_moe", [((128, 3), (4, 16, 16)), None, ((128, 3), (4, 16, 16))]),
    ("qwen3_next", [((128, 3), (4, 16, 16)), None, ((128, 3), (4, 16, 16))]),
    ("lfm2", [((64, 2),), None, ((64, 2),)]),
    ("lfm2_moe", [((64, 2),), None, ((64, 2),)]),
    # conv over x, B and C (2 * 64 + 2 * 2 * 16), the SSM state [heads, head_dim, d_state]
    ("granitemoehybrid", [((192, 3), (8, 16, 16)), None, ((192, 3), (8, 16, 16))]),
])
def test_recurrent_layers_map_onto_state_specs(family, states):
    import pagedkv.hf
    spec = pagedkv.hf.read_model_attention(tiny_hybrid_config(family))
    assert [None if s is None else s.shapes for s in spec.layer_states] == states
    assert spec.is_hybrid and spec.layer_windows == (None,) * 3
    assert (spec.num_kv_heads, spec.head_dim) == (2, 16)


def test_the_cache_holds_the_states():
    import pagedkv.hf
    cache = pagedkv.hf.PagedCache(tiny_hybrid_config("qwen3_5"), num_pages=8, backend="host",
                                  num_state_slots=5, state_rollback_tokens=2)
    assert cache.kv.num_state_slots == cache.kv.num_free_state_slots == 5
    assert cache.state_rollback_tokens == 2
    assert cache.is_linear == [True, False, True]
    # the state pool counts: a slot is one sequence's states of both recurrent layers
    attention_only = pagedkv.hf.PagedCache(tiny_hybrid_config("qwen3_5"), num_pages=8,
                                           backend="host", num_state_slots=1)
    slot_bytes = 2 * (128 * 3 + 4 * 16 * 16) * 4
    assert cache.kv.memory_bytes - attention_only.kv.memory_bytes == 4 * slot_bytes


# -- the tokens -------------------------------------------------------------------------------
def test_left_padded_generate_gives_each_prompt_its_own_tokens(hybrid, backend):
    import torch
    model, expected = hybrid
    ids, mask = padded(PROMPTS, 0, "left")
    cache = paged_cache(model, backend)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[:, ids.shape[1]:].tolist() == expected[:len(PROMPTS)]
    # each row holds its real tokens only: the padding never reached a state or a page
    assert [cache.kv.seq_len(s) for s in cache.rows] == \
        [len(p) + NEW_TOKENS - 1 for p in PROMPTS]


def test_right_padded_generate_gives_the_unpadded_row_its_tokens(backend):
    """Padding after a prompt never reaches its states either; transformers itself takes a
    shorter row's first new token from a pad position, so only the longest row is checked."""
    import torch
    model = tiny_hybrid("qwen3_5")
    ids, mask = padded(PROMPTS, 0, "right")
    cache = paged_cache(model, backend)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[1, ids.shape[1]:].tolist() == greedy_with_own_cache(model, PROMPTS[1],
                                                                   NEW_TOKENS)


def test_generate_batch_gives_each_prompt_its_own_tokens(hybrid, backend):
    import pagedkv.hf
    model, expected = hybrid
    cache = paged_cache(model, backend, num_state_slots=8)
    # two at a time, 16 tokens a step: prompts prefill in chunks beside the other's decodes
    got = pagedkv.hf.generate_batch(model, PROMPTS, NEW_TOKENS, cache=cache, max_num_seqs=2,
                                    max_num_batched_tokens=16)
    assert got == expected[:len(PROMPTS)]
    assert cache.kv.seq_ids() == [] and cache.kv.num_free_pages == cache.kv.num_pages


def test_prompts_sharing_a_prefix_reuse_it_across_calls(hybrid, backend):
    import pagedkv.hf
    model, expected = hybrid
    cache = paged_cache(model, backend, enable_prefix_caching=True, num_state_slots=16,
                        state_snapshot_interval=8)
    # steps of 8 tokens end where the snapshots are taken (Mamba2 writes its state per step)
    options = dict(cache=cache, max_num_batched_tokens=8)
    assert pagedkv.hf.generate_batch(model, PREFIXED[:1], NEW_TOKENS, **options) == \
        expected[len(PROMPTS):len(PROMPTS) + 1]
    first = cache.stats()
    assert pagedkv.hf.generate_batch(model, PREFIXED[1:], NEW_TOKENS, **options) == \
        expected[len(PROMPTS) + 1:]
    second = cache.stats()
    computed = second["num_stored_tokens"] - first["num_stored_tokens"]
    assert second["prefix_hit_rate"] > 0
    # both later prompts start on the shared 40 tokens: pages and a state snapshot
    assert computed == sum(len(p) - len(SHARED) + NEW_TOKENS - 1 for p in PREFIXED[1:])


@pytest.mark.parametrize("family", ["qwen3_5", "granitemoehybrid"])
def test_a_preempted_request_resumes_with_its_states(family, backend):
    """Six pages for two requests that grow to nine: the newer one is swapped out
    (pages and recurrent states to host memory) and resumes where it was."""
    import pagedkv.hf
    from pagedkv.hf.generate import make_engine
    model = tiny_hybrid(family)
    prompts, new_tokens = [PROMPTS[0], PROMPTS[2]], 20
    expected = [greedy_with_own_cache(model, p, new_tokens) for p in prompts]
    cache = pagedkv.hf.PagedCache(model.config, num_pages=6, page_size=8, backend=backend,
                                  num_state_slots=8)
    engine = make_engine(model, cache, max_num_batched_tokens=16)
    ids = [engine.add_request(p, max_new_tokens=new_tokens) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert [engine.requests[i].output_ids for i in ids] == expected
    assert engine.stats.num_swaps >= 1


def test_a_packed_step_of_your_own(backend):
    """The engine author's way in: steps appended to ``cache.kv``, the model on each."""
    import torch
    model = tiny_hybrid("qwen3_5")
    expected = [greedy_with_own_cache(model, p, 1) for p in PROMPTS[:2]]
    cache = paged_cache(model, backend)
    a, b = cache.kv.add_sequence(), cache.kv.add_sequence()
    batch = cache.kv.append([a, b], [len(PROMPTS[0]), len(PROMPTS[1])])
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    positions = torch.tensor([list(range(len(PROMPTS[0]))) + list(range(len(PROMPTS[1])))])
    last = torch.tensor([len(PROMPTS[0]) - 1, len(PROMPTS[0]) + len(PROMPTS[1]) - 1])
    with cache.step(batch), torch.inference_mode():
        logits = model(input_ids=ids, position_ids=positions, past_key_values=cache,
                       logits_to_keep=last).logits
    assert logits[0].argmax(-1).tolist() == [e[0] for e in expected]
    # without the batch, a recurrent layer cannot tell the sequences apart
    batch = cache.kv.append([a], [1])
    with cache.bind(lambda *args, **kw: None), torch.inference_mode(), \
            pytest.raises(ValueError, match=r"cache.step\(batch\)"):
        model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[len(PROMPTS[0])]]),
              past_key_values=cache)


@pytest.mark.parametrize("family", ["qwen3_5", "granitemoehybrid"])
def test_beam_search_forks_the_states(family, backend):
    import torch
    model = tiny_hybrid(family)
    ids, mask = padded(PROMPTS[:2], 0, "left")
    with sdpa(model), torch.inference_mode():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                              num_beams=2)
    # a slot per beam, and one per fork about to diverge
    cache = paged_cache(model, backend, num_state_slots=12)
    with torch.inference_mode():
        got = model.generate(ids, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=5, do_sample=False, num_beams=2)
    assert got.tolist() == want.tolist()
    assert len(cache.kv.seq_ids()) == len(cache.rows) == 4     # forks replaced their rows


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_assisted_decoding_rolls_the_states_back(family, backend):
    """Prompt lookup drafts 3 tokens a pass; those rejected are cropped, states and all,
    and the tokens are plain greedy decoding's.

    (transformers 5.25's own cache gives other tokens for the Qwen3.5 model here,
    ``[..., 293, 190, 207, 24, 224]`` against greedy's ``[..., 293, 45, 171, 252,
    78]``: its crop of the linear-attention states misses; so the oracle is greedy
    decoding without drafts.)
    """
    import torch
    model = tiny_hybrid(family)
    # a prompt that repeats itself, so prompt lookup drafts tokens (some rejected)
    prompt = PROMPTS[1][:12] * 3
    ids, mask = padded([prompt], 0, "left")
    want = greedy_with_own_cache(model, prompt, 8)
    cache = paged_cache(model, backend, state_rollback_tokens=3, num_state_slots=8)
    with torch.inference_mode():
        got = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8,
                             do_sample=False, prompt_lookup_num_tokens=3)
    assert got[0, len(prompt):].tolist() == want


# -- what cannot be served -------------------------------------------------------------------
def test_assisted_decoding_needs_room_to_roll_back():
    import torch
    model = tiny_hybrid("qwen3_5")
    ids, mask = padded([PROMPTS[1]], 0, "left")
    cache = paged_cache(model, "host")                 # state_rollback_tokens=0
    with torch.inference_mode(), pytest.raises(ValueError, match="state_rollback_tokens"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4,
                       do_sample=False, prompt_lookup_num_tokens=3)
    # Mamba2's states come back once per pass (write_states): no crop inside a draft
    model = tiny_hybrid("granitemoehybrid")
    cache = paged_cache(model, "host", state_rollback_tokens=3)
    with torch.inference_mode(), pytest.raises(ValueError, match="assisted decoding: layer 0 "
                                               "of this granitemoehybrid is a Mamba2 layer"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4,
                       do_sample=False, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("config, named", [
    # Mamba2 layers of a model whose mixer pagedkv.hf does not route
    (lambda t: t.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1]),
     r"config.layer_types\[0\]: 'linear_attention' layers of bamba have no mapping"),
    (lambda t: t.FalconH1Config(num_hidden_layers=2),
     r"config.layer_types\[0\]: 'hybrid' has no mapping"),
    (lambda t: t.GraniteMoeHybridConfig(num_hidden_layers=2),
     "config.layer_types: every layer of this granitemoehybrid is recurrent"),
    (lambda t: tiny_hybrid_config("qwen3_5").__class__(
        linear_num_key_heads=3, linear_num_value_heads=4, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"]),
     "config.linear_num_value_heads: 4 is not a multiple of linear_num_key_heads=3"),
])
def test_hybrid_configs_pagedkv_cannot_serve_are_named(config, named):
    import transformers

    import pagedkv.hf
    with pytest.raises(pagedkv.hf.UnsupportedModelError, match=named):
        pagedkv.hf.PagedCache(config(transformers), num_pages=4, backend="host")


def test_state_options_need_a_hybrid_model():
    import transformers

    import pagedkv.hf
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=50)
    with pytest.raises(ValueError, match="state_rollback_tokens: llama has no recurrent layers"):
        pagedkv.hf.PagedCache(config, num_pages=4, backend="host", state_rollback_tokens=2)


# -- the example -------------------------------------------------------------------------------
def test_the_hybrid_example_runs_as_written(backend, capsys):
    """``examples/hf_hybrid.py`` (in this process, its ``main(argv)``): every output equals
    transformers' own cache, and the second turn starts from the cached prefix."""
    import importlib.util
    import re
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "hf_hybrid.py"
    if not path.exists():
        pytest.skip(f"{path} is not here (tests run from a copy without the repository)")
    spec = importlib.util.spec_from_file_location("hf_hybrid", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--backend", backend, "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert "same tokens as transformers' own cache: 5/5" in out, out
    assert re.search(r"[1-9]\d*% of the prompt tokens reused from the prefix cache", out), out


def test_a_pass_that_fails_part_way_leaves_no_tokens():
    """A pass that raises after a recurrent layer advanced its states: they are rolled
    back with the pages (a prefill always can; a decode within ``state_rollback_tokens``),
    or, beyond them, the rows are freed and the next pass says why."""
    import torch
    model = tiny_hybrid("qwen3_5")
    prompt = PROMPTS[1]
    expected = greedy_with_own_cache(model, prompt, NEW_TOKENS)
    ids, mask = padded([prompt], 0, "left")

    def fail(*args):
        raise RuntimeError("a layer failed")

    def failing_pass(cache, input_ids):
        handle = model.model.layers[2].register_forward_pre_hook(fail)   # after layers 0, 1
        try:
            with torch.inference_mode(), pytest.raises(RuntimeError, match="a layer failed"):
                model(input_ids=input_ids, past_key_values=cache)
        finally:
            handle.remove()

    for rollback in (0, 1):
        cache = paged_cache(model, "host", state_rollback_tokens=rollback)
        failing_pass(cache, ids)                       # a prefill: back to no tokens
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache,
                                 max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, len(prompt):].tolist() == expected
        failing_pass(cache, out[:, -1:])              # a decode token: one back
        if rollback:
            with torch.inference_mode():
                model(input_ids=out[:, -1:], past_key_values=cache)
            assert [cache.kv.seq_len(s) for s in cache.rows] == [len(prompt) + NEW_TOKENS]
        else:
            with torch.inference_mode(), pytest.raises(ValueError,
                                                       match="state_rollback_tokens: a forward"):
                model(input_ids=out[:, -1:], past_key_values=cache)
            assert cache.rows == [] and cache.kv.seq_ids() == []

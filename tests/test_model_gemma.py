"""Gemma 3's forward pass (``pagedkv.models.gemma``) against an independent float64 dense forward.

A tiny random Gemma (3 layers: two with a sliding window of 4, then one
full, as Gemma's every-sixth-layer pattern shrunk; 2 query heads over 1 KV
head of head_dim 16) runs prompts longer than the window, in one pass, in
chunks and through the engine, and must give the logits of a float64 forward
written from the architecture's description with no cache: complex-number
RoPE over the halves of each head, explicit window masks, QK-norm, sandwich
norms, tanh-GELU, scaled and tied embeddings.  It is also written to a
``gemma3`` GGUF and loaded back.
"""
import dataclasses

import numpy as np
import pytest

import pagedkv
from dense_kv import DenseKV
from test_model_engine import engine_model
from pagedkv.models.engine import Engine
from pagedkv.models.gemma import (GemmaConfig, GemmaLayerWeights, GemmaModel,
                                  gemma3_layer_windows)
from pagedkv.models.llama import LlamaWeights

# whole-model tests: on the primary OpenCL device only (tests/conftest.py)
pytestmark = pytest.mark.one_opencl_device

CONFIG = GemmaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3,
                     num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=1e6,
                     rms_norm_eps=1e-6, max_position=128, layer_windows=(4, 4, None))
LOGIT_TOLERANCE = 2e-5          # float32 model vs float64 reference, relative to the logits' scale


def random_checkpoint(config, seed=0):
    """Raw ``[out, in]`` matrices and norm weights (Gemma's ``+1`` included), float64."""
    rng = np.random.default_rng(seed)
    c = config

    def mat(rows, cols):
        return rng.standard_normal((rows, cols)) / np.sqrt(cols)

    def norm(size):
        return 1 + 0.2 * rng.standard_normal(size)

    layers = [dict(attn_norm=norm(c.hidden_size), wq=mat(c.q_size, c.hidden_size),
                   wk=mat(c.kv_size, c.hidden_size), wv=mat(c.kv_size, c.hidden_size),
                   q_norm=norm(c.head_dim), k_norm=norm(c.head_dim),
                   wo=mat(c.hidden_size, c.q_size), post_attention_norm=norm(c.hidden_size),
                   ffn_norm=norm(c.hidden_size), w_gate=mat(c.intermediate_size, c.hidden_size),
                   w_up=mat(c.intermediate_size, c.hidden_size),
                   w_down=mat(c.hidden_size, c.intermediate_size),
                   post_ffw_norm=norm(c.hidden_size))
              for _ in range(c.num_layers)]
    return dict(embedding=rng.standard_normal((c.vocab_size, c.hidden_size)) * 0.3,
                output_norm=norm(c.hidden_size), layers=layers)


def dense_forward(checkpoint, config, tokens):
    """Logits at every position of one sequence: float64, no cache, Gemma 3 from its description.

    Returns
    -------
    ndarray, shape [len(tokens), vocab_size], float64
    """
    c = config
    n, half = len(tokens), c.head_dim // 2
    pos = np.arange(n)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps) * w

    def rope(x, theta):                              # the halves (x[i], x[i + D/2]) as complex
        turn = np.exp(1j * pos[:, None] * theta ** (-np.arange(half) * 2 / c.head_dim))
        z = (x[..., :half] + 1j * x[..., half:]) * turn[:, None, :]
        return np.concatenate([z.real, z.imag], axis=-1)

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    x = checkpoint["embedding"][np.asarray(tokens)] * np.sqrt(c.hidden_size)
    for layer, window in zip(checkpoint["layers"], c.layer_windows):
        theta = c.rope_theta if window is None else 10000.0
        visible = pos[None, :] <= pos[:, None]
        if window is not None:
            visible &= pos[None, :] > pos[:, None] - window
        h = norm(x, layer["attn_norm"])
        q = rope(norm((h @ layer["wq"].T).reshape(n, c.num_heads, c.head_dim), layer["q_norm"]),
                 theta)
        k = rope(norm((h @ layer["wk"].T).reshape(n, c.num_kv_heads, c.head_dim),
                      layer["k_norm"]), theta)
        v = (h @ layer["wv"].T).reshape(n, c.num_kv_heads, c.head_dim)
        out = np.empty_like(q)
        for head in range(c.num_heads):
            kv = head // (c.num_heads // c.num_kv_heads)
            scores = np.where(visible, q[:, head] @ k[:, kv].T / np.sqrt(c.head_dim), -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, head] = (weights / weights.sum(axis=1, keepdims=True)) @ v[:, kv]
        x = x + norm(out.reshape(n, -1) @ layer["wo"].T, layer["post_attention_norm"])
        h = norm(x, layer["ffn_norm"])
        ffn = (gelu(h @ layer["w_gate"].T) * (h @ layer["w_up"].T)) @ layer["w_down"].T
        x = x + norm(ffn, layer["post_ffw_norm"])
    return norm(x, checkpoint["output_norm"]) @ checkpoint["embedding"].T


def gemma_model(checkpoint, config):
    return engine_model(checkpoint, config, GemmaLayerWeights, GemmaModel)


def assert_logits_close(actual, expected, message=""):
    np.testing.assert_allclose(actual, expected, rtol=0,
                               atol=LOGIT_TOLERANCE * np.abs(expected).max(), err_msg=message)


@pytest.fixture(scope="module")
def checkpoint():
    return random_checkpoint(CONFIG)


@pytest.fixture(scope="module")
def model(checkpoint):
    return gemma_model(checkpoint, CONFIG)


def test_dense_reference_windows_matter(checkpoint):
    """The oracle itself: causal, and its windows change what positions past the window see."""
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 12).tolist()
    wide = dataclasses.replace(CONFIG, layer_windows=(64, 64, None))  # same RoPE, no cut-off
    full = dense_forward(checkpoint, wide, tokens)
    windowed = dense_forward(checkpoint, CONFIG, tokens)
    np.testing.assert_allclose(windowed[:4], full[:4], atol=1e-12)   # within the window
    assert np.abs(windowed[4:] - full[4:]).max() > 1e-3
    np.testing.assert_allclose(dense_forward(checkpoint, CONFIG, tokens[:7]), windowed[:7],
                               atol=1e-12)


def test_forward_matches_dense_reference_in_one_pass_and_in_steps(checkpoint, model):
    tokens = np.random.default_rng(2).integers(0, CONFIG.vocab_size, 13)
    expected = dense_forward(checkpoint, CONFIG, tokens.tolist())
    n = len(tokens)
    logits = model.forward(tokens, np.arange(n), DenseKV(CONFIG.layer_windows), np.arange(n))
    assert logits.dtype == np.float32 and logits.shape == (n, CONFIG.vocab_size)
    assert_logits_close(logits, expected)
    # the same sequence as a prefill of 5, a chunk of 6, then two decodes
    store, rows = DenseKV(CONFIG.layer_windows), []
    for start, stop in ((0, 5), (5, 11), (11, 12), (12, 13)):
        rows.append(model.forward(tokens[start:stop], np.arange(start, stop), store,
                                  np.arange(stop - start)))
    assert_logits_close(np.concatenate(rows), expected, "chunked steps")


def test_config_validation_and_defaults():
    assert CONFIG.attention_scale == 0.25 and CONFIG.embedding_scale == np.sqrt(32)
    assert CONFIG.has_windowed_layers
    assert gemma3_layer_windows(13, 512) == (512,) * 5 + (None,) + (512,) * 5 + (None, 512)
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=1,
                num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="layer_windows: expected 2 entries"):
        GemmaConfig(**base, layer_windows=(4,))
    with pytest.raises(ValueError, match=r"layer_windows\[1\]: expected None or an int >= 1"):
        GemmaConfig(**base, layer_windows=(4, 0))
    with pytest.raises(ValueError, match="rope_theta_sliding"):
        GemmaConfig(**base, rope_theta_sliding=-1.0)


def test_model_refuses_llama_layers(checkpoint):
    from pagedkv.models.llama import LayerWeights
    layers = [LayerWeights.from_projections(**{k: v for k, v in layer.items() if k not in (
        "q_norm", "k_norm", "post_attention_norm", "post_ffw_norm")})
        for layer in checkpoint["layers"]]
    weights = LlamaWeights(token_embedding=checkpoint["embedding"].astype(np.float32),
                           layers=layers, output_norm=checkpoint["output_norm"].astype(np.float32))
    with pytest.raises(ValueError, match=r"weights.layers\[0\]: expected GemmaLayerWeights"):
        GemmaModel(CONFIG, weights)


def test_attention_scale_other_than_the_default_is_folded_into_q(checkpoint):
    """Gemma 3 27B attends with 1/sqrt(query_pre_attn_scalar) != 1/sqrt(head_dim)."""
    config = dataclasses.replace(CONFIG, attention_scale=0.1)
    tokens = np.arange(9) % CONFIG.vocab_size
    expected_default = dense_forward(checkpoint, CONFIG, tokens.tolist())
    logits = gemma_model(checkpoint, config).forward(tokens, np.arange(9),
                                                     DenseKV(CONFIG.layer_windows), np.arange(9))
    # a scale of 0.1 instead of 0.25 must change the result ...
    assert np.abs(logits - expected_default).max() > 1e-3
    # ... exactly as scaling q by 0.1 / 0.25 in the reference would
    scaled = {**checkpoint, "layers": [{**layer, "q_norm": layer["q_norm"] * 0.4}
                                       for layer in checkpoint["layers"]]}
    assert_logits_close(logits, dense_forward(scaled, CONFIG, tokens.tolist()))


def run_engine(model, cache, prompts, max_new_tokens, **kwargs):
    engine = Engine(model, cache, **kwargs)
    ids = [engine.add_request(p, max_new_tokens=max_new_tokens) for p in prompts]
    events = {i: [] for i in ids}
    while engine.has_unfinished():
        for event in engine.step():
            events[event.request_id].append(event)
    assert cache.num_free_pages == cache.num_pages
    return [events[i] for i in ids]


def assert_engine_matches_dense(checkpoint, config, prompts, events):
    for prompt, generated in zip(prompts, events):
        tokens = prompt + [e.token_id for e in generated]
        reference = dense_forward(checkpoint, config, tokens)
        for i, event in enumerate(generated):
            assert_logits_close(event.logits, reference[len(prompt) - 1 + i], f"token {i}")


def test_engine_over_a_full_attention_cache(backend, checkpoint):
    """Windows wider than every sequence: a cache without windows is exact; the engine's
    chunked prefill and batching then match the dense forward."""
    config = dataclasses.replace(CONFIG, layer_windows=(64, 64, None))
    model = gemma_model(checkpoint, config)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (9, 3, 14)]
    cache = pagedkv.PagedKVCache(config.num_layers, config.num_kv_heads, config.head_dim,
                                 num_pages=32, page_size=4, backend=backend)
    events = run_engine(model, cache, prompts, 5, max_num_batched_tokens=6)
    assert_engine_matches_dense(checkpoint, config, prompts, events)


def test_engine_over_the_window_pool(backend, checkpoint, model):
    """Sequences well past the window of 4, through a cache that keeps only the window."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (11, 5, 17)]
    cache = pagedkv.PagedKVCache(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim,
                                 num_pages=32, page_size=4, backend=backend,
                                 layer_windows=list(CONFIG.layer_windows))
    events = run_engine(model, cache, prompts, 6, max_num_batched_tokens=6)
    assert_engine_matches_dense(checkpoint, CONFIG, prompts, events)


# -- the GGUF round trip -----------------------------------------------------------------
_GGUF_NAMES = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
               "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "wo": "attn_output",
               "post_attention_norm": "post_attention_norm", "ffn_norm": "ffn_norm",
               "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
               "post_ffw_norm": "post_ffw_norm"}


def write_gemma_gguf(path, checkpoint, config, *, window=4, pattern=None, drop=()):
    """``checkpoint`` as a ``gemma3`` GGUF with a SentencePiece vocabulary (no space prefix)."""
    import gguf
    from test_model_gguf import add_shape_keys, finish_gguf, sentencepiece_metadata
    writer = gguf.GGUFWriter(str(path), "gemma3")
    add_shape_keys(writer, "gemma3", config, **{"attention.key_length": config.head_dim,
                                               "attention.value_length": config.head_dim})
    if window is not None:
        writer.add_uint32("gemma3.attention.sliding_window", window)
    if pattern is not None:
        writer.add_array("gemma3.attention.sliding_window_pattern", pattern)
    vocab = sentencepiece_metadata()
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", vocab["tokenizer.ggml.tokens"])
    writer.add_array("tokenizer.ggml.scores", vocab["tokenizer.ggml.scores"])
    writer.add_array("tokenizer.ggml.token_type", vocab["tokenizer.ggml.token_type"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_bool("tokenizer.ggml.add_space_prefix", False)
    arrays = {"token_embd.weight": checkpoint["embedding"],
              "output_norm.weight": checkpoint["output_norm"]}
    for i, layer in enumerate(checkpoint["layers"]):
        arrays.update({f"blk.{i}.{_GGUF_NAMES[k]}.weight": v for k, v in layer.items()})
    return finish_gguf(writer, {n: a for n, a in arrays.items() if n not in drop})


@pytest.fixture(scope="module")
def gguf_config():
    from test_model_gguf import require, sentencepiece_metadata
    require("gguf", "tokenizers")
    vocab_size = len(sentencepiece_metadata()["tokenizer.ggml.tokens"])
    # the layer pattern of the file (no pattern key: every 6th layer full) over 7 layers
    return dataclasses.replace(CONFIG, vocab_size=vocab_size, num_layers=7,
                               layer_windows=gemma3_layer_windows(7, 4),
                               rms_norm_eps=float(np.float32(1e-6)))


def test_gemma_gguf_loads_and_matches_dense_forward(tmp_path, gguf_config):
    from pagedkv.models.gguf_loader import load_gguf_model
    from pagedkv.models.tokenizer import GGUFTokenizer
    checkpoint = random_checkpoint(gguf_config, seed=7)
    stored = write_gemma_gguf(tmp_path / "tiny-gemma.gguf", checkpoint, gguf_config)
    loaded = load_gguf_model(tmp_path / "tiny-gemma.gguf")
    assert isinstance(loaded.model, GemmaModel)
    assert loaded.model.config == gguf_config
    assert loaded.model.config.layer_windows == (4, 4, 4, 4, 4, None, 4)
    as_stored = {**checkpoint, "embedding": stored["token_embd.weight"].astype(np.float64)}
    tokens = np.random.default_rng(5).integers(0, gguf_config.vocab_size, 10)
    logits = loaded.model.forward(tokens, np.arange(10), DenseKV(gguf_config.layer_windows),
                                  np.arange(10))
    assert_logits_close(logits, dense_forward(as_stored, gguf_config, tokens.tolist()))
    tokenizer = GGUFTokenizer.from_metadata(loaded.metadata)
    tokens = loaded.metadata["tokenizer.ggml.tokens"]
    # no space prefix (Gemma): "Hello" is not "\u2581Hello"
    assert tokenizer.encode("Hello world", add_bos=False)[-1] == tokens.index("\u2581world")
    assert tokens[tokenizer.encode("Hello", add_bos=False)[0]] != "\u2581Hello"


@pytest.mark.parametrize("case, match", [
    (dict(window=None), "lacks a positive 'gemma3.attention.sliding_window'"),
    (dict(pattern=[True, False]), "sliding_window_pattern' has 2 entries for 7 layers"),
    (dict(drop={"blk.3.post_ffw_norm.weight"}), r"missing tensors.*blk.3.post_ffw_norm"),
])
def test_bad_gemma_files_raise_model_format_error(tmp_path, gguf_config, case, match):
    from pagedkv.models.errors import ModelFormatError
    from pagedkv.models.gguf_loader import load_gguf_model
    path = tmp_path / "bad.gguf"
    write_gemma_gguf(path, random_checkpoint(gguf_config), gguf_config, **case)
    with pytest.raises(ModelFormatError, match=match):
        load_gguf_model(path)


def test_per_layer_window_pattern_from_the_file(tmp_path, gguf_config):
    from pagedkv.models.gguf_loader import read_gguf_header
    path = tmp_path / "pattern.gguf"
    pattern = [True, False, True, True, False, True, True]
    write_gemma_gguf(path, random_checkpoint(gguf_config), gguf_config, pattern=pattern)
    assert read_gguf_header(path).config.layer_windows == (4, None, 4, 4, None, 4, 4)

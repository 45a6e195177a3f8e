"""Loading Llama GGUF files and their tokenizers, on small files written by the tests.

A tiny random Llama is written with ``gguf.GGUFWriter`` (float32 and Q8_0
tensors, a byte-level BPE vocabulary, a chat template), loaded back, and
its logits compared with the independent dense forward of
``test_model_engine``.  Broken or foreign files must give clear errors.
"""
import dataclasses
import importlib.util
import os

import numpy as np
import pytest

from test_model_engine import CONFIG, dense_forward, random_checkpoint


def require(*modules, extra="demo", install='pip install "pagedkv[demo]"'):
    """Skip when an optional dependency is missing, except in CI (env CI set), where that fails."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        message = f"needs {', '.join(missing)} ({install})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must install the {extra} extra")
        pytest.skip(message)


def require_model(is_installed, install):
    """Skip without the model package ``install`` names, except in CI, where that fails."""
    require("gguf", "tokenizers")
    if not is_installed():
        message = f"needs the model: {install}"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must install it")
        pytest.skip(message)


def load_with_tokenizer(path):
    """``(model, tokenizer)`` of a GGUF file."""
    from pagedkv.models.gguf_loader import load_gguf_model
    from pagedkv.models.tokenizer import GGUFTokenizer
    loaded = load_gguf_model(path)
    return loaded.model, GGUFTokenizer.from_metadata(loaded.metadata)


def add_shape_keys(writer, arch, config, **extra):
    """The ``{arch}.*`` shape keys of ``config`` (and ``extra`` uint32 keys) on a GGUFWriter."""
    c = config
    for key, value in {"block_count": c.num_layers, "context_length": c.max_position,
                       "embedding_length": c.hidden_size,
                       "feed_forward_length": c.intermediate_size,
                       "attention.head_count": c.num_heads,
                       "attention.head_count_kv": c.num_kv_heads, **extra}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", c.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)


@pytest.fixture(autouse=True, scope="module")
def _needs_demo_stack():
    require("gguf", "tokenizers")


CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_symbols():
    """GPT-2's byte -> printable symbol table (the alphabet of byte-level BPE vocabularies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_vocabulary():
    """Tokens, merges and token types: control tokens, 256 bytes, a few merges."""
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_symbols() \
        + ["Ġt", "he", "Ġthe", "Ġa"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, merges, types


VOCAB_SIZE = len(tiny_vocabulary()[0])
GGUF_CONFIG = dataclasses.replace(CONFIG, vocab_size=VOCAB_SIZE)


def write_gguf(path, checkpoint, *, arch="llama", quantize=("blk.1.ffn_up.weight",),
               extra_tensors=(), drop_tensors=(), tokenizer_model="gpt2"):
    """Write ``checkpoint`` (raw [out, in] float64 arrays) as a GGUF file.

    Returns
    -------
    dict name -> ndarray
        What the file holds for each tensor, as float32 (quantized ones
        dequantized), i.e. what a correct loader must return.
    """
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    add_shape_keys(writer, arch, GGUF_CONFIG, **{"rope.dimension_count": GGUF_CONFIG.rope_dim})
    tokens, merges, types = tiny_vocabulary()
    writer.add_string("tokenizer.ggml.model", tokenizer_model)
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)

    names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
             "wo": "attn_output", "ffn_norm": "ffn_norm", "w_gate": "ffn_gate",
             "w_up": "ffn_up", "w_down": "ffn_down"}
    arrays = {"token_embd.weight": checkpoint["embedding"],
              "output_norm.weight": checkpoint["output_norm"]}
    for i, layer in enumerate(checkpoint["layers"]):
        arrays.update({f"blk.{i}.{names[k]}.weight": v for k, v in layer.items()})
    arrays.update(extra_tensors)
    return finish_gguf(writer, {n: a for n, a in arrays.items() if n not in drop_tensors},
                       quantize)


def finish_gguf(writer, arrays, quantize=()):
    """Add ``arrays`` (name -> float array) to an open ``gguf.GGUFWriter`` and write the file.

    Tensors named in ``quantize`` are stored as Q8_0.

    Returns
    -------
    dict name -> ndarray
        What the file holds for each tensor, as float32.
    """
    import gguf
    stored = {}
    for name, array in arrays.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if name in quantize:
            q8 = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(array, q8)
            writer.add_tensor(name, data, raw_dtype=q8)
            stored[name] = gguf.quants.dequantize(data, q8).reshape(array.shape)
        else:
            writer.add_tensor(name, array)
            stored[name] = array
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.fixture(scope="module")
def checkpoint():
    # Q8_0 quantizes rows in blocks of 32: ffn_up's 64 columns qualify.
    return random_checkpoint(GGUF_CONFIG, seed=5)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, checkpoint):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    stored = write_gguf(path, checkpoint)
    return path, stored


def as_checkpoint(stored, config):
    """The raw-array checkpoint layout of what a file stores."""
    keys = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
            "attn_output": "wo", "ffn_norm": "ffn_norm", "ffn_gate": "w_gate",
            "ffn_up": "w_up", "ffn_down": "w_down"}
    layers = [{keys[k]: stored[f"blk.{i}.{k}.weight"].astype(np.float64) for k in keys}
              for i in range(config.num_layers)]
    return dict(embedding=stored["token_embd.weight"].astype(np.float64),
                output_norm=stored["output_norm.weight"].astype(np.float64), layers=layers)


def test_load_gguf_matches_dense_forward(gguf_file):
    from pagedkv.models.gguf_loader import load_gguf_model
    path, stored = gguf_file
    loaded = load_gguf_model(path)
    model = loaded.model
    # the file stores eps as float32
    assert model.config == dataclasses.replace(GGUF_CONFIG, rms_norm_eps=float(np.float32(1e-5)))
    assert model.weights.output is None                     # tied embeddings
    np.testing.assert_array_equal(model.weights.token_embedding, stored["token_embd.weight"])
    # the Q8_0 tensor is the file's dequantized values, close to the original
    w_up = model.weights.layers[1].w_gate_up[:, GGUF_CONFIG.intermediate_size:]
    np.testing.assert_array_equal(w_up, stored["blk.1.ffn_up.weight"].T)

    tokens = [5, 77, 3, 140, 9, 260, 31, 8, 100]
    expected = dense_forward(as_checkpoint(stored, GGUF_CONFIG), GGUF_CONFIG, tokens)
    n = len(tokens)

    def attend(layer, q, k, v):                            # the dense oracle's attention
        from reference import dense_attention
        return dense_attention(q, k, v, np.arange(n)).astype(np.float32)

    logits = model.forward(np.array(tokens), np.arange(n), attend, np.arange(n))
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_tokenizer_from_gguf_metadata(gguf_file):
    from pagedkv.models.gguf_loader import open_gguf, read_metadata
    from pagedkv.models.tokenizer import GGUFTokenizer, TextStream
    tokenizer = GGUFTokenizer.from_metadata(read_metadata(open_gguf(gguf_file[0])))
    tokens = tiny_vocabulary()[0]
    assert tokenizer.encode(" the") == [tokens.index("Ġthe")]
    assert tokenizer.encode(" a the") == [tokens.index("Ġa"), tokens.index("Ġthe")]
    assert tokenizer.encode("<|im_start|>x") == [1, tokens.index("x")]   # control tokens parse
    text = "Grüße, 世界! 🙂 the end"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text                                # byte-level: lossless
    stream = TextStream(tokenizer)
    assert "".join(stream.push(i) for i in ids) == text
    assert tokenizer.stop_ids == {0, 2}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode_chat([{"role": "user", "content": "hi"}])[:1] == [1]


def test_missing_file_and_garbage_file(tmp_path):
    from pagedkv.models.errors import ModelFormatError
    from pagedkv.models.gguf_loader import load_gguf_model
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_gguf_model(tmp_path / "absent.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ModelFormatError, match="not a readable GGUF"):
        load_gguf_model(garbage)


@pytest.mark.parametrize("case, match", [
    (dict(arch="qwen2"), "Llama-family.*'qwen2'"),
    (dict(extra_tensors={"blk.0.attn_q.bias": np.zeros(64)}), "does not support.*attn_q.bias"),
    (dict(drop_tensors={"blk.1.ffn_down.weight"}), "missing tensors.*ffn_down"),
])
def test_unsupported_files_raise_model_format_error(tmp_path, checkpoint, case, match):
    from pagedkv.models.errors import ModelFormatError
    from pagedkv.models.gguf_loader import load_gguf_model
    path = tmp_path / "bad.gguf"
    write_gguf(path, checkpoint, **case)
    with pytest.raises(ModelFormatError, match=match):
        load_gguf_model(path)


def sentencepiece_metadata():
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, 256 byte pieces, scored pieces."""
    merged = ["ll", "He", "\u2581He", "llo", "\u2581Hello", "or", "\u2581w", "\u2581wor", "ld",
              "\u2581world"]
    singles = ["\u2581", "H", "e", "l", "o", "w", "r", "d"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + singles + merged
    types = [2, 3, 3] + [6] * 256 + [1] * (len(singles) + len(merged))
    # a merged piece's score ranks its merge: "ll" first, "\u2581world" last
    scores = [0.0] * (3 + 256 + len(singles)) + [-1.0 - i for i in range(len(merged))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


def test_sentencepiece_tokenizer():
    from pagedkv.models.tokenizer import GGUFTokenizer
    metadata = sentencepiece_metadata()
    tokens = metadata["tokenizer.ggml.tokens"]
    tokenizer = GGUFTokenizer.from_metadata(metadata)
    ids = tokenizer.encode("Hello world")
    assert ids == [1, tokens.index("\u2581Hello"), tokens.index("\u2581world")]   # BOS added
    assert tokenizer.decode(ids) == "Hello world"
    ids = tokenizer.encode("H\u00e9", add_bos=False)       # no piece for "é": its UTF-8 bytes
    assert [tokens[i] for i in ids] == ["\u2581", "H", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(ids) == "H\u00e9"
    assert tokenizer.stop_ids == {2}


def test_unknown_tokenizer_kind_is_refused_clearly():
    from pagedkv.models.errors import ModelFormatError
    from pagedkv.models.tokenizer import GGUFTokenizer
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.model, got 'bert'"):
        GGUFTokenizer.from_metadata({**sentencepiece_metadata(), "tokenizer.ggml.model": "bert"})

"""The fast GGUF reader (``pagedkv.models.gguf_file``) against the ``gguf`` package's own reader.

Files written with ``gguf.GGUFWriter`` (every value type, float32 and Q8_0
tensors) must read back with the same metadata, the same tensor index and
the same dequantized values as ``gguf.GGUFReader`` gives; broken files must
be refused with the place they break.
"""
import struct

import numpy as np
import pytest

from test_model_gguf import require


@pytest.fixture(autouse=True, scope="module")
def _needs_gguf():
    require("gguf")


def write_sample(path):
    import gguf
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4000000000)
    writer.add_int32("t.i32", -2000000000)
    writer.add_float32("t.f32", 1e-6)
    writer.add_uint64("t.u64", 2 ** 63)
    writer.add_int64("t.i64", -2 ** 62)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "h\u00e9llo \u2581 \U0001f642")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "\u2581\u2581", " "])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("b.weight", gguf.quants.quantize(
        rng.standard_normal((2, 5, 64)).astype(np.float32), q8), raw_dtype=q8)
    writer.add_tensor("c.weight", rng.standard_normal(7).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_same_metadata_and_tensors_as_the_gguf_reader(tmp_path):
    import gguf
    from pagedkv.models.gguf_file import read_gguf_file
    path = tmp_path / "sample.gguf"
    write_sample(path)
    ours = read_gguf_file(path)
    theirs = gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected and list(ours.metadata) == list(expected)
    assert ours.metadata["t.str"] == "h\u00e9llo \u2581 \U0001f642"
    assert ours.metadata["t.strs"] == ["a", "", "\u2581\u2581", " "]
    assert ours.version == 3
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type
        np.testing.assert_array_equal(mine.shape, reference.shape)
        assert mine.n_elements == reference.n_elements
        np.testing.assert_array_equal(gguf.quants.dequantize(mine.data, mine.tensor_type),
                                      gguf.quants.dequantize(reference.data,
                                                             reference.tensor_type))
    assert not ours.tensors[0].data.flags.writeable          # a read-only map of the file


def test_model_files_read_the_same(tmp_path):
    """The tiny Llama and Gemma files of the other tests, through both readers."""
    import gguf
    from pagedkv.models.gguf_file import read_gguf_file
    from test_model_engine import random_checkpoint as llama_checkpoint
    from test_model_gemma import CONFIG, random_checkpoint, write_gemma_gguf
    from test_model_gguf import GGUF_CONFIG, write_gguf
    write_gguf(tmp_path / "llama.gguf", llama_checkpoint(GGUF_CONFIG, seed=1))
    write_gemma_gguf(tmp_path / "gemma.gguf", random_checkpoint(CONFIG), CONFIG)
    for name in ("llama.gguf", "gemma.gguf"):
        theirs = gguf.GGUFReader(str(tmp_path / name))
        ours = read_gguf_file(tmp_path / name)
        assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items()
                                 if not k.startswith("GGUF.")}
        assert [(t.name, t.tensor_type) for t in ours.tensors] == \
            [(t.name, t.tensor_type) for t in theirs.tensors]


@pytest.mark.parametrize("damage, match", [
    (lambda b: b"GGML" + b[4:], "magic invalid"),
    (lambda b: b[:4] + struct.pack("<I", 1) + b[8:], "version 1 is not supported"),
    (lambda b: b[:4] + struct.pack(">I", 3) + b[8:], "big-endian"),
    (lambda b: b[:40], "truncated file"),
    (lambda b: b[:-100], "run past the end of the file"),
    (lambda b: b"", "magic"),
])
def test_broken_files_are_refused_with_where(tmp_path, damage, match):
    from pagedkv.models.gguf_file import GGUFFormatError, read_gguf_file
    path = tmp_path / "sample.gguf"
    write_sample(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(GGUFFormatError, match=match):
        read_gguf_file(path)

"""A file fuzzer: files ``save`` wrote, mutated, then loaded, on every backend.

Mutations: bytes flipped anywhere, the file truncated or extended, the
safetensors header's shapes, offsets and dtypes edited, tensors dropped,
added, reshaped or retyped, and metadata entries replaced by other JSON
values (the last three with the checksum made to match, as an attacker
would).  Each mutated file either loads with the sequences' K/V as saved or
is refused with a ``ValueError`` naming the path (``OutOfPagesError`` when it
asks for more pages than the cache has), the cache unchanged; and each load
stays within a time and memory bound proportional to the file's size.
"""
import json
import time
import tracemalloc

import numpy as np
import pytest

import pagedkv
from test_kv_file import rewrite_header
from test_reliability_files import read_file, snapshot, write_file
from test_transfer import L, assert_same_bits, make, step

pytest.importorskip("safetensors")

CASES = 300
MEMORY_PER_BYTE = 40          # peak traced memory of one load, per byte of the file
FLOOR = 2 << 20               # bytes any load may use
SECONDS = 5.0                 # a generous ceiling: a load here takes milliseconds


def json_values(rng):
    """A random JSON value of the kinds a hostile file holds."""
    choices = [None, True, -1, 0, 1, 2**31, 2**63, -2**70, 1e308, "float32", "x" * 300, [], {},
               [1, 2, 3], [None] * L, {"num_tokens": 3}, [[[[[1]]]]], "[" * 50 + "]" * 50]
    return choices[rng.integers(len(choices))]


def mutate(data, metadata, tensors, rng):
    """One mutated file's bytes and what was done."""
    kind = rng.integers(9)
    data = bytearray(data)
    if kind == 0:                                  # bytes flipped anywhere
        for at in rng.integers(0, len(data), rng.integers(1, 4)):
            data[at] ^= 1 << int(rng.integers(8))
        return bytes(data), "flipped bytes"
    if kind == 1:
        return bytes(data[:rng.integers(len(data))]), "truncated"
    if kind == 2:
        return bytes(data) + rng.bytes(int(rng.integers(1, 64))), "appended"
    names = sorted(tensors)
    name = names[rng.integers(len(names))]
    if kind == 3:                                   # the header's shapes
        shape = [int(x) for x in rng.choice([0, 1, 2, 3, 2**20, 2**40], rng.integers(0, 4))]
        return rewrite_header(bytes(data), lambda h: h[name].update(shape=shape)), \
            f"shape of {name} -> {shape}"
    if kind == 4:                                   # the header's offsets
        offsets = sorted(int(x) for x in rng.integers(0, len(data) * 2, 2))
        return rewrite_header(bytes(data), lambda h: h[name].update(data_offsets=offsets)), \
            f"offsets of {name} -> {offsets}"
    if kind == 5:                                   # the header's dtypes
        dtype = ["F64", "F32", "F16", "BF16", "I8", "U8", "I64", "BOOL"][rng.integers(8)]
        return rewrite_header(bytes(data), lambda h: h[name].update(dtype=dtype)), \
            f"dtype of {name} -> {dtype}"
    tensors = dict(tensors)
    metadata = dict(metadata)
    if kind == 6:                                   # a metadata entry, checksum matching
        key = sorted(k for k in metadata if k != "checksum")[rng.integers(len(metadata) - 1)]
        raw = ["[" * 20000 + "]" * 20000, "9" * 5000, "{", '"\\ud800"', "NaN"]
        metadata[key] = raw[rng.integers(len(raw))] if rng.integers(4) == 0 else \
            json.dumps(json_values(rng))
        what = f"metadata {key} -> {metadata[key][:40]}"
    elif kind == 7:                                 # a tensor dropped, or one more
        if rng.integers(2):
            del tensors[name]
            what = f"dropped {name}"
        else:
            tensors[name + "x"] = tensors[name]
            what = f"added {name}x"
    else:                                           # a tensor reshaped or retyped
        array = tensors[name]
        if rng.integers(2) and array.ndim:
            tensors[name] = array.reshape(-1)[:max(0, array.size - 1)]
            what = f"shortened {name}"
        else:
            tensors[name] = array.astype([np.float16, np.int64, np.uint8][rng.integers(3)])
            what = f"retyped {name} as {tensors[name].dtype}"
    return None, (metadata, tensors, what)


def test_mutated_files_load_as_saved_or_are_refused_cheaply(backend, tmp_path):
    rng = np.random.default_rng(400)
    source = make(backend, enable_prefix_caching=True, layer_windows=[None, 6, None])
    prompt = rng.integers(0, 500, 13).tolist()
    a, b = source.add_sequence(token_ids=prompt), source.add_sequence()
    step(source, [a, b], [13, 7], rng, token_ids=prompt + list(range(7)))
    step(source, [a, b], [1, 1], rng, token_ids=[1, 2])
    c = source.add_sequence(token_ids=prompt)               # a prefix hit, then freed
    source.free(c)
    good = tmp_path / "good"
    source.save(good)
    data = good.read_bytes()
    metadata, tensors = read_file(good)
    target = make(backend, enable_prefix_caching=True, layer_windows=[None, 6, None],
                  num_pages=256, page_size=3)
    before = snapshot(target)
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(CASES):
        path = tmp_path / f"case{case}"
        content, what = mutate(data, metadata, tensors, rng)
        if content is None:
            metadata_, tensors_, what = what
            write_file(path, tensors_, metadata_)
        else:
            path.write_bytes(content)
        size = path.stat().st_size
        tracemalloc.start()
        began = time.perf_counter()
        try:
            ids = target.load(path)
        except (ValueError, pagedkv.OutOfPagesError) as exc:
            assert isinstance(exc, pagedkv.OutOfPagesError) or str(path) in str(exc), \
                (case, what, str(exc)[:300])
            assert snapshot(target) == before, (case, what)
            outcomes["refused"] += 1
            ids = None
        finally:
            seconds = time.perf_counter() - began
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < FLOOR + MEMORY_PER_BYTE * size, (case, what, peak, size)
        assert seconds < SECONDS, (case, what, seconds)
        if ids is not None:
            assert len(ids) == 2, (case, what)
            for original, loaded in zip((a, b), ids):
                assert_same_bits(source, original, target, loaded)
            outcomes["loaded"] += 1
            target.clear()
            target.reset_prefix_cache()
            assert snapshot(target) == before
        path.unlink()
    assert outcomes["loaded"] and outcomes["refused"] > CASES // 2, outcomes

"""save / load: sequences and the prefix cache in one safetensors file.

Round trips are bit-exact (into other page sizes and backends); a fresh
process that loads a file serves the saved prompts from its prefix cache with
the same cached length and K/V; every kind of bad file is a ValueError naming
the path and the problem with the cache unchanged; a save that fails part
way leaves an earlier file intact and no temporary file.
"""
import json
import os
import pickle

import numpy as np
import pytest

import pagedkv
from pagedkv import kv_file
from python_child import run_python
from test_transfer import D, DTYPES, H, L, assert_same_bits, held_from, make, step, targets

safetensors = pytest.importorskip("safetensors")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


def snapshot(cache):
    return (cache.num_free_pages, cache.num_free_window_pages, cache.stats(),
            {s: (cache.seq_len(s), list(cache.page_ids(s))) for s in cache.seq_ids()})


@pytest.mark.parametrize("dtype", DTYPES)
def test_save_and_load_round_trip(backend, dtype, tmp_path):
    rng = np.random.default_rng(20)
    windows = [None, 6, None]
    cache = make(backend, dtype=dtype, layer_windows=windows)
    a, b, c = (cache.add_sequence() for _ in range(3))
    step(cache, [a, b, c], [13, 1, 0], rng)
    step(cache, [a, b], [1, 4], rng)          # a's first window page goes back
    cache.swap_out(b)                         # swapped-out sequences save too
    path = tmp_path / "kv.safetensors"
    cache.save(path)
    assert os.listdir(tmp_path) == ["kv.safetensors"]
    with safetensors.safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata()
    assert metadata["pagedkv_format_version"] == "1"
    assert metadata["checksum"].startswith("crc32:")
    for name, value in dict(num_layers=L, num_kv_heads=H, head_dim=D, page_size=4,
                            dtype=dtype, layer_windows=windows, num_pages=64,
                            enable_prefix_caching=False, kv_rotation=True).items():
        assert json.loads(metadata[name]) == value, name
    for target in targets():
        for page_size in (4, 3):
            other = make(target, dtype=dtype, page_size=page_size, layer_windows=windows)
            ids = other.load(path)
            assert [other.seq_len(s) for s in ids] == [14, 5, 0]
            assert_same_bits(cache, a, other, ids[0])
            assert_same_bits(cache, c, other, ids[2])
            cache.swap_in(b)
            assert_same_bits(cache, b, other, ids[1])
            cache.swap_out(b)
    ordered = tmp_path / "two.safetensors"
    cache.save(ordered, seq_ids=[c, a])
    other = make(backend, dtype=dtype, layer_windows=windows)
    assert [other.seq_len(s) for s in other.load(ordered)] == [0, 14]


def test_load_converts_dtype_and_the_prefix_cache_to_other_page_sizes(backend, tmp_path):
    rng = np.random.default_rng(21)
    cache = make(backend, enable_prefix_caching=True, dtype="int8")
    prompt = rng.integers(0, 500, 23).tolist()
    s = cache.add_sequence(token_ids=prompt)
    step(cache, [s], [23], rng, token_ids=prompt)
    cache.free(s)                               # only the cached chain is left
    cache.save(tmp_path / "kv.safetensors")
    for page_size, dtype, hit in ((4, "int8", 20), (8, "float32", 16), (3, "float16", 18)):
        other = make(backend, enable_prefix_caching=True, page_size=page_size, dtype=dtype)
        assert other.load(tmp_path / "kv.safetensors") == []
        t = other.add_sequence(token_ids=prompt)
        assert other.seq_len(t) == hit
        u = cache.add_sequence(token_ids=prompt)
        if dtype == "int8":                     # the same dtype: the same bits
            assert_same_bits(other, t, cache, u)
        else:                                   # converted as storing the values would
            stored = make(backend, dtype=dtype, page_size=page_size)
            w = stored.add_sequence()
            batch = stored.append([w], hit)
            for layer in range(L):
                stored.store(layer, batch, *(x[:hit] for x in cache.gather(layer, u)))
            assert_same_bits(other, t, stored, w)
        cache.free(u)


WARM_START_CHILD = r"""
import sys, json
import numpy as np
import pagedkv
path, prompts_path, expected_path, backend = sys.argv[1:]
expected = np.load(expected_path)
cache = pagedkv.PagedKVCache(3, 2, 8, num_pages=64, page_size=4, backend=backend,
                             enable_prefix_caching=True, layer_windows=[None, 6, None])
assert cache.load(path) == [], "no sequences were saved"
report = []
for i, prompt in enumerate(json.load(open(prompts_path))):
    s = cache.add_sequence(token_ids=prompt)
    kv = cache.export_sequence(s)
    report.append(cache.seq_len(s))
    for layer in range(3):
        k, v = cache.gather(layer, s, kv.layer_start[layer])
        assert kv.layer_start[layer] == expected[f"start_{i}_{layer}"]
        assert np.array_equal(k.view(np.uint32), expected[f"k_{i}_{layer}"].view(np.uint32))
        assert np.array_equal(v.view(np.uint32), expected[f"v_{i}_{layer}"].view(np.uint32))
print(json.dumps(report))
"""


def test_a_fresh_process_that_loads_serves_the_prompts_from_cache(backend, tmp_path):
    """Prompts sharing a system prompt are cached (their sequences freed); a new
    process loads the file and gets the same hits, with the same K/V."""
    rng = np.random.default_rng(22)
    cache = make(backend, enable_prefix_caching=True, layer_windows=[None, 6, None])
    system = rng.integers(0, 500, 9).tolist()
    prompts = [system + rng.integers(0, 500, n).tolist() for n in (11, 4, 7)]
    for prompt in prompts:
        s = cache.add_sequence(token_ids=prompt)
        step(cache, [s], [len(prompt) - cache.seq_len(s)], rng,
             token_ids=prompt[cache.seq_len(s):])
        cache.free(s)
    path = str(tmp_path / "prefix.safetensors")
    cache.save(path)
    probes = prompts + [system + [1, 2, 3], prompts[0][:14], [5, 6, 7, 8, 9]]
    expected, hits = {}, []
    for i, prompt in enumerate(probes):
        s = cache.add_sequence(token_ids=prompt)
        hits.append(cache.seq_len(s))
        for layer in range(L):
            start = held_from(cache, s, layer)
            expected[f"start_{i}_{layer}"] = start
            expected[f"k_{i}_{layer}"], expected[f"v_{i}_{layer}"] = cache.gather(layer, s, start)
        cache.free(s)
    assert hits == [16, 12, 12, 8, 12, 0]
    np.savez(tmp_path / "expected.npz", **expected)
    with open(tmp_path / "prompts.json", "w") as f:
        json.dump(probes, f)
    result = run_python(WARM_START_CHILD, path, tmp_path / "prompts.json",
                        tmp_path / "expected.npz", backend)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == hits


def rewrite_header(data, edit):
    """A safetensors file's bytes with its JSON header changed by ``edit(header)``."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n:]


def lie_about_a_shape(header):
    entry = header["sequence.0.k.0"]
    entry["shape"] = [entry["shape"][0] * 2, entry["shape"][1], entry["shape"][2] // 2]


def lie_consistently(path):
    """The lying header with its checksum made to match: only the shapes betray it."""
    data = rewrite_header(open(path, "rb").read(), lie_about_a_shape)
    open(path, "wb").write(data)
    with safetensors.safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    metadata["checksum"] = kv_file.checksum(metadata, tensors)
    data = rewrite_header(data, lambda h: h.update(__metadata__=metadata))
    open(path, "wb").write(data)


def bad_files(good, tmp_path, backend):
    """(description, path, message fragment) of files that must not load."""
    data = open(good, "rb").read()
    files = {}

    def write(name, content):
        files[name] = tmp_path / name
        open(files[name], "wb").write(content)
        return files[name]

    write("truncated", data[:len(data) // 2])
    write("corrupted", data[:-1] + bytes([data[-1] ^ 1]))
    write("a pickle", pickle.dumps({"keys": np.zeros(3)}))
    write("random bytes", np.random.default_rng(0).bytes(4096))
    write("empty", b"")
    write("lying header", rewrite_header(data, lie_about_a_shape))
    write("offsets past the end", rewrite_header(
        data, lambda h: h["sequence.0.v.0"].update(data_offsets=[0, 10 ** 9])))
    write("other version", rewrite_header(
        data, lambda h: h["__metadata__"].update(pagedkv_format_version="99")))
    consistent = write("consistent lie", data)
    lie_consistently(consistent)
    foreign = tmp_path / "foreign"
    safetensors_numpy.save_file({"weight": np.zeros((4, 4), np.float32)}, str(foreign))
    files["foreign"] = foreign
    other_shape = pagedkv.PagedKVCache(L, 1, D, num_pages=8, page_size=4, backend=backend)
    s = other_shape.add_sequence()
    batch = other_shape.append([s], 2)
    for layer in range(L):
        other_shape.store(layer, batch, np.ones((2, 1, D)), np.ones((2, 1, D)))
    other_shape.save(tmp_path / "other heads")
    files["other heads"] = tmp_path / "other heads"
    (tmp_path / "a folder").mkdir()
    files["a folder"] = tmp_path / "a folder"
    files["missing"] = tmp_path / "missing"
    messages = {"truncated": "not a readable safetensors file",
                "corrupted": "corrupted: its data do not match their checksum",
                "a pickle": "not a readable safetensors file",
                "random bytes": "not a readable safetensors file",
                "empty": "not a readable safetensors file",
                "lying header": "corrupted",
                "offsets past the end": "not a readable safetensors file",
                "other version": "pagedkv_format_version '99'",
                "consistent lie": "the tensor 'sequence.0.k.0': expected float32 of shape "
                                  "[5, 2, 8], got float32 of shape [10, 2, 4]",
                "foreign": "not a pagedkv K/V file",
                "other heads": "num_kv_heads: the file's K/V have num_kv_heads=1, this cache 2",
                "a folder": "not a file",
                "missing": "no such file"}
    return [(name, files[name], messages[name]) for name in messages]


def test_bad_files_are_refused_and_change_nothing(backend, tmp_path):
    rng = np.random.default_rng(23)
    source = make(backend, enable_prefix_caching=True)
    prompt = list(range(12))
    s = source.add_sequence(token_ids=prompt)
    step(source, [s], [5], rng, token_ids=prompt[:5])
    good = tmp_path / "good"
    source.save(good)
    target = make(backend, enable_prefix_caching=True)
    t = target.add_sequence(token_ids=prompt)
    step(target, [t], [8], rng, token_ids=prompt[:8])
    before = snapshot(target)
    for name, path, message in bad_files(good, tmp_path, backend):
        with pytest.raises(ValueError) as info:
            target.load(path)
        assert str(path) in str(info.value) and message in str(info.value), name
        assert snapshot(target) == before, name
    assert len(target.load(good)) == 1


def test_out_of_pages_on_load_changes_nothing(backend, tmp_path):
    rng = np.random.default_rng(24)
    source = make(backend, enable_prefix_caching=True)
    cached, live = list(range(100, 124)), list(range(200, 216))
    s = source.add_sequence(token_ids=cached)
    step(source, [s], [24], rng, token_ids=cached)            # 6 cached pages
    source.free(s)
    s = source.add_sequence()
    step(source, [s], [16], rng)                               # a 4-page sequence
    path = tmp_path / "kv"
    source.save(path)
    # 9 pages hold the sequence or the chains, not both (its 4 and their 6)
    target = make(backend, enable_prefix_caching=True, num_pages=9)
    u = target.add_sequence(token_ids=live)
    step(target, [u], [16], rng, token_ids=live)
    target.free(u)                                             # evictable cached pages
    before = snapshot(target)
    with pytest.raises(pagedkv.OutOfPagesError, match="chains need 6 pages besides the "
                                                      "sequences' 4, 9 of 9 free"):
        target.load(path)
    assert snapshot(target) == before
    small = make(backend, num_pages=3)
    with pytest.raises(pagedkv.OutOfPagesError, match="sequences need 4 pages, 3 of 3 free"):
        small.load(path)
    assert small.num_free_pages == 3 and small.seq_ids() == []


FAILING_SAVE_CHILD = r"""
import os, resource, sys
import numpy as np
import pagedkv
path = sys.argv[1]
cache = pagedkv.PagedKVCache(2, 2, 64, num_pages=128, page_size=16, backend="host")
s = cache.add_sequence()
batch = cache.append([s], 16)
for layer in range(2):
    cache.store(layer, batch, np.ones((16, 2, 64)), np.ones((16, 2, 64)))
cache.save(path)
earlier = open(path, "rb").read()
batch = cache.append([s], 1000)
for layer in range(2):
    cache.store(layer, batch, np.ones((1000, 2, 64)), np.ones((1000, 2, 64)))
limit = len(earlier) + 65536          # far below the new file's 2 MB
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    cache.save(path)
    print("saved")
except OSError as exc:
    print("OSError", exc)
assert open(path, "rb").read() == earlier, "the earlier file changed"
print(sorted(os.listdir(os.path.dirname(path))))
"""


def test_a_save_failing_part_way_leaves_the_earlier_file_and_no_temporary(tmp_path):
    path = tmp_path / "kv.safetensors"
    result = run_python(FAILING_SAVE_CHILD, path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("OSError") and str(path) in lines[0], lines
    assert lines[1] == "['kv.safetensors']"

"""The demo's report (``pagedkv.models.report``) on hand-made figures: memory per pool, wording."""
from types import SimpleNamespace

import numpy as np

from pagedkv.models.engine import EngineStats
from pagedkv.models.report import KVMemory, backend_label, format_report, plural


def fake_cache(*, num_layers=4, num_pages=10, window_pages=None, page_bytes=1024,
               layer_windows=None, backend="host", device=None):
    """A cache-like object: ``memory_bytes`` is ``page_bytes`` per page per layer."""
    windows = layer_windows or [None] * num_layers
    num_windowed = sum(w is not None for w in windows)
    cache = SimpleNamespace(num_layers=num_layers, num_pages=num_pages, page_size=16,
                            dtype=np.dtype("float16"), backend=backend, prefix_caching=False,
                            stats=lambda: {})
    layer_pages = num_pages * (num_layers - num_windowed) + (window_pages or 0) * num_windowed
    cache.memory_bytes = layer_pages * page_bytes
    if window_pages is not None:
        cache.num_window_pages = window_pages
        cache.layer_windows = windows
    if device is not None:
        cache._backend = SimpleNamespace(device=SimpleNamespace(name=device))
    return cache


def stats(**kwargs):
    s = EngineStats()
    for name, value in dict(peak_pages_in_use=4, peak_running=1, **kwargs).items():
        setattr(s, name, value)
    return s


def test_memory_of_one_pool():
    cache = fake_cache()
    memory = KVMemory.from_run(stats(), cache, max_seq_len=64)
    assert memory.layer_page_bytes == 1024 and memory.reserved_bytes == cache.memory_bytes
    assert memory.peak_bytes == 4 * 4 * 1024
    assert memory.contiguous_bytes == 1 * (64 // 16) * 4 * 1024          # one sequence of 64
    assert memory.ratio == 1.0


def test_memory_of_two_pools():
    windows = [8, 8, 8, None]
    cache = fake_cache(window_pages=3, layer_windows=windows)
    memory = KVMemory.from_run(stats(peak_window_pages_in_use=2), cache, max_seq_len=64)
    assert (memory.num_full_layers, memory.num_window_layers) == (1, 3)
    assert memory.layer_page_bytes == 1024
    assert memory.reserved_bytes == (10 * 1 + 3 * 3) * 1024
    assert memory.peak_bytes == (4 * 1 + 2 * 3) * 1024
    lines = format_report(stats(peak_window_pages_in_use=2), cache, max_seq_len=64,
                          wall_seconds=1.0, num_prompts=1, num_generated=1)
    assert any("window pool (3 windowed layers): peak 2 of 3 pages" in line for line in lines)
    assert any("full-attention pool (1 layer): peak 4 of 10 pages" in line for line in lines)


def test_windows_of_a_cache_without_a_window_pool_count_as_full():
    cache = fake_cache()
    memory = KVMemory.from_run(stats(), cache, 64, layer_windows=[8, 8, 8, None])
    assert memory.num_window_layers == 0 and memory.layer_page_bytes == 1024


def test_wording():
    assert plural(1, "sequence") == "1 sequence" and plural(3, "step") == "3 steps"
    lines = format_report(stats(), fake_cache(), max_seq_len=64, wall_seconds=2.0,
                          num_prompts=1, num_generated=1)
    assert lines[0] == "1 prompt, 1 token generated in 2.0 s (0 steps, backend host)"
    assert "for 1 sequence would reserve" in lines[3] and "float16" in lines[3]
    assert "n/a" in lines[1] and "n/a" in lines[2]               # no steps: no throughput
    assert backend_label(fake_cache(backend="opencl", device="  NVIDIA  H200 ")) == \
        "opencl (NVIDIA H200)"


def test_throughput_per_kind_of_step():
    s = EngineStats()
    s.record(100, 0, 1.0)            # a prefill-only step: 100 tokens in 1 s
    s.record(0, 2, 0.2)              # decode-only: 2 tokens in 0.2 s (0.1 s per decode row)
    s.record(0, 4, 0.4)
    s.record(50, 2, 0.7)             # mixed: 0.2 s of its time are its 2 decode rows
    assert abs(s.decode_tokens_per_second - 10.0) < 1e-9
    assert abs(s.prefill_seconds - 1.5) < 1e-12
    assert s.prefill_tokens_per_second == 150 / s.prefill_seconds
    assert (s.prefill_steps, s.decode_only_steps, s.num_steps) == (2, 2, 4)
    assert (s.prefill_tokens, s.decode_tokens) == (150, 8)


def test_preemptions_say_whether_they_swapped_or_recomputed():
    def preemption_line(**kwargs):
        lines = format_report(stats(**kwargs), fake_cache(), max_seq_len=64, wall_seconds=1.0,
                              num_prompts=1, num_generated=1)
        return [line for line in lines if line.startswith("preemptions")]
    assert preemption_line() == []
    assert preemption_line(num_preemptions=3, num_swaps=3) == [
        "preemptions: 3 (3 swapped out to host memory and back in, resumed without "
        "recomputation)"]
    assert preemption_line(num_preemptions=2) == [
        "preemptions: 2 (requests recomputed after their pages were reclaimed)"]

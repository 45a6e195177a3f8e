"""The end-of-run report: throughput, KV memory per pool against a contiguous cache, prefix hits."""
from dataclasses import dataclass
from typing import List

_MIB = 1024 * 1024


def plural(count, noun):
    """``"1 sequence"``, ``"4 sequences"``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def backend_label(cache):
    """The cache's backend, with the OpenCL device's name when there is one.

    Reads ``cache.device_name`` when the cache has it, else the opencl
    backend's ``device``.
    """
    name = getattr(cache, "device_name", None)
    if name is None:
        device = getattr(getattr(cache, "_backend", None), "device", None)
        name = getattr(device, "name", None)
    return f"{cache.backend} ({' '.join(str(name).split())})" if name else str(cache.backend)


@dataclass(frozen=True)
class KVMemory:
    """KV memory of a run, per pool, next to what a contiguous max-length cache reserves.

    A cache with windowed layers (``layer_windows``) has two pools: full
    layers take pages of the full pool, windowed layers pages of the window
    pool.  Byte figures assume every layer's page costs the same (true of
    every storage dtype: a page of one layer holds ``page_size`` tokens of
    K and V, plus int8 scales).

    Attributes
    ----------
    dtype : str
        Storage dtype.
    num_full_layers, num_window_layers : int
    pool_pages, window_pool_pages : int
        Pages in each pool (0 window pages without windowed layers).
    peak_pages, peak_window_pages : int
        Most pages of each pool in use after any step.
    layer_page_bytes : float
        K and V of one page of one layer.
    contiguous_bytes : int
        What a contiguous cache of ``max_seq_len`` tokens per sequence, for
        the most sequences that ran at once, reserves (every layer full).
    """
    dtype: str
    num_full_layers: int
    num_window_layers: int
    pool_pages: int
    window_pool_pages: int
    peak_pages: int
    peak_window_pages: int
    layer_page_bytes: float
    contiguous_bytes: int

    @classmethod
    def from_run(cls, stats, cache, max_seq_len, layer_windows=None):
        """Figures of a finished run.

        Parameters
        ----------
        stats : EngineStats
        cache : PagedKVCache
        max_seq_len : int
            The per-sequence length a contiguous cache would reserve.
        layer_windows : sequence of (None or int), optional
            What the cache was built with (default: ``cache.layer_windows``
            if it has them).  Every layer counts as full for a cache
            without a window pool (no ``num_window_pages``).
        """
        if layer_windows is None:
            layer_windows = getattr(cache, "layer_windows", None)
        if not hasattr(cache, "num_window_pages"):
            layer_windows = None
        windows = list(layer_windows or [None] * cache.num_layers)
        num_window_layers = sum(w is not None for w in windows)
        window_pool = int(getattr(cache, "num_window_pages", 0) or 0) if num_window_layers else 0
        num_full_layers = cache.num_layers - num_window_layers
        layer_pages = cache.num_pages * num_full_layers + window_pool * num_window_layers
        layer_page_bytes = cache.memory_bytes / layer_pages if layer_pages else 0.0
        pages_per_seq = -(-max_seq_len // cache.page_size)
        contiguous = stats.peak_running * pages_per_seq * cache.num_layers * layer_page_bytes
        return cls(dtype=str(getattr(cache.dtype, "name", cache.dtype)),
                   num_full_layers=num_full_layers, num_window_layers=num_window_layers,
                   pool_pages=cache.num_pages, window_pool_pages=window_pool,
                   peak_pages=stats.peak_pages_in_use,
                   peak_window_pages=getattr(stats, "peak_window_pages_in_use", 0),
                   layer_page_bytes=layer_page_bytes, contiguous_bytes=int(contiguous))

    @property
    def reserved_bytes(self):
        """Bytes of both pools."""
        return self.layer_page_bytes * (self.pool_pages * self.num_full_layers
                                        + self.window_pool_pages * self.num_window_layers)

    @property
    def peak_bytes(self):
        """Bytes of the pages in use at the peak, both pools."""
        return self.layer_page_bytes * (self.peak_pages * self.num_full_layers
                                        + self.peak_window_pages * self.num_window_layers)

    @property
    def ratio(self):
        """How many times more the contiguous cache reserves than the peak in use."""
        return self.contiguous_bytes / self.peak_bytes if self.peak_bytes else float("inf")


def prefix_hit_rate(cache):
    """The cache's prefix-cache hit rate as text, or why there is none.

    Uses ``cache.stats()`` when the cache has it (prefix caching); reads a
    ``prefix_hit_rate`` / ``hit_rate`` entry, or ``hits`` over ``queries``.
    """
    stats_fn = getattr(cache, "stats", None)
    if not callable(stats_fn):
        return "n/a (prefix caching not available)"
    if getattr(cache, "prefix_caching", None) is False:
        return "n/a (prefix caching is off)"
    stats = stats_fn()
    values = stats if isinstance(stats, dict) else vars(stats)
    for key in ("prefix_hit_rate", "hit_rate"):
        if values.get(key) is not None:
            return f"{100 * float(values[key]):.1f}%"
    hits = values.get("prefix_hits", values.get("hits"))
    queries = values.get("prefix_queries", values.get("queries", values.get("lookups")))
    if hits is not None and queries:
        return f"{100 * hits / queries:.1f}% ({hits} of {queries})"
    return f"n/a (cache.stats() has no hit rate: {stats!r})"


def _rate(tokens_per_second):
    return f"{tokens_per_second:.1f} tokens/s" if tokens_per_second else "n/a"


def format_report(stats, cache, *, max_seq_len, wall_seconds, num_prompts,
                  num_generated, layer_windows=None) -> List[str]:
    """Lines of the report printed after a run.

    Parameters
    ----------
    stats : EngineStats
    cache : PagedKVCache
    max_seq_len : int
        The per-sequence length a contiguous cache would have to reserve.
    wall_seconds : float
        Time from the first step to the last.
    num_prompts, num_generated : int
        Requests served and tokens they generated.
    layer_windows : sequence of (None or int), optional
        What the cache was built with (see :meth:`KVMemory.from_run`).
    """
    memory = KVMemory.from_run(stats, cache, max_seq_len, layer_windows)
    mib = memory.layer_page_bytes / _MIB
    lines = [
        f"{plural(num_prompts, 'prompt')}, {plural(num_generated, 'token')} generated in "
        f"{wall_seconds:.1f} s ({plural(stats.num_steps, 'step')}, backend "
        f"{backend_label(cache)})",
        f"prefill: {stats.prefill_tokens} tokens in {plural(stats.prefill_steps, 'step')} with "
        f"prefill chunks, {_rate(stats.prefill_tokens_per_second)} (those steps' time less "
        f"their decode rows' share)",
        f"decode:  {stats.decode_tokens} tokens; {_rate(stats.decode_tokens_per_second)} in "
        f"{plural(stats.decode_only_steps, 'decode-only step')} (all running requests together)",
    ]
    each = "for 1 sequence" if stats.peak_running == 1 else \
        f"for each of {stats.peak_running} sequences"
    contiguous = (f"a contiguous cache of {max_seq_len} tokens {each} would reserve "
                  f"{memory.contiguous_bytes / _MIB:.1f} MiB, {memory.ratio:.1f}x the peak")
    lines.append(f"KV memory ({memory.dtype}, page_size {cache.page_size}): "
                 f"{memory.reserved_bytes / _MIB:.1f} MiB reserved, peak "
                 f"{memory.peak_bytes / _MIB:.1f} MiB in use; {contiguous}")
    lines.append(f"  full-attention pool ({plural(memory.num_full_layers, 'layer')}): peak "
                 f"{memory.peak_pages} of {memory.pool_pages} pages "
                 f"({memory.peak_pages * memory.num_full_layers * mib:.1f} MiB)")
    if memory.num_window_layers:
        lines.append(f"  window pool ({plural(memory.num_window_layers, 'windowed layer')}): "
                     f"peak {memory.peak_window_pages} of {memory.window_pool_pages} pages "
                     f"({memory.peak_window_pages * memory.num_window_layers * mib:.1f} MiB)")
    lines.append(f"prefix cache hit rate: {prefix_hit_rate(cache)}")
    swaps = getattr(stats, "num_swaps", 0)
    if swaps:
        lines.append(f"preemptions: {stats.num_preemptions} ({swaps} swapped out to host "
                     f"memory and back in, resumed without recomputation)")
    elif stats.num_preemptions:
        lines.append(f"preemptions: {stats.num_preemptions} (requests recomputed after their "
                     f"pages were reclaimed)")
    return lines

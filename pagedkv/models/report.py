"""The end-of-run report: throughput, KV memory against a contiguous cache, prefix hits."""
from dataclasses import dataclass
from typing import List

_MIB = 1024 * 1024


@dataclass(frozen=True)
class MemoryComparison:
    """Peak paged KV use next to what a contiguous max-length cache would reserve.

    Attributes
    ----------
    peak_pages : int
        Most pages in use after any step.
    pool_pages : int
        Pages in the cache's pool.
    contiguous_pages : int
        Page-equivalents a contiguous cache reserves: ``max_seq_len`` tokens
        for each of the most sequences that ran at once.
    bytes_per_page : int
        K and V of one page across all layers.
    """
    peak_pages: int
    pool_pages: int
    contiguous_pages: int
    bytes_per_page: int

    @classmethod
    def from_run(cls, stats, cache, max_seq_len):
        page_size = cache.page_size
        return cls(peak_pages=stats.peak_pages_in_use, pool_pages=cache.num_pages,
                   contiguous_pages=stats.peak_running * -(-max_seq_len // page_size),
                   bytes_per_page=cache.memory_bytes // cache.num_pages)

    @property
    def ratio(self):
        """How many times more the contiguous cache reserves."""
        return self.contiguous_pages / self.peak_pages if self.peak_pages else float("inf")


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


def format_report(stats, cache, *, max_seq_len, wall_seconds, num_prompts,
                  num_generated) -> List[str]:
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
    """
    memory = MemoryComparison.from_run(stats, cache, max_seq_len)
    mib = memory.bytes_per_page / _MIB
    lines = [
        f"{num_prompts} prompts, {num_generated} tokens generated in {wall_seconds:.1f} s "
        f"({stats.num_steps} steps, backend {cache.backend})",
        f"prefill: {stats.prefill_tokens} tokens, {stats.prefill_tokens_per_second:.1f} tokens/s",
        f"decode:  {stats.decode_tokens} tokens, {stats.decode_tokens_per_second:.1f} tokens/s",
        f"KV pages: peak {memory.peak_pages} of {memory.pool_pages} in the pool "
        f"({memory.peak_pages * mib:.1f} MiB, page_size {cache.page_size}); a contiguous cache "
        f"of {max_seq_len} tokens for each of {stats.peak_running} sequences would reserve "
        f"{memory.contiguous_pages} pages ({memory.contiguous_pages * mib:.1f} MiB), "
        f"{memory.ratio:.1f}x more",
        f"prefix cache hit rate: {prefix_hit_rate(cache)}",
    ]
    if stats.num_preemptions:
        lines.append(f"preemptions: {stats.num_preemptions} (requests recomputed after their "
                     f"pages were reclaimed)")
    return lines

"""A generation request and its progress through the engine."""
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional


@dataclass
class Request:
    """One prompt being completed.

    Attributes
    ----------
    request_id : int
    prompt_ids : list of int
    max_new_tokens : int
    temperature : float
        0 = greedy.
    top_k : int
        Sample among the ``top_k`` likeliest tokens only (0 = all).
    top_p : float
        Sample among the likeliest tokens that reach this probability (1 = all).
    stop_ids : frozenset of int
        Generating one of these finishes the request (the id is kept in
        ``output_ids``; decoding with ``skip_special`` hides it).
    output_ids : list of int
        Tokens generated so far.
    seq_id : int or None
        The cache sequence while the request holds one, swapped out or not
        (None while waiting, after a preemption that recomputes, and once
        finished).
    num_computed : int
        Leading tokens of ``prompt_ids + output_ids`` whose K/V are in the
        cache.  Everything after them is computed by coming steps; when all
        but nothing is pending, the next step's last row yields the next token.
    finish_reason : {None, "stop", "length"}
    prefilled : SequenceKV or None
        K/V of the leading ``num_computed`` tokens computed elsewhere
        (disaggregated prefill), imported into the cache when the request is
        admitted; None once imported, or for a request computed here.
    import_seconds : float
        Time that import took.
    num_samples : int
        Completions of the prompt wanted: once the prompt is computed, the
        request is forked ``num_samples - 1`` times (the samples share the
        prompt's pages), each fork drawing its own first token from the
        prompt's logits.
    parent_id : int or None
        For a fork: the request it was forked from; ``sample`` is its number
        among the prompt's completions (0: the request itself).
    num_preemptions : int
        Times the request lost its pages: swapped out to host memory (with a
        cache that swaps; ``seq_id`` and ``num_computed`` are kept), or freed
        and recomputed.
    """
    request_id: int
    prompt_ids: List[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: FrozenSet[int] = frozenset()
    output_ids: List[int] = field(default_factory=list)
    seq_id: Optional[int] = None
    num_computed: int = 0
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    prefilled: Optional[object] = None
    import_seconds: float = 0.0
    num_samples: int = 1
    parent_id: Optional[int] = None
    sample: int = 0

    @property
    def num_tokens(self):
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self):
        """Tokens not yet in the cache (1 for a decoding request)."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self):
        """True when the only pending token is the last one generated."""
        return bool(self.output_ids) and self.num_pending == 1

    @property
    def finished(self):
        return self.finish_reason is not None

    def token_slice(self, start, stop):
        """Tokens ``start:stop`` of ``prompt_ids + output_ids``; list of int."""
        num_prompt = len(self.prompt_ids)
        if stop <= num_prompt:
            return self.prompt_ids[start:stop]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt:stop - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[:stop - num_prompt]

"""The continuous-batching engine: scheduler, one forward per step, sampling.

A step is one ``cache.append(seq_ids, counts)`` covering every decode (one
token) and prefill chunk the scheduler picked, one ``model.forward``
(:meth:`~pagedkv.models.decoder.DecoderModel.forward`) whose attention goes
through ``cache.store`` / ``cache.attention``, and one
sampled token for each sequence whose last pending token was in the step:
only those rows get logits, not the rest of a prefill chunk.
"""
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from pagedkv.errors import OutOfPagesError
from pagedkv.models.request import Request
from pagedkv.models.sampling import sample
from pagedkv.models.scheduler import Scheduler


@dataclass(frozen=True)
class TokenEvent:
    """A token generated for a request in one step.

    Attributes
    ----------
    request_id : int
    token_id : int
    logits : ndarray, shape [vocab_size], float32
        The logits the token was chosen from (a view into the step's logits).
    finish_reason : {None, "stop", "length"}
        Set when this token ends the request (its pages are already freed).
    """
    request_id: int
    token_id: int
    logits: np.ndarray
    finish_reason: Optional[str] = None


@dataclass
class EngineStats:
    """Counters over the engine's life, and throughput measured so that it is stable.

    Throughput is measured per kind of step, not by splitting a mixed step's
    time by token count (a step's cost is not proportional to its tokens:
    every step reads all the weights once, whatever it holds):

    - **decode** (:attr:`decode_tokens_per_second`): tokens generated per
      second in the steps that only decode, all running requests together.
    - **prefill** (:attr:`prefill_tokens_per_second`): prompt tokens computed
      per second in the steps that carry prefill chunks, each such step's
      time less what its decode rows cost (its number of decode rows times
      the median per-token time of the decode-only steps).

    Attributes
    ----------
    num_steps : int
    prefill_tokens, decode_tokens : int
        Prompt (and recomputed) tokens computed, and decode tokens computed.
    decode_only_steps : int
    decode_only_seconds : float
        Time of the steps that only decoded.
    peak_pages_in_use, peak_window_pages_in_use : int
        Most pages of the full pool and of the window pool (a cache with
        windowed layers) in use right after a step's ``append``.
    peak_running, num_preemptions : int
    num_swaps : int
        Of the preemptions, those that swapped the request's K/V out to host
        memory (resumed later without recomputation).
    shared_token_reads_saved : int
        Over the steps that ran with forked samples: the reads of a key
        position (per layer and KV head) that shared-prefix attention saved
        (``StepBatch.sharing.saved_token_reads``; 0 with ``cascade="off"``).
    """
    num_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_only_steps: int = 0
    decode_only_tokens: int = 0
    decode_only_seconds: float = 0.0
    peak_pages_in_use: int = 0
    peak_window_pages_in_use: int = 0
    peak_running: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0
    shared_token_reads_saved: int = 0
    _decode_token_seconds: list = field(default_factory=list, repr=False)
    _prefill_steps: list = field(default_factory=list, repr=False)  # (prefill, decode, seconds)

    def record(self, num_prefill, num_decode, seconds):
        """Count one step of ``num_prefill`` prompt tokens and ``num_decode`` decodes."""
        self.num_steps += 1
        self.prefill_tokens += num_prefill
        self.decode_tokens += num_decode
        if num_prefill:
            self._prefill_steps.append((num_prefill, num_decode, seconds))
        elif num_decode:
            self.decode_only_steps += 1
            self.decode_only_tokens += num_decode
            self.decode_only_seconds += seconds
            self._decode_token_seconds.append(seconds / num_decode)

    @property
    def decode_tokens_per_second(self):
        """Decode throughput of the decode-only steps (0.0 before there is one)."""
        return self.decode_only_tokens / self.decode_only_seconds \
            if self.decode_only_seconds else 0.0

    @property
    def prefill_seconds(self):
        """Time the steps with prefill chunks spent on them (their decode rows' share removed)."""
        per_decode = float(np.median(self._decode_token_seconds)) \
            if self._decode_token_seconds else 0.0
        return sum(max(0.0, seconds - num_decode * per_decode)
                   for _, num_decode, seconds in self._prefill_steps)

    @property
    def prefill_steps(self):
        """Steps that carried prefill chunks."""
        return len(self._prefill_steps)

    @property
    def prefill_tokens_per_second(self):
        """Prefill throughput, see the class notes (0.0 before any prefill)."""
        seconds = self.prefill_seconds
        return self.prefill_tokens / seconds if seconds else 0.0


def paged_attend(cache, batch):
    """The forward's attention hook over a KV cache for one step.

    Parameters
    ----------
    cache : PagedKVCache or compatible (``store`` and ``attention``)
    batch : the step's batch from ``cache.append``

    Returns
    -------
    AttendFn
        ``attend(layer, q, k, v, **variants)``: ``cache.store(layer, batch, k,
        v)`` then ``cache.attention(layer, batch, q, **variants)`` (``scale``,
        ``logits_soft_cap``, ``sinks``, ...: for models that pass them, such as
        transformers' through :mod:`pagedkv.hf`).
    """
    def attend(layer, q, k, v, **variants):
        cache.store(layer, batch, k, v)
        return cache.attention(layer, batch, q, **variants)
    return attend


class Engine:
    """Serve generation requests over one model and one KV cache.

    Parameters
    ----------
    model : DecoderModel
        A :class:`~pagedkv.models.llama.LlamaModel` or
        :class:`~pagedkv.models.gemma.GemmaModel`.  A model with windowed
        layers (``model.config.layer_windows``) needs a cache built with the
        same ``layer_windows``, which applies each layer's window.
    cache : PagedKVCache or compatible
        Sized for the model (``num_layers``, ``num_kv_heads``, ``head_dim``).
        Anything with the same ``add_sequence / free / seq_len / truncate /
        page_count / append / store / attention`` methods works too (the
        benchmark's contiguous baseline).  When ``cache.prefix_caching`` is
        set, requests start on the cached pages of their longest known prefix
        and only the rest of their tokens is computed.
    max_num_seqs : int
        Most requests running at once.
    max_num_batched_tokens : int
        Token budget of a step: decodes plus prefill chunks.
    max_seq_len : int, optional
        Cap on prompt plus generated tokens (default: the model's context
        length, or the cache's ``max_seq_len`` if smaller).
    seed : int or numpy.random.Generator, optional
        Randomness for temperature sampling.
    on_finish : callable, optional
        ``on_finish(request)`` runs when a request finishes, before its
        sequence is freed (e.g. to export its K/V: disaggregated prefill).

    Examples
    --------
    >>> engine = Engine(model, cache)
    >>> rid = engine.add_request(prompt_ids, max_new_tokens=16)
    >>> while engine.has_unfinished():
    ...     for event in engine.step():
    ...         print(event.request_id, event.token_id)
    """

    def __init__(self, model, cache, *, max_num_seqs=32, max_num_batched_tokens=256,
                 max_seq_len=None, seed=None, on_finish=None):
        c = model.config
        for name, got, want in (("num_layers", cache.num_layers, c.num_layers),
                                ("num_kv_heads", cache.num_kv_heads, c.num_kv_heads),
                                ("head_dim", cache.head_dim, c.head_dim)):
            if got != want:
                raise ValueError(f"cache: expected {name}={want} for this model, got {got}")
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        limits = [c.max_position]
        if getattr(cache, "max_seq_len", None):
            limits.append(cache.max_seq_len)
        if max_seq_len is not None:
            if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) \
                    or max_seq_len < 2:
                raise ValueError(f"max_seq_len: expected an int >= 2, got {max_seq_len!r}")
            limits.append(max_seq_len)
        self.model = model
        self.cache = cache
        self.max_seq_len = int(min(limits))
        self.scheduler = Scheduler(cache, max_num_seqs=int(max_num_seqs),
                                   max_num_batched_tokens=int(max_num_batched_tokens))
        self.rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        self.requests = {}
        self.on_finish = on_finish
        self.stats = EngineStats()
        self._next_id = 0

    # -- requests ------------------------------------------------------------------
    def add_request(self, prompt_ids, *, max_new_tokens, temperature=0.0, stop_ids=(),
                    top_k=0, top_p=1.0, num_samples=1):
        """Queue a prompt; it joins the running batch at the next step with room.

        Parameters
        ----------
        prompt_ids : sequence of int, length >= 1
        max_new_tokens : int >= 1
            Generation also stops at ``max_seq_len`` tokens in all.
        temperature : float >= 0
            0 = greedy.
        stop_ids : iterable of int
            Token ids that end the request.
        top_k : int >= 0
            With ``temperature > 0``: sample among the ``top_k`` likeliest
            tokens only (0 = all).
        top_p : float in (0, 1]
            With ``temperature > 0``: sample among the likeliest tokens whose
            probabilities reach ``top_p`` (1 = all).
        num_samples : int >= 1
            Completions of the prompt: the prompt is computed once, then its
            sequence is forked (``PagedKVCache.fork``) into ``num_samples - 1``
            more requests that share its pages, each sampling its own tokens
            from the first on.  The forks' ids appear in the step that
            computes the prompt's last token (their ``parent_id`` is this
            request's id); they run beside the other requests, past
            ``max_num_seqs`` if need be.

        Returns
        -------
        int
            The request id (key of :attr:`requests`).
        """
        vocab_size = self.model.config.vocab_size
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids: expected at least one token, got none")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: expected ids in [0, {vocab_size}), got {bad[:5]}")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"prompt_ids: {len(prompt)} tokens leave no room to generate "
                             f"within max_seq_len={self.max_seq_len}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        temperature = float(temperature)
        if not (temperature >= 0 and np.isfinite(temperature)):
            raise ValueError(f"temperature: expected a finite float >= 0, got {temperature!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0, got {top_k!r}")
        top_p = float(top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: expected a float in (0, 1], got {top_p!r}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) \
                or num_samples < 1:
            raise ValueError(f"num_samples: expected an int >= 1, got {num_samples!r}")
        longest = min(len(prompt) + int(max_new_tokens), self.max_seq_len)
        pages = -(-longest // self.cache.page_size)
        if pages > self.cache.num_pages:
            raise ValueError(f"prompt_ids: a request of up to {longest} tokens needs {pages} "
                             f"pages, more than the cache's {self.cache.num_pages}")
        request = Request(self._next_id, prompt, int(max_new_tokens), temperature,
                          int(top_k), top_p, frozenset(int(t) for t in stop_ids),
                          num_samples=int(num_samples))
        self._next_id += 1
        self.requests[request.request_id] = request
        if not self._finishes(request):
            self.scheduler.add(request)
        return request.request_id

    def _finishes(self, request):
        """Set the finish reason of a request whose last token ends it; True if it did."""
        if request.output_ids and request.output_ids[-1] in request.stop_ids:
            request.finish_reason = "stop"
        elif len(request.output_ids) >= request.max_new_tokens \
                or (request.output_ids and request.num_tokens >= self.max_seq_len):
            request.finish_reason = "length"
        return request.finished

    def add_prefilled_request(self, prompt_ids, kv, first_token, *, max_new_tokens,
                              temperature=0.0, stop_ids=()):
        """Queue a prompt prefilled elsewhere, to be decoded here (disaggregated serving).

        Parameters
        ----------
        prompt_ids : sequence of int
        kv : SequenceKV
            The prompt's K/V (``kv.num_tokens == len(prompt_ids)``), from
            ``export_sequence`` of the cache that prefilled it; imported into
            this engine's cache when the request is admitted.
        first_token : int
            The token that prefill generated.
        max_new_tokens, temperature, stop_ids
            As for :meth:`add_request`; ``first_token`` counts as the first
            of the ``max_new_tokens``.

        Returns
        -------
        int
            The request id.  The request's first token is ``first_token``;
            the next comes from this engine's steps (none when
            ``first_token`` already finished it: a stop id, or
            ``max_new_tokens=1``).
        """
        if kv.num_tokens != len(prompt_ids):
            raise ValueError(f"kv: expected K/V of the prompt's {len(prompt_ids)} tokens, got "
                             f"{kv.num_tokens}")
        request_id = self._next_id
        self.add_request(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                         stop_ids=stop_ids)
        request = self.requests[request_id]
        request.output_ids.append(int(first_token))
        request.num_computed = kv.num_tokens
        request.prefilled = kv
        if self._finishes(request):     # the first token ended it: nothing to decode
            self.scheduler.waiting.remove(request)
            request.prefilled = None
        return request_id

    def has_unfinished(self):
        """True while some request is waiting or running."""
        return self.scheduler.has_work()

    @property
    def num_running(self):
        return len(self.scheduler.running)

    @property
    def num_waiting(self):
        return len(self.scheduler.waiting)

    # -- one step -----------------------------------------------------------------------
    def _append(self):
        """Schedule the step and reserve its slots; preempt and replan if the pool runs out.

        Returns
        -------
        plan : list of ScheduledChunk
        batch : the cache's step batch, or None when there is nothing to run
        token_ids : list of int, the step's new tokens in row order
        """
        while True:
            plan = self.scheduler.schedule()
            if not plan:
                if self.scheduler.has_work():
                    raise OutOfPagesError("no request fits in the page pool; give the cache "
                                          "more pages or lower max_num_batched_tokens")
                return plan, None, []
            token_ids = []
            for chunk in plan:
                start = chunk.request.num_computed
                token_ids.extend(chunk.request.token_slice(start, start + chunk.num_tokens))
            seq_ids = [c.request.seq_id for c in plan]
            counts = [c.num_tokens for c in plan]
            try:
                if getattr(self.cache, "prefix_caching", False):
                    # the cache hashes the pages these tokens fill, for later prompts to reuse
                    batch = self.cache.append(seq_ids, counts, token_ids=token_ids)
                else:
                    batch = self.cache.append(seq_ids, counts)
            except OutOfPagesError:
                # The plan's page estimate missed copy-on-write of shared pages.
                self.scheduler.preempt_newest()
                continue
            return plan, batch, token_ids

    def step(self):
        """Run one step of every scheduled request.

        Returns
        -------
        list of TokenEvent
            One per request that generated a token this step, in step order.
        """
        start = time.perf_counter()
        plan, batch, token_ids = self._append()
        if batch is None:
            return []
        # Pages peak right after the append, before finished requests free theirs.
        pages_in_use = self.cache.num_pages - self.cache.num_free_pages
        window_pages_in_use = getattr(self.cache, "num_window_pages", 0) \
            - getattr(self.cache, "num_free_window_pages", 0)
        num_running = len(self.scheduler.running)
        # the stat covers the steps that run forked samples (see EngineStats)
        if any(c.request.parent_id is not None for c in plan) and hasattr(batch, "sharing"):
            self.stats.shared_token_reads_saved += batch.sharing.saved_token_reads
        positions, logit_rows, sampling = [], [], []
        row = 0
        num_decode = 0
        for chunk in plan:
            request, n = chunk.request, chunk.num_tokens
            positions.append(np.arange(request.num_computed, request.num_computed + n))
            num_decode += request.is_decoding
            row += n
            if chunk.samples:
                logit_rows.append(row - 1)
                sampling.append(request)
        logits = self.model.forward(np.asarray(token_ids, dtype=np.int64),
                                    np.concatenate(positions),
                                    paged_attend(self.cache, batch),
                                    np.asarray(logit_rows, dtype=np.intp))
        for chunk in plan:
            chunk.request.num_computed += chunk.num_tokens
        next_tokens = sample(logits, [r.temperature for r in sampling], self.rng,
                             [r.top_k for r in sampling], [r.top_p for r in sampling])
        events = []
        for request, token, row_logits in zip(sampling, next_tokens.tolist(), logits):
            forks = self._fork_samples(request, row_logits) \
                if request.num_samples > 1 and not request.output_ids else []
            for r, t in [(request, token)] + forks:
                r.output_ids.append(t)
                if self._finishes(r):
                    if self.on_finish is not None:
                        self.on_finish(r)
                    self.scheduler.finish(r)
                events.append(TokenEvent(r.request_id, t, row_logits, r.finish_reason))
        self._record(row, num_decode, pages_in_use, window_pages_in_use, num_running,
                     time.perf_counter() - start)
        return events

    def _fork_samples(self, request, row_logits):
        """The other samples of ``request``, whose prompt was just computed: each a
        fork of its sequence (sharing its pages) with its own first token drawn
        from ``row_logits``; returns ``[(fork, token)]``."""
        forks = []
        for number in range(1, request.num_samples):
            fork = Request(self._next_id, request.prompt_ids, request.max_new_tokens,
                           request.temperature, request.top_k, request.top_p,
                           request.stop_ids, parent_id=request.request_id, sample=number)
            fork.seq_id = self.cache.fork(request.seq_id)
            fork.num_computed = request.num_computed
            self._next_id += 1
            self.requests[fork.request_id] = fork
            self.scheduler.running.append(fork)
            token = sample(row_logits[None, :], [fork.temperature], self.rng,
                           [fork.top_k], [fork.top_p])
            forks.append((fork, int(token[0])))
        request.num_samples = 1      # a recompute after a preemption forks no more
        return forks

    def _record(self, num_tokens, num_decode, pages_in_use, window_pages_in_use, num_running,
                seconds):
        s = self.stats
        s.record(num_tokens - num_decode, num_decode, seconds)
        s.peak_pages_in_use = max(s.peak_pages_in_use, pages_in_use)
        s.peak_window_pages_in_use = max(s.peak_window_pages_in_use, window_pages_in_use)
        s.peak_running = max(s.peak_running, num_running)
        s.num_preemptions = self.scheduler.num_preemptions
        s.num_swaps = self.scheduler.num_swaps

    def warm_up(self):
        """Run one throwaway token through every layer, untimed and uncounted.

        The first step of a process pays one-time costs (BLAS threads
        starting, OpenCL kernels' first launch, the pools' first touch of
        memory); calling this before timing keeps them out of the measured
        throughput.  Leaves the cache as it was (the sequence is freed; with
        prefix caching its page is not hashed).
        """
        seq_id = self.cache.add_sequence()
        try:
            batch = self.cache.append([seq_id], 1)
            self.model.forward(np.zeros(1, np.int64), np.zeros(1, np.int64),
                               paged_attend(self.cache, batch), np.zeros(1, np.intp))
        finally:
            self.cache.free(seq_id)

    # -- convenience ---------------------------------------------------------------
    def generate(self, prompts, *, max_new_tokens, temperature=0.0, stop_ids=()):
        """Complete several prompts together and return their generated ids.

        Parameters
        ----------
        prompts : list of sequence of int
        max_new_tokens, temperature, stop_ids
            As for :meth:`add_request`, applied to every prompt.

        Returns
        -------
        list of list of int
            Generated ids per prompt, in the order given.
        """
        ids = [self.add_request(p, max_new_tokens=max_new_tokens, temperature=temperature,
                                stop_ids=stop_ids) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [list(self.requests[i].output_ids) for i in ids]

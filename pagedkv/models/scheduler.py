"""Continuous batching: which tokens of which requests run in the next step.

Each step mixes every decoding request (one token each) with chunks of
prompts still being prefilled, up to a token budget, so a long prompt never
stalls the decodes beside it.  Requests join between steps (admitted oldest
first while pages and the sequence limit allow) and leave as soon as they
finish, freeing their pages for the next step.

When the pool cannot hold the next decode token of every running request,
the newest running request is preempted.  With a cache that swaps
(``swap_out`` / ``swap_in``, as ``PagedKVCache`` does), its K/V move to host
memory and its pages go back to the pool; it resumes where it was, without
recomputing anything, as soon as its pages fit again, before any new
request is admitted (vLLM v0's swap).  A cache without swap frees the
sequence instead, and the request goes back to the head of the queue to be
recomputed from its prompt and the tokens generated so far.
"""
import time
from collections import deque
from dataclasses import dataclass
from typing import List

from pagedkv.errors import OutOfPagesError


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request``, starting at ``request.num_computed``."""
    request: object
    num_tokens: int

    @property
    def samples(self):
        """True when the chunk reaches the request's last token, so it yields the next one."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class Scheduler:
    """Queue, running set and the per-step plan over one KV cache.

    Parameters
    ----------
    cache : PagedKVCache or compatible
        Used for ``add_sequence``, ``free``, ``seq_len``, ``page_count``,
        ``page_size`` and ``num_free_pages``, and ``swap_out`` / ``swap_in``
        when it has them.
    max_num_seqs : int
        Most requests holding a sequence at once.
    max_num_batched_tokens : int
        Most new tokens in one step (decodes and prefill chunks together).
    """

    def __init__(self, cache, *, max_num_seqs, max_num_batched_tokens):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = deque()
        self.running: List = []          # admission order, oldest first
        self.swapped: List = []          # preempted, K/V in host memory; oldest request first
        self.swaps = callable(getattr(cache, "swap_out", None))
        self.num_preemptions = 0
        self.num_swaps = 0               # preemptions that swapped out (no recompute)

    def add(self, request):
        """Queue a new request (it is admitted by a later :meth:`schedule`)."""
        self.waiting.append(request)

    def has_work(self):
        return bool(self.waiting or self.running or self.swapped)

    # -- sequences ------------------------------------------------------------------
    def _pages_needed(self, seq_id, num_tokens):
        """Pages a sequence must take to grow by ``num_tokens`` (copy-on-write aside)."""
        page_size = self.cache.page_size
        have = self.cache.page_count(seq_id)
        return max(0, -(-(self.cache.seq_len(seq_id) + num_tokens) // page_size) - have)

    def _start(self, request):
        """Give a request its cache sequence.

        The one place a sequence is created.  A request whose K/V were
        computed elsewhere (``request.prefilled``, a SequenceKV) gets them
        imported.  With a prefix-caching cache
        (``cache.prefix_caching``) the request's tokens go to
        ``add_sequence(token_ids=...)``, the cache may already hold a leading
        part of them (``seq_len > 0``), and only the rest is computed.  At
        least the last token is always left to compute: its row yields the
        next token's logits.
        """
        if request.prefilled is not None:        # K/V computed elsewhere: imported
            start = time.perf_counter()
            request.seq_id = self.cache.import_sequence(request.prefilled)
            request.import_seconds = time.perf_counter() - start
            request.prefilled = None
            self.running.append(request)
            return
        if getattr(self.cache, "prefix_caching", False):
            seq_id = self.cache.add_sequence(
                token_ids=request.token_slice(0, request.num_tokens))
        else:
            seq_id = self.cache.add_sequence()
        reused = min(self.cache.seq_len(seq_id), request.num_tokens - 1)
        if reused < self.cache.seq_len(seq_id):
            self.cache.truncate(seq_id, reused)
        request.seq_id = seq_id
        request.num_computed = reused
        self.running.append(request)

    def finish(self, request):
        """Release a finished request's sequence and pages at once."""
        self.running.remove(request)
        self.cache.free(request.seq_id)
        request.seq_id = None

    def preempt_newest(self):
        """Preempt the newest running request: swap its K/V out to host memory (a cache
        that swaps), or free its pages and requeue it for recompute.

        Raises
        ------
        OutOfPagesError
            Nothing is running, so nothing can give pages back.
        """
        if not self.running:
            raise OutOfPagesError("the page pool cannot hold even one request's next step; "
                                  "give the cache more pages")
        request = self.running.pop()
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.swaps:
            self.cache.swap_out(request.seq_id)
            self.num_swaps += 1
            self.swapped.append(request)
            self.swapped.sort(key=lambda r: r.request_id)
            return
        self.cache.free(request.seq_id)
        request.seq_id = None
        request.num_computed = 0
        self.waiting.appendleft(request)

    def _swap_in(self, request, budget, free_pages):
        """Bring a swapped-out request back if its pages and next chunk fit; the chunk's
        token count (0: it stays swapped out)."""
        seq_len = self.cache.seq_len(request.seq_id)
        num_tokens = min(request.num_pending, budget)
        if -(-(seq_len + num_tokens) // self.cache.page_size) > free_pages:
            return 0
        try:
            self.cache.swap_in(request.seq_id)
        except OutOfPagesError:          # another pool (a window pool) is short
            return 0
        self.swapped.remove(request)
        self.running.append(request)
        return num_tokens

    # -- the plan ----------------------------------------------------------------------
    def schedule(self):
        """Plan the next step.

        Returns
        -------
        list of ScheduledChunk
            In step-row order: decodes (oldest request first), then prefill
            chunks of running requests, then the chunks of swapped-out requests
            brought back, then those of newly admitted ones.
            Empty when there is nothing to run.
        """
        budget = self.max_num_batched_tokens
        free_pages = self.cache.num_free_pages
        preemptions_before = self.num_preemptions
        plan = []

        # 1. Every decoding request gets its token; preempt the newest to make room.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if not request.is_decoding:
                index += 1
                continue
            need = self._pages_needed(request.seq_id, 1)
            # Victims are newer than ``request``, so none is in the plan yet.
            while need > free_pages and self.running[-1] is not request:
                self.preempt_newest()
                free_pages = self.cache.num_free_pages
            if need > free_pages:               # the request itself is the newest
                self.preempt_newest()
                break
            plan.append(ScheduledChunk(request, 1))
            free_pages -= need
            budget -= 1
            index += 1

        # 2. Running requests still prefilling take what budget and pages allow.
        for request in self.running:
            if budget <= 0:
                break
            if request.is_decoding:
                continue
            num_tokens = self._fit(request.seq_id, min(request.num_pending, budget), free_pages)
            if num_tokens:
                plan.append(ScheduledChunk(request, num_tokens))
                free_pages -= self._pages_needed(request.seq_id, num_tokens)
                budget -= num_tokens

        # 3. Swapped-out requests come back, oldest first, while they fit, before any
        #    new request; not in a step that had to preempt (the victim would take its
        #    pages straight back).
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs \
                and self.num_preemptions == preemptions_before:
            request = self.swapped[0]
            before = self.cache.num_free_pages
            num_tokens = self._swap_in(request, budget, free_pages)
            if not num_tokens:
                break
            plan.append(ScheduledChunk(request, num_tokens))
            free_pages -= before - self.cache.num_free_pages \
                + self._pages_needed(request.seq_id, num_tokens)
            budget -= num_tokens

        # 4. Admit waiting requests, oldest first, while they fit; not in a step that
        #    had to preempt, nor while a swapped-out request waits for room.
        while self.waiting and not self.swapped and budget > 0 \
                and len(self.running) < self.max_num_seqs \
                and self.num_preemptions == preemptions_before:
            request = self.waiting[0]
            first_chunk = min(request.num_pending, budget)
            if -(-(request.num_computed + first_chunk) // self.cache.page_size) > free_pages:
                break
            try:
                self._start(request)
            except OutOfPagesError:          # an import short of another pool (window pages)
                break
            self.waiting.popleft()
            num_tokens = self._fit(request.seq_id, min(request.num_pending, budget), free_pages)
            if not num_tokens:
                break
            plan.append(ScheduledChunk(request, num_tokens))
            free_pages -= self._pages_needed(request.seq_id, num_tokens)
            budget -= num_tokens

        preempted = self.num_preemptions != preemptions_before
        if not plan and (self.running or ((self.waiting or self.swapped) and preempted)):
            # Nothing fits (every running request is prefilling and the pool
            # is full), or a preemption emptied the batch: make room, plan again.
            if self.running:
                self.preempt_newest()
            return self.schedule()
        return plan

    def _fit(self, seq_id, num_tokens, free_pages):
        """The largest count <= ``num_tokens`` the sequence can grow by with ``free_pages``."""
        room = (self.cache.page_count(seq_id) + free_pages) * self.cache.page_size \
            - self.cache.seq_len(seq_id)
        return max(0, min(num_tokens, room))

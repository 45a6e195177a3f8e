# distutils: language = c++
"""Per-sequence page tables and the per-step tables kernels read.

Each sequence owns an ordered list of page ids in every pool (a
:class:`pagedkv._pool.Pool`: its allocator and its rule for which pages a
sequence gives back) and a length.  ``append`` reserves the slots for one
step, all or nothing over every pool, copying a shared or cached last page
first (copy-on-write), and builds every table format an engine may want: the
slot mapping (vLLM), the CSR page table (FlashInfer, TVM) and the padded
block table.  The first pool keeps every page and holds the prefix chain.

With prefix caching, a sequence also keeps its token ids and the hash chain
of its full pages (``hash(parent page's hash, page's token ids)``).  A page
that a step fills is entered in the allocator's prefix index only once that
step's K/V is stored in every layer (``close_step``).  A step abandoned
before that (another append, a truncate, a free) leaves nothing reusable:
its pages are not cached, and its sequences forget the step's tokens, so
that no later page holding those unwritten positions is cached either
(they cache again once truncated back below them).  A page of another pool
is cached under the prefix-index entry of the first pool's page at the same
place in the chain, which identifies its content exactly.

A swapped-out sequence keeps its id, length and token ids but no pages: it
sits in ``swapped`` instead of the sequence map, so no table of it can reach
a kernel, and ``find`` says it is swapped out.  Sequences placed with K/V
from elsewhere are ``pagedkv._placement``'s; chains of cached pages that
travel in files are ``pagedkv._prefix_chains``'.
"""
import numbers

import numpy as np
cimport cython
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcpy
from cpython.dict cimport PyDict_Clear
from cpython.ref cimport PyObject
from libcpp.pair cimport pair
from libcpp.vector cimport vector
from cython.operator cimport dereference as deref

from pagedkv._pool cimport (Pool, PoolTables, new_pool_tables, rows_from, pages_for, RELEASED,
                            ROOT_HASH, ROOT_ENTRY)
from pagedkv.pkv_page_table cimport (PkvPages, PkvSequence, PkvPendingPage, PkvUndoSeq,
                                     PkvForgotten, PkvStepPlan, PkvStepOut, pkv_forget,
                                     pkv_remember, pkv_hash_page)
from pagedkv.errors import UnknownSequenceError

cnp.import_array()


cdef class AppendTables:
    """The tables of one ``append`` step: those the pools share, and each pool's.

    Attributes
    ----------
    query_start : ndarray, shape [B+1], int32
    seq_lens : ndarray, shape [B], int32
    page_indptr : ndarray, shape [B+1], int32
    last_page_len : ndarray, shape [B], int32
        A sequence's page list has as many entries in every pool, so the CSR
        row pointers and last-page lengths serve them all.
    pools : tuple of PoolTables
        Each pool's tables, indexed like ``PageTables.pools``.
    """
    cdef readonly cnp.ndarray query_start, seq_lens, page_indptr, last_page_len
    cdef readonly tuple pools


cdef class PageTables:
    """The page tables of every live sequence, over any number of pools.

    Parameters
    ----------
    pools : sequence of Pool
        Every pool, ``pools[i].index == i``.  The first keeps every page and
        holds the prefix chain; its allocator's ``page_size`` and
        ``prefix_caching`` apply to all.
    hash_fn : callable, optional
        ``hash_fn(parent_hash: int, token_ids: tuple) -> int`` replaces the
        default page hash (e.g. to force collisions in tests).

    Attributes
    ----------
    pools : tuple of Pool
    """

    def __cinit__(self, pools, hash_fn=None):
        cdef Pool pool
        self.pools = tuple(pools)
        if not self.pools or (<Pool>self.pools[0]).gives_back or \
                [pool.index for pool in self.pools] != list(range(len(self.pools))) or \
                any(pool.allocator.page_size != self.pools[0].allocator.page_size
                    for pool in self.pools):
            raise ValueError("pools: expected Pools indexed 0, 1, ... of one page size, the "
                             "first keeping every page")
        for pool in self.pools:
            self.pool_refs.push_back(<PyObject*>pool)
        self.allocator = (<Pool>self.pools[0]).allocator
        self.page_size = self.allocator.page_size
        self.caching = self.allocator.prefix_caching
        self.hash_fn = hash_fn
        self.next_id = 0
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_reused_tokens = 0
        self.swapped = {}
        self.undo_armed = False

    cdef uint64_t page_hash(self, uint64_t parent_hash, const int32_t* tokens) except? 0:
        if self.hash_fn is None:
            return pkv_hash_page(parent_hash, tokens, self.page_size)
        value = self.hash_fn(parent_hash, tuple([tokens[i] for i in range(self.page_size)]))
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"prefix_hash: expected it to return an int, got "
                            f"{type(value).__name__} {value!r}"[:200])
        return <uint64_t>(int(value) & 0xFFFFFFFFFFFFFFFF)

    cdef PkvSequence* find(self, seq_id) except NULL:
        """The live sequence ``seq_id`` (any Python object), or UnknownSequenceError."""
        if not isinstance(seq_id, (int, np.integer)) or isinstance(seq_id, bool):
            raise UnknownSequenceError(f"seq_id: expected an int sequence id, got {seq_id!r}")
        if not -2**63 <= seq_id < 2**63:
            raise UnknownSequenceError(f"seq_id: no live sequence {seq_id!r} (never added, or freed)")
        return self.find_id(seq_id)

    cdef PkvSequence* find_id(self, int64_t seq_id) except NULL:
        it = self.seqs.find(seq_id)
        if it == self.seqs.end():
            if seq_id in self.swapped:
                raise ValueError(f"seq_id: sequence {seq_id} is swapped out (its K/V wait in "
                                 f"host memory); swap_in({seq_id}) first")
            raise UnknownSequenceError(f"seq_id: no live sequence {seq_id} (never added, or freed)")
        return &deref(it).second

    cdef PkvPages* pool_list(self, seq_id, int pool) except NULL:
        """The live sequence's page list in pool ``pool`` (an index of ``pools``)."""
        cdef PkvSequence* seq = self.find(seq_id)
        if not 0 <= pool < <int>seq.pools.size():
            raise ValueError(f"pool: expected an index of the {seq.pools.size()} pools, "
                             f"got {pool}")
        return &seq.pools[pool]

    # -- sequences ---------------------------------------------------------------
    def add(self, token_ids=None, allowed=None):
        """Create a sequence; return its id (ids are never reused).

        With prefix caching and ``token_ids`` (the prompt, int32 [n]), the
        sequence starts on the longest cached chain of full pages of the
        prompt, short of its last token, whose K/V in every other pool (what
        a query at its end sees) is cached too; ``seq_len`` tells how many
        tokens that covers.  Nothing is reserved for the rest.

        ``allowed`` (uint8, indexed by a number of full pages, at least
        ``(n - 1) // page_size + 1`` entries): the hits that what the page
        tables do not hold can serve too (the recurrent layers' snapshots);
        a hit of ``h`` pages needs ``allowed[h]``.  None: any.
        """
        cdef PkvSequence seq
        cdef int32_t[::1] prompt
        cdef const uint8_t[::1] may_hit = allowed
        cdef int64_t j, hit, num_full, ps = self.page_size
        cdef int64_t parent_entry = ROOT_ENTRY
        cdef uint64_t h = ROOT_HASH
        cdef vector[uint64_t] chain
        cdef vector[vector[int32_t]] found     # per pool: the cached pages it starts on
        cdef int32_t page
        cdef Pool pool
        seq.pools.resize(len(self.pools))
        if self.caching and token_ids is not None:
            prompt = token_ids
            num_full = (prompt.shape[0] - 1) // ps if prompt.shape[0] else 0
            # hash first: a user hash function may raise, and nothing is held yet
            for j in range(num_full):
                h = self.page_hash(h, &prompt[j * ps])
                chain.push_back(h)
            found.resize(len(self.pools))
            for j in range(num_full):
                page = self.allocator.lookup(chain[j], parent_entry, &prompt[j * ps])
                if page < 0:
                    break
                found[0].push_back(page)
                parent_entry = self.allocator.entry_of(page)
            hit = found[0].size()
            if may_hit is not None and may_hit.shape[0] <= hit:
                raise ValueError(f"allowed: expected at least {hit + 1} entries, "
                                 f"got {may_hit.shape[0]}")
            while hit > 0 and (may_hit is not None and not may_hit[hit]
                               or not self.find_cached(found, &prompt[0], hit)):
                hit -= 1        # another pool's K/V at that end is gone: a shorter hit
            found[0].resize(hit)
            for pool in self.pools:
                pool.start_on(seq.pools[pool.index], hit - <int64_t>found[pool.index].size(),
                              found[pool.index])
            for j in range(hit):
                seq.hashes.push_back(chain[j])
            seq.length = hit * ps
            seq.tokens.assign(&prompt[0], &prompt[0] + seq.length) if seq.length else None
            self.num_prompt_tokens += prompt.shape[0]
            self.num_reused_tokens += seq.length
        cdef int64_t seq_id = self.next_id
        self.next_id += 1
        self.seqs[seq_id] = seq
        return seq_id

    cdef bint find_cached(self, vector[vector[int32_t]]& found, const int32_t* prompt,
                          int64_t hit) noexcept nogil:
        """The cached pages of every pool but the first that a sequence starting on
        the chain's first ``hit`` pages ``found[0]`` needs, into ``found``; False
        if any is missing."""
        cdef size_t p
        for p in range(1, self.pool_refs.size()):
            if not (<Pool>self.pool_refs[p]).find_cached(self.allocator, found[0], prompt, hit,
                                                         found[p]):
                return False
        return True

    def fork(self, parent_id):
        """A new sequence sharing every page of ``parent_id`` (ref counts only)."""
        cdef PkvSequence* parent = self.find(parent_id)
        cdef int64_t child_id = self.next_id
        cdef size_t i
        for i in range(self.pool_refs.size()):
            (<Pool>self.pool_refs[i]).share(parent.pools[i])
        for i in range(self.open_seqs.size()):   # the child shares the open step's fate
            if self.open_seqs[i].first == <int64_t>parent_id:
                self.open_seqs.push_back(pair[int64_t, int64_t](child_id, self.open_seqs[i].second))
                break
        self.next_id += 1
        self.seqs[child_id] = deref(parent)   # copies the page lists, not the pages
        return child_id

    cdef void drop(self, PkvSequence* seq) noexcept nogil:
        cdef size_t p
        for p in range(self.pool_refs.size()):
            (<Pool>self.pool_refs[p]).drop(seq.pools[p])

    def free(self, seq_id, tuple also=()):
        """Drop the sequence; its pages go back to the pool once no one shares them.

        ``also``: dicts (the caller's own records of sequences, by int id) to
        drop ``seq_id`` from once it is gone, through the C API only, so that
        nothing (not even a RecursionError) can raise between the two.
        """
        cdef PkvSequence* seq
        cdef dict records
        key = int(seq_id) if self.swapped_entry(seq_id) is not None else None
        if key is not None:
            del self.swapped[key]
        else:
            seq = self.find(seq_id)
            key = int(seq_id)
            self.abandon_step()
            self.drop(seq)
            self.seqs.erase(<int64_t>seq_id)
        for records in also:
            if key in records:
                del records[key]

    def clear(self, tuple also=()):
        """Free every sequence; ``also``: dicts to empty with them (as in ``free``)."""
        cdef dict records
        self.abandon_step()
        for kv in self.seqs:
            self.drop(&kv.second)
        self.seqs.clear()
        PyDict_Clear(self.swapped)
        for records in also:
            PyDict_Clear(records)

    def __contains__(self, seq_id):
        if self.swapped_entry(seq_id) is not None:
            return True
        try:
            self.find(seq_id)
        except UnknownSequenceError:
            return False
        return True

    def __len__(self):
        return self.seqs.size() + len(self.swapped)

    def ids(self):
        """Ids of the live sequences (swapped-out ones included), ascending."""
        return sorted([kv.first for kv in self.seqs] + list(self.swapped))

    def seq_len(self, seq_id):
        """Tokens stored in the sequence (swapped out or not)."""
        if self.swapped:
            entry = self.swapped_entry(seq_id)
            if entry is not None:
                return entry[0]
        return self.find(seq_id).length

    def pages(self, seq_id, int pool=0):
        """The sequence's page ids in pool ``pool``, in order (-1 for pages given
        back); ndarray, shape [num_pages], int32 (a copy)."""
        cdef vector[int32_t]* pages = &self.pool_list(seq_id, pool).pages
        out = np.empty(pages.size(), dtype=np.int32)
        cdef int32_t[::1] view = out
        if pages.size():
            memcpy(&view[0], pages.data(), pages.size() * sizeof(int32_t))
        return out

    def held_from(self, seq_id, int pool):
        """The first position whose K/V the sequence still holds in pool ``pool``."""
        cdef PkvPages* own = self.pool_list(seq_id, pool)
        return min(rows_from(own[0], self.page_size), self.find(seq_id).length)

    def held_pages(self, seq_id, int pool):
        """Pages the sequence holds in pool ``pool``."""
        cdef PkvPages* own = self.pool_list(seq_id, pool)
        return <int64_t>own.pages.size() - own.released

    def slots(self, seq_id, int64_t start, int64_t stop, int pool=0):
        """Slots (``page * page_size + offset``) of positions ``start:stop`` in pool
        ``pool``.

        Returns
        -------
        slots : ndarray, shape [stop - start], int64
        """
        cdef PkvPages* own = self.pool_list(seq_id, pool)
        cdef int64_t length = self.find(seq_id).length
        if not 0 <= start <= stop <= length:
            raise ValueError(f"positions {start}:{stop}: expected 0 <= start <= stop <= "
                             f"seq_len={length}")
        (<Pool>self.pool_refs[pool]).check_held(own[0], start, stop)
        out = np.empty(stop - start, dtype=np.int64)
        cdef int64_t[::1] view = out
        cdef int64_t pos, ps = self.page_size
        for pos in range(start, stop):
            view[pos - start] = <int64_t>own.pages[pos // ps] * ps + pos % ps
        return out

    def check_rollback(self, seq_id, int64_t new_len):
        """ValueError unless truncating to ``new_len`` keeps what every pool's queries need."""
        cdef PkvSequence* seq = self.find(seq_id)
        cdef Pool pool
        for pool in self.pools:
            pool.check_rollback(seq.pools[pool.index], seq.length, new_len)

    def truncate(self, seq_id, int64_t new_len):
        """Shorten the sequence to ``new_len`` tokens; pages past it are released."""
        cdef PkvSequence* seq = self.find(seq_id)
        cdef size_t p
        if not 0 <= new_len <= seq.length:
            raise ValueError(f"new_len: expected 0 <= new_len <= seq_len={seq.length}, got {new_len}")
        self.check_rollback(seq_id, new_len)
        self.abandon_step()
        for p in range(self.pool_refs.size()):
            (<Pool>self.pool_refs[p]).truncate(seq.pools[p], pages_for(new_len, self.page_size))
        seq.length = new_len
        if <int64_t>seq.tokens.size() > new_len:
            seq.tokens.resize(new_len)
        if <int64_t>seq.hashes.size() > new_len // self.page_size:
            seq.hashes.resize(new_len // self.page_size)

    # -- one step ----------------------------------------------------------------
    cdef int new_page_hashes(self, PkvSequence* seq, int64_t num_new, const int32_t* new_tokens,
                             vector[uint64_t]& out) except -1:
        """Hashes of the pages this step fills, for a sequence whose tokens are known."""
        cdef int64_t ps = self.page_size, j, i, pos
        cdef int64_t old_len = seq.length
        cdef vector[int32_t] page_tokens
        cdef uint64_t parent = seq.hashes.back() if seq.hashes.size() else ROOT_HASH
        page_tokens.resize(ps)
        out.clear()
        for j in range(<int64_t>seq.hashes.size(), (old_len + num_new) // ps):
            for i in range(ps):
                pos = j * ps + i
                page_tokens[i] = seq.tokens[pos] if pos < old_len else new_tokens[pos - old_len]
            parent = self.page_hash(parent, page_tokens.data())
            out.push_back(parent)
        return 0

    def append(self, seq_ids, num_new_tokens, max_seq_len=None, token_ids=None):
        """Reserve slots for ``num_new_tokens[b]`` new tokens of each ``seq_ids[b]``.

        All or nothing, over every pool: on any error no sequence or page
        changes, and once it has returned ``undo_append`` takes it back.  A
        sequence whose last page is partly filled and shared (or cached)
        gets a private copy of it first; the (source, destination) pairs are
        returned so that the backend copies the data before anything is
        stored.  Pages no later query can see are given back before the
        step's new pages are taken, so their room serves this step.

        Two phases, each in named steps.  A plan that changes nothing:
        ``plan_step`` validates, hashes the pages the step fills (a user hash
        function may raise) and has each pool count what it must give
        exactly (``Pool.plan``: the pages the step gives back count only
        where the sequence gets new tokens, and only once no sequence holds
        them), ``Pool.check_room`` raises if a pool is short, ``new_tables``
        allocates the tables.  Then ``commit_step``, which cannot fail: per
        pool ``Pool.commit`` (its copies, the pages it gives back, its new
        pages, its tables, recorded for undo; see there for the order), then
        per sequence ``extend_sequence`` (its token ids, length and the
        tables the pools share).

        Parameters
        ----------
        seq_ids : ndarray, shape [B], int64
            Distinct live sequence ids.
        num_new_tokens : ndarray, shape [B], int64
            New tokens per sequence, each >= 0.
        max_seq_len : int or None
            Cap on any sequence's length.
        token_ids : ndarray, shape [total_new], int32, optional
            The new tokens, flat.  With prefix caching, pages they fill join
            the prefix index once the step is closed; a sequence appended
            without them stops caching until truncated back to its known tokens.

        Returns
        -------
        AppendTables
            ``query_start``, ``seq_lens``, ``page_indptr``, ``last_page_len``
            and, per pool (``pools``), its ``slot_mapping``, ``page_indices``,
            ``block_table`` and the copies ``copy_src`` / ``copy_dst`` (see
            :class:`PoolTables`).
        """
        self.undo_armed = False
        cdef int64_t[::1] ids = seq_ids
        cdef int64_t[::1] counts = num_new_tokens
        cdef int32_t[::1] token_view
        cdef const int32_t* tokens = NULL
        cdef bint track = self.caching and token_ids is not None
        cdef PkvStepPlan plan
        cdef PkvStepOut out
        cdef Pool pool
        self.num_steps += 1
        if track:
            token_view = token_ids
            if token_view.shape[0]:
                tokens = &token_view[0]
        self.plan_step(plan, ids, counts, -1 if max_seq_len is None else max_seq_len, track,
                       tokens)
        for pool in self.pools:
            pool.check_room(plan.pools[pool.index])
        tables = self.new_tables(plan, out)
        # (these may raise MemoryError: before anything changes)
        self.undo_seqs.resize(ids.shape[0])
        for pool in self.pools:
            pool.undo.resize(ids.shape[0])
            pool.undo_released.clear()
        self.abandon_step(True)      # a previous step not stored in full is given up
        with nogil:
            self.commit_step(plan, ids, counts, track, tokens, out)
        self.undo_armed = True
        return tables

    # (the plan: nothing changes but each sequence's duplicate-check mark)
    cdef int plan_step(self, PkvStepPlan& plan, int64_t[::1] ids,
                       int64_t[::1] counts, int64_t cap, bint track,
                       const int32_t* tokens) except -1:
        """Find and validate every sequence and hash the pages the step fills, then
        have each pool decide its copies and count its pages, into ``plan``."""
        cdef Py_ssize_t B = ids.shape[0], b
        cdef PkvSequence* seq
        cdef int64_t new_len, ps = self.page_size
        cdef Pool pool
        plan.batch.reserve(B)
        plan.pools.resize(len(self.pools))
        for pool in self.pools:
            plan.pools[pool.index].copy.resize(B)
        if track:
            plan.hashes.resize(B)
        for b in range(B):
            seq = self.find_id(ids[b])
            if seq.last_step == self.num_steps:
                raise ValueError(f"seq_ids: sequence {ids[b]} appears more than once in one step")
            seq.last_step = self.num_steps
            new_len = seq.length + counts[b]
            if cap >= 0 and new_len > cap:
                raise ValueError(f"num_new_tokens: sequence {ids[b]} would reach {new_len} tokens, "
                                 f"over max_seq_len={cap}")
            if new_len >= 2**31:
                raise ValueError(f"num_new_tokens: sequence {ids[b]} would reach {new_len} tokens, "
                                 f"over the int32 limit of the tables")
            if track and <int64_t>seq.tokens.size() == seq.length:
                self.new_page_hashes(seq, counts[b], tokens + plan.total_new if counts[b] else NULL,
                                     plan.hashes[b])
            plan.total_new += counts[b]
            plan.nnz += pages_for(new_len, ps)
            plan.max_pages = max(plan.max_pages, pages_for(new_len, ps))
            plan.batch.push_back(seq)
        for pool in self.pools:
            pool.plan(plan.pools[pool.index], plan.batch, counts)
        return 0

    cdef object new_tables(self, PkvStepPlan& plan, PkvStepOut& out):
        """The step's tables, allocated (``out``: where the commit writes them)."""
        cdef Py_ssize_t B = plan.batch.size(), p
        cdef AppendTables tables = AppendTables.__new__(AppendTables)
        tables.query_start = np.empty(B + 1, dtype=np.int32)
        tables.seq_lens = np.empty(B, dtype=np.int32)
        tables.page_indptr = np.empty(B + 1, dtype=np.int32)
        tables.last_page_len = np.empty(B, dtype=np.int32)
        out.query_start = <int32_t*>cnp.PyArray_DATA(tables.query_start)
        out.seq_lens = <int32_t*>cnp.PyArray_DATA(tables.seq_lens)
        out.page_indptr = <int32_t*>cnp.PyArray_DATA(tables.page_indptr)
        out.last_page_len = <int32_t*>cnp.PyArray_DATA(tables.last_page_len)
        out.max_pages = plan.max_pages
        out.pools.resize(plan.pools.size())
        pool_tables = []
        for p in range(<Py_ssize_t>plan.pools.size()):
            pool_tables.append(new_pool_tables(out.pools[p], B, plan.total_new, plan.nnz,
                                               plan.max_pages, plan.pools[p].num_copies))
        tables.pools = tuple(pool_tables)
        return tables

    # (the commit: cannot fail)
    cdef void commit_step(self, PkvStepPlan& plan, int64_t[::1] ids,
                          int64_t[::1] counts, bint track, const int32_t* tokens,
                          PkvStepOut& out) noexcept nogil:
        cdef Py_ssize_t b, B = plan.batch.size()
        cdef size_t p
        cdef int64_t row = 0
        for p in range(self.pool_refs.size()):
            (<Pool>self.pool_refs[p]).commit(plan.pools[p], plan.batch, counts, out.pools[p],
                                             out.max_pages)
        out.query_start[0] = 0
        out.page_indptr[0] = 0
        for b in range(B):
            self.extend_sequence(plan, b, ids[b], counts[b], track, tokens, row, out)
            row += counts[b]
        self.undo_batch.swap(plan.batch)

    cdef void extend_sequence(self, PkvStepPlan& plan, Py_ssize_t b, int64_t seq_id,
                              int64_t count, bint track, const int32_t* tokens, int64_t row,
                              PkvStepOut& out) noexcept nogil:
        """Sequence ``b`` of the step, once every pool has its pages: its new token
        ids (and pending full pages), its length, and its rows of the tables the
        pools share (its new tokens are rows ``row:row + count``), each change
        recorded for ``undo_append``."""
        cdef PkvSequence* seq = plan.batch[b]
        cdef PkvUndoSeq* u = &self.undo_seqs[b]
        cdef int64_t ps = self.page_size, new_len = seq.length + count
        cdef size_t n_pages = seq.pools[0].pages.size()
        u.seq_id = seq_id
        u.length = seq.length
        u.num_tokens = seq.tokens.size()
        u.num_hashes = seq.hashes.size()
        if track and <int64_t>seq.tokens.size() == seq.length:
            self.open_seqs.push_back(pair[int64_t, int64_t](seq_id, seq.length))
            if count > 0:   # (tokens + row may be one past the end of tokens otherwise)
                seq.tokens.insert(seq.tokens.end(), tokens + row, tokens + row + count)
            self.record_full_pages(seq_id, seq, plan.hashes[b])
        seq.length = new_len
        out.page_indptr[b + 1] = out.page_indptr[b] + <int32_t>n_pages
        out.query_start[b + 1] = <int32_t>(row + count)
        out.seq_lens[b] = <int32_t>new_len
        out.last_page_len[b] = <int32_t>(new_len - (<int64_t>n_pages - 1) * ps) if n_pages else 0

    def undo_append(self):
        """Take back the last ``append``, when what its caller does next with it
        fails (copying pages, uploading tables): every sequence, page, free
        queue and open step as before it.  Only right after that append; a
        no-op otherwise.  Free pages it took that held an evictable cached
        prefix stay evicted (they are free either way)."""
        if not self.undo_armed:
            return
        self.undo_armed = False
        with nogil:
            self.undo_last_append()

    cdef void undo_last_append(self) noexcept nogil:
        cdef Py_ssize_t b, i, B = self.undo_batch.size()
        cdef size_t p
        cdef PkvSequence* seq
        cdef PkvUndoSeq* u
        # each pool's part (Pool.undo_commit), then each sequence's length and
        # known tokens, then the previous open step
        for p in range(self.pool_refs.size()):
            (<Pool>self.pool_refs[p]).undo_commit(self.undo_batch)
        for b in range(B - 1, -1, -1):
            u = &self.undo_seqs[b]
            seq = self.undo_batch[b]
            seq.length = u.length
            seq.tokens.resize(u.num_tokens)
            seq.hashes.resize(u.num_hashes)
        for i in range(<Py_ssize_t>self.undo_forgotten.size()):
            it = self.seqs.find(self.undo_forgotten[i].seq_id)
            if it != self.seqs.end():
                pkv_remember(self.undo_forgotten[i], deref(it).second)
        self.pending.swap(self.undo_pending)
        self.open_seqs.swap(self.undo_open_seqs)
        self.undo_pending.clear()
        self.undo_open_seqs.clear()
        self.undo_forgotten.clear()
        self.undo_batch.clear()

    cdef void record_full_pages(self, int64_t seq_id, PkvSequence* seq,
                                vector[uint64_t]& new_hashes) noexcept nogil:
        """Extend the sequence's hash chain by the pages this step fills, and hold
        them as pending until ``close_step``."""
        cdef size_t i
        cdef PkvPendingPage entry
        for i in range(new_hashes.size()):
            entry.seq_id = seq_id
            entry.index = seq.hashes.size()
            entry.hash = new_hashes[i]
            seq.hashes.push_back(new_hashes[i])
            self.pending.push_back(entry)

    cdef void abandon_step(self, bint record=False) noexcept nogil:
        """Give up the open step: cache none of its pages, and make its sequences
        forget its tokens (their K/V may never have been stored).  ``record``:
        keep what it forgot and the open step itself, for ``undo_append``."""
        cdef size_t i
        cdef int64_t old_len
        cdef PkvSequence* seq
        if record:
            self.undo_forgotten.clear()
        for i in range(self.open_seqs.size()):
            it = self.seqs.find(self.open_seqs[i].first)
            if it == self.seqs.end():
                continue
            seq = &deref(it).second
            old_len = self.open_seqs[i].second
            if record and (<int64_t>seq.tokens.size() > old_len or
                           <int64_t>seq.hashes.size() > old_len // self.page_size):
                pkv_forget(self.undo_forgotten, self.open_seqs[i].first, deref(seq),
                           min(<size_t>old_len, seq.tokens.size()),
                           min(<size_t>(old_len // self.page_size), seq.hashes.size()))
            if <int64_t>seq.tokens.size() > old_len:
                seq.tokens.resize(old_len)
            if <int64_t>seq.hashes.size() > old_len // self.page_size:
                seq.hashes.resize(old_len // self.page_size)
        if record:
            self.undo_open_seqs.clear()
            self.undo_pending.clear()
            self.undo_open_seqs.swap(self.open_seqs)
            self.undo_pending.swap(self.pending)
        else:
            self.open_seqs.clear()
            self.pending.clear()

    def close_step(self):
        """The open step is stored in every layer: enter the pages it filled in the
        prefix index, in chain order.

        A page joins only if its parent page is cached: the chain is what a
        later prompt is matched against.  The pages at the same place in the
        other pools join their pool's index under the full page's entry.  Returns
        how many full pages joined.
        """
        cdef size_t i
        cdef int64_t parent_entry, j
        cdef int joined = 0
        cdef PkvSequence* seq
        cdef vector[int32_t]* chain
        for i in range(self.pending.size()):
            it = self.seqs.find(self.pending[i].seq_id)
            if it == self.seqs.end():
                continue
            seq = &deref(it).second
            j = self.pending[i].index
            chain = &seq.pools[0].pages
            if j >= <int64_t>chain.size() or j >= <int64_t>seq.hashes.size() or \
                    seq.hashes[j] != self.pending[i].hash or \
                    (j + 1) * self.page_size > <int64_t>seq.tokens.size():
                continue
            parent_entry = self.chain_entry(seq, j - 1)
            if parent_entry == 0 or not self.allocator.cache_page(
                    deref(chain)[j], self.pending[i].hash, parent_entry,
                    &seq.tokens[j * self.page_size]):
                continue
            joined += 1
            self.cache_in_other_pools(seq, j)
        self.pending.clear()
        self.open_seqs.clear()
        return joined

    @property
    def has_open_step(self):
        """Whether a step with prefix tracking waits for ``close_step``."""
        return not self.open_seqs.empty()

    # -- sequences that leave the cache (see _placement for those that come) ----------
    cdef object swapped_entry(self, seq_id):
        """``(length, known token ids)`` of a swapped-out ``seq_id``, else None."""
        if not self.swapped or isinstance(seq_id, bool) or \
                not isinstance(seq_id, (int, np.integer)):
            return None
        return self.swapped.get(int(seq_id))

    def is_swapped(self, seq_id):
        """Whether ``seq_id`` is swapped out (UnknownSequenceError if it is not live)."""
        if self.swapped_entry(seq_id) is not None:
            return True
        self.find(seq_id)
        return False

    def known_tokens(self, seq_id):
        """The sequence's leading token ids that the cache knows and whose K/V are
        stored (prefix caching: all of them while ``len == seq_len``); ndarray,
        shape [known], int32 (a copy).

        The tokens of a step still open (not yet stored in every layer) are left
        out: a sequence exported, saved or swapped out meanwhile must not bring
        their pages into a prefix cache, unwritten.
        """
        entry = self.swapped_entry(seq_id)
        if entry is not None:
            return entry[1].copy()
        cdef PkvSequence* seq = self.find(seq_id)
        cdef size_t n = seq.tokens.size(), i
        for i in range(self.open_seqs.size()):
            if self.open_seqs[i].first == <int64_t>seq_id:
                n = min(n, <size_t>self.open_seqs[i].second)
        out = np.empty(n, dtype=np.int32)
        cdef int32_t[::1] view = out
        if n:
            memcpy(&view[0], seq.tokens.data(), n * sizeof(int32_t))
        return out

    def swap_out(self, seq_id):
        """Give the sequence's pages back (a page shared with another sequence stays
        with it) and keep its id, length and known token ids, until ``swap_in``."""
        cdef PkvSequence* seq = self.find(seq_id)
        entry = (seq.length, self.known_tokens(seq_id))
        self.abandon_step()
        self.drop(seq)
        self.seqs.erase(<int64_t>seq_id)
        self.swapped[int(seq_id)] = entry

    cdef void cache_known_pages(self, PkvSequence* seq) noexcept nogil:
        """Enter a written sequence's full pages of known tokens in the prefix index,
        in chain order, with their pages in the other pools (as ``close_step`` does)."""
        cdef int64_t j, parent_entry, ps = self.page_size
        cdef vector[int32_t]* chain = &seq.pools[0].pages
        for j in range(<int64_t>seq.hashes.size()):
            parent_entry = self.chain_entry(seq, j - 1)
            if parent_entry == 0 or not self.allocator.cache_page(
                    deref(chain)[j], seq.hashes[j], parent_entry, &seq.tokens[j * ps]):
                continue
            self.cache_in_other_pools(seq, j)

    cdef int64_t chain_entry(self, PkvSequence* seq, int64_t j) noexcept nogil:
        """The prefix index's entry of the sequence's first ``j + 1`` full pages (the
        parent entry of its page ``j + 1``; ROOT_ENTRY for ``j == -1``), or 0 when
        the index does not hold them.

        That is its page ``j``'s entry, or, where that page is not cached
        because another page of the same tokens after the same chain was
        cached first, the other page's: two sequences computed one prompt, or
        an import, load or swap-in placed a sequence beside its own cached
        copy.  Without that, none of the pages the sequence fills afterwards
        would ever join the index.
        """
        cdef int64_t i = j, entry = ROOT_ENTRY, ps = self.page_size
        cdef vector[int32_t]* chain = &seq.pools[0].pages
        cdef int32_t page
        while i >= 0:           # back to its nearest page that is cached itself ...
            entry = self.allocator.entry_of(deref(chain)[i])
            if entry:
                break
            i -= 1
        if i < 0:
            entry = ROOT_ENTRY
        for i in range(i + 1, j + 1):      # ... then along the cached copies of the rest
            page = self.allocator.lookup(seq.hashes[i], entry, &seq.tokens[i * ps])
            if page < 0:
                return 0
            entry = self.allocator.entry_of(page)
        return entry

    cdef void cache_in_other_pools(self, PkvSequence* seq, int64_t j) noexcept nogil:
        """Cache the sequence's page ``j`` of every pool but the first (where held)
        under the entry of its full page ``j``, just cached."""
        cdef size_t p
        cdef int64_t entry = self.allocator.entry_of(seq.pools[0].pages[j])
        for p in range(1, self.pool_refs.size()):
            (<Pool>self.pool_refs[p]).cache_under(seq.pools[p], j, entry,
                                                  &seq.tokens[j * self.page_size])

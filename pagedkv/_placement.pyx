# distutils: language = c++
"""Sequences placed in the page tables with K/V that come from elsewhere.

A sequence made for an import or a load (``adopt``) gets new pages; so does a
swapped-out one coming back (``swap_in``).  In every pool that gives pages
back, its pages before ``first_page`` are given back from the start, and it
holds its rows from ``first_row`` on.  Placing is three calls, as a step is:
the call reserves the pages, all or nothing; the caller writes the K/V;
then ``commit`` enters its full pages of known tokens in the prefix cache,
or ``undo`` takes everything back.
"""
cimport cython
from libc.stdint cimport int32_t, int64_t, uint64_t
from cython.operator cimport dereference as deref

from pagedkv._page_table cimport PageTables
from pagedkv._pool cimport Pool, pages_for, ROOT_HASH
from pagedkv.pkv_page_table cimport PkvSequence
from pagedkv.errors import OutOfPagesError


@cython.final
cdef class Placement:
    """Placing sequences with K/V from elsewhere in ``tables`` (a PageTables)."""
    cdef PageTables tables
    # the sequence placed last, while its K/V are being written (-1: none), and
    # its swapped-out entry (None: it was adopted)
    cdef int64_t placing
    cdef object placing_swapped

    def __cinit__(self, PageTables tables):
        self.tables = tables
        self.placing = -1

    def adopt(self, int64_t length, token_ids=None, int64_t first_page=0,
              int64_t first_row=-1):
        """A new sequence of ``length`` tokens on new pages, for K/V that come from
        elsewhere (import, load); returns its id.

        All or nothing over every pool.  In a pool that gives pages back, its
        pages before page ``first_page`` are given back from the start, and
        it holds its rows from position ``first_row`` on (a position of page
        ``first_page``; -1: that page's first), so that no rollback reaches
        the rows of that page before it.  ``token_ids`` (int32, at most
        ``length``: the leading tokens the cache will know, with prefix
        caching) extend into its hash chain.  The caller then writes its K/V
        and calls ``commit`` (the full pages of known tokens join the prefix
        cache, as a stored step's pages would), or ``undo`` if the writing
        failed (the sequence goes, and its id is issued again).

        Raises
        ------
        OutOfPagesError
            Too few free pages in a pool; nothing changed.
        """
        seq_id = self.tables.next_id
        self.place(seq_id, length, token_ids, first_page, first_row, "import")
        self.tables.next_id += 1
        self.placing, self.placing_swapped = seq_id, None
        return seq_id

    def undo_adopt(self, int64_t first_id):
        """Drop the sequences made since ``next_id`` was ``first_id`` (``adopt``s of
        one load whose rest failed) and issue their ids again: no caller saw them."""
        cdef PageTables t = self.tables
        cdef int64_t seq_id
        for seq_id in range(t.next_id - 1, first_id - 1, -1):   # (free queues as they were)
            it = t.seqs.find(seq_id)
            if it != t.seqs.end():
                t.drop(&deref(it).second)
                t.seqs.erase(seq_id)
        t.next_id = min(t.next_id, first_id)

    def swap_in(self, seq_id, int64_t first_page=0, int64_t first_row=-1):
        """Give a swapped-out sequence new pages (as ``adopt`` does, its pages before
        ``first_page`` given back where a pool gives pages back, its rows from
        ``first_row`` on) and its id, length and token ids again.  The caller
        then writes its K/V and calls ``commit``, or ``undo`` (it is swapped
        out again).  All or nothing: it stays swapped out when this raises
        (``OutOfPagesError``)."""
        entry = self.tables.swapped_entry(seq_id)
        if entry is None:
            self.tables.find(seq_id)
            raise ValueError(f"seq_id: sequence {seq_id} is not swapped out")
        self.place(int(seq_id), entry[0], entry[1], first_page, first_row, "swap_in")
        del self.tables.swapped[int(seq_id)]
        self.placing, self.placing_swapped = int(seq_id), entry

    def commit(self):
        """The K/V of the sequence ``adopt`` or ``swap_in`` placed are written: its full
        pages of known tokens join the prefix cache.  A no-op when nothing is
        placed (or the placed sequence is gone)."""
        cdef PageTables t = self.tables
        cdef int64_t seq_id = self.placing
        self.placing, self.placing_swapped = -1, None
        it = t.seqs.find(seq_id)
        if seq_id >= 0 and it != t.seqs.end():
            t.cache_known_pages(&deref(it).second)

    def undo(self):
        """Take back the last ``adopt`` or ``swap_in`` whose K/V could not be written:
        the sequence goes (an adopted one's id is issued again; a swapped-in
        one is swapped out again, as it was).  A no-op when nothing is placed."""
        cdef PageTables t = self.tables
        cdef int64_t seq_id = self.placing
        entry = self.placing_swapped
        self.placing, self.placing_swapped = -1, None
        it = t.seqs.find(seq_id)
        if seq_id < 0 or it == t.seqs.end():
            return
        t.drop(&deref(it).second)
        t.seqs.erase(seq_id)
        if entry is not None:
            t.swapped[seq_id] = entry
        elif seq_id == t.next_id - 1:
            t.next_id = seq_id

    cdef place(self, int64_t seq_id, int64_t length, token_ids, int64_t first_page,
               int64_t first_row, str caller):
        """``adopt`` and ``swap_in``: sequence ``seq_id`` of ``length`` tokens on new pages."""
        cdef PageTables t = self.tables
        cdef int64_t ps = t.page_size, j, needed, num_pages = pages_for(length, ps)
        cdef const int32_t[::1] tokens
        cdef uint64_t h = ROOT_HASH
        cdef PkvSequence seq
        cdef Pool pool
        if not 0 <= first_page <= num_pages:
            raise ValueError(f"first_page: expected 0 <= first_page <= {num_pages} pages, "
                             f"got {first_page}")
        if first_row == -1:
            first_row = first_page * ps
        if not first_page * ps <= first_row < (first_page + 1) * ps:
            raise ValueError(f"first_row: expected a position of page {first_page} "
                             f"({first_page * ps} to {(first_page + 1) * ps - 1}), "
                             f"got {first_row}")
        for pool in t.pools:
            pool.check_first_held(length, first_page, first_row)
        for pool in t.pools:
            needed = num_pages - pool.first_held(first_page)
            if needed > pool.allocator.num_free_pages:
                raise OutOfPagesError(f"{caller}: this sequence of {length} tokens needs "
                                      f"{needed} {pool.names.noun}, {pool.free_text()}")
        if t.caching and token_ids is not None and len(token_ids):
            tokens = token_ids
            if tokens.shape[0] > length:
                raise ValueError(f"token_ids: expected at most {length} token ids, got "
                                 f"{tokens.shape[0]}")
            # hashed first: a user hash function may raise, and nothing is held yet
            for j in range(tokens.shape[0] // ps):
                h = t.page_hash(h, &tokens[j * ps])
                seq.hashes.push_back(h)
            seq.tokens.assign(&tokens[0], &tokens[0] + tokens.shape[0])
        seq.pools.resize(len(t.pools))
        for pool in t.pools:
            pool.start(seq.pools[pool.index], pool.first_held(first_page), num_pages,
                       first_row if pool.gives_back else 0)
        seq.length = length
        t.seqs[seq_id] = seq

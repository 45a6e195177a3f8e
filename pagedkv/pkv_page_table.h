// The page tables' records of sequences, steps and their undo (see _page_table.pyx
// and _pool.pyx; declared for Cython in pkv_page_table.pxd).
#ifndef PKV_PAGE_TABLE_H
#define PKV_PAGE_TABLE_H
#include <vector>
#include <cstdint>
#include <unordered_map>
#include "pkv_hash.h"
// one sequence's page list in one pool; the first `released` entries are
// -1 (given back: only a pool with a span gives pages back).  It holds
// the rows from position first_row on, in page `released` or later: a
// sequence placed with K/V that begin mid-page (an import) lacks the rows
// of its first page before it
struct PkvPages {
    std::vector<int32_t> pages;
    int64_t released = 0;
    int64_t first_row = 0;
};
struct PkvSequence {
    std::vector<PkvPages> pools;   // indexed like PageTables.pools
    int64_t length = 0;
    int64_t last_step = -1;   // the append call that last named it (duplicate check)
    // prefix caching only: the token ids (known while tokens.size() ==
    // length) and the hash of each full page, in order
    std::vector<int32_t> tokens;
    std::vector<uint64_t> hashes;
};
// a page a step filled, waiting for its K/V to be stored before it is cached
struct PkvPendingPage {
    int64_t seq_id;
    int64_t index;            // position of the page in the sequence's list
    uint64_t hash;
};
// what one sequence of the last append was before it (see PageTables.undo_append)
struct PkvUndoSeq {
    int64_t seq_id;
    int64_t length;
    int64_t num_tokens;
    int64_t num_hashes;
};
// ... and its page list in one pool
struct PkvUndoPages {
    int64_t num_pages;
    int64_t released;
    int32_t copy_source;      // the shared last page it copied, or -1
};
// a page the last append gave back: entry `index` of sequence `b`
struct PkvReleased {
    int64_t b;
    int64_t index;
    int32_t page;
};
// the tokens and hashes an abandoned step made a sequence forget
struct PkvForgotten {
    int64_t seq_id;
    std::vector<int32_t> tokens;
    std::vector<uint64_t> hashes;
};
static inline void pkv_forget(std::vector<PkvForgotten>& out, int64_t seq_id,
                              PkvSequence& seq, size_t num_tokens, size_t num_hashes) {
    PkvForgotten f;
    f.seq_id = seq_id;
    if (seq.tokens.size() > num_tokens)
        f.tokens.assign(seq.tokens.begin() + num_tokens, seq.tokens.end());
    if (seq.hashes.size() > num_hashes)
        f.hashes.assign(seq.hashes.begin() + num_hashes, seq.hashes.end());
    out.push_back(f);
}
static inline void pkv_remember(PkvForgotten& f, PkvSequence& seq) {
    seq.tokens.insert(seq.tokens.end(), f.tokens.begin(), f.tokens.end());
    seq.hashes.insert(seq.hashes.end(), f.hashes.begin(), f.hashes.end());
}
// what an append's plan found and counted in one pool, before anything changes
struct PkvPoolPlan {
    std::vector<char> copy;                     // per sequence: copy its last page
    // copies per shared page: the last writer of a page shared only within
    // the step keeps it instead of copying
    std::unordered_map<int32_t, int32_t> copies_of;
    // references to pages the step gives back, per page
    std::unordered_map<int32_t, int32_t> releases;
    int64_t num_copies = 0, new_pages = 0, freed = 0;
};
// ... and in every pool
struct PkvStepPlan {
    std::vector<PkvSequence*> batch;
    std::vector<std::vector<uint64_t>> hashes;  // per sequence: of the pages it fills
    std::vector<PkvPoolPlan> pools;
    int64_t total_new = 0, nnz = 0, max_pages = 0;
};
// where the commit writes one pool's tables (into the arrays append returns)
struct PkvPoolOut {
    int64_t* slot_mapping = nullptr;
    int32_t* page_indices = nullptr;
    int32_t* block_table = nullptr;     // [B, max_pages]
    int32_t* copy_src = nullptr;
    int32_t* copy_dst = nullptr;
    int64_t num_copied = 0;
};
// where the commit writes the step's tables: those the pools share, and each pool's
struct PkvStepOut {
    int32_t* query_start = nullptr;
    int32_t* seq_lens = nullptr;
    int32_t* page_indptr = nullptr;
    int32_t* last_page_len = nullptr;
    int64_t max_pages = 0;
    std::vector<PkvPoolOut> pools;
};

#endif

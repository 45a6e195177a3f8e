/* The default prefix-cache page hash: deterministic across processes and
 * platforms (unlike Python's salted hash()), a 64-bit splitmix chain over the
 * parent page's hash and the page's token ids.  Collisions cost a cache miss,
 * never wrong KV: a hit is always confirmed by comparing the token ids. */
#ifndef PKV_HASH_H
#define PKV_HASH_H
#include <stdint.h>

static inline uint64_t pkv_mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static inline uint64_t pkv_hash_page(uint64_t parent_hash, const int32_t *tokens, int n) {
    uint64_t h = pkv_mix64(parent_hash ^ (uint64_t)n);
    for (int i = 0; i < n; i++) h = pkv_mix64(h ^ (uint32_t)tokens[i]);
    return h;
}
#endif

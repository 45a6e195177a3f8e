"""A pure-Python model of the page pool with prefix caching, for model checking.

It keys cached pages by their exact token prefix (no hashing), keeps the free
queue as a plain list, and follows the documented policy step by step:

* allocation takes the head of the free queue, evicting a cached page;
* a page whose last reference goes returns to the head if it holds nothing
  cached (reused first), to the tail if it does (least recently used first);
* a sequence's pages are released last page first;
* a write into a partly filled last page that is cached, or held by another
  sequence, copies it first;
* a page joins the cache when it becomes full, if its parent's prefix is cached
  (on its parent page or another) and no page is cached under the same prefix.

It predicts exact page ids, so the real cache must agree with it page for page.
"""


class PrefixCacheModel:
    def __init__(self, num_pages, page_size):
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self.queue = list(range(num_pages))     # head first
        self.prefix_of = {}                     # cached page -> its full token prefix
        self.page_of = {}                       # token prefix -> cached page
        self.seqs = {}                          # id -> dict(pages, tokens, known)
        self.prompt_tokens = self.reused_tokens = self.evictions = 0

    # -- pages --------------------------------------------------------------------
    def _take(self):
        page = self.queue.pop(0)
        if page in self.prefix_of:
            del self.page_of[self.prefix_of.pop(page)]
            self.evictions += 1
        self.refcount[page] = 1
        return page

    def _release(self, page):
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self.prefix_of:
                self.queue.append(page)
            else:
                self.queue.insert(0, page)

    def _acquire(self, page):
        if self.refcount[page] == 0:
            self.queue.remove(page)
        self.refcount[page] += 1

    # -- sequences ------------------------------------------------------------------
    def add(self, seq_id, prompt):
        ps = self.page_size
        pages = []
        if prompt is not None:
            for j in range((len(prompt) - 1) // ps if prompt else 0):
                page = self.page_of.get(tuple(prompt[:(j + 1) * ps]))
                if page is None:
                    break
                self._acquire(page)
                pages.append(page)
            self.prompt_tokens += len(prompt)
            self.reused_tokens += len(pages) * ps
        tokens = list(prompt[:len(pages) * ps]) if prompt is not None else []
        self.seqs[seq_id] = dict(pages=pages, tokens=tokens, known=len(tokens))

    def fork(self, parent, child):
        p = self.seqs[parent]
        for page in p["pages"]:
            self.refcount[page] += 1
        self.seqs[child] = dict(pages=list(p["pages"]), tokens=list(p["tokens"]), known=p["known"])

    def free(self, seq_id):
        for page in reversed(self.seqs.pop(seq_id)["pages"]):
            self._release(page)

    def truncate(self, seq_id, new_len):
        s = self.seqs[seq_id]
        keep = -(-new_len // self.page_size)
        while len(s["pages"]) > keep:
            self._release(s["pages"].pop())
        del s["tokens"][new_len:]
        s["known"] = min(s["known"], new_len)

    def pages_needed(self, seq_ids, counts):
        """Pages ``append`` would take, or None if it would not fit."""
        ps, needed, copies = self.page_size, 0, {}
        for sid, n in zip(seq_ids, counts):
            s = self.seqs[sid]
            length = len(s["tokens"])
            if n and length % ps:
                last = s["pages"][-1]
                if last in self.prefix_of or self.refcount[last] - copies.get(last, 0) > 1:
                    copies[last] = copies.get(last, 0) + 1
                    needed += 1
            needed += -(-(length + n) // ps) - len(s["pages"])
        return needed if needed <= len(self.queue) else None

    def append(self, seq_ids, counts, new_tokens, with_tokens):
        ps, row = self.page_size, 0
        for sid, n in zip(seq_ids, counts):
            s = self.seqs[sid]
            length = len(s["tokens"])
            if n and length % ps:
                last = s["pages"][-1]
                if last in self.prefix_of or self.refcount[last] > 1:
                    page = self._take()
                    self._release(last)
                    s["pages"][-1] = page
            while len(s["pages"]) < -(-(length + n) // ps):
                s["pages"].append(self._take())
            tracked = with_tokens and s["known"] == length
            s["tokens"] += list(new_tokens[row:row + n])
            row += n
            if tracked:
                s["known"] = len(s["tokens"])
                for j in range(length // ps, s["known"] // ps):
                    prefix = tuple(s["tokens"][:(j + 1) * ps])
                    # its parent's prefix is cached: on its parent page, or on another
                    # page cached first under the same prefix
                    parent_cached = j == 0 or tuple(s["tokens"][:j * ps]) in self.page_of
                    page = s["pages"][j]
                    if parent_cached and prefix not in self.page_of and page not in self.prefix_of:
                        self.page_of[prefix] = page
                        self.prefix_of[page] = prefix

    def reset(self):
        for page in [p for p in self.queue if p in self.prefix_of]:
            del self.page_of[self.prefix_of.pop(page)]
            self.queue.remove(page)
            self.queue.insert(0, page)

    def stats(self):
        return {
            "num_free_pages": len(self.queue),
            "num_used_pages": sum(r > 0 for r in self.refcount),
            "num_shared_pages": sum(r > 1 for r in self.refcount),
            "num_cached_pages": sum(p in self.prefix_of for p in self.queue),
            "prefix_hit_rate": self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "num_evictions": self.evictions,
            "num_swapped_sequences": 0,       # the model never swaps
            "swapped_bytes": 0,
        }

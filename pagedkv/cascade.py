"""Shared-prefix (cascade) attention: a run of pages that several sequences of a
step share is read once for all their queries.

Sequences forked from one prompt, or that hit the same cached prefix, hold
the same physical pages at the same positions.  For each group of such
sequences, :func:`plan_cascade` finds the keys that every query of the group
sees and that lie in the shared pages, ``[lo, hi)``.  Attention then runs
twice over disjoint keys, through the backend's ordinary kernels:

* **shared**: the group's queries gathered into one pseudo-sequence whose
  keys are ``[lo, hi)`` of the shared pages: a multi-query block (GQA x
  sequences rows per KV head) that reads each shared page once;
* **own**: every sequence over its keys outside ``[lo, hi)``;

and the two merge by log-sum-exp (:func:`merge_lse`), the sinks joining the
denominator once.  The shared call knows no query's position: every one of
its queries sees all of ``[lo, hi)`` (so the band needs no mask), and ALiBi's
bias, which depends on the position only through a constant per query, is
corrected in the merge.

Only where it pays (:class:`CascadePolicy`): groups of sequences with few
query rows each (decode, speculative or beam steps) whose run is long enough
and would be read often enough without cascade to cover the second call and
the merge; measured per backend (docs/cascade.md).
"""
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from pagedkv.backends.base import StepTables
from pagedkv.backends.schedule import KeyCut

if TYPE_CHECKING:   # annotations only: importing them here would be circular
    from pagedkv.attention_spec import AttentionSpec, Band
    from pagedkv.backends.base import Backend
    from pagedkv.storage import StorageFormat

#: A group of :func:`find_groups`: (members, lo, hi).
Group = Tuple[np.ndarray, int, int]

#: The values of ``PagedKVCache(cascade=...)``.
MODES = ("auto", "off")


def check_mode(value: Any) -> str:
    """``value`` if it is one of :data:`MODES`, else ValueError naming ``cascade``."""
    if not isinstance(value, str) or value not in MODES:
        raise ValueError(f"cascade: expected one of {', '.join(repr(m) for m in MODES)}, "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class CascadePolicy:
    """When a group of sequences sharing pages reads them once ("auto").

    Attributes
    ----------
    min_run_bytes : int
        Fewest bytes of K/V that the group's sequences would read from the
        run in one layer without cascade: ``sharers * shared keys *
        key_bytes`` (``key_bytes``: a position's K and V over every KV head,
        scales included).  The shared call turns those reads into a
        compute-bound block; it must also pay for a second kernel call, the
        gather of the queries and the merge.
    min_shared_keys : int
        Fewest shared keys every query of the group sees.
    max_rows : int
        Most query rows a sequence of a group may have in the step: the
        block path already reads a sequence's keys once for many rows.
    """
    min_run_bytes: int = 0
    min_shared_keys: int = 1
    max_rows: int = 8


@dataclass(frozen=True)
class Sharing:
    """What a step's sequences share, as cascade attention reads it.

    Attributes
    ----------
    num_groups : int
        Groups of sequences whose shared keys are read once.
    num_sequences : int
        Sequences in those groups.
    shared_tokens : int
        Key positions read once for a whole group, summed over the groups.
    saved_token_reads : int
        Reads of a key position (per layer and KV head) that the sharing
        saves: ``sum(shared * (sharers - 1))``.
    """
    num_groups: int = 0
    num_sequences: int = 0
    shared_tokens: int = 0
    saved_token_reads: int = 0


@dataclass(frozen=True, eq=False)
class CascadePlan:
    """A step's two attention calls and how their results merge.

    Attributes
    ----------
    rows : ndarray, shape [n], int64
        The query rows of the step that the shared call computes, group by group.
    shared : StepTables
        The shared call's pseudo-batch: one sequence per group, its rows
        ``rows`` in order, its keys the group's shared run (``key_cut`` keeps
        ``[lo, hi)``).
    own : StepTables
        The step's tables with ``key_cut`` skipping each grouped sequence's
        shared run.
    position_shift : ndarray, shape [n], int64
        The shared call's position of each row minus its true position
        (what ALiBi's bias in the shared call is off by, times the slope).
    sharing : Sharing
    """
    rows: np.ndarray
    shared: StepTables
    own: StepTables
    position_shift: np.ndarray
    sharing: Sharing


def _first_index(flags: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per segment ``starts[i]:ends[i]`` of ``flags``, the offset of its first
    True (the segment's length when none)."""
    lengths = ends - starts
    hits = np.flatnonzero(flags)
    seg = np.searchsorted(ends, hits, side="right")
    first = np.full(len(starts), -1, dtype=np.int64)
    # the first hit of each segment: hits are sorted, so the earliest wins
    order = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]]) if len(hits) else hits
    first[seg[order]] = hits[order] - starts[seg[order]]
    return np.where(first < 0, lengths, first)


def key_bytes(storage: "StorageFormat", num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one position's K and V in one layer (every KV head, scales included)."""
    return 2 * num_kv_heads * storage.row_bytes(head_dim)


def find_groups(tables: StepTables, page_size: int, band: "Optional[Band]",
                policy: CascadePolicy, bytes_per_key: int) -> List[Group]:
    """The groups of a step's sequences that read shared keys once.

    Parameters
    ----------
    tables : StepTables
    page_size : int
    band : pagedkv.attention_spec.Band or None
    policy : CascadePolicy
    bytes_per_key : int
        :func:`key_bytes` of the layers.

    Returns
    -------
    list of (members, lo, hi)
        ``members``: int64 [n_g] sequence indices of the step (the first is
        the group's representative); every query of every member sees the
        key positions ``lo:hi``, which lie in pages all members hold.
    """
    if not tables.may_share:
        return []       # no page had two holders: the common case, at no cost
    query_start = tables.query_start.astype(np.int64)
    seq_lens = tables.seq_lens.astype(np.int64)
    indptr = tables.page_indptr.astype(np.int64)
    pages = tables.page_indices
    num_rows = np.diff(query_start)
    eligible = (num_rows >= 1) & (num_rows <= policy.max_rows)
    if eligible.sum() < 2:
        return []
    num_pages = np.diff(indptr)
    entry_seq = np.repeat(np.arange(len(seq_lens)), num_pages)
    in_play = eligible[entry_seq] & (pages >= 0)
    counts = np.bincount(pages[in_play], minlength=1)
    shared = np.zeros(len(pages), dtype=bool)
    shared[in_play] = counts[pages[in_play]] >= 2
    if not shared.any():
        return []
    # each sequence's last shared page: a group's members end their common run there
    entry = np.flatnonzero(shared)
    last = np.full(len(seq_lens), -1, dtype=np.int64)
    np.maximum.at(last, entry_seq[entry], entry)
    has = last >= 0
    seqs = np.flatnonzero(has)
    last_page = pages[last[seqs]]
    last_index = last[seqs] - indptr[seqs]
    order = np.lexsort((seqs, last_index, last_page))
    seqs, last_page, last_index = seqs[order], last_page[order], last_index[order]
    starts = np.flatnonzero(np.r_[True, (last_page[1:] != last_page[:-1])
                                  | (last_index[1:] != last_index[:-1])])
    sizes = np.diff(np.r_[starts, len(seqs)])

    first_pos = seq_lens - num_rows         # position of each sequence's first new row
    last_pos = seq_lens - 1
    lo_key = np.zeros(len(seq_lens), dtype=np.int64) if band is None else \
        band.first_visible(last_pos.astype(np.int64))

    big = sizes >= 2
    starts, sizes = starts[big], sizes[big]
    if not len(starts):
        return []
    # every member (sorted by group; the first of each is its representative)
    member_group = np.repeat(np.arange(len(starts)), sizes)
    members = seqs[np.repeat(starts, sizes) + np.arange(len(member_group))
                   - np.repeat(np.cumsum(sizes) - sizes, sizes)]
    ends = last_index[starts] + 1               # one past each run's last page index
    reps = seqs[starts]
    # each member's run backwards from its group's end: pages equal to the representative's
    others = np.ones(len(members), dtype=bool)
    others[np.cumsum(sizes) - sizes] = False
    other_group = member_group[others]
    lengths = ends[other_group]
    offsets = np.cumsum(lengths) - lengths
    back = np.repeat(lengths - 1, lengths) - (np.arange(lengths.sum()) - np.repeat(offsets, lengths))
    mine = pages[np.repeat(indptr[members[others]], lengths) + back]
    theirs = pages[np.repeat(indptr[reps[other_group]], lengths) + back]
    run = _first_index((mine != theirs) | (theirs < 0), offsets, offsets + lengths)
    group_firsts = np.cumsum(sizes - 1) - (sizes - 1)
    begin = ends - np.minimum.reduceat(run, group_firsts)
    first_of = np.cumsum(sizes) - sizes
    lo = np.maximum(begin * page_size, np.maximum.reduceat(lo_key[members], first_of))
    hi = np.minimum(ends * page_size, np.minimum.reduceat(first_pos[members], first_of) + 1)
    shared = hi - lo
    keep = (shared >= max(policy.min_shared_keys, 1)) & \
        (sizes * shared * bytes_per_key >= policy.min_run_bytes)
    return [(members[first_of[g]:first_of[g] + sizes[g]], int(lo[g]), int(hi[g]))
            for g in np.flatnonzero(keep)]


def _sharing_of(groups: Sequence[Group]) -> Sharing:
    return Sharing(len(groups), sum(len(m) for m, _, _ in groups),
                   sum(hi - lo for _, lo, hi in groups),
                   sum((hi - lo) * (len(m) - 1) for m, lo, hi in groups))


def plan_cascade(tables: StepTables, groups: Sequence[Group], page_size: int,
                 prepare_step: Callable[[StepTables], None]) -> Optional[CascadePlan]:
    """The cascade plan of a step, or None when no group pays.

    ``groups``: :func:`find_groups` of the step; ``prepare_step(tables)``: the
    backend's, for the shared call's tables.
    """
    if not groups:
        return None
    query_start = tables.query_start.astype(np.int64)
    indptr = tables.page_indptr
    row_lists, shared_starts, shared_lens, shared_pages, shared_indptr = [], [0], [], [], [0]
    shift = []
    skip_lo = np.zeros(len(tables.seq_lens), dtype=np.int64)
    skip_hi = np.zeros(len(tables.seq_lens), dtype=np.int64)
    keep_lo, keep_hi = [], []
    for members, lo, hi in groups:
        member_rows = [np.arange(query_start[b], query_start[b + 1]) for b in members]
        group_rows = np.concatenate(member_rows)
        positions = np.concatenate([
            np.arange(tables.seq_lens[b] - len(r), tables.seq_lens[b]) for b, r in
            zip(members, member_rows)])
        n = len(group_rows)
        # the pseudo-sequence's rows sit at hi - 1 .. hi + n - 2: each sees all of lo:hi
        shift.append(np.arange(hi - 1, hi - 1 + n) - positions)
        row_lists.append(group_rows)
        shared_starts.append(shared_starts[-1] + n)
        shared_lens.append(hi + n - 1)
        rep = members[0]
        shared_pages.append(tables.page_indices[indptr[rep]:indptr[rep] + -(-hi // page_size)])
        shared_indptr.append(shared_indptr[-1] + len(shared_pages[-1]))
        keep_lo.append(lo)
        keep_hi.append(hi)
        skip_lo[members] = lo
        skip_hi[members] = hi
    rows = np.concatenate(row_lists)
    shared = StepTables(
        np.asarray(shared_starts, dtype=np.int32), np.asarray(shared_lens, dtype=np.int32),
        tables.slot_mapping[rows], np.asarray(shared_indptr, dtype=np.int32),
        np.concatenate(shared_pages).astype(np.int32),
        key_cut=KeyCut(np.asarray(keep_lo, np.int64), np.asarray(keep_hi, np.int64), True))
    prepare_step(shared)
    own = replace(tables, key_cut=KeyCut(skip_lo, skip_hi, False), plans={})
    return CascadePlan(rows, shared, own, np.concatenate(shift), _sharing_of(groups))


def merge_lse(out: np.ndarray, lse: np.ndarray, rows: np.ndarray, shared_out: np.ndarray,
              shared_lse: np.ndarray, sinks: Optional[np.ndarray]) -> None:
    """Merge the own call's results with the shared call's, in place.

    Parameters
    ----------
    out : ndarray, shape [T, num_heads, D], float32
        The own call's results (each normalised over its own keys); becomes
        the attention over all keys.
    lse : ndarray, shape [T, num_heads], float32
        Their log-sum-exps.
    rows : ndarray, shape [n], int64
        The rows the shared call computed.
    shared_out : ndarray, shape [n, num_heads, D]
    shared_lse : ndarray, shape [n, num_heads]
        The shared call's, ALiBi-corrected.
    sinks : ndarray, shape [num_heads], or None
        Joins every query's denominator once.
    """
    sink = -np.inf if sinks is None else np.asarray(sinks, np.float32)[None, :]
    with np.errstate(invalid="ignore", over="ignore"):
        own_lse = lse[rows]
        top = np.maximum(np.maximum(own_lse, shared_lse), sink)
        top = np.where(np.isfinite(top), top, 0.0)
        w_own, w_shared = np.exp(own_lse - top), np.exp(shared_lse - top)
        total = w_own + w_shared + np.exp(sink - top)
        inv = np.where(total > 0, 1.0 / np.where(total > 0, total, 1.0), 0.0)
        out[rows] = (out[rows] * (w_own * inv)[..., None]
                     + shared_out * (w_shared * inv)[..., None])
        if sinks is not None:
            # rows outside every group: their sink, once
            alone = np.ones(len(out), dtype=bool)
            alone[rows] = False
            top = np.maximum(lse[alone], sink)
            top = np.where(np.isfinite(top), top, 0.0)
            w = np.exp(lse[alone] - top)
            total = w + np.exp(sink - top)
            out[alone] *= np.where(total > 0, w / np.where(total > 0, total, 1.0), 0.0)[..., None]


class CascadeAttention:
    """A backend's attention that reads shared runs once where the backend's
    ``cascade_policy`` finds they pay (``enabled``: ``cascade="auto"``)."""

    def __init__(self, backend: "Backend", enabled: bool):
        self.backend = backend
        self.enabled = enabled
        self.key_bytes = key_bytes(backend.storage, backend.num_kv_heads, backend.head_dim)

    @property
    def policy(self) -> Optional[CascadePolicy]:
        """The :class:`CascadePolicy` in force, or None (``cascade="off"``)."""
        return self.backend.cascade_policy if self.enabled else None

    def groups(self, tables: StepTables, band: "Optional[Band]") -> List[Group]:
        """:func:`find_groups` of a step's ``tables`` for ``band`` under the policy
        in force, searched once per step and band (attention's plan and
        ``StepBatch.sharing`` both read it)."""
        policy = self.policy
        if policy is None:
            return []
        return tables.kept(
            ("cascade groups", band),
            lambda: find_groups(tables, self.backend.page_size, band, policy, self.key_bytes))

    def sharing(self, tables: StepTables) -> Sharing:
        """The :class:`Sharing` of a step's ``tables`` (causal attention)."""
        return _sharing_of(self.groups(tables, None))


    def plan(self, tables: StepTables, q: Any, spec: "AttentionSpec") -> Optional[CascadePlan]:
        """The step's :class:`CascadePlan` for ``q`` and ``spec`` (made once per
        step, head count and band), or None: one ordinary call."""
        if self.policy is None or self.backend.is_native(q):
            return None   # a device array stays on the device: no gather on the host
        return tables.kept(("cascade", q.shape[1], spec.band), lambda: plan_cascade(
            tables, self.groups(tables, spec.band), self.backend.page_size,
            self.backend.prepare_step))

    def __call__(self, layer: int, tables: StepTables, q: Any, spec: "AttentionSpec",
                 out: Optional[np.ndarray] = None) -> Any:
        """``backend.attention(layer, tables, q, spec, out=out)``, by cascade where planned."""
        backend = self.backend
        plan = self.plan(tables, q, spec)
        if plan is None:
            return backend.attention(layer, tables, q, spec, out=out)
        q = np.asarray(q, dtype=np.float32)
        no_sinks = replace(spec, sinks=None)
        shared_lse = np.empty((len(plan.rows), q.shape[1]), np.float32)
        # every query of the shared call sees all its keys: no band
        shared_out = backend.attention(
            layer, plan.shared, np.ascontiguousarray(q[plan.rows]),
            no_sinks.without_band(), lse=shared_lse)
        if spec.alibi_slopes is not None:
            # the shared call took each row at another position: every logit of
            # the row is off by slope * shift, and so is its log-sum-exp
            shared_lse += spec.alibi_slopes[None, :] * \
                plan.position_shift[:, None].astype(np.float32)
        lse = np.empty(q.shape[:2], np.float32)
        out = backend.attention(layer, plan.own, q, no_sinks, out=out, lse=lse)
        merge_lse(out, lse, plan.rows, shared_out, shared_lse, spec.sinks)
        return out

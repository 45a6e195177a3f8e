"""The state pool: slots that hold recurrent layers' states (hybrid models).

A recurrent layer keeps a fixed-size state per sequence instead of K/V
(:class:`pagedkv.state_spec.StateSpec`).  The cache keeps those states in
one pool of **slots**; a slot holds one copy of every recurrent layer's
state arrays (the backend's state store: per layer and array, one
``[num_slots, *shape]`` array).  The pool is described by a frozen
:class:`StatePoolSpec` beside the page pools' specs (:mod:`pagedkv.pools`),
and :class:`StatePool` is its manager.  It hands out slots as the page pools
hand out pages, through a :class:`~pagedkv._allocator.PageAllocator` of
one-slot pages, whose reference counts give what pages get from theirs:

* **fork** shares the parent's slots; the first step of either sequence
  writes into a slot of its own (copy on write);
* **rollback**: a sequence keeps its states after each of its last
  ``rollback`` tokens (a slot each), so ``truncate`` to any of those lengths
  restores the state after that token;
* **prefix snapshots** (with prefix caching): every ``snapshot_interval``
  tokens of a sequence whose tokens are known, the state at that position
  is copied into a slot of its own, found again by a digest of the token
  prefix.  A new sequence with that prompt starts on it (sharing the slot);
  snapshots that no sequence uses count as free and are evicted least
  recently used when slots run short.

A step (``append``) is planned before the page tables commit it
(:meth:`StatePool.plan`: it raises ``OutOfPagesError`` naming the state
pool, changing nothing) and committed after (:meth:`StatePool.commit`),
which makes the :class:`StateStep` the recurrences read: each sequence's
slot, advanced in place, and the *save points* (a row of the step and a
slot to copy the state after that row into) of its rollback states and
snapshots.  A state saved inside a step is usable once every recurrent
layer's arrays were advanced by the built-in calls (``write_states`` has
no state inside a step); a snapshot at a step's end once every array was
advanced, either way.
"""
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import numpy as np

from pagedkv._allocator import PageAllocator
from pagedkv.errors import OutOfPagesError
from pagedkv.state_spec import StateSpec

def prefix_hasher() -> "hashlib.blake2b":
    """A hasher of token prefixes: fed a prefix's tokens (int32 bytes, in any
    pieces), its ``digest()`` is the prefix's key (256-bit BLAKE2b: two
    different prefixes never meet in practice), whatever the snapshot
    interval or page size, so that a file's snapshots serve any cache."""
    return hashlib.blake2b(digest_size=32, person=b"pagedkv-states")


def _extend(hashers: "List[hashlib.blake2b]", tokens: np.ndarray) -> bytes:
    """Append the hasher of the last prefix extended by ``tokens``; its digest."""
    hasher = hashers[-1].copy() if hashers else prefix_hasher()
    hasher.update(np.ascontiguousarray(tokens, np.int32).tobytes())
    hashers.append(hasher)
    return hasher.digest()


@dataclass(frozen=True)
class StatePoolSpec:
    """The state pool and the layers it serves.

    Attributes
    ----------
    num_slots : int
    layer_states : tuple of (StateSpec or None), shape [num_layers]
        Each layer's state arrays; None for an attention layer.
    rollback : int
        Tokens a sequence can always be rolled back by (``state_rollback_tokens``).
    snapshot_interval : int or None
        Tokens between prefix snapshots; None: no snapshots (no prefix caching).
    """
    num_slots: int
    layer_states: Tuple[Optional[StateSpec], ...]
    rollback: int
    snapshot_interval: Optional[int]
    name = "state"

    @property
    def layers(self) -> Tuple[int, ...]:
        """The recurrent layers, ascending."""
        return tuple(layer for layer, spec in enumerate(self.layer_states) if spec is not None)

    @property
    def shapes(self) -> Tuple[Optional[Tuple[Tuple[int, ...], ...]], ...]:
        """Per layer, its state arrays' shapes (None: an attention layer)."""
        return tuple(None if spec is None else spec.shapes for spec in self.layer_states)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: every recurrent layer's arrays."""
        return sum(spec.nbytes for spec in self.layer_states if spec is not None)


class StateStep:
    """A step's slots and save points, as the recurrences read them.

    Attributes
    ----------
    query_start : ndarray, shape [B+1], int32
        Rows of sequence ``b`` are ``query_start[b]:query_start[b+1]``.
    slots : ndarray, shape [B], int32
        The slot holding sequence ``b``'s state, advanced in place by the
        step (before it, the state after the sequence's earlier tokens);
        -1 for a sequence without rows and without a state.
    save_rows, save_slots : ndarray, shape [M], int32
        Ascending by row: after row ``save_rows[m]``, the state is copied into
        slot ``save_slots[m]`` (rollback states and snapshots).
    """

    def __init__(self, query_start: np.ndarray, slots: np.ndarray, save_rows: np.ndarray,
                 save_slots: np.ndarray, arrays: Set[Tuple[int, int]]):
        self.query_start = query_start
        self.slots = slots
        self.save_rows = save_rows
        self.save_slots = save_slots
        self._arrays = frozenset(arrays)      # every (layer, array) the step must advance
        self.by_kernel: Set[Tuple[int, int]] = set()
        self.written: Set[Tuple[int, int]] = set()
        last = query_start[1:] - 1
        ends = np.isin(save_rows, last[query_start[1:] > query_start[:-1]])
        #: the save points at a sequence's last row (write_states fills these too)
        self.end_save_rows = save_rows[ends]
        self.end_save_slots = save_slots[ends]

    def advanced(self, layer: int, index: int) -> bool:
        return (layer, index) in self.by_kernel or (layer, index) in self.written

    def complete(self, inside: bool) -> bool:
        """Whether states saved by the step are whole: inside it, every array
        advanced by the built-in calls; at its end, by any means."""
        if inside:
            return self.by_kernel >= self._arrays
        return (self.by_kernel | self.written) >= self._arrays


class _Entry(NamedTuple):
    """A state a sequence holds: after its first ``length`` tokens, in ``slot``.
    ``step``/``inside``: the step that saved it (None: whole since) and whether
    inside that step (see :meth:`StateStep.complete`)."""
    length: int
    slot: int
    step: Optional[StateStep] = None
    inside: bool = False

    def usable(self) -> bool:
        return self.step is None or self.step.complete(self.inside)


class _Snapshot(NamedTuple):
    slot: int
    length: int
    step: Optional[StateStep]
    inside: bool

    def usable(self) -> bool:
        return self.step is None or self.step.complete(self.inside)


class _History:
    """What the pool keeps of one sequence: its states (ascending by length; the
    last is its current state, none at length 0) and, while its tokens are
    known, the hashers of its token prefixes at each snapshot position."""
    __slots__ = ("entries", "digests")

    def __init__(self, entries: Optional[List[_Entry]] = None,
                 digests: "Optional[List[hashlib.blake2b]]" = None):
        self.entries: List[_Entry] = entries or []
        self.digests: "Optional[List[hashlib.blake2b]]" = digests

    @property
    def current(self) -> Optional[_Entry]:
        return self.entries[-1] if self.entries else None


class _SeqPlan(NamedTuple):
    """One sequence's part of a step (see :meth:`StatePool.plan`)."""
    row: int                    # its first row in the step
    old_len: int
    new_len: int
    in_place: bool              # advance its current slot (else a new one)
    inside: Tuple[int, ...]     # lengths inside the step whose states it keeps
    snapshots: Tuple[Tuple[int, bytes], ...]    # (position, digest) to snapshot
    digests: "Optional[List[hashlib.blake2b]]"    # its prefix hashers after the step


class StepPlan(NamedTuple):
    """A step planned by :meth:`StatePool.plan`, for :meth:`StatePool.commit`."""
    seq_ids: Tuple[int, ...]
    query_start: np.ndarray
    seqs: Tuple[Optional[_SeqPlan], ...]     # None: no rows this step


class StatePool:
    """The manager of the state pool (see the module docstring).

    Parameters
    ----------
    spec : StatePoolSpec
    store : object
        The backend's state store (``Backend.state_store``): the slots' arrays.
    caching : bool
        Whether the page tables keep a prefix cache (snapshots need it).
    """

    def __init__(self, spec: StatePoolSpec, store, caching: bool):
        self.spec = spec
        self.store = store
        self.layers = spec.layers
        self.allocator = PageAllocator(spec.num_slots, 1, False)
        self.rollback = spec.rollback
        self.interval = spec.snapshot_interval if caching else None
        self._arrays = {(layer, i) for layer in self.layers
                        for i in range(spec.layer_states[layer].num_arrays)}  # type: ignore
        self._seqs: Dict[int, _History] = {}
        # digest of a token prefix -> its snapshot, least recently used first
        self._snapshots: "OrderedDict[bytes, _Snapshot]" = OrderedDict()
        self.num_evictions = 0

    name = "state"

    # -- slots ---------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.spec.num_slots

    def _evictable(self) -> List[bytes]:
        """Snapshots no sequence uses, least recently used first."""
        if not self._snapshots:
            return []
        slots = np.fromiter((snap.slot for snap in self._snapshots.values()), np.int32,
                            len(self._snapshots))
        alone = self.allocator.refcount(slots) == 1
        return [key for key, free in zip(self._snapshots, alone.tolist()) if free]

    @property
    def num_free(self) -> int:
        """Slots a step can take: free ones and those of snapshots no sequence uses."""
        return self.allocator.num_free + len(self._evictable())

    @property
    def num_cached(self) -> int:
        """Slots of snapshots no sequence uses (evictable)."""
        return len(self._evictable())

    def _take(self, n: int) -> np.ndarray:
        """``n`` slots (int32 [n]), evicting unused snapshots, oldest first, as needed;
        the caller made sure there are enough."""
        short = n - self.allocator.num_free
        if short > 0:
            for key in self._evictable()[:short]:
                self.allocator.decref([self._snapshots.pop(key).slot])
                self.num_evictions += 1
        return self.allocator.allocate(n)

    def _release(self, slots: Sequence[int]) -> None:
        if len(slots):
            self.allocator.decref(np.asarray(slots, np.int32))

    def stats(self) -> Dict[str, int]:
        refcounts = self.allocator.refcount(np.arange(self.num_slots))
        return {"num_free_state_slots": self.num_free,
                "num_used_state_slots": int((refcounts > 0).sum()) - self.num_cached,
                "num_shared_state_slots": int((refcounts > 1).sum()),
                "num_cached_state_slots": self.num_cached,
                "num_state_evictions": self.num_evictions}

    def reset_snapshots(self) -> int:
        """Drop every snapshot no sequence uses; return how many."""
        keys = self._evictable()
        for key in keys:
            self.allocator.decref([self._snapshots.pop(key).slot])
        return len(keys)

    # -- sequences -----------------------------------------------------------------
    def _history(self, seq_id: int) -> _History:
        return self._seqs.get(seq_id) or _History(digests=[] if self.interval else None)

    def current_slot(self, seq_id: int) -> int:
        """The slot of the sequence's state now, -1 when it has none (zeros)."""
        entry = self._history(seq_id).current
        return -1 if entry is None else entry.slot

    def prompt_digests(self, tokens: np.ndarray) -> "List[hashlib.blake2b]":
        """Hashers of ``tokens``' prefixes at each snapshot position short of its
        last token (what a prefix hit may cover)."""
        hashers: "List[hashlib.blake2b]" = []
        if self.interval is None:
            return hashers
        step = self.interval
        for end in range(step, len(tokens), step):
            _extend(hashers, tokens[end - step:end])
        return hashers

    def allowed_hits(self, digests: "List[hashlib.blake2b]", page_size: int) -> np.ndarray:
        """Per number of full pages ``h`` a prefix hit may cover (``[0, len + 1)``):
        whether a usable snapshot holds the state after them; uint8.  ``h = 0``
        always: a new sequence's state is zeros."""
        assert self.interval is not None
        allowed = np.zeros((len(digests) + 1) * (self.interval // page_size) + 1, np.uint8)
        allowed[0] = 1
        for k, hasher in enumerate(digests):
            snap = self._snapshots.get(hasher.digest())
            if snap is not None and snap.usable():
                allowed[(k + 1) * self.interval // page_size] = 1
        return allowed

    def start(self, seq_id: int, length: int,
              digests: "Optional[List[hashlib.blake2b]]") -> None:
        """A new sequence of ``length`` tokens (a prefix hit: on the snapshot at
        that length, shared; 0: no state yet).  ``digests``: its prompt's."""
        history = _History(digests=None if self.interval is None else [])
        if length:
            assert self.interval is not None and digests is not None
            key = digests[length // self.interval - 1].digest()
            snap = self._snapshots[key]
            self._snapshots.move_to_end(key)
            self.allocator.incref([snap.slot])
            history.entries.append(_Entry(length, snap.slot))
            history.digests = digests[:length // self.interval]
        self._seqs[seq_id] = history

    def fork(self, parent: int, child: int) -> None:
        """``child`` shares ``parent``'s states (copy on write)."""
        history = self._history(parent)
        # (a hasher is never updated once in a list: sharing them is safe)
        self._seqs[child] = _History(list(history.entries),
                                     None if history.digests is None else list(history.digests))
        if history.entries:
            self.allocator.incref(np.array([e.slot for e in history.entries], np.int32))

    def free(self, seq_id: int) -> None:
        history = self._seqs.pop(seq_id, None)
        if history is not None:
            self._release([e.slot for e in history.entries])

    def clear(self) -> None:
        for seq_id in list(self._seqs):
            self.free(seq_id)

    def check_truncate(self, seq_id: int, new_len: int, old_len: int) -> None:
        """ValueError unless the sequence holds a usable state after ``new_len`` tokens."""
        if new_len in (0, old_len):
            return
        history = self._history(seq_id)
        for entry in history.entries:
            if entry.length == new_len and entry.usable():
                return
        kept = [e.length for e in history.entries if e.usable()]
        raise ValueError(
            f"new_len: the recurrent layers hold sequence {seq_id}'s state only after "
            f"{kept or 'none of its'} tokens (state_rollback_tokens={self.rollback}; "
            f"write_states keeps only a step's end) or 0, got {new_len}")

    def truncate(self, seq_id: int, new_len: int) -> None:
        """Roll the sequence's state back to ``new_len`` (checked by ``check_truncate``)."""
        history = self._seqs.get(seq_id)
        if history is None:
            return
        keep = [e for e in history.entries if e.length <= new_len]
        self._release([e.slot for e in history.entries if e.length > new_len])
        history.entries = keep
        if history.digests is not None and self.interval:
            del history.digests[new_len // self.interval:]

    # -- a step ------------------------------------------------------------------------
    def _refcounts(self, slots: List[int]) -> List[int]:
        """The slots' reference counts, in one call (0 for -1)."""
        if not slots:
            return []
        array = np.array(slots, np.int32)
        counts = np.zeros(len(slots), np.int32)
        held = array >= 0
        counts[held] = self.allocator.refcount(array[held])
        return counts.tolist()

    def plan(self, seq_ids: np.ndarray, counts: np.ndarray, old_lens: Sequence[int],
             known: Optional[Callable[[int], np.ndarray]],
             tokens: Optional[np.ndarray]) -> StepPlan:
        """Plan a step of ``counts[b]`` new tokens of each ``seq_ids[b]`` (lengths
        ``old_lens`` before it); OutOfPagesError naming the state pool when the
        slots it needs are not there.  Changes nothing.

        ``known(seq_id)``: the sequence's known token ids (prefix caching: the
        page tables' ``known_tokens``), or None; ``tokens``: the step's token
        ids, flat (or None).
        """
        query_start = np.zeros(len(seq_ids) + 1, np.int32)
        np.cumsum(counts, out=query_start[1:])
        rollback, interval = self.rollback, self.interval
        ids, ns = seq_ids.tolist(), counts.tolist()
        histories = [self._seqs.get(s) for s in ids]
        currents = [h.entries[-1] if h is not None and h.entries else None for h in histories]
        shared = self._refcounts([-1 if c is None else c.slot for c in currents])
        # states no longer kept after the step, other than the current one
        stale = [e.slot for h, old, n in zip(histories, old_lens, ns) if n and h is not None
                 for e in h.entries[:-1] if e.length < old + n - rollback] if rollback else []
        releasable = sum(1 for count in self._refcounts(stale) if count == 1)
        seqs: List[Optional[_SeqPlan]] = []
        planned: Set[bytes] = set()     # snapshots of this step (two sequences may share one)
        need = 0
        for b, (seq_id, n) in enumerate(zip(ids, ns)):
            if n == 0:
                seqs.append(None)
                continue
            old = int(old_lens[b])
            new = old + n
            cur = currents[b]
            keep_cur = cur is not None and rollback > 0 and cur.length >= new - rollback
            in_place = cur is not None and not keep_cur and shared[b] == 1
            inside = tuple(range(max(old + 1, new - rollback), new)) if rollback else ()
            need += (not in_place) + len(inside)
            snapshots: List[Tuple[int, bytes]] = []
            history = histories[b]
            digests = history.digests if history is not None else \
                ([] if interval else None)
            if tokens is None or known is None or interval is None:
                digests = None              # tokens unknown from here: no more snapshots
            elif digests is not None and new // interval > old // interval:
                start = query_start[b]
                step_tokens = tokens[start:start + n]
                prior = known(seq_id)
                if len(prior) != old or len(digests) != old // interval:
                    digests = None
                else:
                    digests = list(digests)
                    for end in range((old // interval + 1) * interval, new + 1, interval):
                        begin = end - interval
                        chunk = np.concatenate([prior[begin:old], step_tokens[:end - old]]) \
                            if begin < old else step_tokens[begin - old:end - old]
                        digest = _extend(digests, chunk)
                        if digest not in self._snapshots and digest not in planned:
                            planned.add(digest)
                            snapshots.append((end, digest))
            seqs.append(_SeqPlan(int(query_start[b]), old, new, in_place, inside,
                                 tuple(snapshots), digests))
        # free slots first: counting the unused snapshots walks all of them
        free = self.allocator.num_free
        if need > free + releasable:
            free = self.num_free
        if need > free + releasable:
            raise OutOfPagesError(
                f"num_state_slots: the step needs {need} slots of the state pool (the "
                f"recurrent layers' states: a new or forked sequence's own, and one per "
                f"rollback state kept), {free + releasable} are free of "
                f"{self.num_slots}; free sequences or raise num_state_slots")
        return StepPlan(tuple(ids), query_start, tuple(seqs))

    def commit(self, plan: StepPlan) -> StateStep:
        """Take the planned step's slots, copy or zero the states it starts from,
        and return the :class:`StateStep` its recurrences read."""
        rollback = self.rollback
        planned = [(seq_id, sp, self._history(seq_id)) for seq_id, sp in
                   zip(plan.seq_ids, plan.seqs) if sp is not None]
        # what the step no longer keeps first: its slots may serve the step
        if rollback:
            stale: List[int] = []
            for _, sp, history in planned:
                entries = history.entries
                keep = [e for e in entries[:-1] if e.length >= sp.new_len - rollback]
                if len(keep) < len(entries) - 1:
                    stale += [e.slot for e in entries[:-1] if e.length < sp.new_len - rollback]
                    history.entries = keep + entries[-1:]
            self._release(stale)
        needed = sum((not sp.in_place) + len(sp.inside) for _, sp, _ in planned)
        fresh = iter(self._take(needed).tolist()) if needed else iter(())
        wanted = sum(len(sp.snapshots) for _, sp, _ in planned)
        spare = iter(self._take(min(wanted, self.num_free)).tolist()) if wanted else iter(())
        slots = np.full(len(plan.seq_ids), -1, np.int32)
        copy_src: List[int] = []
        copy_dst: List[int] = []
        zero: List[int] = []
        saves: List[Tuple[int, int]] = []
        records = []
        at = 0
        for b, (seq_id, maybe) in enumerate(zip(plan.seq_ids, plan.seqs)):
            if maybe is None:
                slots[b] = self.current_slot(seq_id)
                continue
            sp = maybe
            history = planned[at][2]
            at += 1
            cur = history.current
            if sp.in_place:
                assert cur is not None
                slot = cur.slot
            else:
                slot = next(fresh)
                if cur is not None:
                    copy_src.append(cur.slot)
                    copy_dst.append(slot)
                else:
                    zero.append(slot)
            slots[b] = slot
            inside = [(length, next(fresh)) for length in sp.inside]
            snaps = []
            for position, digest in sp.snapshots:
                snap_slot = next(spare, None)
                if snap_slot is None:
                    break               # no free slot: the snapshot is skipped
                snaps.append((position, digest, snap_slot))
            for length, s in inside:
                saves.append((sp.row + length - sp.old_len - 1, s))
            for position, _, s in snaps:
                saves.append((sp.row + position - sp.old_len - 1, s))
            records.append((seq_id, sp, history, slot, inside, snaps))
        try:
            if copy_src:
                self.store.copy(np.array(copy_src, np.int32), np.array(copy_dst, np.int32))
            if zero:
                self.store.zero(np.array(zero, np.int32))
        except BaseException:
            self._release(copy_dst + zero + [s for r in records for s in
                                             [x[1] for x in r[4]] + [x[2] for x in r[5]]])
            raise
        saves.sort()
        step = StateStep(plan.query_start, slots,
                         np.array([r for r, _ in saves], np.int32).reshape(-1),
                         np.array([s for _, s in saves], np.int32).reshape(-1), self._arrays)
        released: List[int] = []
        for seq_id, sp, history, slot, inside, snaps in records:
            cur = history.current
            entries = history.entries
            if sp.in_place:
                entries = entries[:-1]
            elif cur is not None and not (rollback and cur.length >= sp.new_len - rollback):
                released.append(cur.slot)
                entries = entries[:-1]
            if inside:
                entries = entries + [_Entry(length, s, step, True) for length, s in inside]
            entries.append(_Entry(sp.new_len, slot, step, False))
            for position, digest, s in snaps:
                self._snapshots[digest] = _Snapshot(s, position, step, position < sp.new_len)
            self._seqs[seq_id] = _History(entries, sp.digests)
        self._release(released)
        return step

    # -- sequences that leave the cache ------------------------------------------------
    def export(self, seq_id: int) -> Tuple[Optional[Tuple[np.ndarray, ...]], ...]:
        """Per layer, the sequence's state arrays now (float32 copies), None for an
        attention layer; zeros while it has no state."""
        slot = np.array([self.current_slot(seq_id)], np.int32)
        return tuple(None if spec is None else
                     tuple(self.store.read(layer, i, slot)[0] for i in range(spec.num_arrays))
                     for layer, spec in enumerate(self.spec.layer_states))

    def check_import(self, name: str, states: object) -> Tuple[Optional[Tuple[np.ndarray, ...]], ...]:
        """``states`` (per layer None or a tuple of arrays) checked against the
        layers' specs: float32 C-contiguous copies; ValueError naming the field."""
        layer_states = self.spec.layer_states
        if not isinstance(states, (tuple, list)) or len(states) != len(layer_states):
            raise ValueError(f"{name}: expected a tuple of {len(layer_states)} entries (per "
                             f"layer, None or its state arrays), got {type(states).__name__}")
        out: List[Optional[Tuple[np.ndarray, ...]]] = []
        for layer, (spec, given) in enumerate(zip(layer_states, states)):
            if spec is None:
                if given is not None:
                    raise ValueError(f"{name}[{layer}]: layer {layer} is an attention layer of "
                                     f"this cache; expected None, got its state arrays")
                out.append(None)
                continue
            if not isinstance(given, (tuple, list)) or len(given) != spec.num_arrays:
                raise ValueError(f"{name}[{layer}]: layer {layer} is a recurrent layer of this "
                                 f"cache; expected a tuple of {spec.num_arrays} arrays, got "
                                 f"{type(given).__name__}")
            arrays = []
            for i, (shape, array) in enumerate(zip(spec.shapes, given)):
                if not isinstance(array, np.ndarray) or array.shape != shape or \
                        array.dtype.kind != "f":
                    got = type(array).__name__ if not isinstance(array, np.ndarray) \
                        else f"{array.dtype} {list(array.shape)}"
                    raise ValueError(f"{name}[{layer}][{i}]: expected a float array of shape "
                                     f"{list(shape)}, got {got}")
                arrays.append(np.ascontiguousarray(np.asarray(array), np.float32))
            out.append(tuple(arrays))
        return tuple(out)

    def check_room(self, count: int, what: str) -> None:
        if count > self.num_free:
            raise OutOfPagesError(f"num_state_slots: {what} needs {count} slots of the state "
                                  f"pool, {self.num_free} are free of {self.num_slots}")

    def place(self, seq_id: int, length: int, states: Tuple[Optional[Tuple[np.ndarray, ...]], ...],
              tokens: Optional[np.ndarray]) -> None:
        """Give the new sequence ``seq_id`` (``length`` tokens) the state ``states``
        (checked by ``check_import``; room checked by ``check_room``)."""
        history = _History(digests=None)
        if length:
            slot = self._take(1)
            try:
                for layer, arrays in enumerate(states):
                    for i, array in enumerate(arrays or ()):
                        self.store.write(layer, i, slot, array[None])
            except BaseException:
                self._release(slot.tolist())
                raise
            history.entries.append(_Entry(length, int(slot[0])))
        if self.interval is not None and tokens is not None and len(tokens) == length:
            history.digests = self.prompt_digests(np.append(tokens, 0))
        elif self.interval is not None and length == 0:
            history.digests = []
        self._seqs[seq_id] = history

    def snapshots(self) -> List[Tuple[bytes, int, int]]:
        """Usable snapshots as (digest, position, slot), least recently used first."""
        return [(key, snap.length, snap.slot) for key, snap in self._snapshots.items()
                if snap.usable()]

    def add_snapshot(self, digest: bytes, states: Tuple[Optional[Tuple[np.ndarray, ...]], ...],
                     position: int) -> bool:
        """Enter a snapshot of ``states`` at ``position`` (a file's); False when no
        slot is free or it is there already."""
        if self.interval is None or digest in self._snapshots or self.num_free == 0:
            return False
        slot = self._take(1)
        for layer, arrays in enumerate(states):
            for i, array in enumerate(arrays or ()):
                self.store.write(layer, i, slot, array[None])
        self._snapshots[digest] = _Snapshot(int(slot[0]), position, None, False)
        return True

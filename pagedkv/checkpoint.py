"""``Checkpoint``: a sequence's length at some moment, for rolling back to it.

A checkpoint keeps no pages alive; it records its cache and a stamp.  The
cache marks the stamp void when the sequence is truncated below the
checkpoint, so a restore after the sequence was cut and regrown (its tokens
there are no longer the checkpoint's) is refused instead of silently
continuing from other K/V.  Only ``truncate`` does that bookkeeping (over the
sequence's live checkpoints), so decode steps pay nothing for it.  A copy
(``copy.copy``, ``copy.deepcopy``) is the checkpoint itself, so it is voided
with it; a checkpoint cannot be pickled (its cache lives in this process).
"""
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, NoReturn, Optional

if TYPE_CHECKING:   # annotations only: importing it here would be circular
    from pagedkv.cache import PagedKVCache


class _Stamp:
    """Shared by a checkpoint and its cache's book; ``valid`` drops to False for good."""
    __slots__ = ("seq_len", "valid", "__weakref__")

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.valid = True


@dataclass(frozen=True)
class Checkpoint:
    """A sequence's length at some moment; ``PagedKVCache.restore`` rolls back to it.

    Attributes
    ----------
    seq_id : int
    seq_len : int
    """
    seq_id: int
    seq_len: int
    _cache: object = field(default=None, repr=False, compare=False)   # weakref to the cache
    _stamp: Optional[_Stamp] = field(default=None, repr=False, compare=False)

    # A copy must be voided with the original: a new stamp would be one the
    # cache's book does not know.  A checkpoint is immutable, so a copy is itself.
    def __copy__(self) -> "Checkpoint":
        return self

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Checkpoint":
        return self

    def __reduce__(self) -> NoReturn:
        raise TypeError("Checkpoint cannot be pickled: it restores only on the cache that "
                        "made it, in this process")


class CheckpointBook:
    """The live checkpoints of one cache's sequences, weakly held."""

    def __init__(self, cache: "PagedKVCache"):
        self._cache = weakref.ref(cache)
        # seq_id -> [weakref to the _Stamp of each live checkpoint]
        self._stamps: "Dict[int, List[weakref.ref[_Stamp]]]" = {}

    def make(self, seq_id: int, seq_len: int) -> Checkpoint:
        """A new checkpoint of ``seq_id`` at ``seq_len`` tokens."""
        stamp = _Stamp(seq_len)
        refs = [r for r in self._stamps.get(seq_id, ())
                if (live := r()) is not None and live.valid]
        refs.append(weakref.ref(stamp))
        self._stamps[seq_id] = refs
        return Checkpoint(seq_id, seq_len, self._cache, stamp)

    def beyond(self, seq_id: int, new_len: int) -> List[_Stamp]:
        """The stamps of ``seq_id``'s live checkpoints beyond ``new_len`` tokens: the
        caller voids them (``stamp.valid = False``) once the truncation is done,
        with no call in between that could fail.  Changes nothing."""
        stamps = [ref() for ref in self._stamps.get(seq_id, ())]
        return [s for s in stamps if s is not None and s.valid and s.seq_len > new_len]

    # (a freed sequence's entry is dropped by the cache itself: ``_stamps.pop``,
    # after the sequence is gone, with no call that could fail in between)

    def check_owner(self, checkpoint: Checkpoint) -> None:
        """ValueError unless ``checkpoint`` is this cache's."""
        if checkpoint._cache is not self._cache:
            raise ValueError("checkpoint: made by another cache; restore it on the cache whose "
                             "checkpoint() made it")

    def check_valid(self, checkpoint: Checkpoint) -> None:
        """ValueError if the sequence was truncated below ``checkpoint`` since it was taken."""
        assert checkpoint._stamp is not None    # this cache's (check_owner): it has a stamp
        if not checkpoint._stamp.valid:
            raise ValueError(
                f"checkpoint: sequence {checkpoint.seq_id} was truncated below the checkpoint's "
                f"{checkpoint.seq_len} tokens since it was taken; its tokens there are no longer "
                f"the checkpoint's")

"""The exceptions pagedkv raises; each is also a standard Python exception."""


class OutOfPagesError(MemoryError):
    """An allocation needs more pages than the pool has free.  Nothing changed."""


class UnknownSequenceError(KeyError):
    """A sequence id that the cache does not hold (never added, or freed)."""

    def __str__(self) -> str:  # KeyError would repr() the message and quote it
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(RuntimeError):
    """A known backend that cannot run on this machine; the message says how to fix it."""


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type or dtype.

    A ``TypeError`` by Python convention, and a ``ValueError`` because the
    contract promises ``ValueError`` for every malformed argument.
    """


class ReentrantCallError(RuntimeError):
    """A call on a cache from inside another call on the same cache (e.g. from a
    ``prefix_hash`` callback); nothing changed."""

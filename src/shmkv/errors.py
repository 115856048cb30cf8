"""The exception types of the API contract (docs/reference/index.md, "Errors").

Every shmkv error derives from :class:`ShmkvError`; where a builtin describes the same
situation the class derives from it too (``except MemoryError`` and ``except KeyError``
keep working), in the manner of pyarrow's errors.
"""
from typing import Optional

__all__ = [
    "ShmkvError",
    "CacheFullError",
    "SequenceNotFound",
    "SegmentError",
    "LockTimeout",
    "UntrustedSegmentError",
]


class ShmkvError(Exception):
    """Base class of every error raised by shmkv."""


class CacheFullError(ShmkvError, MemoryError):
    """The block pool or the sequence slots are exhausted; the call had no effect."""


class SequenceNotFound(ShmkvError, KeyError):
    """The sequence id is unknown or was freed."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SegmentError(ShmkvError):
    """Not a shmkv segment, an incompatible layout version, or a corrupt segment.

    ``reason`` says which, for tools: ``"bad_magic"`` (not shmkv), ``"incompatible"``
    (another layout version or ABI), ``"corrupt"``, ``"not_ready"`` (still being built,
    or its creator died building it), or ``None`` when unknown.
    """

    def __init__(self, *args: object, reason: Optional[str] = None) -> None:
        super().__init__(*args)
        self.reason = reason


class LockTimeout(ShmkvError, TimeoutError):
    """A lock stayed held by a live process for longer than the wait bound."""


class UntrustedSegmentError(ShmkvError, PermissionError):
    """The segment (or its pending table) is owned by another user whom the caller did not
    name as trusted (``KVCache.attach(name, trusted_owners=[...])``).  The message names the
    owner and the file's mode.  Being root is no exception: another user's file is refused.
    """

"""KVCache: the public handle of a shmkv segment.

The methods on the decode loop's path (append, reserve, write, gather, fork, free, ...)
are implemented in Cython by the method chain ``_core.Segment`` <- ``_inspect.InspectOps``
<- ``_prefix.PrefixOps`` <- ``_sequences.SequenceOps`` <- ``_kvdata.DataOps`` and inherited
here, so a call costs one Python-to-C transition; this module adds the constructors, the
context manager and the attention entry point.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional, Tuple

from . import _attention, _events
from ._kvdata import DataOps
from .config import CacheConfig
from .events import EventBatch

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["KVCache"]


class KVCache(DataOps):
    """A paged KV cache in one POSIX shared-memory segment.

    Every process that attaches the same name shares one block pool, one free list,
    one set of sequences and block tables.  Use :meth:`create` once, :meth:`attach`
    everywhere else, and :meth:`close` (or ``with``) when done.
    """

    @classmethod
    def create(cls, name: str, config: CacheConfig, *, mode: int = 0o600,
               group: Optional[int | str] = None, prefault: bool = True,
               hash_seed: Optional[int] = None) -> "KVCache":
        """Create a new segment.

        Parameters
        ----------
        name : str
            ``"llama-cache"``; a leading ``/`` is accepted and ignored.
        config : CacheConfig
        mode : int
            Permission bits of the segment, exact whatever the umask (default 0o600).
            Its pending-marks table (``NAME.pending``, made by the vLLM connector) gets
            the same mode and group.
        group : str or int, optional
            Give the segment to this group (a name or gid; this user must be a member)
            before its mode is set: ``mode=0o660, group="llm"`` shares it with the
            group's members (who attach it with ``trusted_owners=[this user]``).
        prefault : bool
            Map with MAP_POPULATE so the first decode step pays no page faults.
        hash_seed : int, optional
            Seed of the prefix cache's block hashes (default: ``$SHMKV_HASH_SEED``, else
            random).  Segments on different hosts that share a remote tier
            (:meth:`set_tier`) must use the same seed: it is part of the tier's keys.

        Raises
        ------
        FileExistsError
            The name exists already, as anything (of two racing creators, exactly one
            wins).  The file is made with ``O_CREAT | O_EXCL | O_NOFOLLOW``.
        PermissionError
            The group is not one of this user's.
        OSError
            ``/dev/shm`` cannot hold the segment (nothing is left behind).
        """
        return cls._create(name, config, mode, prefault, 10.0, hash_seed, group)

    @classmethod
    def attach(cls, name: str, *, prefault: bool = True, timeout: float = 10.0,
               recover: bool = True,
               trusted_owners: Optional[int | str | Iterable[int | str]] = None
               ) -> "KVCache":
        """Attach an existing segment.

        Waits up to ``timeout`` seconds for a segment whose creator is still building it.
        With ``recover`` (default) a recovery pass reclaims what dead processes left.

        The segment must be a regular file (a link at the name is never followed) owned
        by this process's user, or by one of ``trusted_owners`` (user names or uids, or
        one string of them separated by commas).  Root gets the same rule: another
        user's segment could hold planted K/V and would read every tenant's tokens.

        Raises
        ------
        FileNotFoundError
            No segment has that name.
        UntrustedSegmentError
            Another user owns the segment and is not in ``trusted_owners`` (the message
            names the owner and the mode); a ``PermissionError`` too.
        PermissionError
            The system refuses this user read-write access (the message names the
            owner and the mode).
        SegmentError
            Not a shmkv segment (a link, a directory, a FIFO...), an incompatible
            layout version, or a corrupt header.
        """
        return cls._attach(name, prefault, timeout, recover, trusted_owners)

    @classmethod
    def open(cls, name: str, config: CacheConfig, *, mode: int = 0o600,
             group: Optional[int | str] = None, prefault: bool = True,
             timeout: float = 10.0, hash_seed: Optional[int] = None,
             trusted_owners: Optional[int | str | Iterable[int | str]] = None
             ) -> "KVCache":
        """Create the segment, or attach it if it exists (a race of many openers is
        safe: one creates, the others wait for it to be ready).  ``mode`` and ``group``
        as :meth:`create`, ``trusted_owners`` as :meth:`attach`.

        Raises
        ------
        SegmentError
            The existing segment has another config.
        """
        while True:
            try:
                return cls._create(name, config, mode, prefault, timeout, hash_seed, group)
            except FileExistsError:
                pass
            try:
                cache = cls._attach(name, prefault, timeout, True, trusted_owners)
            except FileNotFoundError:   # unlinked between the two calls: try again
                continue
            if cache.config != config:
                cache.close()
                raise SegmentError(
                    f"open({name!r}): the segment exists with config {cache.config}, "
                    f"expected {config}")
            return cache

    def gather_buffers(self, n_tokens: int) -> Tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """A ``(k_out, v_out)`` pair for ``gather(sid, start, start + n_tokens,
        out=...)``, page-aligned like the pools: numpy's own large arrays start 16 bytes
        past a page boundary, which costs the copy about 1.7x through 4K aliasing."""
        from ._kvdata import empty_gather_buffers

        return empty_gather_buffers(self, n_tokens)

    def attention(self, layer: int, q: npt.NDArray[Any],
                  sids: Iterable[int | np.integer[Any]] | npt.NDArray[np.integer[Any]], *,
                  q_lens: Optional[Iterable[int] | npt.NDArray[np.integer[Any]]] = None,
                  scale: Optional[float] = None,
                  out: Optional[npt.NDArray[np.float32]] = None,
                  precision: str = "fp32") -> npt.NDArray[np.float32]:
        """Paged attention over the block tables of ``sids``, for one layer.

        ``softmax(q . k^T * scale) . v`` per query head, read straight from the pools (no
        gather), accumulated in float32.  q head ``h`` reads kv head
        ``h // (num_q_heads // num_kv_heads)`` (GQA / MQA / MHA).

        Parameters
        ----------
        layer : int
        q : ndarray [rows, num_q_heads, head_dim]
            float32, float16, or the pool's dtype.  Without ``q_lens`` (decode) row ``i``
            is one query at the last position of ``sids[i]``.
        sids : sequence of int
        q_lens : sequence of int, optional
            Prefill / chunked prefill: the rows of sequence ``i`` are its last
            ``q_lens[i]`` tokens (already written), in order, each attending causally to
            the tokens up to and including its own position.  ``sum(q_lens) == rows``.
        scale : float, optional
            Default ``1 / sqrt(head_dim)``.
        out : ndarray, optional
            C-contiguous, writable float32 of q's shape; written and returned.
        precision : {"fp32", "bf16"}
            ``"fp32"`` (the default): every product in float32, the result within float32
            rounding of the exact one.  ``"bf16"`` (opt-in, faster on CPUs with
            AVX512_BF16 / AVX512_VNNI): q (times the scale) and the softmax weights are
            rounded to bfloat16 once, the products run on the CPU's bf16 dot instructions
            (int8 pools: q quantized to int8 per vector, on VNNI), accumulation stays
            float32.  Its error bounds are in the README (Paged attention).

        Returns
        -------
        ndarray, float32, q's shape.

        Every sequence of the batch is held under its lock for the call (the rule of
        :meth:`gather`), so a sequence another process appends to is read as it was
        when the call took its lock.  The kernel runs without the GIL on the library's
        own threads (:func:`shmkv.set_num_threads`).

        Raises
        ------
        IndexError
            ``layer`` out of range.
        ValueError
            q's rank, shape or head count; ``len(sids)`` or ``sum(q_lens)`` not matching
            the rows; a ``q_lens[i]`` < 1 or > ``seq_len``; an empty sequence; a bad
            ``out``; a ``precision`` other than "fp32" / "bf16".
        TypeError
            q's or out's dtype; a non-str ``precision``.
        SequenceNotFound
            An unknown or freed sid.
        SegmentError
            A corrupt table or length in the segment.
        """
        return _attention.attention(self, layer, q, sids, q_lens, scale, out, precision)

    def close(self) -> None:
        """Detach this process (idempotent; the segment stays).  A remote tier set on
        this handle is turned off first (its queued writes get ``close_timeout``)."""
        if self._has_tier():
            try:
                self.set_tier(None)
            except Exception:         # the tier never raises into close()
                pass
        super().close()

    def events(self, since: int = 0, *, max_events: Optional[int] = None) -> EventBatch:
        """The KV events of the segment with ``seq >= since`` (vLLM's KV events).

        Every process writes them, in pool-lock order, when a block's hash enters the
        prefix index (``"stored"``), when a cached block's hash leaves it because the
        block is reused (``"removed"``), and when :meth:`reset_prefix_cache` drops them
        all (``"cleared"``).  Read without any lock; a reader never sees half an event.

        Parameters
        ----------
        since : int
            First sequence number wanted (seqs start at 0 and grow by 1 per event).
        max_events : int, optional
            At most this many events (default 65536); ask again from ``next_seq``.

        Returns
        -------
        EventBatch
            ``(events, next_seq, lost)``: the events still in the ring, in order;
            the ``since`` of the next call; how many events with ``seq >= since`` were
            overwritten (the ring keeps ``config.event_capacity``) before this read.
            They are contiguous: ``events[i].seq == since + lost + i`` and
            ``next_seq == since + lost + len(events)`` (writers that lap a reader
            while it reads make it count the events before the lap as lost too).
            With the ring off (capacity 0): ``([], 0, 0)``.  A ``since`` past the
            newest event gives ``([], next, 0)``, ``next`` being the next seq.
        """
        return _events.read(self, since, max_events)

    def reset_prefix_cache(self) -> int:
        """Drop every hash from the host's prefix index (vLLM's ``reset_prefix_cache``).

        Cached blocks become free blocks; blocks in use stay with their sequences but
        are no longer findable.  Writes one ``"cleared"`` event.  Returns the number of
        hashes dropped.
        """
        return _events.reset_prefix_cache(self)

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<KVCache {self.name!r} {state} {self.config}>"


from .errors import SegmentError  # noqa: E402  (after the class, no import cycle)

"""KV events under chaos: what a well-formed event is (the workers' lock-free readers and
the audits use it) and the audit of the ring with every worker dead -- seqs dense from the
last audit's cursor, no torn or malformed event, and every "stored" event whose block is
still findable carrying exactly the token ids that block holds (a record mixing two
writes, or an event that does not describe the index, shows).  A mixin of Controller.
Imports nothing of ``chaos`` but ``common``."""
from __future__ import annotations

import mmap
import os

import numpy as np

from shmkv import _core
from shmkv.inspect import snapshot

KINDS = ("stored", "removed", "cleared")


def event_error(ev, bs):
    """None, or what is wrong with one event read from the ring."""
    if ev.kind not in KINDS:
        return f"kind {ev.kind!r}"
    if ev.block_size != bs:
        return f"block_size {ev.block_size}, the segment's is {bs}"
    if ev.kind == "cleared":
        if ev.block_hashes or ev.token_ids or ev.parent_block_hash is not None:
            return "a cleared event with a block"
        return None
    if len(ev.block_hashes) != 1 or not 0 <= ev.block_hashes[0] < 1 << 64:
        return f"block_hashes {ev.block_hashes}"
    if ev.block_id < 0:
        return f"block_id {ev.block_id}"
    if ev.kind == "removed":
        if ev.token_ids or ev.parent_block_hash is not None:
            return "a removed event with token ids or a parent"
        return None
    if len(ev.token_ids) != bs or min(ev.token_ids) < 0:
        return f"{len(ev.token_ids)} token ids (min {min(ev.token_ids, default=0)})"
    p = ev.parent_block_hash
    if p is not None and not 0 <= p < 1 << 64:
        return f"parent_block_hash {p}"
    return None


def token_table(name, cfg):
    """The segment's token-id table [num_blocks, block_size], read raw (read-only)."""
    bs = cfg.block_size
    off = _core.layout_of(cfg)["off_tokens"]
    fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, off + cfg.num_blocks * bs * 4, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        return np.frombuffer(mm, np.int32, cfg.num_blocks * bs, off).reshape(-1, bs).copy()
    finally:
        mm.close()


class EventAudits:
    """The KV-event audit (mixed into Controller; needs cache, cfg, name, cfail)."""

    ev_next = 0                 # the seq the next audit reads from
    events_audited = 0          # events read in audits
    events_lost_audit = 0       # events overwritten between two audits (ring wrapped)
    stored_blocks_matched = 0   # findable blocks whose latest "stored" event was checked

    def _event_audit(self):
        c, cfg = self.cache, self.cfg
        if not cfg.event_capacity:
            return
        since = self.ev_next
        b = c.events(since)
        head = c.events(2**62).next_seq
        seqs = [ev.seq for ev in b.events]
        if seqs != list(range(since + b.lost, since + b.lost + len(seqs))) \
                or b.next_seq != head:
            self.cfail("bad_event", f"audit: events({since}) gave seqs {seqs[:4]}.. lost "
                                    f"{b.lost}, next {b.next_seq}, head {head}: not dense")
        for ev in b.events:
            err = event_error(ev, cfg.block_size)
            if err:
                self.cfail("bad_event", f"audit: event {ev.seq}: {err}: {ev}")
        self.events_audited += len(b.events)
        self.events_lost_audit += b.lost
        self.ev_next = b.next_seq
        # the window against the index: the latest event of each block
        latest = {}
        for ev in c.events(0).events:
            if ev.kind == "cleared":
                latest.clear()
            elif ev.kind == "stored":
                latest[ev.block_id] = ev
            else:
                latest[ev.block_id] = None
        snap = snapshot(self.name, tables=False)
        hashed = np.asarray(snap["block_flags"]) & 1
        toks = token_table(self.name, cfg)
        nbad = 0
        for blk, ev in latest.items():
            if ev is None or not 0 <= blk < cfg.num_blocks or not hashed[blk]:
                continue
            self.stored_blocks_matched += 1
            if toks[blk].tolist() != ev.token_ids:
                nbad += 1
                if nbad <= 5:
                    self.cfail("bad_event", f"audit: event {ev.seq} stored block {blk}, "
                                            f"still findable, with ids {ev.token_ids[:6]}.. "
                                            f"but the block holds {toks[blk][:6].tolist()}..")

    def _event_live_check(self):
        """Right after a worker died at event_mid, with the others running: the latest
        "stored" event of every still-findable block must carry the ids the block holds.
        A record whose seq became visible before its token ids were written (the planted
        torn_event) is caught here, before the block is reused and the final audit can no
        longer tell.  Race-free against live writers: a block that any event touched
        between the first read and the last is skipped (a reuse writes its "removed"
        before it drops the hash or rewrites the ids)."""
        c, cfg = self.cache, self.cfg
        if not cfg.event_capacity:
            return
        head0 = c.events(2**62).next_seq
        latest = {}
        for ev in c.events(max(0, head0 - cfg.event_capacity)).events:
            if ev.seq >= head0:
                break
            if ev.kind == "cleared":
                latest.clear()
            else:
                latest[ev.block_id] = ev if ev.kind == "stored" else None
        hashed = np.asarray(snapshot(self.name, tables=False)["block_flags"]) & 1
        toks = token_table(self.name, cfg)
        later = c.events(head0)
        if later.lost:
            return                          # the ring wrapped meanwhile: nothing is sure
        moved = {ev.block_id for ev in later.events}
        if any(ev.kind == "cleared" for ev in later.events):
            return
        for blk, ev in latest.items():
            if ev is None or blk in moved or not 0 <= blk < cfg.num_blocks or not hashed[blk]:
                continue
            if toks[blk].tolist() != ev.token_ids:
                self.cfail("bad_event", f"after a death at event_mid: event {ev.seq} stored "
                                        f"block {blk}, still findable, with ids "
                                        f"{ev.token_ids[:6]}.. but the block holds "
                                        f"{toks[blk][:6].tolist()}..")
                return

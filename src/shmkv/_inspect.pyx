# cython: language_level=3, binding=False
# binding=False: the methods of the cdef classes are method descriptors, which check
# self; Cython 3's cyfunctions do not (KVCache.unlink("name") crashed the interpreter).
"""shmkv._inspect: observability and repair.

InspectOps, the first link of the method chain above _core.Segment: stats(), check(),
recover().  Module functions: snapshot() (a read-only copy of a segment for operators and
the CLI), struct_layout() (the C structs' sizes and offsets, for tools that read raw
bytes); their public face is shmkv.inspect.  The benchmarks' timing hooks are
shmkv._bench's.

Writes: check() and snapshot() write nothing in the segment (check() only try-locks idle
sequences and every process cache, and releases them); stats() writes the sampled
shared.peak_used; recover() runs a recovery pass: the scheduled one (shmkv_recover_scheduled:
the gate, one recoverer, the pass of what died) or, with full=True, the full pass
(shmkv_recover_locked) under pool_lock.
"""
import os

import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset, memcpy

from shmkv._core cimport *
from shmkv._sizes cimport layout_dict

from ._core import COUNTER_NAMES, _map_readonly, _norm_name, _open_existing
from .errors import CacheFullError, SegmentError

cnp.import_array()
bind_debug_state()


cdef class InspectOps(Segment):
    def recover(self, full=False):
        """Reclaim what dead processes held.

        Without ``full`` (the pass to run on a schedule): when no attached process is
        dead and no earlier pass left work pending, it returns at once, all zeros,
        without taking the pool lock or reading the pool (the process table only).  When
        another process is recovering right now it returns at once with ``busy``.  Else
        it reclaims what died: the dead processes' sequences, the locks they held, their
        unpublished tails and in-flight blocks -- O(their blocks), not O(pool) -- and
        falls back to the full pass only where a death may have left something
        half-changed (a fast path's lock held by the dead, a corrupt table).

        With ``full=True``: the full pass (the repair) -- every refcount recounted and
        every list, the index and the free stacks rebuilt from the tables, O(pool)
        under the pool lock, whatever is dead or not.

        Returns
        -------
        dict
            ``sequences`` and ``blocks`` reclaimed, ``processes`` found dead, ``locks``
            taken from dead holders, unpublished ``tail_blocks`` trimmed,
            ``refcounts_fixed``, ``corrupt_sequences`` dropped, ``duration_s``;
            ``full`` (the full pass ran), ``busy`` (another process was recovering:
            nothing done), ``blocks_visited`` (block entries read: 0 when no pass ran,
            the dead's table entries and in-flight blocks, ``num_blocks`` for the full
            pass).
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef shmkv_recovery_t r
        cdef int st
        if full:
            pool_lock(c)
            st = shmkv_recover_locked(c, &r)
            shmkv_pool_unlock(c)
        else:
            with nogil:
                st = shmkv_recover_scheduled(c, &r)
        if st != SHMKV_OK:
            raise_status(st, "recover")
        return dict(sequences=r.sequences, blocks=r.blocks, processes=r.processes,
                    locks=r.locks, tail_blocks=r.tails, refcounts_fixed=r.refcounts_fixed,
                    corrupt_sequences=r.corrupt, duration_s=r.duration_ns / 1e9,
                    full=bool(r.full), busy=bool(r.busy), blocks_visited=r.blocks_visited)

    def stats(self):
        """Counters and gauges of the whole segment (every process).

        ``free_blocks + used_blocks == num_blocks``; a block is used iff its refcount is
        positive.  ``cached_blocks`` (free, still findable by hash) count as free, and so
        do the few free blocks each process keeps in its own cache.
        ``peak_used_blocks`` is sampled whenever a process touches the shared pool and at
        every stats() call: a peak reached and left entirely through the processes' own
        caches (at most 20 blocks each) between two samples is not seen.
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef shmkv_shared_t *sh = c.sh
        cdef uint64_t counters[32]
        cdef uint64_t nfree, cached, num_seqs
        cdef int i
        pool_lock(c)
        shmkv_counts(c, &nfree, &cached, &num_seqs)
        if c.cfg.num_blocks - nfree > sh.peak_used:    # a sample point of the peak too
            sh.peak_used = <uint32_t>(c.cfg.num_blocks - nfree)
        num_procs, peak = sh.num_procs, sh.peak_used
        last_rec, max_rec = sh.last_recovery_ns, sh.max_recovery_ns
        idx_used = sh.index_used
        shmkv_pool_unlock(c)
        shmkv_counters_total(c, counters)
        d = dict(num_blocks=c.cfg.num_blocks, free_blocks=nfree,
                 used_blocks=c.cfg.num_blocks - nfree, cached_blocks=cached,
                 num_sequences=num_seqs, max_seqs=c.cfg.max_seqs, num_processes=num_procs,
                 peak_used_blocks=peak, index_entries=idx_used,
                 last_recovery_s=last_rec / 1e9, max_recovery_s=max_rec / 1e9)
        for i in range(SHMKV_NCOUNTERS):
            d[COUNTER_NAMES[i]] = counters[i]
        return d

    def check(self):
        """Verify every invariant of the segment.

        Returns
        -------
        list of str
            One line per violation; ``[]`` means consistent.  Sequences being changed
            by another process right now get the checks that hold mid-operation.
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int st
        cdef shmkv_recovery_t r
        pool_lock(c)
        try:
            st = shmkv_quiesce_locked(c)      # every process's cache at rest
            if st == SHMKV_EDEADHOLDER:
                # a process died inside a fast path: what it left half-done is recovery's
                # to finish, as for a pool lock that comes back EOWNERDEAD
                shmkv_unquiesce_locked(c)
                st = shmkv_recover_locked(c, &r)
                if st == SHMKV_OK:
                    st = shmkv_quiesce_locked(c)
                    if st == SHMKV_EDEADHOLDER:
                        st = SHMKV_OK           # died again just now: report what we see
            if st != SHMKV_OK:
                raise_status(st, "check")
            try:
                return _check_locked(c)
            finally:
                shmkv_unquiesce_locked(c)
        finally:
            shmkv_pool_unlock(c)

    # ---- internals for tests and tools --------------------------------------------------
    def _debug_info(self):
        cdef shmkv_ctx_t *c = ctx_of(self)
        return dict(proc_slot=c.proc_slot, proc_token=c.proc_token,
                    layout=layout_dict(&c.lay), hash_seed=c.hdr.hash_seed,
                    creator_pid=c.hdr.creator_pid, create_time_ns=c.hdr.create_time_ns)


cdef list _check_ids(list bad, str what, const uint32_t *ids, uint32_t n, uint32_t cap,
                     uint32_t limit, uint8_t *mark):
    """A list of ids in the segment (a free stack, a process's cache): its count against
    its capacity, every id against `limit`, repeats (here or on a list checked before,
    through `mark`).  Marks and returns the valid ids."""
    cdef uint32_t i, x
    if n > cap:
        bad.append(f"{what}: {n} entries > capacity {cap}")
        return []
    out = []
    for i in range(n):
        x = ids[i]
        if x >= limit:
            bad.append(f"{what}[{i}] = {x} is out of range (< {limit})")
        elif mark[x]:
            bad.append(f"{what}: {x} appears twice, or also on another free list")
        else:
            mark[x] = 1
            out.append(x)
    return out


cdef list _check_locked(shmkv_ctx_t *c):
    """All invariants; the pool lock is held.  Bounded work, bounded output."""
    cdef list bad = []
    cdef uint32_t NB = c.cfg.num_blocks, NS = c.cfg.max_seqs, NP = c.cfg.max_procs
    cdef uint32_t i, j, b, s, nb, ln, want, top, cc, live = 0, nfree_slots, nprocs = 0
    cdef uint32_t ncache = 0
    cdef uint64_t tok, first_ev, n_ev
    cdef uint32_t *cnt = <uint32_t *>malloc(sizeof(uint32_t) * NB + 4)
    cdef uint8_t *mark = <uint8_t *>malloc(NB + 1)
    cdef uint8_t *smark = <uint8_t *>malloc(NS + 1)
    cdef shmkv_seq_t *q
    cdef const int32_t *t
    cdef bint locked
    cdef uint64_t me = c.proc_token if c.proc_token else 1
    if cnt == NULL or mark == NULL or smark == NULL:
        free(cnt); free(mark); free(smark)
        raise MemoryError()
    memset(cnt, 0, sizeof(uint32_t) * NB)
    memset(mark, 0, NB)
    memset(smark, 0, NS)
    try:
        for s in range(NS):
            q = &c.seqs[s]
            if q.state == SHMKV_SEQ_FREE:
                continue
            if q.state != SHMKV_SEQ_LIVE:
                bad.append(f"sequence slot {s}: state {q.state} outside a critical section")
                continue
            live += 1
            sid = shmkv_slot_sid(c, s)
            nb = q.nblocks
            ln = shmkv_atomic_load_u32_acquire(&q.len)
            if nb > c.cfg.max_blocks_per_seq:
                bad.append(f"sequence {sid}: {nb} blocks exceed max_blocks_per_seq "
                           f"{c.cfg.max_blocks_per_seq}")
                continue
            t = shmkv_table(c, s)
            for i in range(nb):
                if not shmkv_block_ok(c, t[i]):
                    bad.append(f"sequence {sid}: table[{i}] = {t[i]} is not a block id")
                else:
                    cnt[t[i]] += 1
            want = shmkv_blocks_for(c, ln)
            if want > nb:
                bad.append(f"sequence {sid}: length {ln} needs {want} blocks, has {nb}")
            # strict checks only when nobody is mid-operation on it (never wait here)
            locked = shmkv_atomic_cas_u64(&q.writer, 0, me)
            if locked:
                ln = q.len
                want = shmkv_blocks_for(c, ln)
                if want != nb:
                    bad.append(f"sequence {sid}: length {ln} needs {want} blocks, table "
                               f"holds {nb} (unpublished tail with no writer)")
                elif (ln % c.cfg.block_size and shmkv_block_ok(c, t[want - 1])
                        and c.blocks[t[want - 1]].flags & SHMKV_BLOCK_HASHED
                        and not q.flags & SHMKV_SEQF_COW_TAIL):
                    # only truncate leaves a findable block partial in a table: its next
                    # write must copy it (SHMKV_SEQF_COW_TAIL)
                    bad.append(f"sequence {sid}: its partial last block {t[want - 1]} is "
                               f"in the prefix index but not marked copy-on-write")
                shmkv_seq_unlock(c, s)
            tok = q.owner
            if tok != 0 and ((tok & 0xffffffff) == 0 or (tok & 0xffffffff) - 1 >= NP):
                bad.append(f"sequence {sid}: owner token {tok:#x} names no process slot")
        for s in range(NP):
            if c.procs[s].state == SHMKV_PROC_ACTIVE:
                nprocs += 1
                for j in range(SHMKV_INFLIGHT_PER_PROC):
                    b = c.procs[s].inflight[j]
                    if b == SHMKV_NIL:
                        continue
                    if b >= NB:
                        bad.append(f"process slot {s}: in-flight entry {b} is not a block id")
                    else:
                        cnt[b] += 1
            elif c.procs[s].state != SHMKV_PROC_FREE:
                bad.append(f"process slot {s}: unknown state {c.procs[s].state}")
        nused = 0
        for b in range(NB):
            rc = shmkv_atomic_load_u32(&c.blocks[b].ref_cnt)
            if rc != cnt[b]:
                bad.append(f"block {b}: ref_cnt {rc}, but {cnt[b]} references "
                           "(table entries + in-flight)")
            if rc > 0:
                nused += 1
        cc = c.sh.cached_count
        valid = _check_ids(bad, "free list", c.free_stack, c.sh.free_top, NB, NB, mark)
        top = len(valid)
        for b in valid:
            if c.blocks[b].ref_cnt != 0:
                bad.append(f"free list: block {b} has ref_cnt {c.blocks[b].ref_cnt}")
            if c.blocks[b].flags & SHMKV_BLOCK_HASHED:
                bad.append(f"free list: block {b} carries a hash (belongs on the LRU list)")
        # the LRU list of cached blocks, walked with a bound
        i = 0
        b = c.sh.lru_head
        prev = SHMKV_NIL
        while b != SHMKV_NIL and i <= NB:
            if b >= NB:
                bad.append(f"LRU list: entry {b} is not a block id")
                break
            if mark[b]:
                bad.append(f"LRU list: block {b} appears twice or also on the free list")
                break
            mark[b] = 2
            if c.blocks[b].ref_cnt != 0:
                bad.append(f"LRU list: block {b} has ref_cnt {c.blocks[b].ref_cnt}")
            if not (c.blocks[b].flags & SHMKV_BLOCK_HASHED):
                bad.append(f"LRU list: block {b} has no hash")
            if c.blocks[b].lru_prev != prev:
                bad.append(f"LRU list: block {b} has a wrong back link")
            prev = b
            b = c.blocks[b].lru_next
            i += 1
        if i != cc:
            bad.append(f"LRU list: {i} blocks linked, cached_count says {cc}")
        if prev != c.sh.lru_tail:
            bad.append("LRU list: tail does not match the last linked block")
        # the processes' own caches of free blocks
        for s in range(NP):
            if c.procs[s].state != SHMKV_PROC_ACTIVE:
                continue
            for b in _check_ids(bad, f"process slot {s}: cached blocks", c.procs[s].cache_blocks,
                                c.procs[s].cache_nblocks, SHMKV_PCACHE_BLOCKS, NB, mark):
                ncache += 1
                if c.blocks[b].ref_cnt != 0:
                    bad.append(f"process slot {s}: cached block {b} has ref_cnt "
                               f"{c.blocks[b].ref_cnt}")
                if c.blocks[b].flags & SHMKV_BLOCK_HASHED:
                    bad.append(f"process slot {s}: cached block {b} carries a hash")
        for b in range(NB):
            if c.blocks[b].ref_cnt == 0 and not mark[b]:
                bad.append(f"block {b}: ref_cnt 0 but on no free list, LRU list or process "
                           "cache (leaked)")
        if top + cc + ncache + nused != NB:
            bad.append(f"counts: free {top} + cached {cc} + in process caches {ncache} + "
                       f"used {nused} != num_blocks {NB}")
        # sequence slots
        valid = _check_ids(bad, "sequence free stack", c.seq_free, c.sh.seq_free_top, NS,
                           NS, smark)
        nfree_slots = len(valid)
        for s in valid:
            if c.seqs[s].state != SHMKV_SEQ_FREE:
                bad.append(f"sequence free stack: slot {s} is not free")
        for s in range(NP):
            if c.procs[s].state != SHMKV_PROC_ACTIVE:
                continue
            for j in _check_ids(bad, f"process slot {s}: cached sequence slots",
                                c.procs[s].cache_seqs, c.procs[s].cache_nseqs,
                                SHMKV_PCACHE_SEQS, NS, smark):
                nfree_slots += 1
                if c.seqs[j].state != SHMKV_SEQ_FREE:
                    bad.append(f"process slot {s}: cached sequence slot {j} is not free")
        if nfree_slots + live != NS:
            bad.append(f"sequence slots: {nfree_slots} free (stack and process caches) + "
                       f"{live} live != max_seqs {NS}")
        if c.sh.num_procs != nprocs:
            bad.append(f"num_processes {c.sh.num_procs} != {nprocs} active slots")
        # the index: every entry names a hashed block with that hash
        n_idx = 0
        for i in range(c.lay.index_capacity):
            e = &c.index[i]
            if (e.hash[0] == 0 and (e.hash[1] == 0 or e.hash[1] == 1)):
                continue
            n_idx += 1
            b = e.block
            if b >= NB:
                bad.append(f"index[{i}]: block {b} is not a block id")
            elif not (c.blocks[b].flags & SHMKV_BLOCK_HASHED) or \
                    c.blocks[b].hash[0] != e.hash[0] or c.blocks[b].hash[1] != e.hash[1]:
                bad.append(f"index[{i}]: block {b} does not carry this hash")
        if n_idx != c.sh.index_used:
            bad.append(f"index: {n_idx} entries, index_used says {c.sh.index_used}")
        # the KV event ring: no torn or unstamped event in the window (kernels/events.h)
        first_ev = 0
        n_ev = shmkv_events_check_locked(c, &first_ev)
        if n_ev:
            bad.append(f"event ring: {n_ev} events of the window are torn or unstamped "
                       f"(first: seq {first_ev})")
    finally:
        free(cnt)
        free(mark)
        free(smark)
    if len(bad) > 200:
        bad = bad[:200] + [f"... and {len(bad) - 200} more"]
    return bad


# --------------------------------------------------------------------------------------
# read-only inspection: no lock, no registration, bounded reads, torn values tolerated
# --------------------------------------------------------------------------------------
def snapshot(name, *, bint tables=True):
    """Copy out everything an operator may want to see of a segment, read-only.

    Maps the segment PROT_READ, takes no lock and registers nothing, so it works on a
    segment whose processes are all dead and never changes one.  Values another process
    is changing may be torn; every index is clamped before use, so a corrupt or hostile
    segment gives SegmentError or odd numbers, never a crash.

    Raises FileNotFoundError, PermissionError or SegmentError.
    """
    name = _norm_name(name)
    fd = _open_existing(name, True)
    try:
        return _snapshot(name, _map_readonly(fd, name), fd, tables)
    finally:
        os.close(fd)


cdef dict _snapshot(str name, _Mapping m, int fd, bint want_tables):
    cdef shmkv_ctx_t ctx
    cdef shmkv_ctx_t *c = &ctx
    cdef int st = shmkv_ctx_bind(c, m.base, m.size, 1)
    if st != SHMKV_OK:
        raise_status(st, name)
    c.lock_fd = fd
    cdef shmkv_shared_t *sh = c.sh
    cdef uint32_t NB = c.cfg.num_blocks, NS = c.cfg.max_seqs, NP = c.cfg.max_procs
    cdef uint32_t s, b, nb
    cdef uint64_t tok, owner_slot
    cdef shmkv_seq_t q
    cdef shmkv_proc_t p
    cdef cnp.npy_intp dims[1]
    cfg = cfg_object(&c.cfg)
    procs = []
    alive_tokens = {}
    for s in range(NP):
        memcpy(&p, &c.procs[s], sizeof(shmkv_proc_t))
        if p.state == SHMKV_PROC_FREE:
            continue
        tok = (<uint64_t>p.gen << 32) | (s + 1)
        alive = p.state == SHMKV_PROC_ACTIVE and shmkv_ofd_probe(fd, s) == 1
        alive_tokens[tok] = alive
        procs.append(dict(slot=s, pid=p.pid, pid_start=p.pid_start, gen=p.gen,
                          attach_time_ns=p.attach_time_ns, alive=alive,
                          inflight=[x for x in p.inflight[:SHMKV_INFLIGHT_PER_PROC]
                                    if x != SHMKV_NIL],
                          cached_blocks=p.cache_nblocks if p.cache_nblocks <= SHMKV_PCACHE_BLOCKS else 0,
                          cached_seq_slots=p.cache_nseqs if p.cache_nseqs <= SHMKV_PCACHE_SEQS else 0))
    dims[0] = NB
    refcnt = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT32, 0)
    flags = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT32, 0)
    cdef uint32_t[:] rv = refcnt
    cdef uint32_t[:] fv = flags
    for b in range(NB):
        rv[b] = shmkv_atomic_load_u32_relaxed(&c.blocks[b].ref_cnt)
        fv[b] = c.blocks[b].flags
    seqs = []
    for s in range(NS):
        memcpy(&q, &c.seqs[s], sizeof(shmkv_seq_t))
        if q.state != SHMKV_SEQ_LIVE:
            continue
        nb = min(q.nblocks, c.cfg.max_blocks_per_seq)
        ln = min(q.len, nb * c.cfg.block_size)
        owner_pid = None
        if q.owner & 0xffffffff:                 # slot half 0 names no slot (hostile)
            owner_slot = (q.owner & 0xffffffff) - 1
            if owner_slot < NP:
                owner_pid = c.procs[owner_slot].pid
        d = dict(sid=<int64_t>q.gen * NS + s, slot=s, len=q.len, nblocks=q.nblocks,
                 owner_token=q.owner, owner_pid=owner_pid, detached=q.owner == 0,
                 owner_alive=alive_tokens.get(q.owner, False) if q.owner else None,
                 writer_token=q.writer,
                 writer_alive=alive_tokens.get(q.writer, False) if q.writer else None,
                 priority=q.priority, hashed=q.hashed, created_ns=q.created_ns,
                 last_access_ns=q.last_access_ns, access_count=q.access_count,
                 consistent=q.len <= nb * c.cfg.block_size and q.nblocks <= c.cfg.max_blocks_per_seq)
        if want_tables:
            dims[0] = nb
            t = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT32, 0)
            if nb:
                memcpy(cnp.PyArray_DATA(t), shmkv_table(c, s), nb * sizeof(int32_t))
            d["table"] = t
        seqs.append(d)
    cdef uint64_t ctr[32]
    shmkv_counters_total(c, ctr)
    counters = {COUNTER_NAMES[j]: ctr[j] for j in range(SHMKV_NCOUNTERS)}
    cdef uint64_t nfree, cached
    shmkv_counts(c, &nfree, &cached, NULL)
    return dict(
        name=name, segment_size=c.size, layout_version=c.hdr.layout_version,
        abi_fingerprint=c.hdr.abi_fingerprint, creator_pid=c.hdr.creator_pid,
        create_time_ns=c.hdr.create_time_ns, hash_seed=c.hdr.hash_seed,
        config=cfg, layout=layout_dict(&c.lay),
        free_blocks=nfree, cached_blocks=cached, used_blocks=NB - nfree,
        num_sequences=len(seqs), num_processes=sh.num_procs, peak_used_blocks=sh.peak_used,
        index_entries=sh.index_used, last_recovery_s=sh.last_recovery_ns / 1e9,
        max_recovery_s=sh.max_recovery_ns / 1e9, counters=counters,
        processes=procs, sequences=seqs, ref_cnt=refcnt, block_flags=flags,
        events=dict(capacity=c.cfg.event_capacity, head=shmkv_event_head(c)))


# --------------------------------------------------------------------------------------
# the ABI, for tools that read raw segment bytes (fuzzers, debuggers): sizes and field
# offsets straight from the C structs, so no Python constant can drift from _layout.h
# --------------------------------------------------------------------------------------
cdef extern from *:
    """
    #include <stddef.h>
    /* the fields of the segment structs: each name once, its offset from C itself */
    typedef struct { const char *name; size_t off; const char *fmt; } shmkv_field_t;
    #define SHMKV_FH(f, t) { #f, offsetof(shmkv_header_t, f), t }
    #define SHMKV_FS(f, t) { #f, offsetof(shmkv_shared_t, f), t }
    #define SHMKV_FQ(f, t) { #f, offsetof(shmkv_seq_t, f), t }
    #define SHMKV_FP(f, t) { #f, offsetof(shmkv_proc_t, f), t }
    #define SHMKV_FB(f, t) { #f, offsetof(shmkv_block_t, f), t }
    #define SHMKV_FI(f, t) { #f, offsetof(shmkv_index_t, f), t }
    #define SHMKV_FE(f, t) { #f, offsetof(shmkv_event_t, f), t }
    static const shmkv_field_t SHMKV_HEADER_FIELDS[] = {
        SHMKV_FH(magic, "Q"), SHMKV_FH(layout_version, "I"), SHMKV_FH(header_size, "I"),
        SHMKV_FH(abi_fingerprint, "Q"), SHMKV_FH(segment_size, "Q"), SHMKV_FH(config, "I"),
        SHMKV_FH(layout, "Q"), SHMKV_FH(creator_pid, "Q"), SHMKV_FH(create_time_ns, "Q"),
        SHMKV_FH(hash_seed, "Q"), SHMKV_FH(checksum, "Q"), {0} };
    static const shmkv_field_t SHMKV_SHARED_FIELDS[] = {
        SHMKV_FS(state, "I"), SHMKV_FS(recover_pending, "I"), SHMKV_FS(recoverer, "Q"),
        SHMKV_FS(recoverer_since_ns, "Q"), SHMKV_FS(pool_lock, "B"), SHMKV_FS(free_top, "I"),
        SHMKV_FS(cached_count, "I"), SHMKV_FS(lru_head, "I"), SHMKV_FS(lru_tail, "I"),
        SHMKV_FS(seq_free_top, "I"), SHMKV_FS(num_procs, "I"), SHMKV_FS(peak_used, "I"),
        SHMKV_FS(index_used, "I"), SHMKV_FS(index_tombs, "I"), SHMKV_FS(lru_clock, "Q"),
        SHMKV_FS(last_recovery_ns, "Q"), SHMKV_FS(max_recovery_ns, "Q"),
        SHMKV_FS(counters, "Q"), {0} };
    static const shmkv_field_t SHMKV_SEQ_FIELDS[] = {
        SHMKV_FQ(state, "I"), SHMKV_FQ(gen, "I"), SHMKV_FQ(owner, "Q"), SHMKV_FQ(writer, "Q"),
        SHMKV_FQ(len, "I"), SHMKV_FQ(nblocks, "I"), SHMKV_FQ(hashed, "I"),
        SHMKV_FQ(priority, "I"), SHMKV_FQ(last_access_ns, "Q"), SHMKV_FQ(access_count, "Q"),
        SHMKV_FQ(created_ns, "Q"), SHMKV_FQ(flags, "I"), SHMKV_FQ(hash_ready, "I"),
        SHMKV_FQ(salt, "Q"), SHMKV_FQ(trimmed, "I"), SHMKV_FQ(trim_s, "I"),
        SHMKV_FQ(trim_d, "I"), SHMKV_FQ(trim_k, "I"), SHMKV_FQ(trim_chunk, "I"),
        SHMKV_FQ(trim_len, "I"), SHMKV_FQ(trim_trimmed, "I"), {0} };
    static const shmkv_field_t SHMKV_PROC_FIELDS[] = {
        SHMKV_FP(state, "I"), SHMKV_FP(gen, "I"), SHMKV_FP(pid, "Q"), SHMKV_FP(pid_start, "Q"),
        SHMKV_FP(attach_time_ns, "Q"), SHMKV_FP(inflight, "I"), SHMKV_FP(counters, "Q"),
        SHMKV_FP(cache_lock, "Q"), SHMKV_FP(cache_nblocks, "I"), SHMKV_FP(cache_nseqs, "I"),
        SHMKV_FP(cache_blocks, "I"), SHMKV_FP(cache_seqs, "I"), {0} };
    static const shmkv_field_t SHMKV_BLOCK_FIELDS[] = {
        SHMKV_FB(ref_cnt, "I"), SHMKV_FB(flags, "I"), SHMKV_FB(lru_prev, "I"),
        SHMKV_FB(lru_next, "I"), SHMKV_FB(hash, "Q"), SHMKV_FB(last_access, "Q"),
        SHMKV_FB(num_tokens, "I"), {0} };
    static const shmkv_field_t SHMKV_INDEX_FIELDS[] = {
        SHMKV_FI(hash, "Q"), SHMKV_FI(block, "I"), {0} };
    static const shmkv_field_t SHMKV_EVENT_FIELDS[] = {
        SHMKV_FE(stamp, "Q"), SHMKV_FE(kind, "I"), SHMKV_FE(num_tokens, "I"),
        SHMKV_FE(hash, "Q"), SHMKV_FE(parent, "Q"), SHMKV_FE(time_ns, "Q"),
        SHMKV_FE(block, "I"), SHMKV_FE(flags, "I"), {0} };
    #undef SHMKV_FH
    #undef SHMKV_FS
    #undef SHMKV_FQ
    #undef SHMKV_FP
    #undef SHMKV_FB
    #undef SHMKV_FI
    #undef SHMKV_FE
    """
    ctypedef struct shmkv_field_t:
        const char *name
        size_t off
        const char *fmt
    const shmkv_field_t SHMKV_HEADER_FIELDS[]
    const shmkv_field_t SHMKV_SHARED_FIELDS[]
    const shmkv_field_t SHMKV_SEQ_FIELDS[]
    const shmkv_field_t SHMKV_PROC_FIELDS[]
    const shmkv_field_t SHMKV_BLOCK_FIELDS[]
    const shmkv_field_t SHMKV_INDEX_FIELDS[]
    const shmkv_field_t SHMKV_EVENT_FIELDS[]


cdef dict _fields(const shmkv_field_t *f, size_t base):
    """{name: (base + offset, struct format)} of a {0}-terminated field table."""
    cdef size_t i = 0
    d = {}
    while f[i].name != NULL:
        d[f[i].name.decode()] = (base + f[i].off, f[i].fmt.decode())
        i += 1
    return d


def struct_layout():
    """Sizes and field offsets of the segment's C structs.

    Returns a dict: ``header`` (offsets from the segment start), ``shared`` (offsets
    from the segment start too), ``seq``, ``proc``, ``block``, ``index``, ``event`` (a
    KV event record's header, the ring's ``ring_size``-byte head line before the records;
    offsets inside one element), each ``{"size": bytes, "fields": {name: (offset, struct format)}}``;
    array fields give the offset of element 0.  ``config`` and ``layout`` name the
    header sub-structs' fields in order.
    """
    cdef shmkv_shared_t sh
    cfg_names = ["num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks",
                 "max_seqs", "max_blocks_per_seq", "max_procs", "dtype", "itemsize",
                 "hash_algo", "_reserved", "event_capacity", "_reserved_ev"]
    lay_names = ["token_bytes", "block_bytes", "layer_stride", "index_capacity",
                 "off_blocks", "off_free", "off_procs", "off_seqs", "off_seq_free",
                 "off_tables", "off_tokens", "off_index", "off_kpool", "off_vpool",
                 "segment_size", "off_events", "event_record_bytes", "scale_bytes",
                 "scale_stride", "off_kscale", "off_vscale", "off_hscale"]
    header = _fields(SHMKV_HEADER_FIELDS, 0)
    shared = _fields(SHMKV_SHARED_FIELDS, SHMKV_SHARED_OFFSET)
    seq = _fields(SHMKV_SEQ_FIELDS, 0)
    proc = _fields(SHMKV_PROC_FIELDS, 0)
    block = _fields(SHMKV_BLOCK_FIELDS, 0)
    index = _fields(SHMKV_INDEX_FIELDS, 0)
    return dict(
        header=dict(size=sizeof(shmkv_header_t), fields=header),
        shared=dict(size=sizeof(shmkv_shared_t), fields=shared,
                    pool_lock_size=sizeof(sh.pool_lock), counters=32),
        seq=dict(size=sizeof(shmkv_seq_t), fields=seq),
        proc=dict(size=sizeof(shmkv_proc_t), fields=proc, inflight=SHMKV_INFLIGHT_PER_PROC,
                  counters=SHMKV_PROC_COUNTERS, cache_blocks=SHMKV_PCACHE_BLOCKS,
                  cache_seqs=SHMKV_PCACHE_SEQS),
        block=dict(size=sizeof(shmkv_block_t), fields=block),
        index=dict(size=sizeof(shmkv_index_t), fields=index),
        event=dict(size=sizeof(shmkv_event_t), fields=_fields(SHMKV_EVENT_FIELDS, 0),
                   ring_size=sizeof(shmkv_event_ring_t)),
        config=cfg_names, layout=lay_names)



"""The operations every implementation is timed on, written once against the shmkv API.

Each op is (run, setup, teardown, calls) for :func:`timing.measure`; ``run`` is a tight
loop over bound methods, the same code for shmkv and for every peer.
"""
from __future__ import annotations

import numpy as np
from timing import measure, record

OPS = ("life", "reserve1", "fork1k", "append1", "prefill512", "gather1k_out",
       "gather1k_new", "bbt256")

OP_TITLES = {
    "life": "sequence life: create_sequence + reserve(block_size) + free",
    "reserve1": "reserve(sid, 1), no new block",
    "fork1k": "fork of a 1k-token sequence",
    "append1": "append 1 token (decode step, all layers)",
    "prefill512": "append 512 tokens (prefill)",
    "gather1k_out": "gather 1k tokens into out=",
    "gather1k_new": "gather 1k tokens into fresh arrays",
    "bbt256": "batch_block_tables, 256 sequences",
}

APPEND_CALLS = 64          # decode appends per sample: 4 blocks of 16, allocation included
RESERVE_SEQS = 16          # sequences per reserve1 sample


class Workload:
    """The data of one config: token arrays and what ops need sized from the config."""

    def __init__(self, cfg, seed=0):
        rng = np.random.default_rng(seed)
        self.cfg = cfg
        L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        dt = cfg.numpy_dtype

        def rnd(n):
            return rng.standard_normal((L, n, H, D), dtype=np.float32).astype(dt)

        self.k1, self.v1 = rnd(1), rnd(1)
        self.kp, self.vp = rnd(512), rnd(512)
        self.tb = cfg.bytes_per_token

    def nbytes(self, op):
        return {"append1": self.tb, "prefill512": 512 * self.tb,
                "gather1k_out": 1024 * self.tb, "gather1k_new": 1024 * self.tb}.get(op)

    def working_set(self, op):
        """Pool bytes a sample of the op touches (blocks are reused LIFO between
        samples): what the matched memcpy floor walks."""
        bpb = self.cfg.bytes_per_block
        return {"append1": (APPEND_CALLS // self.cfg.block_size) * bpb,
                "prefill512": 512 * self.tb, "gather1k_out": 1024 * self.tb,
                "gather1k_new": 1024 * self.tb}.get(op)


def verify(impl, cfg, wl):
    """Round trip on `impl` before anything is timed: appends (prefill and decode),
    fork + copy-on-write, gather, block tables.  Raises AssertionError on a mismatch."""
    bs = cfg.block_size
    n0 = bs + 5
    k0, v0 = wl.kp[:, :n0], wl.vp[:, :n0]
    s = impl.create_sequence()
    try:
        impl.append(s, np.ascontiguousarray(k0), np.ascontiguousarray(v0))
        for _ in range(3):
            impl.append(s, wl.k1, wl.v1)
        c = impl.fork(s)
        try:
            impl.append(c, wl.v1, wl.k1)          # shared partial block: copy-on-write
            impl.append(s, wl.v1, wl.v1)
            ek = np.concatenate([k0] + [wl.k1] * 3, axis=1)
            ev = np.concatenate([v0] + [wl.v1] * 3, axis=1)
            gk, gv = impl.gather(c)
            assert np.array_equal(gk, np.concatenate([ek, wl.v1], 1)), "child K"
            assert np.array_equal(gv, np.concatenate([ev, wl.k1], 1)), "child V"
            gk, gv = impl.gather(s, 2, n0 + 4)
            assert np.array_equal(gk, np.concatenate([ek, wl.v1], 1)[:, 2:]), "parent K"
            assert np.array_equal(gv, np.concatenate([ev, wl.v1], 1)[:, 2:]), "parent V"
            tables, lens = impl.batch_block_tables(np.array([s, c], np.int64))
            assert lens.tolist() == [n0 + 4, n0 + 4], lens
            nb = -(-(n0 + 4) // bs)
            assert tables.shape == (2, nb) and tables.dtype == np.int32, tables
            assert tables[0, 0] == tables[1, 0], "fork shares the first block"
            assert tables[0, nb - 1] != tables[1, nb - 1], "COW gave the child its own block"
        finally:
            impl.free(c)
    finally:
        impl.free(s)


def run_ops(impl, impl_name, cfg_name, cfg, wl, budget, progress, ops=OPS, kind="python",
            in_thread=True):
    """Times every op of `ops` on `impl`; returns result records.  in_thread: the work
    runs in this thread (see timing.measure); False for peers with a server process."""
    bs = cfg.block_size
    out = []
    long_sids = []

    def rec(op, stats, **extra):
        r = record("ops", op, cfg_name, impl_name, stats, kind=kind, nbytes=wl.nbytes(op),
                   working_set=wl.working_set(op), **extra)
        out.append(r)
        progress.result(r)
        return r

    def sample_opts(slow=False):
        return {"repeat": budget.repeat, "min_repeat": budget.min_repeat,
                "in_thread": in_thread,
                    "max_seconds": budget.max_seconds * (1.5 if slow else 1.0),
                    "warmup": budget.warmup}

    try:
        # -- a 1k-token sequence with real data: fork and gather use it -------------------
        progress.step(f"{cfg_name}/{impl_name}: building the 1k-token sequence")
        src = impl.create_sequence()
        long_sids.append(src)
        impl.append(src, wl.kp, wl.vp)
        impl.append(src, wl.kp, wl.vp)

        if "life" in ops:
            progress.step(f"{cfg_name}/{impl_name}/life")
            cs, rs, fr = impl.create_sequence, impl.reserve, impl.free

            def life(_s, n):
                for _ in range(n):
                    s = cs()
                    rs(s, bs)
                    fr(s)
            rec("life", measure(life, max_calls=20000, target_sample_ns=budget.sample_ns,
                                **sample_opts()))

        if "reserve1" in ops:
            progress.step(f"{cfg_name}/{impl_name}/reserve1")

            def setup(_n):
                sids = [impl.create_sequence() for _ in range(RESERVE_SEQS)]
                for s in sids:
                    impl.reserve(s, 1)           # the block is allocated here, untimed
                return sids

            def run(sids, _n):
                r = impl.reserve
                for s in sids * (bs - 1):        # every call fits in the current block
                    r(s, 1)

            def teardown(sids):
                for s in sids:
                    impl.free(s)
            rec("reserve1", measure(run, calls=RESERVE_SEQS * (bs - 1), setup=setup,
                                    teardown=teardown, **sample_opts()))

        if "fork1k" in ops:
            progress.step(f"{cfg_name}/{impl_name}/fork1k")
            kids = []

            def fork_run(_s, n):
                f, a = impl.fork, kids.append
                for _ in range(n):
                    a(f(src))

            def fork_down(_s):
                for c in kids:
                    impl.free(c)
                kids.clear()
            rec("fork1k", measure(fork_run, max_calls=256, teardown=fork_down,
                                  target_sample_ns=budget.sample_ns / 4, **sample_opts()))

        if "append1" in ops:
            progress.step(f"{cfg_name}/{impl_name}/append1")
            k1, v1 = wl.k1, wl.v1

            def app_run(s, n):
                a = impl.append
                for _ in range(n):
                    a(s, k1, v1)
            rec("append1", measure(app_run, calls=APPEND_CALLS,
                                   setup=lambda n: impl.create_sequence(),
                                   teardown=impl.free, **sample_opts(slow=True)))

        if "prefill512" in ops:
            progress.step(f"{cfg_name}/{impl_name}/prefill512")
            kp, vp = wl.kp, wl.vp

            def pre_run(s, n):
                for _ in range(n):
                    impl.append(s, kp, vp)
            rec("prefill512", measure(pre_run, calls=1, setup=lambda n: impl.create_sequence(),
                                      teardown=impl.free, **sample_opts(slow=True)))

        if "gather1k_out" in ops or "gather1k_new" in ops:
            shape = (cfg.num_layers, 1024, cfg.num_kv_heads, cfg.head_dim)
            ko = np.zeros(shape, cfg.numpy_dtype)         # pages touched: no faults timed
            vo = np.zeros(shape, cfg.numpy_dtype)
            ko.fill(1)
            vo.fill(1)
            if "gather1k_out" in ops:
                progress.step(f"{cfg_name}/{impl_name}/gather1k_out")

                def g_out(_s, n):
                    g = impl.gather
                    for _ in range(n):
                        g(src, out=(ko, vo))
                rec("gather1k_out", measure(g_out, calls=1, **sample_opts(slow=True)))
                # the bytes are the bytes: every implementation must return the data
                ek = np.concatenate([wl.kp, wl.kp], axis=1)
                assert np.array_equal(ko, ek), f"{impl_name}: gather returned wrong K"
                del ek
            if "gather1k_new" in ops:
                progress.step(f"{cfg_name}/{impl_name}/gather1k_new")

                def g_new(_s, n):
                    g = impl.gather
                    for _ in range(n):
                        g(src)
                rec("gather1k_new", measure(g_new, calls=1, **sample_opts(slow=True)))
            del ko, vo

        if "bbt256" in ops:
            progress.step(f"{cfg_name}/{impl_name}/bbt256: building 256 sequences")
            rng = np.random.default_rng(1)
            lens = rng.integers(1, 1025, 256)
            batch = []
            try:
                for n in lens:
                    s = impl.create_sequence()
                    batch.append(s)
                    impl.reserve(s, int(n))
                sids = np.array(batch, np.int64)
                tables, got = impl.batch_block_tables(sids)
                W = -(-int(lens.max()) // bs)
                assert got.tolist() == lens.tolist() and tables.shape == (256, W), \
                    f"{impl_name}: batch_block_tables gave {tables.shape}, expected {(256, W)}"
                progress.step(f"{cfg_name}/{impl_name}/bbt256")

                def bbt(_s, n):
                    f = impl.batch_block_tables
                    for _ in range(n):
                        f(sids)
                rec("bbt256", measure(bbt, target_sample_ns=budget.sample_ns,
                                      **sample_opts()))
            finally:
                for s in batch:
                    impl.free(s)
    finally:
        for s in long_sids:
            impl.free(s)
    return out

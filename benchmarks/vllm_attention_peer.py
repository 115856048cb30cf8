"""vLLM's CPU paged attention as a peer of shmkv's kernel; run in the vLLM venv.

    make bench-attn-vllm                                   # .venv-vllm/bin/python this file
    .venv-vllm/bin/python benchmarks/vllm_attention_peer.py --quick

One Llama-3-8B layer (32 q heads over 8 kv heads, head_dim 128): decode 8 x 4k, decode
1 x 32k, prefill 512 rows into a 4k context.  The same K/V go into a shmkv segment
(``KVCache.append``) and into vLLM's own CPU cache (``cpu_attn_reshape_and_cache``, block 128,
``[num_blocks, num_kv_heads, block_size, head_dim]`` for K and for V), in the ISA vLLM's
backend picks (``_get_attn_isa``: "amx" for bf16 on AMX machines, "vec" otherwise).  Before
any timing, both outputs are checked against a float64 numpy reference on the stored K/V: a
peer that computes something else is no peer.  Then medians over interleaved rounds of
shmkv ``cache.attention`` (the default, and ``precision="bf16"``), vLLM ``cpu_attention_with_kv_cache`` (with its scheduler metadata,
built once as the backend does per step), torch SDPA on contiguous K/V (no gather), and the
read floor (every K/V byte read once), all on the same thread count, every call cold
(``floors.Evictor``: twice the last-level cache read just before it, untimed -- a decode
step's layers never share the cache, and a warm call's gain depends on what ran before it).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

THREADS = int(os.environ.get("SHMKV_PEER_THREADS", "2"))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))   # vLLM's kernels use OpenMP

import numpy as np  # noqa: E402
import torch  # noqa: E402

import shmkv  # noqa: E402
from shmkv import (
    _attention,  # noqa: E402
    _bench,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from floors import Evictor  # noqa: E402

HQ, HKV, D = 32, 8, 128
SBS, VBS = 16, 128                    # shmkv block, vLLM CPU block
TORCH_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def vllm_ops():
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return ops, _get_attn_isa


class Peer:
    """`batch` sequences of `length` tokens in shmkv and in vLLM's cache, same K/V."""

    def __init__(self, dtype, batch, length, rows, seed=0):
        ops, get_isa = vllm_ops()
        self.ops, self.dtype, self.batch, self.length, self.rows = ops, dtype, batch, length, rows
        tdt = TORCH_DT[dtype]
        self.isa = get_isa(tdt, VBS, D)
        cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=HKV, head_dim=D,
                                num_blocks=batch * -(-length // SBS), block_size=SBS,
                                dtype=dtype, max_seqs=max(4, batch))
        self.name = f"shmkv-vllm-peer-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.cache = shmkv.KVCache.create(self.name, cfg)
        try:
            self._fill(cfg, tdt, seed)
        except BaseException:
            self.close()
            raise

    def _fill(self, cfg, tdt, seed):
        B, L = self.batch, self.length
        nbs = -(-L // VBS)
        self.kc = torch.zeros((B * nbs, HKV, VBS, D), dtype=tdt)
        self.vc = torch.zeros_like(self.kc)
        perm = torch.randperm(B * nbs, generator=torch.Generator().manual_seed(seed))
        self.block_table = perm.view(B, nbs).to(torch.int32).contiguous()  # scattered blocks
        rng = np.random.default_rng(seed)
        self.sids, self.k, self.v = [], [], []
        for i in range(B):
            sid = self.cache.create_sequence()
            k = torch.from_numpy(rng.standard_normal((L, HKV, D), np.float32)).to(tdt)
            v = torch.from_numpy(rng.standard_normal((L, HKV, D), np.float32)).to(tdt)
            self.cache.append(sid, k.float().numpy().astype(cfg.numpy_dtype)[None],
                              v.float().numpy().astype(cfg.numpy_dtype)[None])
            t = torch.arange(L)
            slots = (self.block_table[i].long()[t // VBS] * VBS + t % VBS).contiguous()
            self.ops.cpu_attn_reshape_and_cache(k, v, self.kc, self.vc, slots, self.isa)
            self.sids.append(sid)
            self.k.append(k.float())
            self.v.append(v.float())
        rows = self.rows or 1
        q = torch.from_numpy(np.random.default_rng(seed + 1)
                             .standard_normal((B * rows, HQ, D), np.float32)).to(tdt)
        self.q_t = q                                  # vLLM's query, in the cache dtype
        self.q_np = q.float().numpy()                 # the same values for shmkv
        self.out_np = np.empty_like(self.q_np)
        self.out_bf = np.empty_like(self.q_np)
        self.out_t = torch.empty_like(q)
        self.qsl = torch.arange(0, B * rows + 1, rows, dtype=torch.int32)
        self.seq_lens = torch.full((B,), L, dtype=torch.int32)
        self.scale = 1.0 / D ** 0.5
        self.sched = self.ops.cpu_attn_get_scheduler_metadata(
            B, HQ, HKV, D, self.seq_lens, tdt, self.qsl, True, -1, self.isa, True)

    def close(self):
        self.cache.close()
        self.cache.unlink()

    def shmkv(self):
        if self.rows:
            return self.cache.attention(0, self.q_np, self.sids, q_lens=[self.rows],
                                        out=self.out_np)
        return self.cache.attention(0, self.q_np, self.sids, out=self.out_np)

    def shmkv_bf16(self):
        """The opt-in reduced-precision mode (precision="bf16")."""
        return self.cache.attention(0, self.q_np, self.sids,
                                    q_lens=[self.rows] if self.rows else None,
                                    out=self.out_bf, precision="bf16")

    def vllm(self):
        self.ops.cpu_attention_with_kv_cache(
            self.q_t, self.kc, self.vc, self.out_t, self.qsl, self.seq_lens, self.scale,
            True, None, -1, self.block_table, 0.0, self.sched, None)
        return self.out_t

    def sdpa_fn(self):
        """torch SDPA (GQA) on contiguous K/V in the stored dtype (no gather counted)."""
        from torch.nn.functional import scaled_dot_product_attention as sdpa
        tdt = TORCH_DT[self.dtype]
        B, L, rows = self.batch, self.length, self.rows or 1
        k = torch.stack(self.k).to(tdt).transpose(1, 2).contiguous()     # [B, HKV, L, D]
        v = torch.stack(self.v).to(tdt).transpose(1, 2).contiguous()
        q = self.q_t.view(B, rows, HQ, D).transpose(1, 2)
        mask = None
        if self.rows:
            mask = torch.arange(L)[None, :] <= torch.arange(L - rows, L)[:, None]
        return lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True)

    def reference(self):
        """float64 numpy attention on the stored K/V: the independent answer."""
        rows = self.rows or 1
        out = np.empty((self.batch * rows, HQ, D))
        for i in range(self.batch):
            k = self.k[i].double().numpy()
            v = self.v[i].double().numpy()
            q = self.q_np[i * rows:(i + 1) * rows].astype(np.float64)
            for h in range(HQ):
                s = q[:, h] @ k[:, h // (HQ // HKV)].T * self.scale          # [rows, L]
                pos = np.arange(self.length - rows, self.length)[:, None]
                s[np.arange(self.length)[None, :] > pos] = -np.inf
                p = np.exp(s - s.max(1, keepdims=True))
                out[i * rows:(i + 1) * rows, h] = (p / p.sum(1, keepdims=True)) @ \
                    v[:, h // (HQ // HKV)]
        return out

    def check(self):
        ref = self.reference()
        tol = 2e-4 if self.dtype == "float32" else 2e-2   # outputs are O(0.1); bf16 q/out
        errs = {"shmkv": float(np.abs(self.shmkv() - ref).max()),
                "shmkv_bf16": float(np.abs(self.shmkv_bf16() - ref).max()),
                "vllm": float(np.abs(self.vllm().float().numpy() - ref).max())}
        for who, e in errs.items():
            if not e <= (2e-2 if who == "shmkv_bf16" else tol):   # the opt-in rounds q, P
                raise SystemExit(f"{who} differs from the reference on {self.dtype} "
                                 f"{self.batch}x{self.length} rows={self.rows}: max abs "
                                 f"error {e:.3g} > {tol}")
        return errs


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def interleaved(fns, rounds, per, before):
    """Median ns per call of each fn, the fns taking turns round after round; ``before``
    runs untimed before each call."""
    ts = {n: [] for n in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for n, fn in fns.items():
            for _ in range(per):
                before()
                t0 = time.perf_counter_ns()
                fn()
                ts[n].append(time.perf_counter_ns() - t0)
    return {n: float(np.median(v)) for n, v in ts.items()}


def run_case(dtype, label, batch, length, rows, rounds, per, evict):
    p = Peer(dtype, batch, length, rows)
    try:
        errs = p.check()
        kb, vb = p.cache.key_cache(0), p.cache.value_cache(0)
        med = interleaved({"shmkv": p.shmkv, "shmkv_bf16": p.shmkv_bf16, "vllm": p.vllm,
                           "sdpa": p.sdpa_fn(),
                           "floor": lambda: (_bench.bench_read(kb),
                                             _bench.bench_read(vb))}, rounds, per, evict)
        return {"case": label, "dtype": dtype, "vllm_isa": p.isa, "err": errs, **med}
    finally:
        p.close()


def table(results, header):
    out = [header, "",
           "| case | dtype | vLLM ISA | shmkv | shmkv bf16 | vLLM CPU | torch SDPA | floor | "
           "shmkv / floor | vLLM / shmkv | vLLM / shmkv bf16 | max err shmkv / bf16 / vLLM |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        out.append(f"| {r['case']} | {r['dtype']} | {r['vllm_isa']} | "
                   f"{r['shmkv'] / 1e6:.2f} ms | {r['shmkv_bf16'] / 1e6:.2f} ms | "
                   f"{r['vllm'] / 1e6:.2f} ms | "
                   f"{r['sdpa'] / 1e6:.2f} ms | {r['floor'] / 1e6:.2f} ms | "
                   f"{r['shmkv'] / r['floor']:.2f}x | "
                   f"{r['vllm'] / r['shmkv']:.2f}x | {r['vllm'] / r['shmkv_bf16']:.2f}x | "
                   f"{r['err']['shmkv']:.1e} / {r['err']['shmkv_bf16']:.1e} / "
                   f"{r['err']['vllm']:.1e} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, decode 1x32k dropped")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--json", help="also write the results (and the header) here as JSON "
                    "(attention_bench.py reads them)")
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    _attention.set_num_threads(THREADS)
    rounds, per = (3, 2) if args.quick else (7, 3)
    cases = [("decode 8 x 4k", 8, 4096, 0), ("prefill 512 into 4k", 1, 4096, 512)]
    if not args.quick:
        cases.insert(1, ("decode 1 x 32k", 1, 32768, 0))
    import vllm
    evict = Evictor()
    head = (f"CPU {cpu_name()}; shmkv ISA {_attention.cpu_isa()} (kernel {_attention.isa()}, "
            f"bf16 mode on {_attention.dot_isa()}), vLLM "
            f"{vllm.__version__} (ISA per dtype in the table), torch {torch.__version__}, "
            f"{THREADS} threads, load average {os.getloadavg()[0]:.2f}; "
            f"medians over {rounds} interleaved rounds of {per} calls, each cold "
            f"({evict.nbytes >> 20} MiB read before it)")
    print(head, flush=True)
    results = []
    for dtype in args.dtypes.split(","):
        for label, b, n, rows in cases:
            r = run_case(dtype, label, b, n, rows, rounds, per, evict)
            results.append(r)
            print(table([r], "").splitlines()[-1], flush=True)
    print()
    print(table(results, head))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"head": head, "results": results, "table": table(results, ""),
                       "load_after": os.getloadavg()[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two hosts, one Redis Cluster: host B's first request for host A's prompt is a hit.

    make cluster && make two-hosts && make cluster-stop
    python tools/two_hosts.py --url redis://127.0.0.1:7000        # a running cluster
    python tools/two_hosts.py --start-cluster                      # its own, on free ports

Two segments stand for two hosts ("host A" and "host B": two separate shared-memory
pools, as on two machines), created with the same block-hash seed and layout. Host A's
worker prefills a prompt and writes its blocks through to the tier; host B's worker
then asks for the same prompt: its ``create_sequence(tokens=)`` takes the blocks from the
tier (checked, landed in B's pool, published for every process of host B), and the K/V
are compared with A's. With the transformers integration installed it then times the
first token on host B with the tier hit against recomputing (the model of
benchmarks/transformers_bench.py).

Both "hosts" run in this one process here (two segments, two tiers with their own
connections); on two machines each runs its half against the same cluster URL.  (Hosts as
network namespaces joined by veth pairs: tools/netlab.py.)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

import numpy as np

import shmkv

LAYOUT = dict(num_layers=8, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")
SEED = 0x7715


def host(tag: str, num_blocks: int) -> shmkv.KVCache:
    name = f"shmkv-host-{tag}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return shmkv.KVCache.create(name, shmkv.CacheConfig(**LAYOUT, num_blocks=num_blocks,
                                                        max_seqs=16), hash_seed=SEED)


def kv_demo(url: str, tokens: int) -> int:
    a, b = host("a", tokens // 16 + 16), host("b", tokens // 16 + 16)
    try:
        a.set_tier(shmkv.RedisTier(url, cluster=True))
        b.set_tier(shmkv.RedisTier(url, cluster=True))
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, 32000, tokens)
        shape = (LAYOUT["num_layers"], tokens, LAYOUT["num_kv_heads"], LAYOUT["head_dim"])
        k = rng.standard_normal(shape).astype(np.float16)
        v = rng.standard_normal(shape).astype(np.float16)

        sa = a.create_sequence(tokens=prompt)
        print(f"host A: {tokens}-token prompt, local hit {a.seq_len(sa)} tokens: prefill")
        a.append(sa, k, v, tokens=prompt)
        t0 = time.perf_counter()
        n = a.flush_tier(30)
        print(f"host A: {n} blocks written through to {url} "
              f"({n * a.config.bytes_per_block / 2**20:.0f} MiB, flushed in "
              f"{(time.perf_counter() - t0) * 1e3:.0f} ms)")

        t0 = time.perf_counter()
        sb = b.create_sequence(tokens=prompt)
        dt = time.perf_counter() - t0
        hit = b.seq_len(sb)
        kb, vb = b.gather(sb)
        same = np.array_equal(kb, k[:, :hit]) and np.array_equal(vb, v[:, :hit])
        print(f"host B: first request for the same prompt: {hit} of {tokens} tokens from "
              f"the tier in {dt * 1e3:.1f} ms ({hit * a.config.bytes_per_token / dt / 1e9:.2f}"
              f" GB/s), K/V equal to host A's: {same}")
        worker2 = shmkv.KVCache.attach(b.name)
        print(f"host B, another worker: match_prefix -> {worker2.match_prefix(prompt)} "
              "tokens (local now)")
        worker2.close()
        st = b.stats()
        print("host B stats: " + ", ".join(f"{k}={st[k]}" for k in st if k.startswith("tier_")))
        ok = hit == (tokens - 1) // 16 * 16 and same
        return 0 if ok else 1
    finally:
        for c in (a, b):
            c.close()
            c.unlink()


def ttft_demo(url: str, length: int) -> None:
    try:
        import torch

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "benchmarks"))
        from transformers_bench import make_model

        from shmkv.integrations.transformers import ShmkvCache, config_for
    except ImportError as e:
        print(f"(first-token timing skipped: {e})")
        return
    torch.set_num_threads(1)
    model = make_model("shmkv")
    cfg = config_for(model.config, num_blocks=4 * (length // 16 + 8), block_size=16,
                     max_seqs=8)
    hosts = [shmkv.KVCache.create(f"shmkv-host-{t}-{uuid.uuid4().hex[:6]}", cfg,
                                  hash_seed=SEED) for t in "ab"]
    a, b = hosts
    try:
        for c in hosts:
            c.set_tier(shmkv.RedisTier(url, cluster=True))
        g = torch.Generator().manual_seed(1)

        def first_token(kv: shmkv.KVCache, ids: "torch.Tensor") -> tuple[float, int]:
            with torch.inference_mode():
                t0 = time.perf_counter()
                past = ShmkvCache(kv, prompt_ids=ids)
                hit = past.get_seq_length()
                model.generate(ids, past_key_values=past, max_new_tokens=1, do_sample=False)
                dt = time.perf_counter() - t0
            past.close()
            return dt, hit

        first_token(b, torch.randint(0, 8192, (1, 32), generator=g))      # warm-up
        ids = torch.randint(0, 8192, (1, length), generator=g)
        ta, _ = first_token(a, ids)
        a.flush_tier(30)
        tb, hit = first_token(b, ids)
        cold = torch.randint(0, 8192, (1, length), generator=g)
        tc, _ = first_token(b, cold)
        print(f"first token, {length}-token prompt (transformers, the integration's model): "
              f"host A computing it {ta * 1e3:.0f} ms; host B with a tier hit of {hit} "
              f"tokens {tb * 1e3:.0f} ms; host B recomputing a new prompt {tc * 1e3:.0f} ms")
    finally:
        for c in hosts:
            c.close()
            c.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="redis://127.0.0.1:7000")
    ap.add_argument("--start-cluster", action="store_true",
                    help="start a 3-master cluster of its own on free loopback ports")
    ap.add_argument("--tokens", type=int, default=1025)
    ap.add_argument("--no-ttft", action="store_true")
    args = ap.parse_args()
    cluster = None
    if args.start_cluster:
        from shmkv.tier.cluster import LocalCluster, free_ports

        cluster = LocalCluster(free_ports(3)).start()
        args.url = cluster.url
        print(f"started a Redis Cluster at {args.url}")
    try:
        rc = kv_demo(args.url, args.tokens)
        if not args.no_ttft:
            ttft_demo(args.url, 1024)
        return rc
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())

"""Peer implementations of the shmkv API, for the benchmarks only.

Every peer offers the methods the benchmark calls on ``shmkv.KVCache`` (create_sequence,
reserve, append, fork, gather, batch_block_tables, free, close) with the same shapes and
semantics (block tables, ref counts, copy-on-write of a shared partial last block), so one
operation suite times them all.  Each is written here from the published design of the
system it stands for; no code is copied.

- vllm_pool.VllmStyleCache  pure-Python vLLM v1 block pool + numpy pools (one process)
- naive_shm.NaiveShmCache   multiprocessing.shared_memory + Lock + Manager dict
- lmdb_kv.LmdbCache         LMDB, one value per block, on /dev/shm
- redis_kv.RedisCache       a real redis-server on a unix socket, one value per block
"""

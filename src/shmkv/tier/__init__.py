"""shmkv.tier: a remote tier on Redis Cluster shared by hosts (extra ``shmkv[redis]``).

The package's face: names only.  The rooms:

- ``redis.py``   -- ``RedisTier``: write-through, prefix reads, circuit breaker, counters
- ``codec.py``   -- a block's value: layout fingerprint, header, checksum
- ``client.py``  -- the bounded Redis / Redis Cluster transport
- ``cluster.py`` -- a local cluster for tests and demos (``python -m shmkv.tier.cluster``)
"""
from .redis import RedisTier as RedisTier

__all__ = ["RedisTier"]

"""shmkv.tier: a remote tier on Redis Cluster shared by hosts (extra ``shmkv[redis]``).

The package's face: names only.  The rooms:

- ``redis.py``   -- ``RedisTier``: write-through, prefix reads, circuit breaker, counters
- ``codec.py``   -- a block's value: layout fingerprint, header, checksum
- ``client.py``  -- the bounded Redis / Redis Cluster transport
- ``cluster.py`` -- a local cluster for tests and demos (``python -m shmkv.tier.cluster``)

Besides RedisTier, the names this module held before the tier moved to redis.py stay
importable from here.
"""
from .client import TierIOError as TierIOError
from .client import Transport as Transport
from .codec import Layout as Layout
from .codec import scale_table as scale_table
from .redis import _PAGE as _PAGE
from .redis import RedisTier as RedisTier
from .redis import _Binding as _Binding
from .redis import _Breaker as _Breaker
from .redis import _value_buffer as _value_buffer

__all__ = ["RedisTier"]

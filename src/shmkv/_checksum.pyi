# Stubs of shmkv._checksum (the remote tier's value checksum; see _checksum.pyx).
from typing import Any

def tier_checksum(data: Any, seed: int = 0) -> int: ...

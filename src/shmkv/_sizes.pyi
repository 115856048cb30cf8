from typing import Any

DTYPES: dict[str, tuple[int, int]]
HASHES: dict[str, int]

def layout_of(cfg: Any) -> dict[str, int]: ...

# Stubs of shmkv._kvdata (K/V bytes in and out: the decode loop; see _kvdata.pyx).
from typing import Any, Union

import numpy as np
import numpy.typing as npt

from ._core import Segment
from ._sequences import SequenceOps

_Sid = Union[int, np.integer[Any]]
_Pair = tuple[npt.NDArray[Any], npt.NDArray[Any]]

class DataOps(SequenceOps):
    def append(self, sid: _Sid, k: npt.NDArray[Any], v: npt.NDArray[Any],
               tokens: npt.ArrayLike | None = None) -> None: ...
    def reserve(self, sid: _Sid, n: int,
                tokens: npt.ArrayLike | None = None) -> npt.NDArray[np.int64]: ...
    def write(self, layer: int, slots: npt.NDArray[np.integer[Any]], k: npt.NDArray[Any],
              v: npt.NDArray[Any]) -> None: ...
    def key_cache(self, layer: int) -> npt.NDArray[Any]: ...
    def value_cache(self, layer: int) -> npt.NDArray[Any]: ...
    def gather(self, sid: _Sid, start: int | None = None, stop: int | None = None, *,
               out: _Pair | None = None) -> _Pair: ...

def empty_gather_buffers(cache: Segment, n_tokens: int) -> _Pair: ...

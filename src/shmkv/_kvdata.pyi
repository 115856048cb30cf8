# Stubs of shmkv._kvdata (K/V bytes in and out: the decode loop; see _kvdata.pyx).
from typing import Any, Literal, Union, overload

import numpy as np
import numpy.typing as npt

from ._core import Segment
from ._quant import QuantOps

_Sid = Union[int, np.integer[Any]]
_Pair = tuple[npt.NDArray[Any], npt.NDArray[Any]]
# gather(raw=True) of a quantized pool: codes, codes, float32 scales, float32 scales
_Raw = tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[np.float32],
             npt.NDArray[np.float32]]

class DataOps(QuantOps):
    def append(self, sid: _Sid, k: npt.NDArray[Any], v: npt.NDArray[Any],
               tokens: npt.ArrayLike | None = None) -> None: ...
    def reserve(self, sid: _Sid, n: int,
                tokens: npt.ArrayLike | None = None) -> npt.NDArray[np.int64]: ...
    def write(self, layer: int, slots: npt.NDArray[np.integer[Any]], k: npt.NDArray[Any],
              v: npt.NDArray[Any]) -> None: ...
    def key_cache(self, layer: int) -> npt.NDArray[Any]: ...
    def value_cache(self, layer: int) -> npt.NDArray[Any]: ...
    @overload
    def gather(self, sid: _Sid, start: int | None = None, stop: int | None = None, *,
               out: _Pair | None = None, raw: Literal[False] = False) -> _Pair: ...
    @overload
    def gather(self, sid: _Sid, start: int | None = None, stop: int | None = None, *,
               out: None = None, raw: Literal[True]) -> _Raw: ...

def empty_gather_buffers(cache: Segment, n_tokens: int) -> _Pair: ...

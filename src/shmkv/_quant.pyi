# Stubs of shmkv._quant (quantized pools: codecs, scale tables and views; see _quant.pyx).
from typing import Union

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

from ._sequences import SequenceOps

_Scales = Union[float, npt.ArrayLike]

SCRATCH_KEEP: int

@disjoint_base
class QuantOps(SequenceOps):
    def key_scales(self, layer: int) -> npt.NDArray[np.float32]: ...
    def value_scales(self, layer: int) -> npt.NDArray[np.float32]: ...
    def set_kv_scales(self, layer: int, k_scale: _Scales, v_scale: _Scales) -> None: ...
    def kv_scales(self, layer: int) -> tuple[npt.NDArray[np.float32],
                                             npt.NDArray[np.float32]]: ...

def _force_quant_isa(name: str | None) -> str: ...

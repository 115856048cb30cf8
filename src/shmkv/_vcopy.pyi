# Stubs of shmkv._vcopy (the vLLM connector's block copy in C; see _vcopy.pyx).
import numpy as np
import numpy.typing as npt

def copy_blocks(t_ptr: int, t_blocks: int, k_ptr: int, v_ptr: int, pool_blocks: int,
                heads: int, head_dim: int, vllm_block_size: int, block_size: int,
                itemsize: int, shm_ids: npt.NDArray[np.int64],
                vllm_ids: npt.NDArray[np.int64], sub: npt.NDArray[np.int64],
                k_transposed: bool, to_vllm: bool, amx_pack: int = 0,
                pool_heads: int = 0, head0: int = 0) -> None: ...
def transpose_isa() -> str: ...
def _force_transpose_isa(name: str | None) -> str: ...

"""shmkv.integrations.torch_views: torch tensors over the pools and results, no copy."""
import subprocess
import sys

import numpy as np
import pytest
import torch  # installed by the Makefile: torch==2.13.0

from shmkv.integrations.torch_views import as_tensor, pool_tensors


@pytest.mark.parametrize("dtype,tdtype", [("float32", torch.float32), ("float16", torch.float16),
                                          ("bfloat16", torch.bfloat16)])
def test_pool_tensors_alias_the_segment(make_cache, dtype, tdtype):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    sid = cache.create_sequence()
    k = np.random.default_rng(0).standard_normal(
        (cfg.num_layers, 5, cfg.num_kv_heads, cfg.head_dim)).astype(cfg.numpy_dtype)
    cache.append(sid, k, k)
    kt, vt = pool_tensors(cache, 1)
    assert kt.dtype == tdtype and tuple(kt.shape) == cache.key_cache(1).shape
    block = int(cache.block_table(sid)[0])
    # the tensor shows what append wrote ...
    want = torch.from_numpy(k[1, 0].astype(np.float32))
    assert torch.equal(kt[block, 0].float(), want)
    # ... and a write through the tensor is seen by gather (same bytes)
    vt[block, 0, 0, 0] = 3.0
    assert float(cache.gather(sid)[1][1, 0, 0, 0]) == 3.0
    assert kt.data_ptr() == cache.key_cache(1).ctypes.data


def test_as_tensor_on_attention_output_and_errors(make_cache):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = as_tensor(a)
    t[0, 0] = 7
    assert a[0, 0] == 7
    with pytest.raises(TypeError, match="ndarray"):
        as_tensor([1.0])
    with pytest.raises(TypeError, match="zero-copy"):
        as_tensor(np.zeros(2, np.dtype("U3")))


def test_import_shmkv_does_not_import_torch():
    code = "import sys, shmkv; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_quantized_pool_views(make_cache):
    """int8 and float8_e4m3 pools: codes and scales as torch tensors over the segment."""
    for dtype, tdt in (("int8", torch.int8), ("float8_e4m3", torch.float8_e4m3fn)):
        cache = make_cache(dtype=dtype)
        sid = cache.create_sequence()
        k = np.random.default_rng(0).standard_normal(
            (2, 3, 2, 8)).astype(np.float32)
        cache.append(sid, k, -k)
        kt, vt = pool_tensors(cache, 0)
        assert kt.dtype == tdt and kt.shape == cache.key_cache(0).shape
        b = int(cache.block_table(sid)[0])
        qk, _, sk, _ = cache.gather(sid, raw=True)
        assert np.array_equal(kt[b, :3].view(torch.uint8).numpy(), qk[0].view(np.uint8))
        st = as_tensor(cache.key_scales(0))
        assert st.dtype == torch.float32 and np.shares_memory(st.numpy(), cache.key_scales(0))

"""The connector's C block copy (shmkv._vcopy via CpuLayout.copy) against the torch
reference (CpuLayout.read / write) on random data, without starting vLLM: both layouts,
shmkv block sizes 16 and 128 inside vLLM's 128, 4- and 2-byte dtypes, loads and saves;
and bad ids raise IndexError and write nothing."""
from __future__ import annotations

import pytest
import torch

from shmkv._vcopy import _force_transpose_isa, copy_blocks
from shmkv.integrations.vllm.layout import LAYOUTS, _c_ok  # imports vLLM (make test-vllm)

VB, H, D = 128, 3, 64


def _case(bs: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(7, H, VB, 2 * D, generator=g).to(dtype)
    kp = torch.randn(40, bs, H, D, generator=g).to(dtype)
    vp = torch.randn(40, bs, H, D, generator=g).to(dtype)
    r = VB // bs
    m = min(2 * r + 1, 30)
    shm = torch.randperm(40, generator=g)[:m]
    pieces = torch.randperm(6 * r, generator=g)[:m] + r         # never vLLM block 0
    return t, kp, vp, shm, pieces // r, pieces % r


@pytest.fixture(params=["portable", "avx2", "avx512"])
def transpose_isa(request):
    """Every K-transpose path this CPU has (one it lacks runs the best it has)."""
    _force_transpose_isa(request.param)
    try:
        yield request.param
    finally:
        _force_transpose_isa(None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("lay", LAYOUTS,
                         ids=lambda lay: "k_transposed" if lay.k_transposed else "k_plain")
def test_c_copy_equals_torch_reference(lay, bs, dtype, transpose_isa):
    t, kp, vp, shm, vblk, sub = _case(bs, getattr(torch, dtype), seed=bs + len(dtype))
    assert _c_ok(t, kp, vp, bs)                 # the C path, not the fallback, is under test
    # load: pools -> vLLM
    want, got = t.clone(), t.clone()
    lay.write(want, bs, vblk, sub, kp.index_select(0, shm), vp.index_select(0, shm))
    lay.copy(got, kp, vp, bs, shm, vblk, sub, to_vllm=True)
    assert torch.equal(got, want)
    assert not torch.equal(got, t)              # the copy did write
    # save: vLLM -> pools
    wk, wv, gk, gv = kp.clone(), vp.clone(), kp.clone(), vp.clone()
    k, v = lay.read(t, bs, vblk, sub)
    wk[shm], wv[shm] = k, v
    lay.copy(t, gk, gv, bs, shm, vblk, sub, to_vllm=False)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)
    assert not torch.equal(gk, kp)


def test_c_copy_non_contiguous_falls_back_to_torch():
    lay = LAYOUTS[0]
    t, kp, vp, shm, vblk, sub = _case(16, torch.float32, seed=3)
    kt = kp.transpose(1, 2).contiguous().transpose(1, 2)        # same values, other strides
    assert not _c_ok(t, kt, vp, 16)
    want, got = t.clone(), t.clone()
    lay.copy(want, kp, vp, 16, shm, vblk, sub, to_vllm=True)
    lay.copy(got, kt, vp, 16, shm, vblk, sub, to_vllm=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("which,bad,msg", [
    ("shm", 40, "shmkv block id 40"), ("shm", -1, "shmkv block id -1"),
    ("vblk", 7, "vLLM block id 7"), ("sub", 8, "sub-block offset 8")])
@pytest.mark.parametrize("to_vllm", [True, False])
def test_c_copy_bad_ids_raise_and_write_nothing(which, bad, msg, to_vllm):
    bs = 16
    t, kp, vp, shm, vblk, sub = _case(bs, torch.float32, seed=5)
    ids = {"shm": shm.clone(), "vblk": vblk.clone(), "sub": sub.clone()}
    ids[which][-1] = bad                        # the last one: earlier pieces are valid
    t0, k0, v0 = t.clone(), kp.clone(), vp.clone()
    with pytest.raises(IndexError, match=msg):
        copy_blocks(t.data_ptr(), t.shape[0], kp.data_ptr(), vp.data_ptr(), kp.shape[0],
                    H, D, VB, bs, 4, ids["shm"].numpy(), ids["vblk"].numpy(),
                    ids["sub"].numpy(), True, to_vllm)
    assert torch.equal(t, t0) and torch.equal(kp, k0) and torch.equal(vp, v0)


def test_c_copy_bad_arguments_raise_value_error():
    t, kp, vp, shm, vblk, sub = _case(16, torch.float32, seed=6)
    args = (t.data_ptr(), 7, kp.data_ptr(), vp.data_ptr(), 40, H, D)
    with pytest.raises(ValueError, match="equal lengths"):
        copy_blocks(*args, VB, 16, 4, shm.numpy(), vblk[:-1].numpy(), sub.numpy(), True, True)
    with pytest.raises(ValueError, match="itemsize must be 1, 2 or 4, got 8"):
        copy_blocks(*args, VB, 16, 8, shm.numpy(), vblk.numpy(), sub.numpy(), True, True)
    with pytest.raises(ValueError, match="bad shapes"):
        copy_blocks(*args, VB, 48, 4, shm.numpy(), vblk.numpy(), sub.numpy(), True, True)

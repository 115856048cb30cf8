"""vLLM's AMX KV layout: what vLLM 0.32 packs for bfloat16 on AMX hosts
(``isa="amx"``), on every machine.

vLLM's ``cpu_attn_reshape_and_cache(..., isa="amx")`` is plain data movement: it runs on
CPUs without AMX (checked here, not assumed), so vLLM's own op is the reference on every
host.  Beside it an independent index model written from ``csrc/cpu/cpu_attn_amx.hpp``
(``_amx_model``: no code shared with layout.py) must agree with the op; the connector's
torch views and its C copy (each forced ISA path) must agree with both; and a connector
worker whose ISA is "amx" saves the K/V that transformers computed (bfloat16 SmolLM2,
written with vLLM's op as an AMX engine would) into the segment bit for bit and loads them
back into vLLM's tensor bit for bit.  Only vLLM's AMX *attention* needs AMX tiles: on a host
with AMX it runs on the loaded tensor and is compared with SDPA; elsewhere that one check
does not run and the test says so (a warning and a line in the output)."""
from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from support import unique_name

from shmkv._vcopy import _force_transpose_isa
from shmkv.integrations.vllm.layout import LAYOUTS, CpuLayout, _c_ok, probe_layout

AMX_HOST = bool(torch.cpu._is_amx_tile_supported())


@functools.lru_cache(maxsize=None)
def vllm_amx_op_missing() -> str:
    """'' where vLLM's CPU extension on this CPU has the AMX layout op, else why not.

    vLLM ships one extension build per ISA and loads the best this CPU runs: the AVX-512
    builds carry the AMX reshape (plain data movement, it runs without AMX tiles), the AVX2
    build does not ("Unsupported CPU attention configuration").  Where it is missing,
    vLLM never picks "amx" either, so no engine here can hold that layout; the tests then
    check the connector's AMX layout against the independent model of vLLM's C++ indexing
    (``_amx_model``) instead of the op, and that the connector refuses the layout it
    cannot verify, and say so."""
    k = torch.zeros(64, 1, 32, dtype=torch.bfloat16)    # a shape the op takes (below)
    try:
        _op_fill(k, k, 64, "amx")
    except RuntimeError as e:
        if "Unsupported CPU attention configuration" not in str(e):
            raise                           # anything else is a failure, not a platform
        return f"vLLM's CPU extension on this CPU has no AMX layout op ({e})"
    return ""


def _note(msg: str) -> None:
    warnings.warn(msg, stacklevel=2)
    print("\n" + msg)


def _op_fill(key, value, vb, isa, nblocks=3, block=1, fp8=False, cache_dtype=None):
    """vLLM's op writes key/value [T, H, D] (T <= vb) into block `block` of a fresh
    [nblocks, H, vb, 2D] tensor."""
    from vllm import _custom_ops as ops

    t_, h, d = key.shape
    t = torch.zeros(nblocks, h, vb, 2 * d, dtype=torch.uint8 if fp8 else cache_dtype or key.dtype)
    kc, vc = t.view(nblocks, h, 2 * vb, d).chunk(2, dim=2)
    slots = torch.arange(t_, dtype=torch.int64) + block * vb
    if fp8:
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, 1.0, 1.0, "fp8")
    else:
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    return t


def _amx_model(k: np.ndarray, v: np.ndarray, vb: int, pack: int) -> np.ndarray:
    """The (block, head) tiles [H, 2 * vb * D] vLLM's AMX reshape writes for one block of
    K/V [vb, H, D], element by element as the C++ loops index them (token groups of 16
    for K with `pack` elements per unit; dim groups of 16 for V with `pack` tokens
    interleaved)."""
    _, h, d = k.shape
    out = np.zeros((h, 2 * vb * d), dtype=k.dtype)
    tok, dim = np.meshgrid(np.arange(vb), np.arange(d), indexing="ij")
    # key: unit j = dim // pack of token t lands at group*(16*d/pack) + j*16 + t%16 units
    kidx = (((tok // 16) * (16 * d // pack) + (dim // pack) * 16 + tok % 16) * pack
            + dim % pack)
    # value: group i = dim // 16; pair s = t // pack; element (i*vb*16) + s*16*pack +
    # (dim%16)*pack + t%pack
    vidx = vb * d + (dim // 16) * vb * 16 + (tok // pack) * 16 * pack + (dim % 16) * pack \
        + tok % pack
    for hh in range(h):
        out[hh, kidx.ravel()] = k[:, hh, :].ravel()
        out[hh, vidx.ravel()] = v[:, hh, :].ravel()
    return out


@pytest.mark.parametrize("dtype,pack", [("bfloat16", 2), ("float16", 2), ("float32", 1),
                                        ("fp8", 2)])
@pytest.mark.parametrize("h,d,vb", [(3, 64, 128), (2, 128, 32), (1, 32, 64)])
def test_vllm_amx_op_runs_here_and_matches_the_model(dtype, pack, h, d, vb):
    fp8 = dtype == "fp8"
    g = torch.Generator().manual_seed(vb + d)
    if fp8:     # e4m3 codes of normal numbers: vLLM's quantizer gives them back exactly
        codes = [(torch.randint(8, 120, (vb, h, d), generator=g, dtype=torch.uint8)
                  | (torch.randint(0, 2, (vb, h, d), generator=g, dtype=torch.uint8) << 7))
                 for _ in range(2)]
        key, value = (c.view(torch.float8_e4m3fn).to(torch.bfloat16) for c in codes)
        want_k, want_v = (c.numpy() for c in codes)
    else:
        key = torch.randn(vb, h, d, generator=g).to(getattr(torch, dtype))
        value = torch.randn(vb, h, d, generator=g).to(getattr(torch, dtype))
        want_k, want_v = (x.view(torch.int16 if x.element_size() == 2 else torch.int32).numpy()
                          for x in (key, value))
    model = _amx_model(want_k, want_v, vb, pack)
    missing = vllm_amx_op_missing()
    if missing:
        # the connector's own writer of the layout against the independent model; and the
        # connector's probe refuses "amx" (it stores nothing it could not verify)
        t = torch.zeros(3, h, vb, 2 * d, dtype=torch.uint8 if fp8 else key.dtype)
        src = [torch.from_numpy(w) for w in (want_k, want_v)]
        if not fp8:
            src = [x.view(key.dtype) for x in src]
        CpuLayout(False, amx_pack=pack).write(t, vb, torch.tensor([1]), torch.tensor([0]),
                                              *(x.reshape(1, vb, h, d) for x in src))
        got = t[1].reshape(h, -1)
        got = got.numpy() if fp8 else got.view(torch.int16 if t.element_size() == 2
                                               else torch.int32).numpy()
        np.testing.assert_array_equal(got, model)
        assert probe_layout("amx", key.dtype, h, d, vb, 16, "fp8" if fp8 else "auto") is None
        _note(f"{missing}: the connector's AMX layout was checked against the model of "
              "vLLM's indexing, not against the op")
        return
    t = _op_fill(key, value, vb, "amx", fp8=fp8)      # runs without AMX: data movement
    got = t[1].reshape(h, -1)
    got = got.numpy() if fp8 else got.view(torch.int16 if t.element_size() == 2
                                           else torch.int32).numpy()
    np.testing.assert_array_equal(got, model)
    assert not t[0].any() and not t[2].any()
    # the connector's probe finds exactly this packing
    lay = probe_layout("amx", key.dtype, h, d, vb, 16, "fp8" if fp8 else "auto")
    assert lay == CpuLayout(False, amx_pack=pack), lay


def _case(lay, bs, dtype, seed, vb=128, h=3, d=64):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        t = torch.randint(0, 256, (7, h, vb, 2 * d), generator=g, dtype=torch.uint8)
        kp = torch.randint(0, 256, (40, bs, h, d), generator=g, dtype=torch.uint8)
        vp = torch.randint(0, 256, (40, bs, h, d), generator=g, dtype=torch.uint8)
    else:
        t = torch.randn(7, h, vb, 2 * d, generator=g).to(dtype)
        kp = torch.randn(40, bs, h, d, generator=g).to(dtype)
        vp = torch.randn(40, bs, h, d, generator=g).to(dtype)
    r = vb // bs
    m = min(2 * r + 1, 30)
    shm = torch.randperm(40, generator=g)[:m]
    pieces = torch.randperm(6 * r, generator=g)[:m] + r
    return t, kp, vp, shm, pieces // r, pieces % r


AMX_LAYOUTS = [lay for lay in LAYOUTS if lay.amx_pack]


@pytest.fixture(params=["portable", "avx2", "avx512"])
def transpose_isa(request):
    """Every copy path this CPU has (one it lacks runs the best it has)."""
    _force_transpose_isa(request.param)
    try:
        yield request.param
    finally:
        _force_transpose_isa(None)


@pytest.mark.parametrize("dtype,pack", [(torch.bfloat16, 2), (torch.float16, 2),
                                        (torch.float32, 1), (torch.uint8, 2)])
@pytest.mark.parametrize("bs", [16, 32, 128])
def test_amx_c_copy_equals_torch_reference_and_vllm_op(dtype, pack, bs, transpose_isa):
    lay = CpuLayout(False, amx_pack=pack)
    assert lay in AMX_LAYOUTS
    t, kp, vp, shm, vblk, sub = _case(lay, bs, dtype, seed=bs + pack + dtype.itemsize)
    assert _c_ok(t, kp, vp, bs) and lay.fits(64, 128, bs)
    # load: pools -> vLLM, C against the torch reference
    want, got = t.clone(), t.clone()
    lay.write(want, bs, vblk, sub, kp.index_select(0, shm), vp.index_select(0, shm))
    lay.copy(got, kp, vp, bs, shm, vblk, sub, to_vllm=True)
    assert torch.equal(got, want)
    assert not torch.equal(got, t)
    # save: vLLM -> pools
    wk, wv, gk, gv = kp.clone(), vp.clone(), kp.clone(), vp.clone()
    k, v = lay.read(t, bs, vblk, sub)
    wk[shm], wv[shm] = k, v
    lay.copy(t, gk, gv, bs, shm, vblk, sub, to_vllm=False)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)
    assert not torch.equal(gk, kp)
    # and both against vLLM's own op: a load of shmkv blocks holding K/V equals what the
    # op writes for the same tokens (where this CPU's vLLM has the op: the writer itself
    # is checked against the model of the op's indexing in the test above)
    if vllm_amx_op_missing():
        _note(vllm_amx_op_missing() + ": C copy checked against the torch reference only")
    elif dtype != torch.uint8:
        vb, h, d = 128, 3, 64
        r = vb // bs
        key = kp[shm[:r]].reshape(vb, h, d)
        value = vp[shm[:r]].reshape(vb, h, d)
        ref = _op_fill(key, value, vb, "amx", nblocks=7, block=4)
        mine = torch.zeros_like(ref)
        lay.copy(mine, kp, vp, bs, shm[:r], torch.full((r,), 4), torch.arange(r),
                 to_vllm=True)
        assert torch.equal(mine, ref)


def test_amx_layout_refuses_what_it_cannot_cut():
    lay = CpuLayout(False, amx_pack=2)
    assert not lay.fits(64, 128, 8)            # token groups of 16
    assert not lay.fits(40, 128, 16)           # dim groups of 16
    from shmkv._vcopy import copy_blocks
    z = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="AMX layout needs block_size and head_dim "
                       "multiples of 16.*got block_size 8"):
        copy_blocks(1, 1, 1, 1, 1, 1, 64, 128, 8, 2, z, z, z, False, True, 2)


def _smollm2_bf16_kv(n_tokens: int):
    """transformers' own K/V of SmolLM2 in bfloat16 (DynamicCache): [L] of [n, H, D]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shmkv.models import smollm2_dir

    path = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(path)
    text = open("/usr/share/common-licenses/GPL-3").read()[:3000]
    ids = tok.encode(text)[:n_tokens]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    pkv = out.past_key_values
    ks = [pkv.layers[i].keys[0].permute(1, 0, 2).contiguous() for i in range(len(pkv.layers))]
    vs = [pkv.layers[i].values[0].permute(1, 0, 2).contiguous() for i in range(len(pkv.layers))]
    return path, ids, ks, vs


def test_connector_worker_on_amx_saves_transformers_kv_and_loads_it_back(monkeypatch):
    """A connector worker whose vLLM picked "amx" (forced here: the layout is what
    matters, and vLLM's op writes it on any CPU) saves the KV an AMX engine would hold
    for SmolLM2 bf16 (transformers' DynamicCache, put in place by vLLM's op) and a second
    worker loads it into an empty tensor: segment == transformers, loaded == op's bytes."""
    import vllm.v1.attention.backends.cpu_attn as cpu_attn
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    import shmkv
    from shmkv.integrations.vllm import ShmkvConnector, request_salt
    from shmkv.integrations.vllm.connector import LoadOp, SaveOp, ShmkvConnectorMetadata

    vb, n = 128, 256
    if vllm_amx_op_missing():
        _connector_refuses_an_unverifiable_amx_layout(monkeypatch)
        return
    path, ids, ks, vs = _smollm2_bf16_kv(n)
    assert len(ids) == n
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: "amx")
    seg = unique_name("vllm-amx")
    cfg = EngineArgs(model=path, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
                     block_size=vb, kv_transfer_config=KVTransferConfig(
                         kv_connector="ShmkvConnector",
                         kv_connector_module_path="shmkv.integrations.vllm",
                         kv_role="kv_both", kv_load_failure_policy="recompute",
                         kv_connector_extra_config={"segment": seg, "num_blocks": 64})
                     ).create_engine_config()
    L = len(ks)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    # vLLM blocks 3 and 5 hold the prompt, as vLLM's op writes them on an AMX host
    blocks = [3, 5]
    slots = torch.cat([torch.arange(vb) + b * vb for b in blocks])
    tensors = {}
    from vllm import _custom_ops as ops
    for name, k, v in zip(names, ks, vs):
        t = torch.zeros(8, k.shape[1], vb, 2 * k.shape[2], dtype=torch.bfloat16)
        kc, vc = t.view(8, k.shape[1], 2 * vb, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "amx")
        tensors[name] = t
    salt = request_salt(path)
    tokens = np.asarray(ids, dtype=np.int32)
    try:
        w = ShmkvConnector(cfg, KVConnectorRole.WORKER, None)
        w.register_kv_caches(tensors)
        lay = w.connector_worker._layout
        assert lay == CpuLayout(False, amx_pack=2), lay
        w.bind_connector_metadata(ShmkvConnectorMetadata(saves=[SaveOp("r", tokens, salt,
                                                                       blocks)]))
        w.wait_for_save()
        w.clear_connector_metadata()
        assert w.connector_worker.stats["saved_tokens"] == n, w.connector_worker.stats
        kv = shmkv.KVCache.attach(seg)
        sid = kv.create_sequence(tokens=np.append(tokens, 0), salt=salt)
        assert kv.seq_len(sid) == n
        gk, gv = kv.gather(sid)
        kv.free(sid)
        for i in range(L):        # bf16 in, bf16 out: bit for bit transformers' cache
            assert np.array_equal(gk[i].view(np.uint16), ks[i].view(torch.uint16).numpy()), i
            assert np.array_equal(gv[i].view(np.uint16), vs[i].view(torch.uint16).numpy()), i
        # a second worker loads the prompt into an empty tensor: the op's bytes exactly
        w2 = ShmkvConnector(cfg, KVConnectorRole.WORKER, None)
        empty = {nm: torch.zeros_like(t) for nm, t in tensors.items()}
        w2.register_kv_caches(empty)
        dst = [6, 1]
        w2.bind_connector_metadata(ShmkvConnectorMetadata(loads=[LoadOp(
            "r2", np.append(tokens, 0), salt, 0, n, dst)]))
        w2.start_load_kv(None)
        w2.clear_connector_metadata()
        assert w2.connector_worker.stats["loaded_tokens"] == n, w2.connector_worker.stats
        for nm in names:
            assert torch.equal(empty[nm][dst], tensors[nm][blocks]), nm
        _amx_attention_check(empty[names[0]], dst, ks[0], vs[0], n)
        w.shutdown()
        w2.shutdown()
        assert kv.check() == []
        kv.close()
    finally:
        try:
            shmkv.KVCache.attach(seg).unlink()
        except FileNotFoundError:
            pass


def _connector_refuses_an_unverifiable_amx_layout(monkeypatch):
    """Where vLLM's extension has no AMX op, a connector told that vLLM's ISA is "amx"
    cannot verify the layout by its self-test: saving and loading turn off (nothing stored,
    no wrong bytes), the engine would serve without the shared cache."""
    import vllm.v1.attention.backends.cpu_attn as cpu_attn
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    import shmkv
    from shmkv.integrations.vllm import ShmkvConnector, request_salt
    from shmkv.integrations.vllm.connector import SaveOp, ShmkvConnectorMetadata
    from shmkv.models import smollm2_dir

    path = str(smollm2_dir())
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: "amx")
    seg = unique_name("vllm-amx")
    cfg = EngineArgs(model=path, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
                     block_size=128, kv_transfer_config=KVTransferConfig(
                         kv_connector="ShmkvConnector",
                         kv_connector_module_path="shmkv.integrations.vllm",
                         kv_role="kv_both", kv_load_failure_policy="recompute",
                         kv_connector_extra_config={"segment": seg, "num_blocks": 64})
                     ).create_engine_config()
    try:
        w = ShmkvConnector(cfg, KVConnectorRole.WORKER, None)
        c = w.connector_worker._kv.config
        names = [f"model.layers.{i}.self_attn.attn" for i in range(c.num_layers)]
        w.register_kv_caches({n: torch.ones(8, c.num_kv_heads, 128, 2 * c.head_dim,
                                            dtype=torch.bfloat16) for n in names})
        ww = w.connector_worker
        assert ww._layout is None and not ww._save_on and not ww._load_on
        tokens = np.arange(1, 129, dtype=np.int32)
        w.bind_connector_metadata(ShmkvConnectorMetadata(saves=[SaveOp(
            "r", tokens, request_salt(path), [3])]))
        w.wait_for_save()
        w.clear_connector_metadata()
        assert w.connector_worker.stats["saved_tokens"] == 0
        assert w.connector_worker._kv.match_prefix(np.append(tokens, 0), request_salt(path)) == 0
        w.shutdown()
    finally:
        try:
            shmkv.KVCache.attach(seg).unlink()
        except FileNotFoundError:
            pass
    _note(vllm_amx_op_missing() + ": the AMX save and load round trip needs it; checked "
          "that the connector turns itself off instead")


def _amx_attention_check(t, blocks, k, v, n):
    """On an AMX host: vLLM's AMX attention over the loaded tensor equals SDPA over
    transformers' K/V.  Elsewhere the tiles are not there: say so."""
    if not AMX_HOST:
        msg = ("vLLM's AMX attention kernel not run: this CPU has no AMX tiles (the AMX "
               "layout, vLLM's AMX reshape op and the connector's copies were checked)")
        warnings.warn(msg, stacklevel=2)
        print("\n" + msg)
        return
    from vllm import _custom_ops as ops

    h, d = k.shape[1], k.shape[2]
    qh = 3 * h
    q = torch.randn(1, qh, d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    vb = t.shape[2]
    kc, vc = t.view(t.shape[0], h, 2 * vb, d).chunk(2, dim=2)
    out = torch.empty(1, qh, d, dtype=torch.bfloat16)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=qh, num_kv_heads=h, head_dim=d,
        seq_lens=torch.tensor([n], dtype=torch.int32), dtype=torch.bfloat16,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), causal=True,
        sliding_window_size=-1, isa="amx", enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=out,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), scale=d ** -0.5, causal=True,
        alibi_slopes=None, sliding_window=-1,
        block_table=torch.tensor([blocks], dtype=torch.int32), softcap=0.0,
        scheduler_metadata=meta, s_aux=None)
    kk = k.float().permute(1, 0, 2).repeat_interleave(3, 0)
    vv = v.float().permute(1, 0, 2).repeat_interleave(3, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().permute(1, 0, 2)[:, None], kk[:, None], vv[:, None])[:, 0].permute(1, 0, 2)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    print("\nvLLM's AMX attention ran on the loaded tensor and matched SDPA")

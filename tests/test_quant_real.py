"""Quantized pools on real text with the real model: int8 keeps the float32
model's top-1 predictions, and calibrate_kv_scales sets a float8 pool's per-(layer, kv head)
scales from the model's own K/V (checked against an independent computation) and keeps
float8 as close as benchmarks/RESULTS_quant.md documents.

512 tokens of Debian's GPL-3 text, teacher-forced in 128-token chunks through ShmkvCache
under attn_implementation="shmkv", against transformers' DynamicCache in float32.
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support import unique_name  # noqa: E402

import shmkv  # noqa: E402
from shmkv.integrations.transformers import ShmkvCache, calibrate_kv_scales, config_for  # noqa: E402

TEXT = "/usr/share/common-licenses/GPL-3"
CALIB = "/usr/share/common-licenses/Apache-2.0"
N, CHUNK = 512, 128


@pytest.fixture(scope="module")
def smol():
    from shmkv.models import ModelUnavailable, load_smollm2

    try:
        tok, model = load_smollm2(attn="shmkv")
    except ModelUnavailable as e:
        if os.environ.get("CI"):
            raise                         # under CI a missing model is a failure
        pytest.skip(f"the real model is unavailable: {e}")
    torch.set_num_threads(1)

    def ids(path, n):
        with open(path) as f:
            return tok(f.read(), return_tensors="pt").input_ids[:, :n]
    text, calib = ids(TEXT, N), ids(CALIB, 256)
    assert text.shape[1] == N and calib.shape[1] == 256
    return model, text, calib


def _logits(model, ids, past, attn):
    model.set_attn_implementation(attn)
    with torch.inference_mode():
        out = [model(input_ids=ids[:, s:s + CHUNK], past_key_values=past,
                     use_cache=True).logits[0].double() for s in range(0, ids.shape[1], CHUNK)]
    return torch.cat(out)[:-1]


def _nll(logits, ids):
    return float(-torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).mean())


@pytest.fixture(scope="module")
def baseline(smol):
    from transformers import DynamicCache

    model, text, _ = smol
    lg = _logits(model, text, DynamicCache(), "sdpa")
    return lg.argmax(-1), _nll(lg, text)


def _pool(model, dtype):
    kv = shmkv.KVCache.create(unique_name("qreal"), config_for(
        model.config, num_blocks=N // 16 + 8, block_size=16, max_seqs=2, dtype=dtype))
    return kv


def _score(model, kv, text, base):
    with ShmkvCache(kv) as past:
        lg = _logits(model, text, past, "shmkv")
    top1 = float((lg.argmax(-1) == base[0]).double().mean())
    return top1, np.exp(_nll(lg, text) - base[1]) - 1


def test_int8_keeps_top1_on_real_text(smol, baseline):
    model, text, _ = smol
    kv = _pool(model, "int8")
    try:
        top1, dppl = _score(model, kv, text, baseline)
    finally:
        kv.close()
        kv.unlink()
    # RESULTS_quant.md: 98.2% top-1, +0.06% perplexity (2,048 tokens); here 98.8%, +0.25%
    assert top1 >= 0.95, top1
    assert abs(dppl) <= 0.02, dppl


def test_calibrate_kv_scales_sets_per_head_amax(smol):
    from transformers import DynamicCache

    model, _, calib = smol
    kv = _pool(model, "float8_e4m3")
    try:
        ks, vs = calibrate_kv_scales(model, kv, calib, rule="amax")
        L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
        assert ks.shape == vs.shape == (L, H) and ks.dtype == np.float32
        # independently: the model's K (after RoPE) and V on the same tokens, one forward
        dc = DynamicCache()
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            model(input_ids=calib, past_key_values=dc, use_cache=True)
        for layer in range(L):
            k, v = dc.layers[layer].keys[0], dc.layers[layer].values[0]   # [H, n, d]
            want_k = k.abs().amax(dim=(1, 2)).numpy() / 448
            want_v = v.abs().amax(dim=(1, 2)).numpy() / 448
            got_k, got_v = kv.kv_scales(layer)
            np.testing.assert_allclose(got_k, want_k, rtol=1e-4)
            np.testing.assert_allclose(got_v, want_v, rtol=1e-4)
            np.testing.assert_array_equal(got_k, ks[layer])
            np.testing.assert_array_equal(got_v, vs[layer])
        assert len(np.unique(ks)) > L              # per head, not one number per layer
        # "one" sets them back
        calibrate_kv_scales(model, kv, calib[:, :16], rule="one")
        assert all((np.asarray(kv.kv_scales(x)) == 1.0).all() for x in range(L))
    finally:
        kv.close()
        kv.unlink()


def test_calibrate_kv_scales_errors_change_nothing(smol):
    model, _, calib = smol
    kv = _pool(model, "float8_e4m3")
    k8 = _pool(model, "int8")
    try:
        with pytest.raises(TypeError, match="float8_e4m3"):
            calibrate_kv_scales(model, k8, calib[:, :8])
        for bad in (dict(rule="max"), dict(margin=0.0), dict(margin=float("nan")),
                    dict(chunk=0)):
            with pytest.raises(ValueError):
                calibrate_kv_scales(model, kv, calib[:, :8], **bad)
        with pytest.raises(ValueError, match="input_ids"):
            calibrate_kv_scales(model, kv, torch.zeros(1, 0, dtype=torch.long))
        with pytest.raises(ValueError, match="input_ids"):
            calibrate_kv_scales(model, kv, torch.zeros(1, 4))
        for layer in range(model.config.num_hidden_layers):
            assert all((np.asarray(s) == 1.0).all() for s in kv.kv_scales(layer))
    finally:
        for c in (kv, k8):
            c.close()
            c.unlink()


def test_float8_with_calibrated_scales_on_real_text(smol, baseline):
    model, text, calib = smol
    kv = _pool(model, "float8_e4m3")
    try:
        ks, vs = calibrate_kv_scales(model, kv, calib)          # the default rule
        assert (ks != 1.0).all() and (vs != 1.0).all()
        top1, dppl = _score(model, kv, text, baseline)
    finally:
        kv.close()
        kv.unlink()
    # RESULTS_quant.md, 2,048 tokens, amax/448: top-1 93.0%, perplexity +2.0%; on these 512
    # tokens 93.7% and +1.5%.  Scales only move values along e4m3's grid: random ones
    # between amax/448 and 2 amax/448 gave -1.5% to +3.1% here, so the bound on perplexity
    # leaves room for another ISA's rounding; top-1 moves far less.
    assert top1 >= 0.91, top1
    assert dppl <= 0.035, dppl

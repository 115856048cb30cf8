"""The connector's access keys (trusted_owners, segment_mode, segment_group) at the level of
segment.py's functions: no engine is started.  Another user's segment is made by chown,
so the refusal cases need root (CI runs as root)."""
from __future__ import annotations

import dataclasses
import os
import stat

import pytest

import shmkv

NOBODY = 65534
SMALL = dict(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=64, block_size=4,
             max_seqs=32)


@pytest.fixture
def spec_for():
    from shmkv.integrations.vllm.segment import SegmentSpec, access_keys

    made = []

    def make(**extra):
        name = f"shmkv-test-vtrust-{os.getpid()}-{len(made)}"
        made.append(name)
        trusted, mode, gid = access_keys(extra)
        return SegmentSpec(name=name, config=shmkv.CacheConfig(**SMALL), vllm_block_size=16,
                           trusted_owners=trusted, mode=mode, group=gid)

    try:
        yield make
    finally:
        for n in made:
            for p in (f"/dev/shm/{n}", f"/dev/shm/{n}.pending"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass


def test_access_keys_parse_and_name_bad_values():
    from shmkv.integrations.vllm.segment import access_keys

    assert access_keys({}) == (frozenset(), 0o600, None)
    assert access_keys({"trusted_owners": "root,65534", "segment_mode": "0o660",
                        "segment_group": "0"}) == (frozenset({0, NOBODY}), 0o660, 0)
    assert access_keys({"trusted_owners": [NOBODY], "segment_mode": 0o640})[:2] == (
        frozenset({NOBODY}), 0o640)
    with pytest.raises(ValueError, match="no user named 'no-such-user-x'"):
        access_keys({"trusted_owners": ["no-such-user-x"]})
    with pytest.raises(ValueError, match="segment_mode"):
        access_keys({"segment_mode": "rw-rw----"})
    with pytest.raises(ValueError, match="segment_mode"):
        access_keys({"segment_mode": 0o1777})
    with pytest.raises(ValueError, match="segment_group: no group named"):
        access_keys({"segment_group": "no-such-group-x"})


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")
def test_open_segment_refuses_another_users_segment_unless_trusted(spec_for):
    from shmkv.integrations.vllm.segment import open_segment

    spec = spec_for(segment_mode="0o660", segment_group=NOBODY)
    with open_segment(spec):                         # created: the spec's mode and group
        st = os.stat(f"/dev/shm/{spec.name}")
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, NOBODY)
    os.chown(f"/dev/shm/{spec.name}", NOBODY, -1)
    with pytest.raises(shmkv.UntrustedSegmentError, match=r"nobody \(uid 65534\).*0o660"):
        open_segment(spec)
    trusting = dataclasses.replace(spec, trusted_owners=frozenset({NOBODY}))
    with open_segment(trusting) as kv:
        assert kv.config == spec.config


def test_off_reason_names_the_segment_and_the_fix_for_each_cause(spec_for):
    import errno

    from shmkv.integrations.vllm.segment import off_reason

    spec = spec_for()
    n = spec.name
    cases = [
        (shmkv.UntrustedSegmentError("owned by nobody"), f"shmkv rm {n}"),
        (shmkv.SegmentError("layout differs"), "another segment name"),
        (OSError(errno.ENOSPC, "No space left on device"), "--shm-size"),
        (PermissionError(errno.EACCES, "Permission denied"), "segment_mode 0o660"),
        (RuntimeError("something else"), f"shmkv check {n} tells"),
    ]
    for e, fix in cases:
        text = off_reason(spec, e)
        assert text.startswith(f"segment {n!r}: {type(e).__name__}: "), text
        assert fix in text, (fix, text)
        assert "NAME" not in text, text


@pytest.mark.parametrize("key,value", [
    ("pending_wait", -1), ("pending_wait", 601), ("pending_stall", -0.5),
    ("pending_stall", 601), ("pending_ttl", 0), ("pending_ttl", 3601),
    ("pending_lock_timeout", -0.1), ("pending_lock_timeout", 1.5)])
def test_pending_keys_out_of_range_are_refused_at_engine_start(key, value):
    """A pending-marks key out of its range is a mistake in the configuration: refused at
    start like vLLM's own flags, the message naming the ranges and the values got; nothing
    is made in /dev/shm."""
    pytest.importorskip("vllm")
    from configs_helpers import engine_config, model_dir
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from shmkv.integrations.vllm import ShmkvConnector

    seg = f"shmkv-test-vtrust-pending-{os.getpid()}"
    cfg = engine_config(model_dir(), seg, dtype="float32")
    cfg.kv_transfer_config.kv_connector_extra_config[key] = value
    with pytest.raises(ValueError, match=r"pending_wait and pending_stall must be in "
                       r"\[0, 600\], pending_ttl in \(0, 3600\] and pending_lock_timeout "
                       rf"in \[0, 1\] seconds, got .*{value}"):
        ShmkvConnector(cfg, KVConnectorRole.SCHEDULER, None)
    assert not os.path.exists(f"/dev/shm/{seg}")
    assert not os.path.exists(f"/dev/shm/{seg}.pending")


@pytest.mark.parametrize("value", [0, -0.1, 10.5, float("nan")])
def test_a_lock_timeout_out_of_range_is_refused_at_engine_start(value):
    """``lock_timeout`` (a step's bound on the segment's pool lock) in (0, 10] seconds:
    anything else is a mistake in the configuration, refused at start naming the value."""
    pytest.importorskip("vllm")
    from configs_helpers import engine_config, model_dir
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from shmkv.integrations.vllm import ShmkvConnector

    seg = f"shmkv-test-vtrust-lock-{os.getpid()}"
    cfg = engine_config(model_dir(), seg, dtype="float32")
    cfg.kv_transfer_config.kv_connector_extra_config["lock_timeout"] = value
    with pytest.raises(ValueError, match=rf"lock_timeout must be in \(0, 10\] seconds, "
                                         rf"got {value}"):
        ShmkvConnector(cfg, KVConnectorRole.SCHEDULER, None)
    assert not os.path.exists(f"/dev/shm/{seg}")

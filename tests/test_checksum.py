"""The remote tier's value checksum (kernels/checksum.h, shmkv._checksum) gives the digests
it always gave: every value in the tier carries one, and a value an older build wrote
must still verify.  The expected digests below were computed by the checksum as it was
before it moved out of shmkv._prefix; they must never change."""
import hashlib

import pytest

from shmkv._checksum import tier_checksum

SEED = 0x0123456789ABCDEF
# (input, digest with seed 0, digest with SEED): lengths around the 32-byte lanes and tails
CASES = [
    (b"", 0x9090306C6E91ED59, 0x8E4B63091ED84BCD),
    (b"\x00", 0x4686204C93007F24, 0x03D83C9021C203A2),
    (b"abc", 0x500112EEDAE253A9, 0xB8BF95B06D970778),
    (bytes(range(31)), 0x8C03E7AD11F1B228, 0x9D0E4D10AE02A0A7),
    (bytes(range(32)), 0x69588587CA7E6DDD, 0xDE90B6053C5198FA),
    (bytes(range(256)) * 3 + b"xyz", 0xAD1C3AA4B834FD0E, 0x063C362C45EBBCF8),
    (hashlib.sha256(b"shmkv").digest() * 100, 0x1A021999F6CE791D, 0x17F4F19AE30A38D9),
]


@pytest.mark.parametrize("data,plain,seeded", CASES)
def test_digests_never_change(data, plain, seeded):
    assert tier_checksum(data) == plain
    assert tier_checksum(data, seed=SEED) == seeded
    assert tier_checksum(bytearray(data), SEED) == seeded      # any contiguous buffer


def test_large_buffer_without_the_gil_gives_the_same_digest():
    data = hashlib.sha256(b"big").digest() * 4096                # 128 KiB: the nogil path
    assert tier_checksum(data) == tier_checksum(memoryview(data))
    assert tier_checksum(data) != tier_checksum(data[:-1])


def test_the_tier_does_not_import_the_prefix_cache_for_it():
    from shmkv.tier import codec

    assert codec.tier_checksum is tier_checksum

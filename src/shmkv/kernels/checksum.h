/*
 * kernels/checksum.h -- the remote tier's value checksum: four xxh64-style lanes over
 * 8-byte words (one multiply and one rotate per word, independent chains: memory speed,
 * ~10 GB/s), the tail bytes, a final avalanche.  Not a hash for adversaries: it catches
 * flipped bits and truncations; a value's fingerprint and block hash catch foreign ones.
 * Owns no data; reads the caller's buffer.
 *
 * The digests are stored with every value in the tier (Redis): a value an older build
 * wrote must still verify, so the function's results never change (tests/test_checksum.py
 * holds fixed inputs and their digests).  Its Python face is shmkv._checksum.tier_checksum.
 */
#ifndef SHMKV_KERNELS_CHECKSUM_H
#define SHMKV_KERNELS_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t shmkv_ck_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t shmkv_tier_checksum(const uint8_t *p, size_t n, uint64_t seed) {
    const uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL,
                   P3 = 0x165667B19E3779F9ULL;
    uint64_t a0 = seed + P1 + P2, a1 = seed + P2, a2 = seed, a3 = seed - P1;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, p + i, 32);
        a0 = shmkv_ck_rotl(a0 + w[0] * P2, 31) * P1;
        a1 = shmkv_ck_rotl(a1 + w[1] * P2, 31) * P1;
        a2 = shmkv_ck_rotl(a2 + w[2] * P2, 31) * P1;
        a3 = shmkv_ck_rotl(a3 + w[3] * P2, 31) * P1;
    }
    uint64_t h = shmkv_ck_rotl(a0, 1) + shmkv_ck_rotl(a1, 7) + shmkv_ck_rotl(a2, 12)
               + shmkv_ck_rotl(a3, 18) + (uint64_t)n;
    for (; i < n; i++)
        h = shmkv_ck_rotl(h ^ ((uint64_t)p[i] * P3), 11) * P1;
    h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
    return h;
}

#endif /* SHMKV_KERNELS_CHECKSUM_H */

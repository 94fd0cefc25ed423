/* SHA-256 (FIPS 180-4), one-shot (sha256.c): the digest every hash profile's chain is
 * made of (profile.c). */
#ifndef CONDUCTOR_NATIVE_SHA256_H
#define CONDUCTOR_NATIVE_SHA256_H

#include <stddef.h>
#include <stdint.h>

/* ``out`` = SHA-256 of ``len`` bytes at ``data``; with the CPU's SHA instructions when it
 * has them, unless ``portable``. */
void sha256_digest(const uint8_t *data, size_t len, uint8_t out[32], int portable);

#endif

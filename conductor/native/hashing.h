/* The prefix hash of a block, XXH64(u64le(parent) || u32le(token)...), and the
 * little-endian writers its input is built with (hashing.c; the ingest lane chains too). */
#ifndef CONDUCTOR_NATIVE_HASHING_H
#define CONDUCTOR_NATIVE_HASHING_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline void put_le32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static inline void put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

uint64_t xxh64(const uint8_t *p, size_t len, uint64_t seed);

/* The prefix hash of a block whose tokens' int32 little-endian bytes are ``step`` bytes at
 * ``tokens``, chained from ``parent``; ``buffer`` holds 8 + ``step`` bytes. */
static inline uint64_t block_hash(uint64_t parent, const uint8_t *tokens, size_t step,
                                  uint8_t *buffer) {
    put_le64(buffer, parent);
    memcpy(buffer + 8, tokens, step);
    return xxh64(buffer, 8 + step, 0);
}

#endif

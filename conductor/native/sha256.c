/* SHA-256 (FIPS 180-4) for the hash profiles' chains (profile.c).
 *
 * Why here: a profiled context's query hashes each block of the prompt with SHA-256, and
 * through hashlib (an object, a call and a digest's bytes per block) a 4,096-token prompt
 * cost ~1.2 ms of the event loop. The compression function is written twice: the
 * reference one, and one with the x86 SHA extensions (SHA-NI, in most x86 CPUs since
 * 2017), chosen once from CPUID. tests/conductor/test_profile_chain.py holds both to
 * hashlib's digests.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "sha256.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_SHA_NI_CODE 1
#endif

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

static const uint32_t INITIAL[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

typedef void (*Compress)(uint32_t state[8], const uint8_t *blocks, size_t count);

static inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t load_be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* The reference compression of ``count`` 64-byte blocks. */
static void compress_portable(uint32_t state[8], const uint8_t *blocks, size_t count) {
    for (; count > 0; count--, blocks += 64) {
        uint32_t w[64];
        for (int t = 0; t < 16; t++) w[t] = load_be32(blocks + 4 * t);
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g))
                          + K[t] + w[t];
            uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state[0] += a;
        state[1] += b;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
    }
}

#ifdef HAVE_SHA_NI_CODE
/* The same with the SHA extensions: 16 groups of four rounds, the message schedule in four
 * registers that take turns (Intel's "SHA extensions" paper, section 5). */
__attribute__((target("sha,sse4.1"))) static void compress_sha_ni(uint32_t state[8],
                                                                   const uint8_t *blocks,
                                                                   size_t count) {
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&state[0]), 0xB1);
    __m128i state1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&state[4]), 0x1B);
    __m128i state0 = _mm_alignr_epi8(tmp, state1, 8);  /* ABEF */
    state1 = _mm_blend_epi16(state1, tmp, 0xF0);  /* CDGH */
    for (; count > 0; count--, blocks += 64) {
        __m128i abef = state0, cdgh = state1, w[4], msg;
#pragma GCC unroll 16
        for (int g = 0; g < 16; g++) {
            if (g < 4) w[g] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blocks + 16 * g)), swap);
            msg = _mm_add_epi32(w[g & 3], _mm_loadu_si128((const __m128i *)&K[4 * g]));
            state1 = _mm_sha256rnds2_epu32(state1, state0, msg);
            if (g >= 3 && g <= 14) {  /* the next group's words */
                __m128i next = _mm_add_epi32(w[(g + 1) & 3], _mm_alignr_epi8(w[g & 3], w[(g + 3) & 3], 4));
                w[(g + 1) & 3] = _mm_sha256msg2_epu32(next, w[g & 3]);
            }
            state0 = _mm_sha256rnds2_epu32(state0, state1, _mm_shuffle_epi32(msg, 0x0E));
            if (g >= 1 && g <= 12) w[(g + 3) & 3] = _mm_sha256msg1_epu32(w[(g + 3) & 3], w[g & 3]);
        }
        state0 = _mm_add_epi32(state0, abef);
        state1 = _mm_add_epi32(state1, cdgh);
    }
    tmp = _mm_shuffle_epi32(state0, 0x1B);  /* FEBA */
    state1 = _mm_shuffle_epi32(state1, 0xB1);  /* DCHG */
    _mm_storeu_si128((__m128i *)&state[0], _mm_blend_epi16(tmp, state1, 0xF0));  /* DCBA */
    _mm_storeu_si128((__m128i *)&state[4], _mm_alignr_epi8(state1, tmp, 8));  /* HGFE */
}

static int cpu_has_sha_ni(void) {
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    int sha = (ebx >> 29) & 1;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
    return sha && (ecx >> 19 & 1) && (ecx >> 9 & 1);  /* and SSE4.1, SSSE3 */
}
#endif

static Compress accelerated(void) {
    static Compress chosen = NULL;
    if (chosen == NULL) {
#ifdef HAVE_SHA_NI_CODE
        chosen = cpu_has_sha_ni() ? compress_sha_ni : compress_portable;
#else
        chosen = compress_portable;
#endif
    }
    return chosen;
}

void sha256_digest(const uint8_t *data, size_t len, uint8_t out[32], int portable) {
    Compress compress = portable ? compress_portable : accelerated();
    uint32_t state[8];
    memcpy(state, INITIAL, sizeof state);
    size_t whole = len / 64;
    compress(state, data, whole);
    uint8_t tail[128] = {0};
    size_t rest = len - 64 * whole;
    memcpy(tail, data + 64 * whole, rest);
    tail[rest] = 0x80;
    size_t tail_blocks = rest + 9 <= 64 ? 1 : 2;
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) tail[64 * tail_blocks - 1 - i] = (uint8_t)(bits >> (8 * i));
    compress(state, tail, tail_blocks);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(state[i] >> 24);
        out[4 * i + 1] = (uint8_t)(state[i] >> 16);
        out[4 * i + 2] = (uint8_t)(state[i] >> 8);
        out[4 * i + 3] = (uint8_t)state[i];
    }
}

PyDoc_STRVAR(sha256_doc,
"sha256(data, portable=False, /)\n--\n\n"
"The SHA-256 digest of ``data`` (bytes), with the reference compression if ``portable``\n"
"(what a CPU without the SHA extensions runs), else the CPU's best.");

static PyObject *sha256_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "sha256 takes bytes and an optional flag");
        return NULL;
    }
    int portable = nargs == 2 ? PyObject_IsTrue(args[1]) : 0;
    if (portable < 0) return NULL;
    uint8_t out[32];
    sha256_digest((const uint8_t *)PyBytes_AS_STRING(args[0]), (size_t)PyBytes_GET_SIZE(args[0]),
                  out, portable);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

PyMethodDef sha256_methods[] = {
    {"sha256", (PyCFunction)(void (*)(void))sha256_py, METH_FASTCALL, sha256_doc},
    {NULL, NULL, 0, NULL},
};

/* The Go conductor's prefix hash chain (``hashing.chain_hashes``).
 *
 * XXH64 is written out below (about 40 lines of the reference algorithm, for inputs of any
 * length) rather than vendored: the one-shot function is all the chain needs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "hashing.h"

/* -- XXH64 (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md) -------------- */

static const uint64_t P1 = 0x9E3779B185EBCA87ULL;
static const uint64_t P2 = 0xC2B2AE3D27D4EB4FULL;
static const uint64_t P3 = 0x165667B19E3779F9ULL;
static const uint64_t P4 = 0x85EBCA77C2B2AE63ULL;
static const uint64_t P5 = 0x27D4EB2F165667C5ULL;

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint32_t read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t xxh_round(uint64_t acc, uint64_t lane) {
    acc += lane * P2;
    return rotl64(acc, 31) * P1;
}

static inline uint64_t xxh_merge(uint64_t acc, uint64_t lane) {
    acc ^= xxh_round(0, lane);
    return acc * P1 + P4;
}

uint64_t xxh64(const uint8_t *p, size_t len, uint64_t seed) {
    const uint8_t *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
        do {
            v1 = xxh_round(v1, read64(p));
            v2 = xxh_round(v2, read64(p + 8));
            v3 = xxh_round(v3, read64(p + 16));
            v4 = xxh_round(v4, read64(p + 24));
            p += 32;
        } while (end - p >= 32);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xxh_merge(h, v1);
        h = xxh_merge(h, v2);
        h = xxh_merge(h, v3);
        h = xxh_merge(h, v4);
    } else {
        h = seed + P5;
    }
    h += (uint64_t)len;
    for (; end - p >= 8; p += 8) {
        h ^= xxh_round(0, read64(p));
        h = rotl64(h, 27) * P1 + P4;
    }
    if (end - p >= 4) {
        h ^= (uint64_t)read32(p) * P1;
        h = rotl64(h, 23) * P2 + P3;
        p += 4;
    }
    for (; p < end; p++) {
        h ^= (uint64_t)(*p) * P5;
        h = rotl64(h, 11) * P1;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* -- the chain -------------------------------------------------------------------------- */

/* A token's int32 bit pattern, values outside int32 wrapped like Go's uint32(int32(t)). */
static int token_bits(PyObject *token, uint32_t *bits) {
    PyObject *index = PyLong_Check(token) ? Py_NewRef(token) : PyNumber_Index(token);
    if (index == NULL) {
        PyErr_SetString(PyExc_TypeError, "token ids must be integers");
        return -1;
    }
    int overflow;
    long long value = PyLong_AsLongLongAndOverflow(index, &overflow);
    if (overflow) value = (long long)PyLong_AsUnsignedLongLongMask(index);
    Py_DECREF(index);
    if (value == -1 && PyErr_Occurred()) return -1;
    *bits = (uint32_t)value;
    return 0;
}

/* The items of an array.array('i') (what the decoders give as token ids) in ``view``:
 * 1 when ``object`` is one (the caller releases the view), 0 when not. */
static int int32_array_view(PyObject *object, Py_buffer *view) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return 0;  /* its items are big-endian: read one by one as a sequence */
#endif
    if (!PyObject_CheckBuffer(object) || PyByteArray_Check(object) || PyMemoryView_Check(object))
        return 0;
    if (PyObject_GetBuffer(object, view, PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->itemsize == 4 && view->format != NULL && strcmp(view->format, "i") == 0)
        return 1;
    PyBuffer_Release(view);
    return 0;
}

PyDoc_STRVAR(chain_hashes_doc,
"chain_hashes(parent, token_ids, block_size, /)\n--\n\n"
"Hashes of the complete blocks of ``token_ids`` (a sequence of ints, an array('i'), or\n"
"their int32 little-endian bytes), chained from ``parent``:\n"
"h = XXH64(u64le(parent) || u32le(token)...).");

static PyObject *chain_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain_hashes takes parent, token_ids, block_size");
        return NULL;
    }
    uint64_t chain = PyLong_AsUnsignedLongLongMask(args[0]);
    if (chain == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    Py_ssize_t block_size = PyLong_AsSsize_t(args[2]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size <= 0) return PyList_New(0);
    if (block_size > (PY_SSIZE_T_MAX - 8) / 4) return PyErr_NoMemory();

    PyObject *tokens = args[1];
    PyObject *seq = NULL;
    const uint8_t *packed = NULL;
    Py_ssize_t count;
    Py_buffer view = {0};
    if (PyBytes_Check(tokens)) {
        packed = (const uint8_t *)PyBytes_AS_STRING(tokens);
        count = PyBytes_GET_SIZE(tokens) / 4;
    } else if (int32_array_view(tokens, &view)) {  /* its items are the int32 values */
        packed = view.buf;
        count = view.len / 4;
    } else {
        seq = PySequence_Fast(tokens, "token ids must be a sequence of integers or bytes");
        if (seq == NULL) return NULL;
        count = PySequence_Fast_GET_SIZE(seq);
    }
    Py_ssize_t blocks = count / block_size, step = 4 * block_size;
    uint8_t stack[8 + 4 * 64];
    uint8_t *buffer = step <= 4 * 64 ? stack : PyMem_Malloc(8 + step);
    PyObject *hashes = buffer == NULL ? PyErr_NoMemory() : PyList_New(blocks);
    if (hashes == NULL) goto done;
    PyObject **items = seq == NULL ? NULL : PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t block = 0; block < blocks; block++) {
        put_le64(buffer, chain);
        if (packed != NULL) {
            memcpy(buffer + 8, packed + block * step, step);
        } else {
            for (Py_ssize_t i = 0; i < block_size; i++) {
                uint32_t bits;
                if (token_bits(items[block * block_size + i], &bits) < 0) {
                    Py_CLEAR(hashes);
                    goto done;
                }
                put_le32(buffer + 8 + 4 * i, bits);
            }
        }
        chain = xxh64(buffer, 8 + step, 0);
        PyObject *value = PyLong_FromUnsignedLongLong(chain);
        if (value == NULL) {
            Py_CLEAR(hashes);
            goto done;
        }
        PyList_SET_ITEM(hashes, block, value);
    }
done:
    if (buffer != stack) PyMem_Free(buffer);
    Py_XDECREF(seq);
    if (view.obj != NULL) PyBuffer_Release(&view);
    return hashes;
}

PyMethodDef hashing_methods[] = {
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_FASTCALL, chain_hashes_doc},
    {NULL, NULL, 0, NULL},
};

/* The ingestion hot path in C: the Go conductor's prefix hash chain, and the index's
 * per-block loops that record and release blocks.
 *
 * Why C: in Python these loops cost ~1.5 us a block (an 8-byte pack, a slice and an xxh64
 * call to hash it; six dict operations in bytecode to record it), about two thirds of what
 * the service spends ingesting an event. Here they work on the same Python dicts with the
 * same semantics, so everything else in conductor/index.py reads and writes those dicts as
 * before. Each function says which Python code it stands for; tests/conductor/test_hashing.py
 * and the randomized model check in tests/conductor/test_index.py pin their results.
 *
 * XXH64 is written out below (about 40 lines of the reference algorithm, for inputs of any
 * length) rather than vendored: the one-shot function is all the chain needs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

static uint64_t xxh64(const uint8_t *p, size_t len, uint64_t seed) {
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

static inline void put_le32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static inline void put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

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

PyDoc_STRVAR(chain_hashes_doc,
"chain_hashes(parent, token_ids, block_size, /)\n--\n\n"
"Hashes of the complete blocks of ``token_ids`` (a sequence of ints, or their int32\n"
"little-endian bytes), chained from ``parent``: h = XXH64(u64le(parent) || u32le(token)...).");

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
    if (PyBytes_Check(tokens)) {
        packed = (const uint8_t *)PyBytes_AS_STRING(tokens);
        count = PyBytes_GET_SIZE(tokens) / 4;
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
    return hashes;
}

/* -- the index's loops ------------------------------------------------------------------- */

/* counts[key] = counts.get(key, 0) + delta; the entry goes when it reaches 0. */
static int add_count(PyObject *counts, PyObject *key, long delta) {
    PyObject *held = PyDict_GetItemWithError(counts, key);
    if (held == NULL && PyErr_Occurred()) return -1;
    long count = held == NULL ? 0 : PyLong_AsLong(held);
    if (count == -1 && PyErr_Occurred()) return -1;
    if (count + delta == 0) return PyDict_DelItem(counts, key);
    PyObject *value = PyLong_FromLong(count + delta);
    if (value == NULL) return -1;
    int result = PyDict_SetItem(counts, key, value);
    Py_DECREF(value);
    return result;
}

static int check_dicts(PyObject *const *args, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyDict_CheckExact(args[i])) {
            PyErr_Format(PyExc_TypeError, "argument %zd must be a dict", i + 1);
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(hold_doc,
"hold(by_engine_hash, copies, extra_refs, engine_prefix, engine_refs, blocks, bit,\n"
"     engine_hashes, prefix_hashes, /)\n--\n\n"
"PrefixContext.hold's loop: record that the owner whose slot bit is ``bit`` holds these\n"
"blocks (pairs of the two sequences, up to the shorter) in its ``by_engine_hash`` (a block\n"
"it holds already counts one more copy), the context's ``engine_prefix`` (one more\n"
"holder in ``engine_refs`` when known) and the tier's ``blocks`` masks (a prefix it holds\n"
"under another engine hash counts in ``extra_refs``). Returns how many pairs it took.");

static PyObject *hold(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "hold takes 9 arguments");
        return NULL;
    }
    if (check_dicts(args, 6) < 0) return NULL;
    PyObject *by_engine_hash = args[0], *copies = args[1], *extra_refs = args[2];
    PyObject *engine_prefix = args[3], *engine_refs = args[4], *blocks = args[5];
    PyObject *bit = args[6];
    PyObject *engine_seq = PySequence_Fast(args[7], "engine_hashes must be a sequence");
    if (engine_seq == NULL) return NULL;
    PyObject *prefix_seq = PySequence_Fast(args[8], "prefix_hashes must be a sequence");
    if (prefix_seq == NULL) {
        Py_DECREF(engine_seq);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(engine_seq);
    if (PySequence_Fast_GET_SIZE(prefix_seq) < count) count = PySequence_Fast_GET_SIZE(prefix_seq);
    PyObject **engine_hashes = PySequence_Fast_ITEMS(engine_seq);
    PyObject **prefix_hashes = PySequence_Fast_ITEMS(prefix_seq);
    Py_ssize_t added = 0;
    for (; added < count; added++) {
        PyObject *engine_hash = engine_hashes[added], *prefix_hash = prefix_hashes[added];
        int held = PyDict_Contains(by_engine_hash, engine_hash);
        if (held < 0) goto fail;
        if (held) {  /* another physical copy of a block this owner holds */
            if (add_count(copies, engine_hash, 1) < 0) goto fail;
            continue;
        }
        if (PyDict_SetItem(by_engine_hash, engine_hash, prefix_hash) < 0) goto fail;
        int known = PyDict_Contains(engine_prefix, engine_hash);
        if (known < 0) goto fail;
        if (known ? add_count(engine_refs, engine_hash, 1)
                  : PyDict_SetItem(engine_prefix, engine_hash, prefix_hash)) goto fail;
        PyObject *mask = PyDict_GetItemWithError(blocks, prefix_hash);
        if (mask == NULL) {
            if (PyErr_Occurred() || PyDict_SetItem(blocks, prefix_hash, bit) < 0) goto fail;
            continue;
        }
        PyObject *both = PyNumber_And(mask, bit);
        if (both == NULL) goto fail;
        int mine = PyObject_IsTrue(both);
        Py_DECREF(both);
        if (mine < 0) goto fail;
        if (mine) {  /* this owner holds the prefix already, under another engine hash */
            if (add_count(extra_refs, prefix_hash, 1) < 0) goto fail;
            continue;
        }
        PyObject *joined = PyNumber_Or(mask, bit);
        if (joined == NULL) goto fail;
        int stored = PyDict_SetItem(blocks, prefix_hash, joined);
        Py_DECREF(joined);
        if (stored < 0) goto fail;
    }
    Py_DECREF(engine_seq);
    Py_DECREF(prefix_seq);
    return PyLong_FromSsize_t(added);
fail:
    Py_DECREF(engine_seq);
    Py_DECREF(prefix_seq);
    return NULL;
}

PyDoc_STRVAR(release_many_doc,
"release_many(by_engine_hash, engine_prefix, engine_refs, blocks, bit, engine_hashes, /)\n"
"--\n\n"
"PrefixContext.release_many's loop, for an owner without copies or duplicate prefixes:\n"
"forget each engine hash it holds (one holder fewer in ``engine_prefix``/``engine_refs``)\n"
"and clear ``bit`` from its prefix's mask in ``blocks`` (the entry goes with the last bit).\n"
"Hashes it does not hold are skipped. Returns how many it held.");

static PyObject *release_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "release_many takes 6 arguments");
        return NULL;
    }
    if (check_dicts(args, 4) < 0) return NULL;
    PyObject *by_engine_hash = args[0], *engine_prefix = args[1], *engine_refs = args[2];
    PyObject *blocks = args[3];
    PyObject *others = PyNumber_Invert(args[4]);
    if (others == NULL) return NULL;
    PyObject *seq = PySequence_Fast(args[5], "engine_hashes must be a sequence");
    if (seq == NULL) {
        Py_DECREF(others);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), released = 0;
    PyObject **engine_hashes = PySequence_Fast_ITEMS(seq);
    PyObject *prefix_hash = NULL;  /* owned while its block is released */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *engine_hash = engine_hashes[i];
        prefix_hash = PyDict_GetItemWithError(by_engine_hash, engine_hash);
        if (prefix_hash == NULL) {
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        Py_INCREF(prefix_hash);  /* the dict's reference goes with the entry */
        if (PyDict_DelItem(by_engine_hash, engine_hash) < 0) goto fail;
        released++;
        int shared = PyDict_Contains(engine_refs, engine_hash);
        if (shared < 0) goto fail;
        if (shared ? add_count(engine_refs, engine_hash, -1)
                   : PyDict_DelItem(engine_prefix, engine_hash)) goto fail;
        PyObject *mask = PyDict_GetItemWithError(blocks, prefix_hash);
        if (mask == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, prefix_hash);
            goto fail;
        }
        PyObject *left = PyNumber_And(mask, others);
        if (left == NULL) goto fail;
        int kept = PyObject_IsTrue(left);
        int result = kept < 0 ? -1
                     : kept  ? PyDict_SetItem(blocks, prefix_hash, left)
                             : PyDict_DelItem(blocks, prefix_hash);
        Py_DECREF(left);
        Py_CLEAR(prefix_hash);
        if (result < 0) goto fail;
    }
    Py_DECREF(others);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(released);
fail:
    Py_XDECREF(prefix_hash);
    Py_DECREF(others);
    Py_DECREF(seq);
    return NULL;
}

/* -- decoding ----------------------------------------------------------------------------- */

PyDoc_STRVAR(u64_hashes_doc,
"u64_hashes(values, /)\n--\n\n"
"normalize_hashes' fast path: a list of every int in ``values`` (a list) as unsigned 64\n"
"bits (a negative int64 wraps; an int already in range is kept as is), or None when one of\n"
"them is not an int or is a bool (the caller then looks at each).");

static PyObject *u64_hashes(PyObject *module, PyObject *values) {
    if (!PyList_Check(values)) {
        PyErr_SetString(PyExc_TypeError, "u64_hashes takes a list");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(values);
    PyObject *hashes = PyList_New(count);
    if (hashes == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = PyList_GET_ITEM(values, i);
        if (!PyLong_Check(value) || PyBool_Check(value)) {
            Py_DECREF(hashes);
            Py_RETURN_NONE;
        }
        PyObject *hash;
        int overflow;
        long long small = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (small == -1 && PyErr_Occurred()) goto fail;
        if (overflow == 0) {  /* an int64: kept, or its unsigned bit pattern when < 0 */
            hash = small >= 0 ? Py_NewRef(value)
                              : PyLong_FromUnsignedLongLong((unsigned long long)small);
        } else if (overflow > 0 && (PyLong_AsUnsignedLongLong(value) != (unsigned long long)-1
                                    || !PyErr_Occurred())) {  /* a uint64 above int64: kept */
            hash = Py_NewRef(value);
        } else {  /* wider than 64 bits, either sign: its low 64 bits, as & MASK64 does */
            PyErr_Clear();
            hash = PyLong_FromUnsignedLongLong(PyLong_AsUnsignedLongLongMask(value));
        }
        if (hash == NULL) goto fail;
        PyList_SET_ITEM(hashes, i, hash);
    }
    return hashes;
fail:
    Py_DECREF(hashes);
    return NULL;
}

static PyMethodDef native_methods[] = {
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_FASTCALL, chain_hashes_doc},
    {"hold", (PyCFunction)(void (*)(void))hold, METH_FASTCALL, hold_doc},
    {"release_many", (PyCFunction)(void (*)(void))release_many, METH_FASTCALL, release_many_doc},
    {"u64_hashes", u64_hashes, METH_O, u64_hashes_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "conductor._native",
    .m_doc = "The ingestion hot path in C: prefix hash chains and the index's per-block loops.",
    .m_size = 0,
    .m_methods = native_methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&native_module); }

/* What the Python decoders call: hashes normalized, token ids read from msgpack. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "decode.h"
#include "hashing.h"
#include "msgpack.h"

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

PyDoc_STRVAR(int32_tokens_doc,
"int32_tokens(raw, /)\n--\n\n"
"A msgpack array of integers (or nil: none), given as its encoded bytes, as the int32\n"
"little-endian bytes of its values (wider values wrapped like Go's int32 cast). None when\n"
"``raw`` is anything else (the caller then decodes it the slow way, with its errors).\n"
"Token ids are read in place, not decoded as Python ints one by one.");

/* The ints of a msgpack array at ``r`` appended to ``*out`` as int32 little-endian bytes
 * (wider values wrapped like Go's int32 cast); ``*used`` of ``*capacity`` bytes are taken,
 * the buffer grows as needed. 1, 0 when it is no array of ints, -1 on error. */
int read_tokens(MpReader *r, uint8_t **out, size_t *used, size_t *capacity) {
    size_t count;
    if (!mp_array(r, &count)) return 0;
    if (*used + 4 * count > *capacity) {
        size_t grown = 2 * *capacity > *used + 4 * count ? 2 * *capacity : *used + 4 * count;
        uint8_t *buffer = PyMem_Realloc(*out, grown ? grown : 1);
        if (buffer == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *out = buffer, *capacity = grown;
    }
    for (size_t i = 0; i < count; i++) {
        uint64_t bits;
        int negative;
        if (!mp_int(r, &bits, &negative)) return 0;
        put_le32(*out + *used + 4 * i, (uint32_t)bits);
    }
    *used += 4 * count;
    return 1;
}

static PyObject *int32_tokens(PyObject *module, PyObject *raw) {
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0) return NULL;
    MpReader r = {view.buf, (const uint8_t *)view.buf + view.len};
    uint8_t *tokens = NULL;
    size_t used = 0, capacity = 0;
    int read = mp_nil(&r) ? 1 : read_tokens(&r, &tokens, &used, &capacity);
    PyObject *packed = read < 0                 ? NULL
                       : read == 0 || r.p != r.end ? Py_NewRef(Py_None)
                                                 : PyBytes_FromStringAndSize((char *)tokens,
                                                                             (Py_ssize_t)used);
    PyMem_Free(tokens);
    PyBuffer_Release(&view);
    return packed;
}

PyMethodDef decode_methods[] = {
    {"u64_hashes", u64_hashes, METH_O, u64_hashes_doc},
    {"int32_tokens", int32_tokens, METH_O, int32_tokens_doc},
    {NULL, NULL, 0, NULL},
};

/* A query's walk over the owner masks of a context's GPU tier (PrefixContext._walk_gpu). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "maps.h"
#include "masks.h"

/* Owner masks as arrays of 64-bit words: a 1,000-slot mask is 16 words, and/compare in a
 * loop, where each int operation in Python allocates a new 1,000-bit int. */
typedef struct {
    unsigned char *bytes;  /* an int's little-endian bytes, grown to the widest seen */
    size_t size;
} Scratch;

/* The number of 64-bit words ``value`` (an int >= 0) needs; -1 on error. */
static Py_ssize_t words_of(PyObject *value) {
#if PY_VERSION_HEX >= 0x030D0000
    int flags = Py_ASNATIVEBYTES_UNSIGNED_BUFFER | Py_ASNATIVEBYTES_REJECT_NEGATIVE;
    Py_ssize_t bytes = PyLong_AsNativeBytes(value, NULL, 0, flags);
    return bytes < 0 ? -1 : (bytes + 7) / 8;
#else
    size_t bits = _PyLong_NumBits(value);
    if (bits == (size_t)-1 && PyErr_Occurred()) return -1;
    return (Py_ssize_t)((bits + 63) / 64);
#endif
}

/* The low ``words`` words of ``value`` (an int >= 0) into ``out``. */
static int low_words(PyObject *value, uint64_t *out, Py_ssize_t words, Scratch *scratch) {
    Py_ssize_t whole = words_of(value);
    if (whole < 0) return -1;
    if (whole < words) whole = words;
    size_t size = (size_t)whole * 8;
    if (size > scratch->size) {
        unsigned char *grown = PyMem_Realloc(scratch->bytes, size);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        scratch->bytes = grown;
        scratch->size = size;
    }
#if PY_VERSION_HEX >= 0x030D0000
    int flags = Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER |
                Py_ASNATIVEBYTES_REJECT_NEGATIVE;
    if (PyLong_AsNativeBytes(value, scratch->bytes, (Py_ssize_t)size, flags) < 0) return -1;
#else
    if (_PyLong_AsByteArray((PyLongObject *)value, scratch->bytes, size, 1, 0) < 0) return -1;
#endif
#if PY_LITTLE_ENDIAN
    memcpy(out, scratch->bytes, (size_t)words * 8);
#else
    for (Py_ssize_t w = 0; w < words; w++) {
        uint64_t word = 0;
        for (int b = 7; b >= 0; b--) word = word << 8 | scratch->bytes[w * 8 + b];
        out[w] = word;
    }
#endif
    return 0;
}

/* (the set bits of ``bits``, lowest first, as a list of ints, (position,) * 4) appended
 * to ``stops``. */
static int add_stop(PyObject *stops, const uint64_t *bits, Py_ssize_t words, Py_ssize_t at) {
    PyObject *indices = PyList_New(0);
    if (indices == NULL) return -1;
    for (Py_ssize_t w = 0; w < words; w++) {
        for (uint64_t word = bits[w]; word; word &= word - 1) {
            PyObject *index = PyLong_FromSsize_t(w * 64 + __builtin_ctzll(word));
            int failed = index == NULL || PyList_Append(indices, index) < 0;
            Py_XDECREF(index);
            if (failed) {
                Py_DECREF(indices);
                return -1;
            }
        }
    }
    PyObject *stop = Py_BuildValue("(N(nnnn))", indices, at, at, at, at);
    if (stop == NULL) return -1;
    int result = PyList_Append(stops, stop);
    Py_DECREF(stop);
    return result;
}

const char context_walk_doc[] =
"walk(hashes, interest, /)\n--\n\n"
"Where the owners in ``interest`` (a mask) stop along ``hashes``: each walks while the GPU\n"
"tier's mask of the next hash (``blocks[0]``) has its bit. A list\n"
"of (owner indices, (position,) * 4): the owners whose first missing block is at that\n"
"position (on each tier, for the index's answers), in order; those that hold every block\n"
"last, at len(hashes). A hash that is no unsigned 64-bit int is held by nobody.\n"
"Machine words, where Python's walk allocates an owner-wide int for each block.";

PyObject *context_walk(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "walk takes 2 arguments (%zd given)", nargs);
    }
    Map *blocks = self->tiers[0];
    PyObject *interest = args[1];
    if (!PyLong_Check(interest)) {  /* a negative one: OverflowError, read as unsigned */
        return PyErr_Format(PyExc_TypeError, "interest must be an int, not %.60R", interest);
    }
    PyObject *hashes = PySequence_Fast(args[0], "hashes must be a sequence");
    if (hashes == NULL) return NULL;
    PyObject *stops = PyList_New(0);
    Py_ssize_t words = words_of(interest);
    Scratch scratch = {NULL, 0};
    uint64_t *alive = NULL;  /* then the words held at a position, and those that stopped */
    if (stops == NULL || words < 0) goto fail;
    alive = PyMem_Calloc((size_t)(words > 0 ? words : 1) * 3, sizeof(uint64_t));
    if (alive == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    uint64_t *held = alive + words, *stopped = held + words;
    if (words > 0 && low_words(interest, alive, words, &scratch) < 0) goto fail;
    sync_lock(self->sync);  /* let go at done or fail_locked */
    for (Py_ssize_t position = 0; position < count && words > 0; position++) {
        uint64_t key, *mask = NULL;
        const uint64_t *bits;
        int found = key_of(items[position], &key);
        if (found < 0) goto fail_locked;
        if (found) mask = map_value_of(blocks, key);
        size_t known = mask != NULL ? mask_words(mask, &bits) : 0;
        if (known > (size_t)words) known = (size_t)words;
        if (known) memcpy(held, bits, known * sizeof(uint64_t));
        memset(held + known, 0, ((size_t)words - known) * sizeof(uint64_t));
        uint64_t any_stopped = 0, any_alive = 0;
        for (Py_ssize_t w = 0; w < words; w++) {
            stopped[w] = alive[w] & ~held[w];
            alive[w] &= held[w];
            any_stopped |= stopped[w];
            any_alive |= alive[w];
        }
        if (any_stopped && add_stop(stops, stopped, words, position) < 0) goto fail_locked;
        if (!any_alive) goto done;
    }
    if (add_stop(stops, alive, words, count) < 0) goto fail_locked;
done:
    sync_unlock(self->sync);
    PyMem_Free(alive);
    PyMem_Free(scratch.bytes);
    Py_DECREF(hashes);
    return stops;
fail_locked:
    sync_unlock(self->sync);
fail:
    PyMem_Free(alive);
    PyMem_Free(scratch.bytes);
    Py_DECREF(hashes);
    Py_XDECREF(stops);
    return NULL;
}

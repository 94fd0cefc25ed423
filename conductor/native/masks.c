/* Owner masks: what they are, in masks.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "masks.h"

/* A wide mask of ``words`` words, zeroed; NULL when out of memory. */
static WideMask *wide_new(size_t words) {
    WideMask *wide = PyMem_RawCalloc(1, sizeof(WideMask) + words * sizeof(uint64_t));
    if (wide != NULL) wide->words = words;
    return wide;
}

/* Set ``bit``: 0, or -1 when out of memory (the mask unchanged). */
int mask_add(uint64_t *mask, size_t bit) {
    if (!mask_is_wide(*mask) && bit < MASK_INLINE_BITS) {
        *mask |= UINT64_C(1) << bit;
        return 0;
    }
    size_t needed = bit / 64 + 1;
    WideMask *wide = mask_is_wide(*mask) ? mask_wide(*mask) : NULL;
    if (wide == NULL || wide->words < needed) {
        WideMask *grown = wide_new(needed);
        if (grown == NULL) return -1;
        if (wide != NULL) memcpy(grown->bits, wide->bits, wide->words * sizeof(uint64_t));
        else grown->bits[0] = *mask;
        PyMem_RawFree(wide);
        wide = grown;
        *mask = (uint64_t)(uintptr_t)wide | MASK_WIDE;
    }
    wide->bits[bit / 64] |= UINT64_C(1) << bit % 64;
    return 0;
}

/* Clear ``bit``; a wide mask left without a bit from 63 on becomes inline. Returns 1 when
 * the mask is empty now, else 0. */
int mask_remove(uint64_t *mask, size_t bit) {
    if (!mask_is_wide(*mask)) {
        if (bit < MASK_INLINE_BITS) *mask &= ~(UINT64_C(1) << bit);
        return *mask == 0;
    }
    WideMask *wide = mask_wide(*mask);
    if (bit / 64 < wide->words) wide->bits[bit / 64] &= ~(UINT64_C(1) << bit % 64);
    uint64_t high = wide->bits[0] & MASK_WIDE;
    for (size_t w = 1; w < wide->words && !high; w++) high = wide->bits[w];
    if (high) return 0;
    *mask = wide->bits[0];
    PyMem_RawFree(wide);
    return *mask == 0;
}

void mask_free(uint64_t mask) {
    if (mask_is_wide(mask)) PyMem_RawFree(mask_wide(mask));
}

/* The mask as an int (the GIL held). */
PyObject *mask_to_int(uint64_t mask) {
    if (!mask_is_wide(mask)) return PyLong_FromUnsignedLongLong(mask);
    const WideMask *wide = mask_wide(mask);
    unsigned char *bytes = PyMem_Malloc(wide->words * 8);
    if (bytes == NULL) return PyErr_NoMemory();
    for (size_t i = 0; i < wide->words * 8; i++) bytes[i] = (unsigned char)(wide->bits[i / 8] >> i % 8 * 8);
    PyObject *value = _PyLong_FromByteArray(bytes, wide->words * 8, 1, 0);
    PyMem_Free(bytes);
    return value;
}

/* An int >= 0 as a mask (the GIL held): 0, or -1 with an error set. */
int mask_from_int(PyObject *value, uint64_t *mask) {
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "values are ints, not %.60R", value);
        return -1;
    }
    if (_PyLong_Sign(value) < 0) {
        PyErr_SetString(PyExc_OverflowError, "a mask is an int >= 0");
        return -1;
    }
    size_t bits = _PyLong_NumBits(value);
    if (bits == (size_t)-1 && PyErr_Occurred()) return -1;
    if (bits <= MASK_INLINE_BITS) {
        *mask = PyLong_AsUnsignedLongLong(value);
        return 0;
    }
    size_t words = (bits + 63) / 64;
    unsigned char *bytes = PyMem_Malloc(words * 8);
    WideMask *wide = bytes != NULL ? wide_new(words) : NULL;
    if (wide == NULL) {
        PyMem_Free(bytes);
        PyErr_NoMemory();
        return -1;
    }
    if (_PyLong_AsByteArray((PyLongObject *)value, bytes, words * 8, 1, 0) < 0) {
        PyMem_Free(bytes);
        PyMem_RawFree(wide);
        return -1;
    }
    for (size_t i = 0; i < words * 8; i++) wide->bits[i / 8] |= (uint64_t)bytes[i] << i % 8 * 8;
    PyMem_Free(bytes);
    *mask = (uint64_t)(uintptr_t)wide | MASK_WIDE;
    return 0;
}

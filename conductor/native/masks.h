/* Owner masks as machine words (masks.c): a tier's value for a prefix in a MaskMap, the
 * bits of the owners holding it. */
#ifndef CONDUCTOR_NATIVE_MASKS_H
#define CONDUCTOR_NATIVE_MASKS_H

#include <Python.h>
#include <stdint.h>

/* Why not int objects: an int mask is one allocation per change (an OR or an AND builds a
 * new int), and only code holding the GIL may touch it. Here a mask of owners 0-62 is the
 * 64-bit value itself (most contexts have fewer owners); one with an owner from 63 on is a
 * WideMask, its pointer tagged with the top bit, each prefix's mask its own (freed with its
 * entry). A mask is wide exactly while it has a bit from 63 on, so each has one form.
 * Every function here but the int conversions runs without the GIL; none raises. */
#define MASK_WIDE (UINT64_C(1) << 63)
#define MASK_INLINE_BITS 63

typedef struct {
    size_t words;
    uint64_t bits[];  /* little end first */
} WideMask;

static inline int mask_is_wide(uint64_t mask) { return (mask & MASK_WIDE) != 0; }

static inline WideMask *mask_wide(uint64_t mask) {
    return (WideMask *)(uintptr_t)(mask & ~MASK_WIDE);
}

/* The words of the mask stored at ``mask`` (an inline one: that value itself) in ``*bits``;
 * returns how many. */
static inline size_t mask_words(const uint64_t *mask, const uint64_t **bits) {
    if (!mask_is_wide(*mask)) {
        *bits = mask;
        return 1;
    }
    const WideMask *wide = mask_wide(*mask);
    *bits = wide->bits;
    return wide->words;
}

static inline int mask_has(uint64_t mask, size_t bit) {
    if (!mask_is_wide(mask)) return bit < MASK_INLINE_BITS && (mask >> bit & 1);
    const WideMask *wide = mask_wide(mask);
    return bit / 64 < wide->words && (wide->bits[bit / 64] >> bit % 64 & 1);
}

int mask_add(uint64_t *mask, size_t bit);
int mask_remove(uint64_t *mask, size_t bit);
void mask_free(uint64_t mask);
PyObject *mask_to_int(uint64_t mask);
int mask_from_int(PyObject *value, uint64_t *mask);

#endif

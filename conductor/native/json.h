/* What json.c shares: JSON's whitespace, and an array of int32 read in place. */
#ifndef CONDUCTOR_NATIVE_JSON_H
#define CONDUCTOR_NATIVE_JSON_H

#include <stddef.h>
#include <stdint.h>

/* Past the whitespace at ``p``. */
const char *json_space(const char *p, const char *end);

/* Past a JSON array of int32 integers at ``p`` (its '['), their int32 LE bytes appended
 * to ``*out`` (grown with PyMem_RawRealloc, so without the GIL too); NULL if it is
 * anything else, or if memory ran out. */
const char *json_int32_array(const char *p, const char *end, uint8_t **out, size_t *used,
                             size_t *capacity);

#endif

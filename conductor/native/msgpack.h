/* A bounds-checked msgpack reader for the C ingest lane (lane.c and decode.c).
 *
 * Each mp_* function reads one value of its type at the reader's position: it returns 1
 * and moves past the value when the value has that type, and 0 when it does not or the
 * input ends first. The position is then unspecified; a caller that gets 0 gives up on
 * the whole payload, and the Python decoders decode it instead.
 */

#ifndef CONDUCTOR_NATIVE_MSGPACK_H
#define CONDUCTOR_NATIVE_MSGPACK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} MpReader;

#define MP_MAX_DEPTH 32  /* nesting mp_skip follows; deeper payloads go the Python way */

static inline uint64_t mp_be(const uint8_t *p, int bytes) {
    uint64_t value = 0;
    for (int i = 0; i < bytes; i++) value = (value << 8) | p[i];
    return value;
}

static inline int mp_take(MpReader *r, size_t bytes, const uint8_t **at) {
    if ((size_t)(r->end - r->p) < bytes) return 0;
    *at = r->p;
    r->p += bytes;
    return 1;
}

static inline int mp_nil(MpReader *r) {
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* Any msgpack integer (not a bool): ``*bits`` is its two's-complement 64-bit pattern, so a
 * negative int64 reads as it wraps to uint64 and a uint64 above INT64_MAX as itself;
 * ``*negative`` says which of the two a pattern with the top bit set was. */
static inline int mp_int(MpReader *r, uint64_t *bits, int *negative) {
    if (r->p >= r->end) return 0;
    uint8_t tag = *r->p;
    if (tag <= 0x7f || tag >= 0xe0) {  /* positive / negative fixint */
        r->p++;
        *bits = (uint64_t)(int64_t)(int8_t)tag;
        *negative = tag >= 0xe0;
        return 1;
    }
    int width, is_signed = tag >= 0xd0;
    switch (tag) {
        case 0xcc: case 0xd0: width = 1; break;  /* uint8, int8 */
        case 0xcd: case 0xd1: width = 2; break;
        case 0xce: case 0xd2: width = 4; break;
        case 0xcf: case 0xd3: width = 8; break;
        default: return 0;
    }
    const uint8_t *at;
    if (!mp_take(r, 1 + (size_t)width, &at)) return 0;
    uint64_t value = mp_be(at + 1, width);
    *negative = is_signed && ((value >> (8 * width - 1)) & 1);
    if (*negative && width < 8) value |= ~(uint64_t)0 << (8 * width);  /* sign-extend */
    *bits = value;
    return 1;
}

static inline int mp_float(MpReader *r, double *value) {
    const uint8_t *at;
    if (r->p < r->end && *r->p == 0xcb && mp_take(r, 9, &at)) {
        uint64_t bits = mp_be(at + 1, 8);
        memcpy(value, &bits, sizeof bits);
        return 1;
    }
    if (r->p < r->end && *r->p == 0xca && mp_take(r, 5, &at)) {
        uint32_t bits = (uint32_t)mp_be(at + 1, 4);
        float single;
        memcpy(&single, &bits, sizeof bits);
        *value = single;
        return 1;
    }
    return 0;
}

/* A str's UTF-8 bytes (not NUL-terminated), left where they are. */
static inline int mp_str(MpReader *r, const uint8_t **text, size_t *length) {
    if (r->p >= r->end) return 0;
    uint8_t tag = *r->p;
    int header;
    if ((tag & 0xe0) == 0xa0) {
        header = 1, *length = tag & 0x1f;
    } else if (tag >= 0xd9 && tag <= 0xdb) {
        header = 1 << (tag - 0xd9);  /* str8, str16, str32: a 1-, 2- or 4-byte length */
        if (r->end - r->p < 1 + header) return 0;
        *length = (size_t)mp_be(r->p + 1, header);
        header += 1;
    } else {
        return 0;
    }
    const uint8_t *at;
    if (!mp_take(r, (size_t)header + *length, &at)) return 0;
    *text = at + header;
    return 1;
}

/* A bin's bytes, left where they are. */
static inline int mp_bin(MpReader *r, const uint8_t **bytes, size_t *length) {
    if (r->p >= r->end || *r->p < 0xc4 || *r->p > 0xc6) return 0;
    int header = 1 << (*r->p - 0xc4);  /* bin8, bin16, bin32: a 1-, 2- or 4-byte length */
    if (r->end - r->p < 1 + header) return 0;
    *length = (size_t)mp_be(r->p + 1, header);
    const uint8_t *at;
    if (!mp_take(r, 1 + (size_t)header + *length, &at)) return 0;
    *bytes = at + 1 + header;
    return 1;
}

/* An array's or a map's element count, from a header of tag ``fix`` (its low nibble holds
 * small counts), ``tag16`` or ``tag16 + 1`` (a 2- or 4-byte count). Every element takes at
 * least a byte (a map entry two), so a count the rest of the input cannot hold is refused. */
static inline int mp_container(MpReader *r, uint8_t fix, uint8_t tag16, size_t per_element,
                               size_t *count) {
    if (r->p >= r->end) return 0;
    uint8_t tag = *r->p;
    const uint8_t *at;
    if ((tag & 0xf0) == fix) {
        r->p++;
        *count = tag & 0x0f;
    } else if ((tag == tag16 || tag == tag16 + 1) && mp_take(r, tag == tag16 ? 3 : 5, &at)) {
        *count = (size_t)mp_be(at + 1, tag == tag16 ? 2 : 4);
    } else {
        return 0;
    }
    return *count <= (size_t)(r->end - r->p) / per_element;
}

static inline int mp_array(MpReader *r, size_t *count) {
    return mp_container(r, 0x90, 0xdc, 1, count);
}

static inline int mp_map(MpReader *r, size_t *count) {
    return mp_container(r, 0x80, 0xde, 2, count);
}

/* Whether ``length`` bytes at ``text`` are UTF-8 as Python decodes it strictly (no
 * overlong forms, no surrogates, nothing past U+10FFFF): a str msgpack's Python decoders
 * would refuse must not pass where C skips it. */
static inline int mp_utf8(const uint8_t *text, size_t length) {
    for (size_t i = 0; i < length;) {
        uint8_t lead = text[i];
        if (lead < 0x80) {
            i++;
            continue;
        }
        size_t width = (lead & 0xe0) == 0xc0 ? 2 : (lead & 0xf0) == 0xe0 ? 3 : (lead & 0xf8) == 0xf0 ? 4 : 0;
        if (width == 0 || length - i < width) return 0;
        uint32_t point = lead & (0x7f >> width);
        for (size_t k = 1; k < width; k++) {
            if ((text[i + k] & 0xc0) != 0x80) return 0;
            point = point << 6 | (text[i + k] & 0x3f);
        }
        uint32_t least = width == 2 ? 0x80 : width == 3 ? 0x800 : 0x10000;
        if (point < least || point > 0x10ffff || (point >= 0xd800 && point <= 0xdfff)) return 0;
        i += width;
    }
    return 1;
}

/* Any one value, containers up to ``depth`` levels deep; a str must be UTF-8. */
static inline int mp_skip(MpReader *r, int depth) {
    if (r->p >= r->end || depth <= 0) return 0;
    uint8_t tag = *r->p;
    uint64_t bits;
    int negative;
    const uint8_t *text;
    size_t count;
    if (mp_int(r, &bits, &negative)) return 1;
    if (mp_str(r, &text, &count)) return mp_utf8(text, count);
    if (mp_array(r, &count)) {
        while (count--)
            if (!mp_skip(r, depth - 1)) return 0;
        return 1;
    }
    if (mp_map(r, &count)) {
        for (count *= 2; count; count--)
            if (!mp_skip(r, depth - 1)) return 0;
        return 1;
    }
    const uint8_t *at;
    switch (tag) {
        case 0xc0: case 0xc2: case 0xc3: return mp_take(r, 1, &at);  /* nil, false, true */
        case 0xca: return mp_take(r, 5, &at);
        case 0xcb: return mp_take(r, 9, &at);
        case 0xd4: return mp_take(r, 3, &at);  /* fixext 1, 2, 4, 8, 16: tag, type, data */
        case 0xd5: return mp_take(r, 4, &at);
        case 0xd6: return mp_take(r, 6, &at);
        case 0xd7: return mp_take(r, 10, &at);
        case 0xd8: return mp_take(r, 18, &at);
        case 0xc4: case 0xc5: case 0xc6:  /* bin 8, 16, 32 */
        case 0xc7: case 0xc8: case 0xc9: {  /* ext 8, 16, 32: a type byte after the length */
            int is_ext = tag >= 0xc7, header = 1 << ((tag - 0xc4) % 3);
            if (r->end - r->p < 1 + header) return 0;
            size_t length = (size_t)mp_be(r->p + 1, header);
            return mp_take(r, 1 + (size_t)header + (size_t)is_ext + length, &at);
        }
        default: return 0;
    }
}

#endif

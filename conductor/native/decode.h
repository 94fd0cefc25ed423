/* The Python decoders' helpers (decode.c), and the token reader the ingest lane shares. */
#ifndef CONDUCTOR_NATIVE_DECODE_H
#define CONDUCTOR_NATIVE_DECODE_H

#include <Python.h>
#include <stdint.h>

#include "msgpack.h"

int read_tokens(MpReader *r, uint8_t **out, size_t *used, size_t *capacity);

#endif

/* The index's per-block loops (blocks.c), and what the ingest lane applies through them. */
#ifndef CONDUCTOR_NATIVE_BLOCKS_H
#define CONDUCTOR_NATIVE_BLOCKS_H

#include <Python.h>
#include <stdint.h>

#include "maps.h"

/* One owner's blocks on one tier, and the context maps they count in: what holding or
 * releasing a block changes. */
typedef struct {
    Map *by_engine_hash;  /* the owner's: engine hash -> prefix hash */
    PyObject *copies;  /* the owner's: engine hash -> physical copies beyond the first */
    PyObject *extra_refs;  /* the owner's: prefix hash -> engine hashes beyond the first */
    Map *engine_prefix;  /* the context's, over every owner and tier */
    PyObject *engine_refs;  /* the context's: engine hash -> holders beyond the first */
    Map *blocks;  /* the tier's prefix hash -> owner bitmask */
    PyObject *bit;  /* the owner's bit */
} Holder;

#define HOLDER_ARGS "by_engine_hash, copies, extra_refs, engine_prefix, engine_refs, blocks, bit"

int check_args(PyObject *const *args, Py_ssize_t nargs, const char *kinds);
int holder_of(PyObject *const *args, Holder *h);
int hold_block(const Holder *h, uint64_t engine_hash, uint64_t prefix_hash,
               PyObject *engine_object, PyObject *prefix_object);
int release_block(const Holder *h, PyObject *others, uint64_t engine_hash,
                  PyObject *engine_object);

#endif

/* A hash profile's chain of block keys (profile.c): what a profiled context's query is
 * keyed by, pulled one block at a time by ContextBlocks' walks and the plain answer. */
#ifndef CONDUCTOR_NATIVE_PROFILE_H
#define CONDUCTOR_NATIVE_PROFILE_H

#include <Python.h>
#include <stdint.h>

extern PyTypeObject ProfileChainType;

/* The chain's next block key into ``key``: 1, or 0 past its last complete block. Touches no
 * Python object. */
int profile_chain_next(PyObject *chain, uint64_t *key);

/* How many keys the chain has left. */
Py_ssize_t profile_chain_length(PyObject *chain);

#endif

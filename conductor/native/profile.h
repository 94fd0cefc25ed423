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

/* A chain as ``model`` (a ProfileChain, from its start) over other tokens (int32 LE, which
 * must outlive it), made without the GIL for the query thread: NULL when memory ran out.
 * ``model`` must outlive it too; profile_chain_like_free lets it go. */
PyObject *profile_chain_like(PyObject *model, const uint8_t *tokens, size_t token_bytes);
void profile_chain_like_free(PyObject *chain);

#endif

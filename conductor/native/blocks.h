/* The index's hot state (blocks.c): a context's blocks and each owner's, and the rules that
 * keep them consistent; what the ingest lane and the query walk use of it. */
#ifndef CONDUCTOR_NATIVE_BLOCKS_H
#define CONDUCTOR_NATIVE_BLOCKS_H

#include <Python.h>
#include <stdint.h>

#include "maps.h"

#define TIERS 3  /* GPU, CPU, DISK: wire.events.Tier's values */

/* One context's blocks over every owner (a PrefixContext's). */
typedef struct {
    PyObject_HEAD
    PyObject *blocks;  /* a tuple of a MaskMap per tier: prefix hash -> its holders' bits */
    Map *tiers[TIERS];  /* the same MaskMaps */
    Map *engine_prefix;  /* engine hash -> prefix hash, over every owner and tier */
    Map *engine_refs;  /* engine hash -> how many more holders than one it has */
    Py_ssize_t block_size;  /* tokens a block: what the lane hashes together */
    Sync *sync;  /* who may touch the maps while the ingest thread applies batches (sync.h) */
} ContextBlocks;

/* One owner's blocks on one tier, keyed by the engine's own hash. */
typedef struct {
    PyObject_HEAD
    ContextBlocks *context;  /* what its blocks count in */
    size_t bit;  /* the owner's bit in the tier's masks */
    int tier;
    Map *by_engine_hash;  /* engine hash -> prefix hash */
    /* engine hash -> how many more physical copies the owner holds (vLLM caches and
     * announces a block again when two requests computed it; each copy is evicted alone) */
    Map *copies;
    Map *extra_refs;  /* prefix hash -> how many more engine hashes of the owner map to it */
} Holdings;

extern PyTypeObject ContextBlocksType;
extern PyTypeObject HoldingsType;

#define HOLD_CHUNK 16  /* pairs converted (or hashed, in the lane) and then held at a time */

/* The rules below run without the GIL (an ingest thread applies batches with them), so
 * they raise nothing: a failure is a Fault, which raise_fault turns into the exception. */
typedef enum { FAULT_NONE, FAULT_MEMORY, FAULT_NO_ENGINE_HASH, FAULT_NO_PREFIX } FaultKind;
typedef struct {
    FaultKind kind;
    uint64_t hash;  /* the hash the index had no entry for */
} Fault;

int raise_fault(const Fault *fault);
int hold_blocks(const Holdings *h, const uint64_t *engine_hashes, const uint64_t *prefix_hashes,
                Py_ssize_t count, Fault *fault);
int release_blocks(const Holdings *h, const uint64_t *engine_hashes, Py_ssize_t count,
                   int every_copy, Py_ssize_t *released, Fault *fault);
int owner_of(const ContextBlocks *context, PyObject *owner, const Holdings *tiers[TIERS]);

#endif

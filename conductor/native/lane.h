/* The ingest lane (lane.c): a batch read whole into C buffers, and applied by
 * ContextBlocks.apply_packed or by the ingest thread (ingest.c). */
#ifndef CONDUCTOR_NATIVE_LANE_H
#define CONDUCTOR_NATIVE_LANE_H

#include <Python.h>
#include <stdint.h>

#include "blocks.h"

/* One event of a PackedBatch; its hashes and tokens are slices of the batch's buffers. */
typedef struct {
    size_t first_hash, hash_count;  /* in PackedBatch.hashes */
    size_t first_token, token_count;  /* in PackedBatch.tokens, 4 bytes each */
    uint64_t parent;
    uint8_t removed, has_parent;
} PackedEvent;

typedef struct {
    PyObject_HEAD
    double timestamp;
    PyObject *dp_rank;  /* None or an int */
    Py_ssize_t count, removals;
    PackedEvent *events;
    uint64_t *hashes;
    size_t hashes_used, hashes_capacity;
    uint8_t *tokens;  /* int32 little-endian */
    size_t tokens_used, tokens_capacity;
} PackedBatch;

extern PyTypeObject PackedBatchType;

/* A batch to apply to an owner's GPU blocks: what apply_packed and the ingest thread are
 * given, checked (lane_task). */
typedef struct {
    const PackedBatch *batch;
    const Holdings *owner[TIERS];
    uint64_t root;  /* the prefix hash chain's start for an event with no parent */
    int profiled;  /* a hash profile's context: the engine hashes are the keys, as they are */
} LaneTask;

/* What applying a batch did so far. */
typedef struct {
    Py_ssize_t reached;  /* the first event not applied */
    Py_ssize_t stored, removed, orphaned, mismatched;
    Fault fault;  /* FAULT_NONE: none */
} Applied;

int lane_task(ContextBlocks *context, PyObject *packed, PyObject *owner, PyObject *root,
              LaneTask *task);
void apply_steps(const LaneTask *task, Py_ssize_t max_blocks, Applied *applied);
PyObject *applied_result(const Applied *applied);

#endif

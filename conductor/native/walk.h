/* A query's walk over every tier of a context (walk.c): what ContextBlocks.walk_tiers and
 * the plain query's answer (answer.c) share. */
#ifndef CONDUCTOR_NATIVE_WALK_H
#define CONDUCTOR_NATIVE_WALK_H

#include <Python.h>
#include <stdint.h>

#include "blocks.h"

/* A pool's slot bit, and the engine slots its CPU and DISK blocks count for. */
typedef struct {
    size_t bit;
    int every;  /* a Mooncake store's pool: every slot */
    uint64_t *members;  /* ``words`` words, unless ``every`` */
} Pool;

/* One walk: every mask ``words`` words wide. */
typedef struct {
    Py_ssize_t words, pool_count;
    Pool *pools;
    uint64_t *alive;  /* per tier (GPU, own CPU, any CPU, any tier): the slots still holding */
    uint64_t *holders;  /* scratch: each tier's holders of a block, and a raw mask */
    Py_ssize_t *at;  /* per slot bit, per tier: the blocks it holds in a row */
    uint64_t *memory;
} TierWalk;

/* Ready for slots up to ``words`` words and the pools of ``pool_members`` (a dict of a pool's
 * bit to the bits it serves, -1 for every slot); each slot's stops start at ``count``. The
 * caller sets ``alive`` (every tier's copy). 0, or -1 with an exception set. */
int tier_walk_start(TierWalk *walk, Py_ssize_t words, PyObject *pool_members, Py_ssize_t count);

/* The same for ``pool_count`` pools left for the caller to fill in (none: a walk of engine
 * slots alone), without the GIL: 0, or -1 when memory ran out (no exception set). */
int tier_walk_alloc(TierWalk *walk, Py_ssize_t words, Py_ssize_t pool_count, Py_ssize_t count);

/* One block at ``position`` (``found``: whether ``hash`` is a key at all): the slots alive
 * on a tier that do not hold it there stop. Whether some slot is alive on the last tier.
 * The context's mutex is held; no Python object is touched. */
int tier_walk_step(TierWalk *walk, const ContextBlocks *context, uint64_t hash, int found,
                   Py_ssize_t position);

/* A walk as wide as ``model`` (one tier_walk_start made), with its pools, each slot's stops
 * at ``count``; without the GIL. 0, or -1 when memory ran out. */
int tier_walk_like(TierWalk *walk, const TierWalk *model, Py_ssize_t count);

void tier_walk_end(TierWalk *walk);

#endif

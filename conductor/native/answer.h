/* The plain query's plan and answer (answer.c): what the query lane's Python calls through
 * QueryPlan.answer, and what the query thread (query_thread.c) calls without the GIL. */
#ifndef CONDUCTOR_NATIVE_ANSWER_H
#define CONDUCTOR_NATIVE_ANSWER_H

#include <Python.h>
#include <stdint.h>

#include "blocks.h"
#include "walk.h"

#define TIER_COUNT 4

typedef struct {
    PyObject_HEAD
    ContextBlocks *context;
    PyObject *pool_members;  /* the context's dict: a pool's bit -> the slots it serves */
    Py_ssize_t count;  /* instances, in the answer's order */
    /* a tuple per instance: its key as written before its value (bytes), its slots' bits
     * in rank order, its value's template cut where a number goes (a tuple of bytes), and
     * which number goes in each cut (bytes) */
    PyObject *instances;
    size_t *bits;  /* every instance's slot bits, one instance after another */
    Py_ssize_t *first;  /* instance i's bits are bits[first[i]] to bits[first[i + 1] - 1] */
    size_t *template_size;  /* each instance's value at most: its parts and 20 digits a cut */
    PyObject *opener, *closer;  /* bytes: what the answer starts and ends with */
    int msgpack;  /* numbers and the map's length in msgpack; else JSON, entries by commas */
    size_t words;  /* of the widest slot bit */
} QueryPlan;

extern PyTypeObject QueryPlanType;

/* The functions below touch no Python object but the plan's own immutable ones (bytes,
 * tuples) and ``profiled``'s C state, and allocate without the GIL's allocator. */

/* The blocks a query of ``token_bytes`` walks (``profiled``: its ProfileChain, or NULL). */
Py_ssize_t plan_blocks(const QueryPlan *self, Py_ssize_t token_bytes, PyObject *profiled);

/* Each slot's blocks held in a row into ``walk`` (started for ``self->words`` words and
 * ``blocks``), under the context's mutex. 0, or -1 when memory ran out. */
int plan_walk(const QueryPlan *self, TierWalk *walk, const uint8_t *tokens, Py_ssize_t blocks,
              uint64_t root, PyObject *profiled);

/* The answer's bytes at most and how many instances it has (``*written``), then the answer
 * written at ``out`` (its end returned): each instance (with a hit on some tier, given
 * ``hits_only``), raised to ``raised[i]`` blocks (``raised``: NULL, none). */
size_t plan_answer_size(const QueryPlan *self, const TierWalk *walk, const uint64_t *raised,
                        int hits_only, Py_ssize_t *written);
char *plan_answer_write(const QueryPlan *self, const TierWalk *walk, const uint64_t *raised,
                        int hits_only, Py_ssize_t written, char *out);

#endif

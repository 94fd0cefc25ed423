/* A query's walk over the owner masks of a context: the GPU tier's (walk), every tier's
 * (walk_tiers); PrefixContext._walk_gpu and _walk_tiers. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "maps.h"
#include "masks.h"
#include "walk.h"

/* Owner masks as arrays of 64-bit words: a 1,000-slot mask is 16 words, and/compare in a
 * loop, where each int operation in Python allocates a new 1,000-bit int. */
typedef struct {
    unsigned char *bytes;  /* an int's little-endian bytes, grown to the widest seen */
    size_t size;
} Scratch;

/* The number of 64-bit words ``value`` (an int >= 0) needs; -1 on error. */
static Py_ssize_t words_of(PyObject *value) {
#if PY_VERSION_HEX >= 0x030D0000
    int flags = Py_ASNATIVEBYTES_UNSIGNED_BUFFER | Py_ASNATIVEBYTES_REJECT_NEGATIVE;
    Py_ssize_t bytes = PyLong_AsNativeBytes(value, NULL, 0, flags);
    return bytes < 0 ? -1 : (bytes + 7) / 8;
#else
    size_t bits = _PyLong_NumBits(value);
    if (bits == (size_t)-1 && PyErr_Occurred()) return -1;
    return (Py_ssize_t)((bits + 63) / 64);
#endif
}

/* The low ``words`` words of ``value`` (an int >= 0) into ``out``. */
static int low_words(PyObject *value, uint64_t *out, Py_ssize_t words, Scratch *scratch) {
    Py_ssize_t whole = words_of(value);
    if (whole < 0) return -1;
    if (whole < words) whole = words;
    size_t size = (size_t)whole * 8;
    if (size > scratch->size) {
        unsigned char *grown = PyMem_Realloc(scratch->bytes, size);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        scratch->bytes = grown;
        scratch->size = size;
    }
#if PY_VERSION_HEX >= 0x030D0000
    int flags = Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER |
                Py_ASNATIVEBYTES_REJECT_NEGATIVE;
    if (PyLong_AsNativeBytes(value, scratch->bytes, (Py_ssize_t)size, flags) < 0) return -1;
#else
    if (_PyLong_AsByteArray((PyLongObject *)value, scratch->bytes, size, 1, 0) < 0) return -1;
#endif
#if PY_LITTLE_ENDIAN
    memcpy(out, scratch->bytes, (size_t)words * 8);
#else
    for (Py_ssize_t w = 0; w < words; w++) {
        uint64_t word = 0;
        for (int b = 7; b >= 0; b--) word = word << 8 | scratch->bytes[w * 8 + b];
        out[w] = word;
    }
#endif
    return 0;
}

/* (the set bits of ``bits``, lowest first, as a list of ints, (position,) * 4) appended
 * to ``stops``. */
static int add_stop(PyObject *stops, const uint64_t *bits, Py_ssize_t words, Py_ssize_t at) {
    PyObject *indices = PyList_New(0);
    if (indices == NULL) return -1;
    for (Py_ssize_t w = 0; w < words; w++) {
        for (uint64_t word = bits[w]; word; word &= word - 1) {
            PyObject *index = PyLong_FromSsize_t(w * 64 + __builtin_ctzll(word));
            int failed = index == NULL || PyList_Append(indices, index) < 0;
            Py_XDECREF(index);
            if (failed) {
                Py_DECREF(indices);
                return -1;
            }
        }
    }
    PyObject *stop = Py_BuildValue("(N(nnnn))", indices, at, at, at, at);
    if (stop == NULL) return -1;
    int result = PyList_Append(stops, stop);
    Py_DECREF(stop);
    return result;
}

const char context_walk_doc[] =
"walk(hashes, interest, /)\n--\n\n"
"Where the owners in ``interest`` (a mask) stop along ``hashes``: each walks while the GPU\n"
"tier's mask of the next hash (``blocks[0]``) has its bit. A list\n"
"of (owner indices, (position,) * 4): the owners whose first missing block is at that\n"
"position (on each tier, for the index's answers), in order; those that hold every block\n"
"last, at len(hashes). A hash that is no unsigned 64-bit int is held by nobody.\n"
"Machine words, where Python's walk allocates an owner-wide int for each block.";

PyObject *context_walk(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "walk takes 2 arguments (%zd given)", nargs);
    }
    Map *blocks = self->tiers[0];
    PyObject *interest = args[1];
    if (!PyLong_Check(interest)) {  /* a negative one: OverflowError, read as unsigned */
        return PyErr_Format(PyExc_TypeError, "interest must be an int, not %.60R", interest);
    }
    PyObject *hashes = PySequence_Fast(args[0], "hashes must be a sequence");
    if (hashes == NULL) return NULL;
    PyObject *stops = PyList_New(0);
    Py_ssize_t words = words_of(interest);
    Scratch scratch = {NULL, 0};
    uint64_t *alive = NULL;  /* then the words held at a position, and those that stopped */
    if (stops == NULL || words < 0) goto fail;
    alive = PyMem_Calloc((size_t)(words > 0 ? words : 1) * 3, sizeof(uint64_t));
    if (alive == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    uint64_t *held = alive + words, *stopped = held + words;
    if (words > 0 && low_words(interest, alive, words, &scratch) < 0) goto fail;
    sync_lock(self->sync);  /* let go at done or fail_locked */
    for (Py_ssize_t position = 0; position < count && words > 0; position++) {
        uint64_t key, *mask = NULL;
        const uint64_t *bits;
        int found = key_of(items[position], &key);
        if (found < 0) goto fail_locked;
        if (found) mask = map_value_of(blocks, key);
        size_t known = mask != NULL ? mask_words(mask, &bits) : 0;
        if (known > (size_t)words) known = (size_t)words;
        if (known) memcpy(held, bits, known * sizeof(uint64_t));
        memset(held + known, 0, ((size_t)words - known) * sizeof(uint64_t));
        uint64_t any_stopped = 0, any_alive = 0;
        for (Py_ssize_t w = 0; w < words; w++) {
            stopped[w] = alive[w] & ~held[w];
            alive[w] &= held[w];
            any_stopped |= stopped[w];
            any_alive |= alive[w];
        }
        if (any_stopped && add_stop(stops, stopped, words, position) < 0) goto fail_locked;
        if (!any_alive) goto done;
    }
    if (add_stop(stops, alive, words, count) < 0) goto fail_locked;
done:
    sync_unlock(self->sync);
    PyMem_Free(alive);
    PyMem_Free(scratch.bytes);
    Py_DECREF(hashes);
    return stops;
fail_locked:
    sync_unlock(self->sync);
fail:
    PyMem_Free(alive);
    PyMem_Free(scratch.bytes);
    Py_DECREF(hashes);
    Py_XDECREF(stops);
    return NULL;
}

/* -- every tier ------------------------------------------------------------------------ */

/* 1 for a pool serving every slot (its members -1, index.EVERY_SLOT), 0 for a mask of
 * slots (an int >= 0), -1 on error. */
static int every_slot(PyObject *members) {
    if (!PyLong_Check(members)) {
        PyErr_Format(PyExc_TypeError, "pool members must be an int, not %.60R", members);
        return -1;
    }
    int overflow;
    long long small = PyLong_AsLongLongAndOverflow(members, &overflow);
    if (small == -1 && PyErr_Occurred()) return -1;
    return !overflow && small < 0;
}

int tier_walk_alloc(TierWalk *walk, Py_ssize_t words, Py_ssize_t pool_count, Py_ssize_t count) {
    memset(walk, 0, sizeof *walk);
    walk->words = words;
    walk->pool_count = pool_count;
    size_t masks = 4 + 5 + (size_t)pool_count;  /* alive, holders and raw, members */
    walk->memory = PyMem_RawCalloc((size_t)words * masks, sizeof(uint64_t));
    walk->pools = PyMem_RawCalloc(pool_count > 0 ? (size_t)pool_count : 1, sizeof(Pool));
    walk->at = PyMem_RawMalloc((size_t)words * 64 * 4 * sizeof(Py_ssize_t));
    if (walk->memory == NULL || walk->pools == NULL || walk->at == NULL) {
        tier_walk_end(walk);
        return -1;
    }
    walk->alive = walk->memory;
    walk->holders = walk->memory + 4 * words;
    for (Py_ssize_t i = 0; i < words * 64 * 4; i++) walk->at[i] = count;
    return 0;
}

int tier_walk_start(TierWalk *walk, Py_ssize_t words, PyObject *pool_members,
                    Py_ssize_t count) {
    memset(walk, 0, sizeof *walk);
    if (!PyDict_Check(pool_members)) {
        PyErr_SetString(PyExc_TypeError, "pool_members must be a dict");
        return -1;
    }
    PyObject *key, *value;
    Py_ssize_t cursor = 0;
    while (PyDict_Next(pool_members, &cursor, &key, &value)) {  /* wide enough for them */
        int every = every_slot(value);
        if (every < 0) return -1;
        PyObject *length = PyObject_CallMethod(key, "bit_length", NULL);  /* a key: 1 << index */
        Py_ssize_t key_bits = length == NULL ? -1 : PyLong_AsSsize_t(length);
        Py_XDECREF(length);
        Py_ssize_t member_words = every ? 0 : words_of(value);
        if (key_bits < 0 || member_words < 0) return -1;
        if ((key_bits + 63) / 64 > words) words = (key_bits + 63) / 64;
        if (member_words > words) words = member_words;
    }
    if (words == 0) words = 1;
    if (tier_walk_alloc(walk, words, PyDict_GET_SIZE(pool_members), count) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    Scratch scratch = {NULL, 0};
    cursor = 0;
    for (Py_ssize_t p = 0; PyDict_Next(pool_members, &cursor, &key, &value); p++) {
        Pool *pool = &walk->pools[p];
        PyObject *length = PyObject_CallMethod(key, "bit_length", NULL);  /* a key: 1 << index */
        Py_ssize_t bits = length == NULL ? -1 : PyLong_AsSsize_t(length);
        Py_XDECREF(length);
        if (bits <= 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "pool_members' keys are pool bits, 1 << index");
            goto fail;
        }
        pool->bit = (size_t)(bits - 1);
        pool->every = every_slot(value);
        pool->members = walk->memory + (9 + p) * words;
        if (!pool->every && low_words(value, pool->members, words, &scratch) < 0) goto fail;
    }
    PyMem_Free(scratch.bytes);
    return 0;
fail:
    PyMem_Free(scratch.bytes);
    tier_walk_end(walk);
    return -1;
}

int tier_walk_like(TierWalk *walk, const TierWalk *model, Py_ssize_t count) {
    if (tier_walk_alloc(walk, model->words, model->pool_count, count) < 0) return -1;
    for (Py_ssize_t p = 0; p < model->pool_count; p++) {
        walk->pools[p] = model->pools[p];
        walk->pools[p].members = walk->memory + (9 + p) * walk->words;
        memcpy(walk->pools[p].members, model->pools[p].members,
               (size_t)walk->words * sizeof(uint64_t));
    }
    return 0;
}

void tier_walk_end(TierWalk *walk) {
    PyMem_RawFree(walk->memory);
    PyMem_RawFree(walk->pools);
    PyMem_RawFree(walk->at);
    memset(walk, 0, sizeof *walk);
}

/* ``holders`` |= the members of every pool whose bit ``held`` (a tier's raw mask) has. */
static void add_members(uint64_t *holders, const uint64_t *held, const TierWalk *walk) {
    for (Py_ssize_t p = 0; p < walk->pool_count; p++) {
        const Pool *pool = &walk->pools[p];
        if (!(held[pool->bit / 64] >> pool->bit % 64 & 1)) continue;
        for (Py_ssize_t w = 0; w < walk->words; w++)
            holders[w] |= pool->every ? UINT64_MAX : pool->members[w];
    }
}

/* The mask stored for ``key`` in ``map`` (absent: none) as ``words`` words. */
static void mask_at(Map *map, uint64_t key, int found, uint64_t *out, Py_ssize_t words) {
    uint64_t *mask = found && map_length(map) ? map_value_of(map, key) : NULL;
    const uint64_t *bits;
    size_t known = mask != NULL ? mask_words(mask, &bits) : 0;
    if (known > (size_t)words) known = (size_t)words;
    if (known) memcpy(out, bits, known * sizeof(uint64_t));
    memset(out + known, 0, ((size_t)words - known) * sizeof(uint64_t));
}

int tier_walk_step(TierWalk *walk, const ContextBlocks *context, uint64_t hash, int found,
                   Py_ssize_t position) {
    Py_ssize_t words = walk->words;
    uint64_t *gpu = walk->holders, *own_cpu = gpu + words, *cpu = gpu + 2 * words;
    uint64_t *disk = gpu + 3 * words, *raw = gpu + 4 * words;
    mask_at(context->tiers[0], hash, found, gpu, words);
    mask_at(context->tiers[1], hash, found, raw, words);
    for (Py_ssize_t w = 0; w < words; w++) own_cpu[w] = gpu[w] | raw[w], cpu[w] = raw[w];
    add_members(cpu, raw, walk);
    for (Py_ssize_t w = 0; w < words; w++) cpu[w] |= own_cpu[w];
    mask_at(context->tiers[2], hash, found, raw, words);
    memcpy(disk, raw, (size_t)words * 8);
    add_members(disk, raw, walk);
    uint64_t any_alive = 0;
    for (int tier = 0; tier < 4; tier++) {
        uint64_t *alive = walk->alive + tier * words, *held = walk->holders + tier * words;
        for (Py_ssize_t w = 0; w < words; w++) {
            if (tier == 3) held[w] |= cpu[w];
            for (uint64_t stopped = alive[w] & ~held[w]; stopped; stopped &= stopped - 1)
                walk->at[(w * 64 + __builtin_ctzll(stopped)) * 4 + tier] = position;
            alive[w] &= held[w];
            if (tier == 3) any_alive |= alive[w];
        }
    }
    return any_alive != 0;
}

const char context_walk_tiers_doc[] =
"walk_tiers(hashes, interest, pool_members, /)\n--\n\n"
"Where each owner in ``interest`` stops along ``hashes`` on each of four tiers: the GPU;\n"
"the GPU or its own CPU; any CPU it can load from (a pool's, ``pool_members`` mapping a\n"
"pool's bit to the bits it serves, -1 for every owner); any tier. A list of ([index],\n"
"(gpu, cpu_local, cpu, disk)), owners lowest bit first; an owner holding every block stops\n"
"at len(hashes). A hash that is no unsigned 64-bit int is held by nobody.\n"
"PrefixContext's general walk, on the masks as machine words.";

PyObject *context_walk_tiers(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "walk_tiers takes hashes, interest (int), pool_members (dict)");
        return NULL;
    }
    Py_ssize_t words = words_of(args[1]);
    if (words < 0) return NULL;
    PyObject *hashes = PySequence_Fast(args[0], "hashes must be a sequence");
    if (hashes == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    TierWalk walk;
    if (tier_walk_start(&walk, words, args[2], count) < 0) {
        Py_DECREF(hashes);
        return NULL;
    }
    Scratch scratch = {NULL, 0};
    PyObject *stops = PyList_New(0);
    if (stops == NULL || low_words(args[1], walk.alive, walk.words, &scratch) < 0) goto fail;
    for (int tier = 1; tier < 4; tier++)
        memcpy(walk.alive + tier * walk.words, walk.alive, (size_t)walk.words * 8);
    sync_lock(self->sync);
    for (Py_ssize_t position = 0; position < count; position++) {
        uint64_t hash;
        int found = key_of(items[position], &hash);
        if (found < 0) {
            sync_unlock(self->sync);
            goto fail;
        }
        if (!tier_walk_step(&walk, self, hash, found, position)) break;
    }
    sync_unlock(self->sync);
    /* every owner of the interest, lowest bit first: ([index], its four stops) */
    if (low_words(args[1], walk.alive, walk.words, &scratch) < 0) goto fail;
    for (Py_ssize_t w = 0; w < walk.words; w++) {
        for (uint64_t left = walk.alive[w]; left; left &= left - 1) {
            Py_ssize_t index = w * 64 + __builtin_ctzll(left), *at = &walk.at[index * 4];
            PyObject *stop = Py_BuildValue("([n](nnnn))", index, at[0], at[1], at[2], at[3]);
            if (stop == NULL || PyList_Append(stops, stop) < 0) {
                Py_XDECREF(stop);
                goto fail;
            }
            Py_DECREF(stop);
        }
    }
    tier_walk_end(&walk);
    PyMem_Free(scratch.bytes);
    Py_DECREF(hashes);
    return stops;
fail:
    tier_walk_end(&walk);
    PyMem_Free(scratch.bytes);
    Py_DECREF(hashes);
    Py_XDECREF(stops);
    return NULL;
}

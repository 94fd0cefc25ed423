/* The index's hot state: ContextBlocks, a context's blocks over every owner, and Holdings,
 * one owner's blocks on one tier. Python's PrefixContext keeps its slots, pools and the
 * match logic, reads these maps, and changes them only through the methods below, which
 * keep the counts that hold them together (docs/architecture.md, "The index's invariants"):
 *
 *   - an owner's holdings map each engine hash it holds to its prefix hash; a hash stored
 *     again is one more physical copy (``copies``), a prefix reached through another engine
 *     hash one more reference (``extra_refs``);
 *   - the context maps each engine hash to its prefix over every owner and tier, with the
 *     holders beyond the first in ``engine_refs`` (a lookup by engine hash is one probe);
 *   - a tier's mask of a prefix has the bit of each owner holding it on that tier.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <structmember.h>

#include "blocks.h"
#include "maps.h"
#include "masks.h"

/* -- the rules ------------------------------------------------------------------------- */

/* counts[key] += 1 (a HashMap of counts: an absent key counts 0). 0, or -1 out of memory. */
static int count_up(Map *counts, uint64_t key) {
    int created;
    uint64_t *count = map_value_slot(counts, key, &created);
    if (count == NULL) return -1;
    ++*count;
    return 0;
}

/* 1 when ``counts`` has ``key`` (counted one less now, gone at 0), 0 when not. */
static int count_down(Map *counts, uint64_t key) {
    uint64_t *count = map_value_of(counts, key), old;
    if (count == NULL) return 0;
    if (--*count == 0) map_erase(counts, key, &old);
    return 1;
}

/* The sum of a HashMap's counts. */
static Py_ssize_t total(const Map *counts) {
    Py_ssize_t sum = 0;
    MapCursor at = MAP_START;
    uint64_t key, count;
    while (map_next(counts, &at, &key, &count)) sum += (Py_ssize_t)count;
    return sum;
}

int raise_fault(const Fault *fault) {
    if (fault->kind == FAULT_MEMORY) PyErr_NoMemory();
    else PyErr_Format(PyExc_KeyError, "%s %llu",
                      fault->kind == FAULT_NO_PREFIX ? "prefix" : "engine hash",
                      (unsigned long long)fault->hash);
    return -1;
}

/* The owner holds one block more: a block it holds already counts one more copy, a prefix
 * it holds under another engine hash one more extra reference. 0, or -1 out of memory. */
static int hold_block(const Holdings *h, uint64_t engine_hash, uint64_t prefix_hash) {
    const ContextBlocks *context = h->context;
    int created;
    uint64_t *slot = map_value_slot(h->by_engine_hash, engine_hash, &created);
    if (slot == NULL) return -1;
    if (!created) return count_up(h->copies, engine_hash);
    *slot = prefix_hash;
    slot = map_value_slot(context->engine_prefix, engine_hash, &created);
    if (slot == NULL) return -1;
    if (created) {
        *slot = prefix_hash;
    } else if (count_up(context->engine_refs, engine_hash) < 0) {
        return -1;
    }
    Map *blocks = context->tiers[h->tier];
    slot = map_value_slot(blocks, prefix_hash, &created);
    if (slot == NULL) return -1;
    if (!created && mask_has(*slot, h->bit)) return count_up(h->extra_refs, prefix_hash);
    if (mask_add(slot, h->bit) == 0) return 0;
    uint64_t empty;
    if (created) map_erase(blocks, prefix_hash, &empty);  /* no mask: no entry */
    return -1;
}

/* hold_block for ``count`` pairs in order, each of its three map slots fetched HOLD_AHEAD
 * pairs ahead (as release_blocks does: at a million blocks each is a cache miss, and a few
 * pairs' misses overlap). 0, or -1 and the fault (the pairs before the failing one held). */
#ifndef HOLD_AHEAD
#define HOLD_AHEAD 4
#endif

int hold_blocks(const Holdings *h, const uint64_t *engine_hashes, const uint64_t *prefix_hashes,
                Py_ssize_t count, Fault *fault) {
    const ContextBlocks *context = h->context;
    for (Py_ssize_t i = 0; i < count + HOLD_AHEAD; i++) {
        if (i < count) {
            map_prefetch(h->by_engine_hash, engine_hashes[i]);
            map_prefetch(context->engine_prefix, engine_hashes[i]);
            map_prefetch(context->tiers[h->tier], prefix_hashes[i]);
        }
        Py_ssize_t now = i - HOLD_AHEAD;
        if (now >= 0 && hold_block(h, engine_hashes[now], prefix_hashes[now]) < 0) {
            *fault = (Fault){FAULT_MEMORY, engine_hashes[now]};
            return -1;
        }
    }
    return 0;
}

/* Clear the owner's bit from the mask its tier holds for the prefix, at ``mask``; the
 * entry goes with its last bit. */
static void unset_bit(const Holdings *h, uint64_t prefix_hash, uint64_t *mask) {
    uint64_t empty;
    if (mask_remove(mask, h->bit)) map_erase(h->context->tiers[h->tier], prefix_hash, &empty);
}

/* One holder fewer of ``engine_hash`` in the context: a count less in ``engine_refs``
 * while others hold it, else its entry goes. 1, or 0 when it had none. */
static int release_engine_hash(const ContextBlocks *context, uint64_t engine_hash) {
    uint64_t old;
    return count_down(context->engine_refs, engine_hash)
           || map_erase(context->engine_prefix, engine_hash, &old);
}

/* The owner holds one copy fewer of a block (``every_copy``: none): 1 when it held it, 0
 * when not, -1 and the fault when the context's maps lack what the owner's maps name. Its last
 * copy gone, the block is forgotten; its prefix keeps the owner's bit while another engine
 * hash of the owner still stands for it. */
static int release_block(const Holdings *h, uint64_t engine_hash, int every_copy, Fault *fault) {
    uint64_t prefix_hash, *mask;
    if (every_copy) {
        map_erase(h->copies, engine_hash, &prefix_hash);
    } else if (count_down(h->copies, engine_hash)) {
        return 1;
    }
    if (!map_erase(h->by_engine_hash, engine_hash, &prefix_hash)) return 0;
    if (!release_engine_hash(h->context, engine_hash)) {
        *fault = (Fault){FAULT_NO_ENGINE_HASH, engine_hash};
        return -1;
    }
    if (count_down(h->extra_refs, prefix_hash)) return 1;
    mask = map_value_of(h->context->tiers[h->tier], prefix_hash);
    if (mask == NULL) {
        *fault = (Fault){FAULT_NO_PREFIX, prefix_hash};
        return -1;
    }
    unset_bit(h, prefix_hash, mask);
    return 1;
}

/* release_block for each of ``count`` engine hashes in order, adding to ``*released`` how
 * many the owner held. 0, or -1 on error (the hashes before the failing one released).
 *
 * At a million blocks a removal misses the cache (and the TLB) on each of its maps: the
 * owner's engine hash, the context's, then the tier's prefix, which only the first one's
 * value names. So the first two maps' slots are fetched RELEASE_AHEAD hashes ahead, the
 * prefix's half as far (once the owner's entry is at hand), and the misses of a few hashes
 * overlap. A modest gain on a VM (~5-10 %, bench/results/index-vs-dynamo.md): what is left
 * is mostly page walks, which huge pages cut. */
#define RELEASE_CHUNK 16  /* hashes release_each converts at a time */
#ifndef RELEASE_AHEAD
#define RELEASE_AHEAD 4
#endif

int release_blocks(const Holdings *h, const uint64_t *engine_hashes, Py_ssize_t count,
                   int every_copy, Py_ssize_t *released, Fault *fault) {
    const ContextBlocks *context = h->context;
    const Map *tier = context->tiers[h->tier];
    for (Py_ssize_t i = 0; i < count + 2 * RELEASE_AHEAD; i++) {
        if (i < count) {
            map_prefetch(h->by_engine_hash, engine_hashes[i]);
            map_prefetch(context->engine_prefix, engine_hashes[i]);
        }
        Py_ssize_t next = i - RELEASE_AHEAD, now = i - 2 * RELEASE_AHEAD;
        uint64_t prefix_hash;
        if (next >= 0 && next < count
            && map_lookup(h->by_engine_hash, engine_hashes[next], &prefix_hash))
            map_prefetch(tier, prefix_hash);
        if (now >= 0) {
            int held = release_block(h, engine_hashes[now], every_copy, fault);
            if (held < 0) return -1;
            *released += held;
        }
    }
    return 0;
}

/* Forget every block of the owner on its tier. */
static void clear_holdings(const Holdings *h) {
    MapCursor at = MAP_START;
    uint64_t engine_hash, prefix_hash, *mask;
    while (map_next(h->by_engine_hash, &at, &engine_hash, &prefix_hash)) {
        release_engine_hash(h->context, engine_hash);
        mask = map_value_of(h->context->tiers[h->tier], prefix_hash);
        if (mask != NULL && mask_has(*mask, h->bit))  /* else unset already: an extra reference's */
            unset_bit(h, prefix_hash, mask);
    }
    map_clear_all(h->by_engine_hash);
    map_clear_all(h->copies);
    map_clear_all(h->extra_refs);
}

/* -- Holdings ---------------------------------------------------------------------------- */

static Holdings *holdings_new(ContextBlocks *context, size_t bit, int tier) {
    Holdings *h = PyObject_New(Holdings, &HoldingsType);
    if (h == NULL) return NULL;
    h->context = (ContextBlocks *)Py_NewRef(context);
    h->bit = bit;
    h->tier = tier;
    h->by_engine_hash = map_of_context(&HashMapType, context->sync);
    h->copies = map_of_context(&HashMapType, context->sync);
    h->extra_refs = map_of_context(&HashMapType, context->sync);
    if (h->by_engine_hash == NULL || h->copies == NULL || h->extra_refs == NULL) Py_CLEAR(h);
    return h;
}

static void holdings_dealloc(Holdings *h) {
    Py_XDECREF(h->by_engine_hash);
    Py_XDECREF(h->copies);
    Py_XDECREF(h->extra_refs);
    Py_DECREF(h->context);
    PyObject_Free(h);
}

static PyObject *holdings_count(Holdings *h, PyObject *unused) {
    sync_lock(h->context->sync);
    Py_ssize_t count = map_length(h->by_engine_hash) + total(h->copies);
    sync_unlock(h->context->sync);
    return PyLong_FromSsize_t(count);
}

static PyObject *holdings_prefix_count(Holdings *h, PyObject *unused) {
    sync_lock(h->context->sync);
    Py_ssize_t count = map_length(h->by_engine_hash) - total(h->extra_refs);
    sync_unlock(h->context->sync);
    return PyLong_FromSsize_t(count);
}

static PyMethodDef holdings_methods[] = {
    {"count", (PyCFunction)holdings_count, METH_NOARGS,
     "count()\n--\n\nthe engine blocks held, each physical copy counted"},
    {"prefix_count", (PyCFunction)holdings_prefix_count, METH_NOARGS,
     "prefix_count()\n--\n\nthe distinct prefix blocks held, as the tier's masks count them"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef holdings_members[] = {
    {"by_engine_hash", T_OBJECT, offsetof(Holdings, by_engine_hash), READONLY,
     "engine hash -> prefix hash (a HashMap; read only)"},
    {"copies", T_OBJECT, offsetof(Holdings, copies), READONLY,
     "engine hash -> how many more physical copies are held (a HashMap; read only)"},
    {"extra_refs", T_OBJECT, offsetof(Holdings, extra_refs), READONLY,
     "prefix hash -> how many more engine hashes map to it (a HashMap; read only)"},
    {NULL},
};

PyTypeObject HoldingsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "conductor._native.Holdings",
    .tp_doc = "One owner's blocks on one tier of a context (ContextBlocks.owner makes them).",
    .tp_basicsize = sizeof(Holdings),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_dealloc = (destructor)holdings_dealloc,
    .tp_methods = holdings_methods,
    .tp_members = holdings_members,
};

/* -- ContextBlocks ----------------------------------------------------------------------- */

/* ``object`` as holdings of ``context``; NULL (an error set) when it is not. */
static const Holdings *holdings_of(const ContextBlocks *context, PyObject *object) {
    if (!Py_IS_TYPE(object, &HoldingsType) || ((Holdings *)object)->context != context) {
        PyErr_SetString(PyExc_TypeError, "holdings must be a Holdings of this ContextBlocks");
        return NULL;
    }
    return (const Holdings *)object;
}

/* ``owner``, a tuple this context's ``owner`` made, as its holdings per tier: 0, or -1. */
int owner_of(const ContextBlocks *context, PyObject *owner, const Holdings *tiers[TIERS]) {
    int valid = PyTuple_Check(owner) && PyTuple_GET_SIZE(owner) == TIERS;
    for (int tier = 0; valid && tier < TIERS; tier++) {
        tiers[tier] = (const Holdings *)PyTuple_GET_ITEM(owner, tier);
        valid = Py_IS_TYPE(tiers[tier], &HoldingsType) && tiers[tier]->context == context
                && tiers[tier]->tier == tier && tiers[tier]->bit == tiers[0]->bit;
    }
    if (!valid) PyErr_SetString(PyExc_TypeError, "owner must be a tuple this ContextBlocks made");
    return valid ? 0 : -1;
}

static int check_count(Py_ssize_t nargs, Py_ssize_t expected, const char *name) {
    if (nargs == expected) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, expected, nargs);
    return -1;
}

static PyObject *context_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Py_ssize_t block_size;
    static char *names[] = {"block_size", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:ContextBlocks", names, &block_size))
        return NULL;
    ContextBlocks *self = (ContextBlocks *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->block_size = block_size;
    self->sync = sync_new();
    self->blocks = self->sync != NULL ? PyTuple_New(TIERS) : NULL;
    if (self->blocks == NULL) goto fail;
    for (int tier = 0; tier < TIERS; tier++) {
        self->tiers[tier] = map_of_context(&MaskMapType, self->sync);
        if (self->tiers[tier] == NULL) goto fail;
        PyTuple_SET_ITEM(self->blocks, tier, Py_NewRef(self->tiers[tier]));
    }
    self->engine_prefix = map_of_context(&HashMapType, self->sync);
    self->engine_refs = map_of_context(&HashMapType, self->sync);
    if (self->engine_prefix == NULL || self->engine_refs == NULL) goto fail;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static void context_dealloc(ContextBlocks *self) {
    for (int tier = 0; tier < TIERS; tier++) Py_XDECREF(self->tiers[tier]);
    Py_XDECREF(self->blocks);
    Py_XDECREF(self->engine_prefix);
    Py_XDECREF(self->engine_refs);
    sync_release(self->sync);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(context_owner_doc,
"owner(bit, /)\n--\n\n"
"A new owner's holdings on each tier (GPU, CPU, DISK), empty; ``bit`` (a power of two) is\n"
"the owner's bit in the context's masks, given to no other owner while it holds blocks.");

static PyObject *context_owner(ContextBlocks *self, PyObject *bit) {
    uint64_t mask;
    if (!PyLong_Check(bit) || mask_from_int(bit, &mask) < 0) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) PyErr_Clear();
        if (!PyErr_Occurred()) goto refused;
        return NULL;
    }
    const uint64_t *words;
    size_t count = mask_words(&mask, &words), set = 0, index = 0;
    for (size_t w = 0; w < count; w++) {
        if (words[w]) index = w * 64 + (size_t)__builtin_ctzll(words[w]);
        set += (size_t)__builtin_popcountll(words[w]);
    }
    mask_free(mask);
    if (set != 1) goto refused;
    PyObject *owner = PyTuple_New(TIERS);
    for (int tier = 0; owner != NULL && tier < TIERS; tier++) {
        Holdings *h = holdings_new(self, index, tier);
        if (h == NULL) Py_CLEAR(owner);
        else PyTuple_SET_ITEM(owner, tier, (PyObject *)h);
    }
    return owner;
refused:
    return PyErr_Format(PyExc_ValueError, "bit must be a power of two, not %.60R", bit);
}

PyDoc_STRVAR(context_hold_doc,
"hold(holdings, engine_hashes, prefix_hashes, /)\n--\n\n"
"PrefixContext.hold: the owner holds these blocks (pairs of the two sequences, up to the\n"
"shorter) on its holdings' tier. A block it holds already counts one more copy; an engine\n"
"hash another owner holds, one more holder; a prefix it holds under another engine hash,\n"
"one more extra reference; else its tier's mask of the prefix gets the owner's bit.\n"
"Returns how many pairs it took; a hash that is no unsigned 64-bit int raises TypeError\n"
"(the pairs before it are held).");

static PyObject *context_hold(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_count(nargs, 3, "hold") < 0) return NULL;
    const Holdings *h = holdings_of(self, args[0]);
    if (h == NULL) return NULL;
    PyObject *engine_seq = PySequence_Fast(args[1], "engine_hashes must be a sequence");
    if (engine_seq == NULL) return NULL;
    PyObject *prefix_seq = PySequence_Fast(args[2], "prefix_hashes must be a sequence");
    if (prefix_seq == NULL) {
        Py_DECREF(engine_seq);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(engine_seq);
    if (PySequence_Fast_GET_SIZE(prefix_seq) < count) count = PySequence_Fast_GET_SIZE(prefix_seq);
    PyObject **engine_hashes = PySequence_Fast_ITEMS(engine_seq);
    PyObject **prefix_hashes = PySequence_Fast_ITEMS(prefix_seq);
    PyObject *result = NULL;
    uint64_t engine_keys[HOLD_CHUNK], prefix_keys[HOLD_CHUNK];
    sync_settle(self->sync);
    for (Py_ssize_t i = 0; i < count;) {
        Py_ssize_t taken = 0, failed = 0;
        for (; i < count && taken < HOLD_CHUNK; i++, taken++) {
            if (required_key(engine_hashes[i], &engine_keys[taken]) < 0
                || required_key(prefix_hashes[i], &prefix_keys[taken]) < 0) {
                failed = 1;
                break;
            }
        }
        Fault fault;
        if (hold_blocks(h, engine_keys, prefix_keys, taken, &fault) < 0) {
            raise_fault(&fault);
            goto done;
        }
        if (failed) goto done;
    }
    result = PyLong_FromSsize_t(count);
done:
    sync_unlock(self->sync);
    Py_DECREF(engine_seq);
    Py_DECREF(prefix_seq);
    return result;
}

/* release and evict: each engine hash's block released (every copy of it, or one). A hash
 * that is no unsigned 64-bit int is held by no one: skipped. */
static PyObject *release_each(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs,
                              int every_copy) {
    if (check_count(nargs, 2, every_copy ? "evict" : "release") < 0) return NULL;
    const Holdings *h = holdings_of(self, args[0]);
    if (h == NULL) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "engine_hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), released = 0;
    PyObject **engine_hashes = PySequence_Fast_ITEMS(seq), *result = NULL;
    uint64_t keys[RELEASE_CHUNK];
    sync_settle(self->sync);
    for (Py_ssize_t i = 0; i < count;) {
        Py_ssize_t taken = 0, failed = 0;
        for (; i < count && taken < RELEASE_CHUNK; i++) {
            int found = key_of(engine_hashes[i], &keys[taken]);
            if (found < 0) {
                failed = 1;
                break;
            }
            taken += found;
        }
        Fault fault;
        if (release_blocks(h, keys, taken, every_copy, &released, &fault) < 0) {
            raise_fault(&fault);
            goto done;
        }
        if (failed) goto done;
    }
    result = PyLong_FromSsize_t(released);
done:
    sync_unlock(self->sync);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(context_release_doc,
"release(holdings, engine_hashes, /)\n--\n\n"
"PrefixContext.release_many: the owner holds one copy fewer of each of these blocks on its\n"
"holdings' tier (hashes it does not hold are skipped). Its last copy gone, a block has one\n"
"holder fewer in the context, and its prefix's mask loses the owner's bit (the entry goes\n"
"with the last bit) unless another engine hash of the owner stands for that prefix.\n"
"Returns how many it held.");

static PyObject *context_release(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs) {
    return release_each(self, args, nargs, 0);
}

PyDoc_STRVAR(context_evict_doc,
"evict(holdings, engine_hashes, /)\n--\n\n"
"``release``, every copy of each block at once (its one key left the store, whoever saved\n"
"it). Returns how many it held.");

static PyObject *context_evict(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs) {
    return release_each(self, args, nargs, 1);
}

PyDoc_STRVAR(context_clear_doc,
"clear(holdings, /)\n--\n\n"
"PrefixContext.clear_slot for one tier: the owner holds nothing there any more. Returns how\n"
"many engine blocks it held, each copy counted.");

static PyObject *context_clear(ContextBlocks *self, PyObject *holdings) {
    const Holdings *h = holdings_of(self, holdings);
    if (h == NULL) return NULL;
    sync_settle(self->sync);
    Py_ssize_t held = map_length(h->by_engine_hash) + total(h->copies);
    clear_holdings(h);
    sync_unlock(self->sync);
    return PyLong_FromSsize_t(held);
}

/* defined with their concerns */
PyObject *context_walk(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *context_walk_tiers(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *context_apply_packed(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs);
extern const char context_walk_doc[], context_walk_tiers_doc[], context_apply_packed_doc[];

#define FASTCALL(function) (PyCFunction)(void (*)(void))(function), METH_FASTCALL

static PyMethodDef context_methods[] = {
    {"owner", (PyCFunction)context_owner, METH_O, context_owner_doc},
    {"hold", FASTCALL(context_hold), context_hold_doc},
    {"release", FASTCALL(context_release), context_release_doc},
    {"evict", FASTCALL(context_evict), context_evict_doc},
    {"clear", (PyCFunction)context_clear, METH_O, context_clear_doc},
    {"apply_packed", FASTCALL(context_apply_packed), context_apply_packed_doc},
    {"walk", FASTCALL(context_walk), context_walk_doc},
    {"walk_tiers", FASTCALL(context_walk_tiers), context_walk_tiers_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef context_members[] = {
    {"blocks", T_OBJECT, offsetof(ContextBlocks, blocks), READONLY,
     "per tier (GPU, CPU, DISK), prefix hash -> its holders' bits (MaskMaps; read only)"},
    {"engine_prefix", T_OBJECT, offsetof(ContextBlocks, engine_prefix), READONLY,
     "engine hash -> prefix hash, over every owner and tier (a HashMap; read only)"},
    {"engine_refs", T_OBJECT, offsetof(ContextBlocks, engine_refs), READONLY,
     "engine hash -> how many more holders than one it has (a HashMap; read only)"},
    {NULL},
};

PyTypeObject ContextBlocksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "conductor._native.ContextBlocks",
    .tp_doc = "ContextBlocks(block_size)\n--\n\n"
              "The blocks of one context (tenant, model, LoRA, block size) and of each of its\n"
              "owners, with the rules that keep them consistent.",
    .tp_basicsize = sizeof(ContextBlocks),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = context_new,
    .tp_dealloc = (destructor)context_dealloc,
    .tp_methods = context_methods,
    .tp_members = context_members,
};

int blocks_exec(PyObject *module) {
    PyTypeObject *types[] = {&ContextBlocksType, &HoldingsType};
    for (size_t i = 0; i < 2; i++) {
        if (PyType_Ready(types[i]) < 0 || PyModule_AddType(module, types[i]) < 0) return -1;
    }
    return 0;
}

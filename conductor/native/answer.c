/* The plain query's answer, from the index straight to its bytes (conductor.plain_query).
 *
 * Why: answering a 1-block query in Python (validation, the match's objects, the answer's
 * dicts, their encoding) cost ~80 µs of CPU in the service, more than the kernel's own
 * work on the request, as the interpreter runs it cold between two requests. In the usual
 * context (Go prefix hashes, every instance one engine slot of one DP rank) an instance's
 * answer holds eight numbers at most: on each tier, the tokens its slot holds in a row
 * from the prompt's start, for the instance (raised to what a router routed there) and for
 * its DP rank. A QueryPlan walks the tiers' masks for those (walk.h) and writes each
 * instance's answer from templates the service's own encoders made
 * (conductor.plain_query), so both ways answer alike byte for byte (the tests compare them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "hashing.h"
#include "answer.h"
#include "profile.h"

/* The numbers of an instance's answer, as a template's kinds name them: the instance's
 * tokens on each tier (GPU, own CPU, any CPU, any tier: the most any of its slots holds;
 * raised to what a router routed there, when a query gives such a minimum), then each of
 * its DP ranks' own, in rank order (never raised, as conductor.routed.raise_hits leaves
 * the ranks alone). */
#define MOST_NUMBERS 256  /* a kind is a byte: 4 + 4 * 63 ranks at most */


static void plan_dealloc(QueryPlan *self) {
    Py_XDECREF(self->context);
    Py_XDECREF(self->pool_members);
    Py_XDECREF(self->instances);
    Py_XDECREF(self->opener);
    Py_XDECREF(self->closer);
    PyMem_Free(self->bits);
    PyMem_Free(self->first);
    PyMem_Free(self->template_size);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *name_of(const QueryPlan *self, Py_ssize_t i) {
    return PyTuple_GET_ITEM(PyTuple_GET_ITEM(self->instances, i), 0);
}

static PyObject *parts_of(const QueryPlan *self, Py_ssize_t i) {
    return PyTuple_GET_ITEM(PyTuple_GET_ITEM(self->instances, i), 2);
}

static const unsigned char *kinds_of(const QueryPlan *self, Py_ssize_t i) {
    return (const unsigned char *)PyBytes_AS_STRING(PyTuple_GET_ITEM(PyTuple_GET_ITEM(self->instances, i), 3));
}

/* Instance ``i``'s entry (name, bits, parts, kinds) checked; its bits appended at
 * ``self->bits[*at]``. 0, or -1 with an exception set. */
static int read_instance(QueryPlan *self, Py_ssize_t i, Py_ssize_t *at) {
    PyObject *entry = PyTuple_GET_ITEM(self->instances, i);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4
        || !PyBytes_Check(PyTuple_GET_ITEM(entry, 0)) || !PyTuple_Check(PyTuple_GET_ITEM(entry, 1))
        || !PyTuple_Check(PyTuple_GET_ITEM(entry, 2)) || !PyBytes_Check(PyTuple_GET_ITEM(entry, 3))) {
        PyErr_SetString(PyExc_TypeError,
                        "an instance is (name: bytes, bits: tuple, parts: tuple, kinds: bytes)");
        return -1;
    }
    PyObject *bits = PyTuple_GET_ITEM(entry, 1), *parts = PyTuple_GET_ITEM(entry, 2);
    Py_ssize_t slots = PyTuple_GET_SIZE(bits), cuts = PyBytes_GET_SIZE(PyTuple_GET_ITEM(entry, 3));
    int kinds_known = 1;
    for (Py_ssize_t k = 0; k < cuts; k++)
        kinds_known &= kinds_of(self, i)[k] < TIER_COUNT * (1 + slots);
    if (slots < 1 || TIER_COUNT * (1 + slots) > MOST_NUMBERS || PyTuple_GET_SIZE(parts) != cuts + 1
        || !kinds_known) {
        PyErr_SetString(PyExc_ValueError,
                        "an instance has 1 to 63 slots, a template of one part more than its "
                        "cuts, a kind below 4 + 4 * its slots for each cut");
        return -1;
    }
    self->template_size[i] = (size_t)cuts * 20 + 1;
    for (Py_ssize_t p = 0; p <= cuts; p++) {
        if (!PyBytes_Check(PyTuple_GET_ITEM(parts, p))) {
            PyErr_SetString(PyExc_TypeError, "parts must be bytes");
            return -1;
        }
        self->template_size[i] += (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(parts, p));
    }
    for (Py_ssize_t j = 0; j < slots; j++) {
        size_t bit = PyLong_AsSize_t(PyTuple_GET_ITEM(bits, j));
        if (bit == (size_t)-1 && PyErr_Occurred()) return -1;
        if (bit > (size_t)1 << 24) {
            PyErr_SetString(PyExc_ValueError, "a slot bit is 2**24 at most");
            return -1;
        }
        self->bits[(*at)++] = bit;
        if (bit / 64 + 1 > self->words) self->words = bit / 64 + 1;
    }
    return 0;
}

static int plan_init(QueryPlan *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"context", "pool_members", "instances", "opener", "closer",
                               "msgpack", NULL};
    ContextBlocks *context;
    PyObject *pool_members, *instances, *opener, *closer;
    int msgpack;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!SSp:QueryPlan", keywords,
                                     &ContextBlocksType, &context, &PyDict_Type, &pool_members,
                                     &PyTuple_Type, &instances, &opener, &closer, &msgpack)) {
        return -1;
    }
    if (self->context != NULL) {
        PyErr_SetString(PyExc_TypeError, "a QueryPlan is made once");
        return -1;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(instances), total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *entry = PyTuple_GET_ITEM(instances, i);
        if (PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 4
            && PyTuple_Check(PyTuple_GET_ITEM(entry, 1)))
            total += PyTuple_GET_SIZE(PyTuple_GET_ITEM(entry, 1));
    }
    self->bits = PyMem_Calloc(total > 0 ? (size_t)total : 1, sizeof(size_t));
    self->first = PyMem_Calloc((size_t)count + 1, sizeof(Py_ssize_t));
    self->template_size = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(size_t));
    if (self->bits == NULL || self->first == NULL || self->template_size == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->instances = Py_NewRef(instances);  /* read_instance reads it */
    self->words = 1;
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        self->first[i] = at;
        if (read_instance(self, i, &at) < 0) return -1;
    }
    self->first[count] = at;
    self->count = count;
    self->context = (ContextBlocks *)Py_NewRef(context);
    self->pool_members = Py_NewRef(pool_members);
    self->opener = Py_NewRef(opener);
    self->closer = Py_NewRef(closer);
    self->msgpack = msgpack;
    return 0;
}

/* ``value`` as msgpack writes an unsigned int (the shortest form), or in decimal. */
static char *put_number(char *out, uint64_t value, int msgpack) {
    if (!msgpack) {
        char digits[20];
        int n = 0;
        do digits[n++] = (char)('0' + value % 10);
        while ((value /= 10) != 0);
        while (n) *out++ = digits[--n];
        return out;
    }
    int bytes;
    if (value < 0x80) {
        *out++ = (char)value;
        return out;
    }
    if (value <= 0xff) {
        *out++ = (char)0xcc;
        bytes = 1;
    } else if (value <= 0xffff) {
        *out++ = (char)0xcd;
        bytes = 2;
    } else if (value <= 0xffffffff) {
        *out++ = (char)0xce;
        bytes = 4;
    } else {
        *out++ = (char)0xcf;
        bytes = 8;
    }
    for (int i = bytes - 1; i >= 0; i--) *out++ = (char)(value >> (8 * i));
    return out;
}

/* A msgpack map's length, in the shortest form. */
static char *put_map_length(char *out, size_t count) {
    if (count < 16) {
        *out++ = (char)(0x80 | count);
    } else if (count <= 0xffff) {
        *out++ = (char)0xde;
        *out++ = (char)(count >> 8);
        *out++ = (char)count;
    } else {
        *out++ = (char)0xdf;
        for (int i = 3; i >= 0; i--) *out++ = (char)(count >> (8 * i));
    }
    return out;
}

static char *put_bytes(char *out, PyObject *bytes) {
    memcpy(out, PyBytes_AS_STRING(bytes), (size_t)PyBytes_GET_SIZE(bytes));
    return out + PyBytes_GET_SIZE(bytes);
}

/* Each slot's blocks held in a row from the prompt's start on each tier, in ``walk->at``:
 * the blocks of ``tokens`` hashed one by one from ``root`` (or the keys of ``profiled``, a
 * ProfileChain, when not NULL) while some slot still holds them. The context's mutex is
 * held. */
static void walk_blocks(const QueryPlan *self, TierWalk *walk, const uint8_t *tokens,
                        Py_ssize_t blocks, uint64_t root, PyObject *profiled, uint8_t *buffer) {
    size_t step = 4 * (size_t)self->context->block_size;
    uint64_t chain = root;
    for (Py_ssize_t position = 0; position < blocks; position++) {
        if (profiled == NULL)
            chain = block_hash(chain, tokens + position * step, step, buffer);
        else if (!profile_chain_next(profiled, &chain))
            return;
        if (!tier_walk_step(walk, self->context, chain, 1, position)) return;
    }
}

/* Instance ``i``'s numbers in blocks (see TIER_COUNT), its tiers raised to ``raised[i]``
 * blocks (``raised``: NULL, none) as raise_hits does: when that is more than its GPU hit. */
static void numbers_of(const QueryPlan *self, const TierWalk *walk, const uint64_t *raised,
                       Py_ssize_t i, uint64_t numbers[MOST_NUMBERS]) {
    for (int tier = 0; tier < TIER_COUNT; tier++) numbers[tier] = 0;
    for (Py_ssize_t j = self->first[i]; j < self->first[i + 1]; j++) {
        const Py_ssize_t *at = &walk->at[self->bits[j] * TIER_COUNT];
        uint64_t *rank = &numbers[TIER_COUNT * (1 + j - self->first[i])];
        for (int tier = 0; tier < TIER_COUNT; tier++) {
            rank[tier] = (uint64_t)at[tier];
            if (rank[tier] > numbers[tier]) numbers[tier] = rank[tier];
        }
    }
    if (raised != NULL && raised[i] > numbers[0]) {
        for (int tier = 0; tier < TIER_COUNT; tier++)
            if (raised[i] > numbers[tier]) numbers[tier] = raised[i];
    }
}

size_t plan_answer_size(const QueryPlan *self, const TierWalk *walk, const uint64_t *raised,
                        int hits_only, Py_ssize_t *written) {
    size_t size = 0;
    uint64_t numbers[MOST_NUMBERS];
    *written = 0;
    for (Py_ssize_t i = 0; i < self->count; i++) {
        numbers_of(self, walk, raised, i, numbers);
        if (hits_only && numbers[TIER_COUNT - 1] == 0) continue;  /* nothing on any tier */
        size += (size_t)PyBytes_GET_SIZE(name_of(self, i)) + self->template_size[i];
        ++*written;
    }
    return size + (size_t)PyBytes_GET_SIZE(self->opener) + (size_t)PyBytes_GET_SIZE(self->closer)
           + 5;
}

char *plan_answer_write(const QueryPlan *self, const TierWalk *walk, const uint64_t *raised,
                        int hits_only, Py_ssize_t written, char *out) {
    uint64_t numbers[MOST_NUMBERS];
    out = put_bytes(out, self->opener);
    if (self->msgpack) out = put_map_length(out, (size_t)written);
    int first = 1;
    uint64_t block_size = (uint64_t)self->context->block_size;
    for (Py_ssize_t i = 0; i < self->count; i++) {
        numbers_of(self, walk, raised, i, numbers);
        if (hits_only && numbers[TIER_COUNT - 1] == 0) continue;
        if (!self->msgpack && !first) *out++ = ',';
        first = 0;
        out = put_bytes(out, name_of(self, i));
        PyObject *parts = parts_of(self, i);
        const unsigned char *kinds = kinds_of(self, i);
        for (Py_ssize_t p = 0; p < PyTuple_GET_SIZE(parts); p++) {
            if (p) out = put_number(out, numbers[kinds[p - 1]] * block_size, self->msgpack);
            out = put_bytes(out, PyTuple_GET_ITEM(parts, p));
        }
    }
    return put_bytes(out, self->closer);
}

Py_ssize_t plan_blocks(const QueryPlan *self, Py_ssize_t token_bytes, PyObject *profiled) {
    Py_ssize_t step = 4 * self->context->block_size;
    return profiled ? profile_chain_length(profiled) : step > 0 ? token_bytes / step : 0;
}

int plan_walk(const QueryPlan *self, TierWalk *walk, const uint8_t *tokens, Py_ssize_t blocks,
              uint64_t root, PyObject *profiled) {
    ContextBlocks *context = self->context;
    Py_ssize_t step = 4 * context->block_size;
    uint8_t stack[8 + 4 * 64];
    uint8_t *buffer = step <= 4 * 64 ? stack : PyMem_RawMalloc(8 + (size_t)step);
    if (buffer == NULL) return -1;
    for (Py_ssize_t j = 0; j < self->first[self->count]; j++) {
        for (int tier = 0; tier < TIER_COUNT; tier++)
            walk->alive[tier * walk->words + self->bits[j] / 64] |= 1ULL << self->bits[j] % 64;
    }
    sync_lock(context->sync);
    walk_blocks(self, walk, tokens, blocks, root, profiled, buffer);
    sync_unlock(context->sync);
    if (buffer != stack) PyMem_RawFree(buffer);
    return 0;
}

/* ``minimum`` (a sequence of an int >= 0 for each instance, or None) as blocks in
 * ``raised``; 1 if given, 0 if None, -1 on error. */
static int read_minimum(QueryPlan *self, PyObject *minimum, uint64_t **raised) {
    *raised = NULL;
    if (minimum == Py_None) return 0;
    PyObject *seq = PySequence_Fast(minimum, "minimum must be None or a sequence of ints");
    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != self->count) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "minimum must give each instance's blocks");
        return -1;
    }
    *raised = PyMem_Calloc(self->count > 0 ? (size_t)self->count : 1, sizeof(uint64_t));
    if (*raised == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        unsigned long long blocks = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (blocks == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            PyMem_Free(*raised);
            *raised = NULL;
            return -1;
        }
        (*raised)[i] = blocks < UINT32_MAX ? blocks : UINT32_MAX;
    }
    Py_DECREF(seq);
    return 1;
}

PyDoc_STRVAR(plan_answer_doc,
"answer(tokens, root, hits_only, minimum, /)\n--\n\n"
"The answer for a prompt (``tokens``: int32 little-endian bytes) whose prefix hashes\n"
"chain from ``root`` (in a profiled context: ``root`` is a fresh ProfileChain of the\n"
"prompt, the blocks' keys): each instance's tokens held in a row on each tier, at least\n"
"``minimum[i]`` blocks for instance i (None: no minimum); only those with a hit given\n"
"``hits_only``. (the answer's bytes, how many instances the minimum raised).");

static PyObject *plan_answer(QueryPlan *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        return PyErr_Format(PyExc_TypeError, "answer takes 4 arguments (%zd given)", nargs);
    }
    if (!PyBytes_Check(args[0])) {
        return PyErr_Format(PyExc_TypeError, "tokens must be bytes, not %.60R", args[0]);
    }
    PyObject *profiled = Py_IS_TYPE(args[1], &ProfileChainType) ? args[1] : NULL;
    uint64_t root = profiled ? 0 : PyLong_AsUnsignedLongLongMask(args[1]);
    if (root == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    int hits_only = PyObject_IsTrue(args[2]);
    if (hits_only < 0) return NULL;
    uint64_t *raised;
    if (read_minimum(self, args[3], &raised) < 0) return NULL;
    PyObject *result = NULL;
    TierWalk walk;
    Py_ssize_t blocks = plan_blocks(self, PyBytes_GET_SIZE(args[0]), profiled);
    if (tier_walk_start(&walk, (Py_ssize_t)self->words, self->pool_members, blocks) < 0) goto done;
    if (plan_walk(self, &walk, (const uint8_t *)PyBytes_AS_STRING(args[0]), blocks, root,
                  profiled) < 0) {
        PyErr_NoMemory();
        tier_walk_end(&walk);
        goto done;
    }
    Py_ssize_t raised_count = 0;
    uint64_t numbers[MOST_NUMBERS];
    for (Py_ssize_t i = 0; raised != NULL && i < self->count; i++) {
        numbers_of(self, &walk, NULL, i, numbers);
        raised_count += raised[i] > numbers[0];
    }
    Py_ssize_t written;
    PyObject *answer = PyBytes_FromStringAndSize(
        NULL, (Py_ssize_t)plan_answer_size(self, &walk, raised, hits_only, &written));
    if (answer != NULL) {
        char *end = plan_answer_write(self, &walk, raised, hits_only, written,
                                      PyBytes_AS_STRING(answer));
        if (_PyBytes_Resize(&answer, end - PyBytes_AS_STRING(answer)) == 0)
            result = Py_BuildValue("(Nn)", answer, raised_count);
    }
    tier_walk_end(&walk);
done:
    PyMem_Free(raised);
    return result;
}

static PyMethodDef plan_methods[] = {
    {"answer", (PyCFunction)(void (*)(void))plan_answer, METH_FASTCALL, plan_answer_doc},
    {NULL, NULL, 0, NULL},
};

PyTypeObject QueryPlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "conductor._native.QueryPlan",
    .tp_doc = PyDoc_STR(
        "QueryPlan(context, pool_members, instances, opener, closer, msgpack)\n--\n\n"
        "How to answer a plain query of a context (a ContextBlocks, and its dict of a pool's\n"
        "bit to the slots it serves): ``instances``, in the answer's order, each (its key as\n"
        "written, its engine slots' bits in DP rank order, its value cut where its numbers\n"
        "go, the kind of each cut: 0-3 the instance's tokens on the GPU, its own CPU, any\n"
        "CPU, any tier; 4 + 4 * j + tier its j-th rank's); the answer's ``opener`` and\n"
        "``closer``, in msgpack or JSON."),
    .tp_basicsize = sizeof(QueryPlan),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)plan_init,
    .tp_dealloc = (destructor)plan_dealloc,
    .tp_methods = plan_methods,
};

int answer_exec(PyObject *module) {
    if (PyType_Ready(&QueryPlanType) < 0) return -1;
    return PyModule_AddObjectRef(module, "QueryPlan", (PyObject *)&QueryPlanType);
}

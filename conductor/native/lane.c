/* The C ingest lane: a whole batch read and applied without Python objects. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "decode.h"
#include "hashing.h"
#include "lane.h"
#include "maps.h"
#include "msgpack.h"


enum { F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
       F_EXTRA_KEYS, F_GROUP_IDX, F_CACHE_SALT, F_FIELDS };

static const char *const FIELD_NAMES[F_FIELDS] = {
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "cache_salt"};

/* Fields in the order of vLLM <= 0.23's positional BlockStored / BlockRemoved arrays. */
static const int STORED_ARRAY[] = {F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE,
                                   F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA_KEYS, F_GROUP_IDX};
static const int REMOVED_ARRAY[] = {F_TYPE, F_HASHES, F_MEDIUM, F_GROUP_IDX};
#define STORED_MIN 6  /* the elements vLLM always sent, up to lora_id */
#define STORED_MAX 12  /* vLLM 0.22-0.23 send two more after group_idx; ignored */
#define REMOVED_MIN 2
#define REMOVED_MAX 4

/* What an event said, read field by field (either layout) before it is judged whole. */
typedef struct {
    int kind;  /* 0 unknown, 1 BlockStored, 2 BlockRemoved */
    unsigned seen;  /* bit per field */
    PackedEvent event;
} EventReading;

static int is_str(const uint8_t *text, size_t length, const char *expected) {
    return length == strlen(expected) && memcmp(text, expected, length) == 0;
}

static int grow_hashes(PackedBatch *b, size_t more) {
    if (b->hashes_used + more <= b->hashes_capacity) return 0;
    size_t grown = 2 * b->hashes_capacity > b->hashes_used + more ? 2 * b->hashes_capacity
                                                                  : b->hashes_used + more;
    uint64_t *hashes = PyMem_Realloc(b->hashes, grown * sizeof *hashes);
    if (hashes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->hashes = hashes, b->hashes_capacity = grown;
    return 0;
}

/* One field's value into ``e``: 1 when it is one the lane takes, 0 when the event must go
 * the Python way, -1 on error. The lane takes what needs no Python decision: int hashes,
 * int token ids, the registered block size, the GPU medium, no LoRA, salt or group. */
static int read_field(PackedBatch *b, MpReader *r, int field, int64_t block_size,
                      EventReading *e) {
    uint64_t bits;
    int negative;
    const uint8_t *text;
    size_t count;
    switch (field) {
        case F_TYPE:
            if (!mp_str(r, &text, &count)) return 0;
            e->kind = is_str(text, count, "BlockStored")    ? 1
                      : is_str(text, count, "BlockRemoved") ? 2
                                                            : 0;
            return e->kind != 0;
        case F_HASHES:
            if (!mp_array(r, &count) || grow_hashes(b, count) < 0) return PyErr_Occurred() ? -1 : 0;
            e->event.first_hash = b->hashes_used, e->event.hash_count = count;
            for (size_t i = 0; i < count; i++) {
                if (!mp_int(r, &b->hashes[b->hashes_used + i], &negative)) return 0;
            }
            b->hashes_used += count;
            return 1;
        case F_PARENT:
            e->event.has_parent = !mp_nil(r);
            return !e->event.has_parent || mp_int(r, &e->event.parent, &negative);
        case F_TOKENS: {
            e->event.first_token = b->tokens_used / 4;
            int read = read_tokens(r, &b->tokens, &b->tokens_used, &b->tokens_capacity);
            e->event.token_count = b->tokens_used / 4 - e->event.first_token;
            return read;
        }
        case F_BLOCK_SIZE:
            if (mp_nil(r)) return 1;
            return mp_int(r, &bits, &negative) && !negative && bits == (uint64_t)block_size;
        case F_MEDIUM:
            if (mp_nil(r)) return 1;
            if (!mp_str(r, &text, &count) || count != 3) return 0;
            return (text[0] | 0x20) == 'g' && (text[1] | 0x20) == 'p' && (text[2] | 0x20) == 'u';
        case F_GROUP_IDX:
            if (mp_nil(r)) return 1;
            return mp_int(r, &bits, &negative) && bits == 0;
        case F_EXTRA_KEYS:  /* no salt: none, or none for block 0 (salt_from_extra_keys) */
            if (mp_nil(r)) return 1;
            if (!mp_array(r, &count)) return 0;
            for (size_t i = 0; i < count; i++) {
                if (i == 0 ? !mp_nil(r) : !mp_skip(r, MP_MAX_DEPTH)) return 0;
            }
            return 1;
        case F_LORA_NAME: case F_CACHE_SALT:
            return mp_nil(r);
        default:  /* lora_id, and what vLLM 0.22-0.23 send past group_idx */
            return mp_skip(r, MP_MAX_DEPTH);
    }
}

/* One event into the batch: 1 taken, 0 not the lane's, -1 on error. */
static int read_event(PackedBatch *b, MpReader *r, int64_t block_size, PackedEvent *out) {
    EventReading e = {0};
    size_t count;
    if (mp_array(r, &count)) {  /* vLLM <= 0.23: [tag, fields...] */
        const uint8_t *text;
        size_t length;
        MpReader peek = *r;
        if (count == 0 || !mp_str(&peek, &text, &length)) return 0;
        int stored = is_str(text, length, "BlockStored");
        const int *order = stored ? STORED_ARRAY : REMOVED_ARRAY;
        size_t least = stored ? STORED_MIN : REMOVED_MIN, most = stored ? STORED_MAX : REMOVED_MAX;
        size_t named = stored ? sizeof STORED_ARRAY / sizeof *order : REMOVED_MAX;
        if (count < least || count > most) return 0;
        for (size_t i = 0; i < count; i++) {
            int field = i < named ? order[i] : F_LORA_ID;  /* past group_idx: skipped */
            int read = read_field(b, r, field, block_size, &e);
            if (read <= 0) return read;
            e.seen |= 1u << field;
        }
    } else if (mp_map(r, &count)) {  /* vLLM >= 0.24, SGLang: tagged maps, any key order */
        for (size_t i = 0; i < count; i++) {
            const uint8_t *key;
            size_t length;
            if (!mp_str(r, &key, &length)) return 0;
            int field = 0;
            while (field < F_FIELDS && !is_str(key, length, FIELD_NAMES[field])) field++;
            if (field == F_FIELDS || e.seen & (1u << field)) return 0;  /* unknown or twice */
            int read = read_field(b, r, field, block_size, &e);
            if (read <= 0) return read;
            e.seen |= 1u << field;
        }
    } else {
        return 0;
    }
    unsigned stored_fields = (1u << F_FIELDS) - 1;
    unsigned removed_fields = 1u << F_TYPE | 1u << F_HASHES | 1u << F_MEDIUM | 1u << F_GROUP_IDX;
    unsigned required = 1u << F_TYPE | 1u << F_HASHES;
    if ((e.seen & required) != required) return 0;
    if (e.kind == 1) {  /* with hashes and tokens: no-token and empty events go the Python way */
        if (e.seen & ~stored_fields || !(e.seen & 1u << F_TOKENS)) return 0;
        if (e.event.hash_count == 0 || e.event.token_count == 0) return 0;
    } else if (e.seen & ~removed_fields) {
        return 0;
    }
    e.event.removed = e.kind == 2;
    *out = e.event;
    return 1;
}

/* The batch ``[timestamp, events(, dp_rank)]``: 1 taken, 0 not the lane's, -1 on error. */
static int read_batch(PackedBatch *b, MpReader *r, int64_t block_size) {
    size_t fields, count;
    uint64_t bits;
    int negative;
    if (!mp_array(r, &fields) || fields < 2 || fields > 3) return 0;
    if (mp_float(r, &b->timestamp)) {
    } else if (mp_int(r, &bits, &negative)) {  /* milliseconds (the Mooncake master's) */
        int64_t millis = (int64_t)bits;
        if (negative ? millis < -(INT64_C(1) << 53) : bits > (UINT64_C(1) << 53)) return 0;
        b->timestamp = (double)millis / 1000.0;  /* exact: |millis| <= 2**53, as Python's */
    } else {
        return 0;
    }
    if (!mp_array(r, &count)) return 0;
    b->events = PyMem_Calloc(count ? count : 1, sizeof *b->events);
    if (b->events == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (b->count = 0; (size_t)b->count < count; b->count++) {
        int read = read_event(b, r, block_size, &b->events[b->count]);
        if (read <= 0) return read;
        b->removals += b->events[b->count].removed;
    }
    b->dp_rank = Py_NewRef(Py_None);
    if (fields == 3 && !mp_nil(r)) {
        if (!mp_int(r, &bits, &negative) || negative || bits > INT32_MAX) return 0;
        Py_SETREF(b->dp_rank, PyLong_FromUnsignedLongLong(bits));
        if (b->dp_rank == NULL) return -1;
    }
    return r->p == r->end;  /* trailing bytes: the decoders refuse the payload */
}

static void packed_dealloc(PackedBatch *b) {
    PyMem_Free(b->events);
    PyMem_Free(b->hashes);
    PyMem_Free(b->tokens);
    Py_XDECREF(b->dp_rank);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

PyDoc_STRVAR(pack_batch_doc,
"pack_batch(payload, block_size, /)\n--\n\n"
"A vLLM / SGLang event batch read whole into C buffers, for ContextBlocks.apply_packed;\n"
"None when any part of it needs a decision in Python: an event other than BlockStored\n"
"(with int hashes and token ids, the registered block size or none, GPU medium or none, no\n"
"LoRA, salt, extra keys or group) or BlockRemoved (GPU medium or none, no group), an\n"
"unknown field, a malformed payload. The Python decoders then decode it, with their\n"
"errors.");

static PyObject *pack_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pack_batch takes payload, block_size");
        return NULL;
    }
    long long block_size = PyLong_AsLongLong(args[1]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    PackedBatch *b = PyObject_New(PackedBatch, &PackedBatchType);
    if (b == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    memset((char *)b + sizeof(PyObject), 0, sizeof *b - sizeof(PyObject));
    MpReader r = {view.buf, (const uint8_t *)view.buf + view.len};
    int read = read_batch(b, &r, block_size);
    PyBuffer_Release(&view);
    if (read <= 0) {
        Py_DECREF(b);
        return read < 0 ? NULL : Py_NewRef(Py_None);
    }
    return (PyObject *)b;
}

/* ``PrefixContext.prefix_of`` in C: the prefix the owner (on any tier) or, failing that,
 * any owner of the context indexed ``engine_hash`` under. */
static int prefix_of(const Holdings *const owner[TIERS], uint64_t engine_hash, uint64_t *prefix_hash) {
    for (int tier = 0; tier < TIERS; tier++) {
        if (map_lookup(owner[tier]->by_engine_hash, engine_hash, prefix_hash)) return 1;
    }
    return map_lookup(owner[0]->context->engine_prefix, engine_hash, prefix_hash);
}

int lane_task(ContextBlocks *context, PyObject *packed, PyObject *owner, PyObject *root,
              LaneTask *task) {
    if (!Py_IS_TYPE(packed, &PackedBatchType)) {
        PyErr_SetString(PyExc_TypeError, "packed must be a PackedBatch");
        return -1;
    }
    if (owner_of(context, owner, task->owner) < 0) return -1;
    task->batch = (const PackedBatch *)packed;
    task->profiled = root == Py_None;
    task->root = task->profiled ? 0 : PyLong_AsUnsignedLongLong(root);
    if (PyErr_Occurred()) return -1;
    if (context->block_size <= 0 || context->block_size > (PY_SSIZE_T_MAX - 8) / 4) {
        PyErr_SetString(PyExc_ValueError, "apply_packed: bad block size");
        return -1;
    }
    return 0;
}

/* Apply the task's events from ``applied->reached`` on, counting into ``applied``; it stops
 * after the event that brings the blocks it looked at to ``max_blocks``, or at a fault.
 * Runs without the GIL: the caller holds the context's mutex (sync.h). */
void apply_steps(const LaneTask *task, Py_ssize_t max_blocks, Applied *applied) {
    const PackedBatch *b = task->batch;
    const Holdings *gpu = task->owner[0];
    size_t step = 4 * (size_t)gpu->context->block_size;
    uint8_t stack[8 + 4 * 64];
    uint8_t *buffer = step <= 4 * 64 ? stack : PyMem_RawMalloc(8 + step);
    Py_ssize_t looked_at = 0, i;
    if (buffer == NULL) {
        applied->fault = (Fault){FAULT_MEMORY, 0};
        return;
    }
    for (i = applied->reached; i < b->count && looked_at < max_blocks && !applied->fault.kind;
         i++) {
        const PackedEvent *e = &b->events[i];
        looked_at += (Py_ssize_t)e->hash_count + 1;  /* an empty event costs a little too */
        const uint64_t *hashes = b->hashes + e->first_hash;
        if (e->removed) {
            release_blocks(gpu, hashes, (Py_ssize_t)e->hash_count, 0, &applied->removed,
                           &applied->fault);
            continue;
        }
        if (task->profiled) {  /* as PrefixCacheTable._prefixes: neither tokens nor parent */
            if (hold_blocks(gpu, hashes, hashes, (Py_ssize_t)e->hash_count, &applied->fault) == 0)
                applied->stored += (Py_ssize_t)e->hash_count;
            continue;
        }
        if (e->token_count != e->hash_count * (size_t)gpu->context->block_size) {
            applied->mismatched++;
            continue;
        }
        uint64_t chain = task->root;
        if (e->has_parent && !prefix_of(task->owner, e->parent, &chain)) {
            applied->orphaned++;
            continue;
        }
        const uint8_t *tokens = b->tokens + 4 * e->first_token;
        uint64_t chains[HOLD_CHUNK];  /* a chunk's prefix hashes, then held together */
        for (size_t k = 0; k < e->hash_count && !applied->fault.kind;) {
            size_t first = k;
            for (; k < e->hash_count && k - first < HOLD_CHUNK; k++) {
                chains[k - first] = chain = block_hash(chain, tokens + k * step, step, buffer);
            }
            hold_blocks(gpu, hashes + first, chains, (Py_ssize_t)(k - first), &applied->fault);
        }
        if (!applied->fault.kind) applied->stored += (Py_ssize_t)e->hash_count;
    }
    applied->reached = i;
    if (buffer != stack) PyMem_RawFree(buffer);
}

/* apply_packed's answer for ``applied``, or its fault raised. */
PyObject *applied_result(const Applied *a) {
    if (a->fault.kind) {
        raise_fault(&a->fault);
        return NULL;
    }
    return Py_BuildValue("(nnnnn)", a->reached, a->stored, a->removed, a->orphaned,
                         a->mismatched);
}

const char context_apply_packed_doc[] =
"apply_packed(packed, owner, start, max_blocks, root, /)\n--\n\n"
"Apply the events of a PackedBatch from ``start`` on to an owner's GPU blocks (``owner``:\n"
"what ``owner`` made), as PrefixCacheTable does an event it decoded: a stored event's\n"
"prefix hashes chain from ``root`` (no parent) or from its parent's prefix (the owner's on\n"
"any tier, else any owner's: unknown, the event is orphaned) over ``block_size`` tokens a\n"
"block, and each block is held; a removed event's blocks are released. It stops after the\n"
"event that brings the blocks it looked at to ``max_blocks`` (a bound on the time it holds\n"
"the caller). ``root`` None: the context is a hash profile's, and a stored event's engine\n"
"hashes are its blocks' keys (tokens and parent unread). Returns (the first event not\n"
"applied, blocks stored, blocks removed, events\n"
"orphaned, events whose token count does not fit their hashes).";

PyObject *context_apply_packed(ContextBlocks *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        return PyErr_Format(PyExc_TypeError, "apply_packed takes 5 arguments (%zd given)", nargs);
    }
    LaneTask task;
    if (lane_task(self, args[0], args[1], args[4], &task) < 0) return NULL;
    Applied applied = {.reached = PyLong_AsSsize_t(args[2])};
    Py_ssize_t max_blocks = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (applied.reached < 0 || applied.reached > task.batch->count || max_blocks <= 0) {
        PyErr_SetString(PyExc_ValueError, "apply_packed: bad start or max_blocks");
        return NULL;
    }
    sync_settle(self->sync);
    apply_steps(&task, max_blocks, &applied);
    sync_unlock(self->sync);
    return applied_result(&applied);
}

static PyObject *packed_removals(PackedBatch *b, void *unused) {
    return PyLong_FromSsize_t(b->removals);
}

static PyObject *packed_timestamp(PackedBatch *b, void *unused) {
    return PyFloat_FromDouble(b->timestamp);
}

static PyObject *packed_dp_rank(PackedBatch *b, void *unused) { return Py_NewRef(b->dp_rank); }

static Py_ssize_t packed_length(PackedBatch *b) { return b->count; }

static PyGetSetDef packed_getset[] = {
    {"timestamp", (getter)packed_timestamp, NULL, "the batch's time, in seconds", NULL},
    {"dp_rank", (getter)packed_dp_rank, NULL, "the batch's DP rank, or None", NULL},
    {"removals", (getter)packed_removals, NULL, "how many events are BlockRemoved", NULL},
    {NULL},
};

static PySequenceMethods packed_as_sequence = {.sq_length = (lenfunc)packed_length};

PyTypeObject PackedBatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "conductor._native.PackedBatch",
    .tp_doc = "An event batch pack_batch read into C buffers: len() events.",
    .tp_basicsize = sizeof(PackedBatch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_dealloc = (destructor)packed_dealloc,
    .tp_as_sequence = &packed_as_sequence,
    .tp_getset = packed_getset,
};

PyMethodDef lane_methods[] = {
    {"pack_batch", (PyCFunction)(void (*)(void))pack_batch, METH_FASTCALL, pack_batch_doc},
    {NULL, NULL, 0, NULL},
};

int lane_exec(PyObject *module) {
    return PyType_Ready(&PackedBatchType) < 0 || PyModule_AddType(module, &PackedBatchType) < 0
               ? -1
               : 0;
}

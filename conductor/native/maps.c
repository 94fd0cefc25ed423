/* HashMap and MaskMap: what they are for, in maps.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "maps.h"
#include "masks.h"

/* The next occupied entry from (*shard, *position) on, both moved past it; NULL at the end.
 * How map_next goes over the tables. */
static Entry *next_entry(const Map *map, Py_ssize_t *shard, Py_ssize_t *position) {
    Py_ssize_t tables = map->shards ? SHARDS : 1;
    for (; *shard < tables; (*shard)++, *position = 0) {
        const Table *table = map->shards ? &map->shards[*shard] : &map->one;
        while (*position < table->capacity) {
            Entry *entry = &table->entries[(*position)++];
            if (entry->key != 0) return entry;
        }
    }
    return NULL;
}

/* The next key and its value from ``at`` on (1), or the end (0). */
int map_next(const Map *map, MapCursor *at, uint64_t *key, uint64_t *value) {
    if (at->position == -1) {  /* the key 0 first, kept beside the tables */
        at->position = 0;
        if (map->has_zero) {
            *key = 0, *value = map->zero_value;
            return 1;
        }
    }
    Entry *entry = next_entry(map, &at->shard, &at->position);
    if (entry == NULL) return 0;
    *key = entry->key, *value = entry->value;
    return 1;
}

static void place(Entry *entries, Py_ssize_t capacity, uint64_t key, uint64_t value) {
    size_t i = home_of(key, capacity);
    while (entries[i].key != 0) i = next_slot(i, capacity);
    entries[i].key = key;
    entries[i].value = value;
}

static int table_resize(Table *table, Py_ssize_t capacity) {
    Entry *entries = PyMem_RawCalloc((size_t)capacity, sizeof(Entry));
    if (entries == NULL) return -1;
    for (Py_ssize_t i = 0; i < table->capacity; i++) {
        if (table->entries[i].key != 0)
            place(entries, capacity, table->entries[i].key, table->entries[i].value);
    }
    PyMem_RawFree(table->entries);
    table->entries = entries;
    table->capacity = capacity;
    return 0;
}

/* Room for one more key in ``table``: half as large again when 3/4 full. Growing by half,
 * not doubling, keeps a table between 1/2 and 3/4 full (16 to 32 bytes a key, not 16 to
 * 43): at a million keys that is most of the index's memory (bench.index_bench). */
static int table_reserve(Table *table) {
    if (4 * (table->used + 1) <= 3 * table->capacity) return 0;
    return table_resize(table, table->capacity ? table->capacity + table->capacity / 2 : 8);
}

/* The one table's keys dealt to SHARDS tables, each about half full. */
static int map_split(Map *map) {
    Table *shards = PyMem_RawCalloc(SHARDS, sizeof(Table));
    if (shards == NULL) return -1;
    Py_ssize_t capacity = 2 * (map->used / SHARDS + 1);
    if (capacity < 8) capacity = 8;
    for (Py_ssize_t i = 0; i < SHARDS; i++) {
        if (table_resize(&shards[i], capacity) < 0) goto fail;
    }
    for (Py_ssize_t i = 0; i < map->one.capacity; i++) {
        Entry *entry = &map->one.entries[i];
        if (entry->key == 0) continue;
        Table *table = &shards[mix(entry->key) >> (64 - SHARD_BITS)];
        if (table_reserve(table) < 0) goto fail;
        place(table->entries, table->capacity, entry->key, entry->value);
        table->used++;
    }
    PyMem_RawFree(map->one.entries);
    map->one = (Table){NULL, 0, 0};
    map->shards = shards;
    return 0;
fail:
    for (Py_ssize_t i = 0; i < SHARDS; i++) PyMem_RawFree(shards[i].entries);
    PyMem_RawFree(shards);
    return -1;
}

/* The value slot of ``key``; an absent key is added first, its value 0 for the caller to
 * set at once (``*created`` says which). NULL on error. One probe for a lookup and an
 * insertion: at millions of keys, each probe of a large table is a cache miss. Out of
 * memory it sets no error (it runs without the GIL too): the caller raises MemoryError. */
uint64_t *map_value_slot(Map *map, uint64_t key, int *created) {
    if (key == 0) {
        *created = !map->has_zero;
        if (*created) {
            map->has_zero = 1;
            map->zero_value = 0;
            map->version++;
        }
        return &map->zero_value;
    }
    Table *table = table_of(map, key);
    Entry *free_entry = NULL;
    for (size_t i = table->capacity ? home_of(key, table->capacity) : 0; table->capacity;
         i = next_slot(i, table->capacity)) {
        Entry *entry = &table->entries[i];
        if (entry->key == key) {
            *created = 0;
            return &entry->value;
        }
        if (entry->key == 0) {
            free_entry = entry;
            break;
        }
    }
    if (4 * (table->used + 1) > 3 * table->capacity) {
        if (map->shards == NULL && map->used + 1 > SHARD_AT) {
            if (map_split(map) < 0) return NULL;
            table = table_of(map, key);
        }
        if (table_reserve(table) < 0) return NULL;
        size_t i = home_of(key, table->capacity);
        while (table->entries[i].key != 0) i = next_slot(i, table->capacity);
        free_entry = &table->entries[i];
    }
    free_entry->key = key;
    free_entry->value = 0;
    table->used++;
    map->used++;
    map->version++;
    *created = 1;
    return &free_entry->value;
}

/* Store ``value`` under ``key``; a value it replaces goes to ``*old`` (returns 1), a new
 * key returns 0, an error -1. The map takes no reference: the caller keeps them right. */
static int map_insert(Map *map, uint64_t key, uint64_t value, uint64_t *old) {
    int created;
    uint64_t *slot = map_value_slot(map, key, &created);
    if (slot == NULL) return -1;
    if (!created) *old = *slot;
    *slot = value;
    return !created;
}

/* Remove ``key``; its value goes to ``*old`` (returns 1), or it was absent (0). */
int map_erase(Map *map, uint64_t key, uint64_t *old) {
    if (key == 0) {
        if (!map->has_zero) return 0;
        *old = map->zero_value;
        map->has_zero = 0;
        map->version++;
        return 1;
    }
    Entry *entry = map_find(map, key);
    if (entry == NULL) return 0;
    *old = entry->value;
    Table *table = table_of(map, key);
    Entry *entries = table->entries;
    size_t hole = (size_t)(entry - entries);
    for (size_t i = next_slot(hole, table->capacity); entries[i].key != 0;
         i = next_slot(i, table->capacity)) {
        size_t home = home_of(entries[i].key, table->capacity);
        /* the entry at i may fill the hole unless its home lies cyclically in (hole, i] */
        int stays = hole < i ? (hole < home && home <= i) : (hole < home || home <= i);
        if (!stays) {
            entries[hole] = entries[i];
            hole = i;
        }
    }
    entries[hole].key = 0;
    table->used--;
    map->used--;
    map->version++;
    return 1;
}

/* 1 and the key when ``object`` is an unsigned 64-bit int, 0 when it is anything else (no
 * error set: such a key is simply never present), -1 on another error. */
int key_of(PyObject *object, uint64_t *key) {
    if (!PyLong_Check(object)) return 0;
    unsigned long long value = PyLong_AsUnsignedLongLong(object);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        return 0;
    }
    *key = value;
    return 1;
}

int required_key(PyObject *object, uint64_t *key) {
    int found = key_of(object, key);
    if (found == 0)
        PyErr_Format(PyExc_TypeError, "keys are unsigned 64-bit ints, not %.60R", object);
    return found == 1 ? 0 : -1;
}

static PyObject *value_to_object(const Map *map, uint64_t value) {
    return HOLDS_MASKS(map) ? mask_to_int(value) : PyLong_FromUnsignedLongLong(value);
}

/* The stored form of ``object`` (a MaskMap's: a mask, maybe allocated). */
static int value_of(const Map *map, PyObject *object, uint64_t *value) {
    if (HOLDS_MASKS(map)) return mask_from_int(object, value);
    if (!PyLong_Check(object)) {
        PyErr_Format(PyExc_TypeError, "values are ints, not %.60R", object);
        return -1;
    }
    *value = PyLong_AsUnsignedLongLong(object);
    return *value == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

void release_value(const Map *map, uint64_t value) {
    if (HOLDS_MASKS(map)) mask_free(value);
}

static int map_set(Map *map, uint64_t key, PyObject *object) {
    uint64_t value, old;
    if (value_of(map, object, &value) < 0) return -1;
    sync_settle(map->sync);
    int replaced = map_insert(map, key, value, &old);
    sync_unlock(map->sync);
    if (replaced < 0) {
        release_value(map, value);
        PyErr_NoMemory();
        return -1;
    }
    if (replaced) release_value(map, old);
    return 0;
}

void map_clear_all(Map *map) {
    Map emptied = *map;
    map->one = (Table){NULL, 0, 0};
    map->shards = NULL;
    map->used = 0;
    map->has_zero = 0;
    map->version++;
    MapCursor at = MAP_START;
    uint64_t key, value;
    while (HOLDS_MASKS(map) && map_next(&emptied, &at, &key, &value)) release_value(map, value);
    PyMem_RawFree(emptied.one.entries);
    for (Py_ssize_t i = 0; emptied.shards != NULL && i < SHARDS; i++)
        PyMem_RawFree(emptied.shards[i].entries);
    PyMem_RawFree(emptied.shards);
}

static PyObject *map_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_Format(PyExc_TypeError, "%s() takes no arguments", type->tp_name);
        return NULL;
    }
    return type->tp_alloc(type, 0);  /* zeroed: empty */
}

/* A new empty map whose Python calls take ``sync`` (a context's); NULL on error. */
Map *map_of_context(PyTypeObject *type, Sync *sync) {
    Map *map = (Map *)PyObject_CallNoArgs((PyObject *)type);
    if (map != NULL) map->sync = sync_ref(sync);
    return map;
}

static void map_dealloc(Map *map) {
    map_clear_all(map);
    sync_release(map->sync);
    Py_TYPE(map)->tp_free((PyObject *)map);
}

static int map_contains(Map *map, PyObject *object) {
    uint64_t key, value;
    int found = key_of(object, &key);
    if (found <= 0) return found;
    sync_lock(map->sync);
    found = map_lookup(map, key, &value);
    sync_unlock(map->sync);
    return found;
}

/* The value of ``key`` as an int, read under the context's mutex (the ingest thread may
 * change a wide mask once it is let go): a new reference; NULL and no error when absent. */
static PyObject *lookup_object(Map *map, uint64_t key) {
    uint64_t value;
    sync_lock(map->sync);
    PyObject *object = map_lookup(map, key, &value) ? value_to_object(map, value) : NULL;
    sync_unlock(map->sync);
    return object;
}

static PyObject *map_subscript(Map *map, PyObject *object) {
    uint64_t key;
    int found = key_of(object, &key);
    if (found < 0) return NULL;
    PyObject *value = found ? lookup_object(map, key) : NULL;
    if (value == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, object);
    return value;
}

static int map_ass_subscript(Map *map, PyObject *object, PyObject *item) {
    uint64_t key, old;
    if (item != NULL) return required_key(object, &key) < 0 ? -1 : map_set(map, key, item);
    int found = key_of(object, &key);
    if (found < 0) return -1;
    sync_settle(map->sync);
    found = found && map_erase(map, key, &old);
    sync_unlock(map->sync);
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, object);
        return -1;
    }
    release_value(map, old);
    return 0;
}

static PyObject *map_get(Map *map, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) return PyErr_Format(PyExc_TypeError, "get takes 1 or 2 arguments");
    uint64_t key;
    int found = key_of(args[0], &key);
    if (found < 0) return NULL;
    PyObject *value = found ? lookup_object(map, key) : NULL;
    if (value != NULL || PyErr_Occurred()) return value;
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

static PyObject *map_pop(Map *map, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) return PyErr_Format(PyExc_TypeError, "pop takes 1 or 2 arguments");
    uint64_t key, old;
    int found = key_of(args[0], &key);
    if (found < 0) return NULL;
    sync_settle(map->sync);
    found = found && map_erase(map, key, &old);
    sync_unlock(map->sync);
    if (found) {
        PyObject *value = value_to_object(map, old);
        release_value(map, old);
        return value;
    }
    if (nargs == 2) return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *map_clear(Map *map, PyObject *unused) {
    sync_settle(map->sync);
    map_clear_all(map);
    sync_unlock(map->sync);
    Py_RETURN_NONE;
}

/* -- their iterators -- */

enum { KEYS, VALUES, ITEMS };

typedef struct {
    PyObject_HEAD
    Map *map;  /* NULL once exhausted */
    MapCursor at;
    uint64_t version;
    int kind;
} MapIter;

static PyTypeObject MapIterType;

static PyObject *map_iterate(Map *map, int kind) {
    MapIter *iter = PyObject_New(MapIter, &MapIterType);
    if (iter == NULL) return NULL;
    iter->map = (Map *)Py_NewRef(map);
    iter->at = (MapCursor)MAP_START;
    sync_settle(map->sync);  /* the batches the ingest thread holds are part of the walk */
    iter->version = map->version;
    sync_unlock(map->sync);
    iter->kind = kind;
    return (PyObject *)iter;
}

static PyObject *map_iter(Map *map) { return map_iterate(map, KEYS); }
static PyObject *map_keys(Map *map, PyObject *unused) { return map_iterate(map, KEYS); }
static PyObject *map_values(Map *map, PyObject *unused) { return map_iterate(map, VALUES); }
static PyObject *map_items(Map *map, PyObject *unused) { return map_iterate(map, ITEMS); }

static PyObject *iter_next(MapIter *iter) {
    Map *map = iter->map;
    if (map == NULL) return NULL;
    uint64_t key, value;
    sync_settle(map->sync);
    int changed = map->version != iter->version;
    int more = !changed && map_next(map, &iter->at, &key, &value);
    PyObject *value_object = more && iter->kind != KEYS ? value_to_object(map, value) : NULL;
    sync_unlock(map->sync);
    if (changed) {
        PyErr_SetString(PyExc_RuntimeError, "map changed size during iteration");
        return NULL;
    }
    if (!more) {
        Py_CLEAR(iter->map);
        return NULL;
    }
    if (iter->kind == VALUES) return value_object;
    PyObject *key_object = PyLong_FromUnsignedLongLong(key);
    if (iter->kind == KEYS || key_object == NULL) {
        Py_XDECREF(value_object);
        return key_object;
    }
    PyObject *pair = value_object ? PyTuple_Pack(2, key_object, value_object) : NULL;
    Py_DECREF(key_object);
    Py_XDECREF(value_object);
    return pair;
}

static void iter_dealloc(MapIter *iter) {
    Py_XDECREF(iter->map);
    PyObject_Free(iter);
}

static PyTypeObject MapIterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "conductor._native.MapIterator",
    .tp_basicsize = sizeof(MapIter),
    .tp_dealloc = (destructor)iter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)iter_next,
};

/* The map as a new dict (repr, comparison: tests and debugging, not the hot path). */
static PyObject *map_to_dict(Map *map) {
    PyObject *items = map_items(map, NULL);
    PyObject *copy = items ? PyDict_New() : NULL;
    if (copy != NULL && PyDict_MergeFromSeq2(copy, items, 1) < 0) Py_CLEAR(copy);
    Py_XDECREF(items);
    return copy;
}

static int is_map(PyObject *object) {
    return Py_IS_TYPE(object, &HashMapType) || Py_IS_TYPE(object, &MaskMapType);
}

/* == and != compare the keys and values, with a dict or another map, as dicts do. */
static PyObject *map_richcompare(PyObject *self, PyObject *other, int op) {
    if ((op != Py_EQ && op != Py_NE) || !(PyDict_Check(other) || is_map(other)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *mine = map_to_dict((Map *)self);
    PyObject *theirs = mine == NULL ? NULL
                       : is_map(other) ? map_to_dict((Map *)other) : Py_NewRef(other);
    PyObject *result = theirs == NULL ? NULL : PyObject_RichCompare(mine, theirs, op);
    Py_XDECREF(mine);
    Py_XDECREF(theirs);
    return result;
}

static PyObject *map_repr(Map *map) {
    PyObject *copy = map_to_dict(map);
    PyObject *repr = copy ? PyUnicode_FromFormat("%s(%R)", Py_TYPE(map)->tp_name, copy) : NULL;
    Py_XDECREF(copy);
    return repr;
}

static Py_ssize_t map_len(Map *map) {
    sync_lock(map->sync);
    Py_ssize_t length = map_length(map);
    sync_unlock(map->sync);
    return length;
}

static PyMappingMethods map_as_mapping = {
    .mp_length = (lenfunc)map_len,
    .mp_subscript = (binaryfunc)map_subscript,
    .mp_ass_subscript = (objobjargproc)map_ass_subscript,
};

static PySequenceMethods map_as_sequence = {
    .sq_contains = (objobjproc)map_contains,
};

static PyMethodDef map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))map_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))map_pop, METH_FASTCALL, "pop(key[, default])"},
    {"keys", (PyCFunction)map_keys, METH_NOARGS, "an iterator over the keys"},
    {"values", (PyCFunction)map_values, METH_NOARGS, "an iterator over the values"},
    {"items", (PyCFunction)map_items, METH_NOARGS, "an iterator over (key, value) pairs"},
    {"clear", (PyCFunction)map_clear, METH_NOARGS, "remove every key"},
    {NULL, NULL, 0, NULL},
};

#define MAP_TYPE(c_name, py_name, doc)                                                      \
    PyTypeObject c_name = {                                                          \
        PyVarObject_HEAD_INIT(NULL, 0)                                                      \
        .tp_name = "conductor._native." py_name,                                            \
        .tp_basicsize = sizeof(Map),                                                        \
        .tp_dealloc = (destructor)map_dealloc,                                              \
        .tp_repr = (reprfunc)map_repr,                                                      \
        .tp_richcompare = map_richcompare,                                                  \
        .tp_hash = PyObject_HashNotImplemented,                                             \
        .tp_as_sequence = &map_as_sequence,                                                 \
        .tp_as_mapping = &map_as_mapping,                                                   \
        .tp_iter = (getiterfunc)map_iter,                                                   \
        .tp_flags = Py_TPFLAGS_DEFAULT,                                                     \
        .tp_doc = doc,                                                                      \
        .tp_methods = map_methods,                                                          \
        .tp_new = map_new,                                                                  \
    }

MAP_TYPE(HashMapType, "HashMap", "uint64 -> uint64, a compact dict for hashes.");
MAP_TYPE(MaskMapType, "MaskMap", "uint64 -> int, a compact dict for owner bitmasks.");

int maps_exec(PyObject *module) {
    if (PyType_Ready(&MapIterType) < 0) return -1;
    PyTypeObject *types[] = {&HashMapType, &MaskMapType};
    for (size_t i = 0; i < 2; i++) {
        if (PyType_Ready(types[i]) < 0 || PyModule_AddType(module, types[i]) < 0) return -1;
    }
    return 0;
}

/* The index's per-block loops: PrefixContext.hold, release_many and clear_slot. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "maps.h"

/* counts[key] = counts.get(key, 0) + delta; the entry goes when it reaches 0. */
static int add_count(PyObject *counts, PyObject *key, long delta) {
    PyObject *held = PyDict_GetItemWithError(counts, key);
    if (held == NULL && PyErr_Occurred()) return -1;
    long count = held == NULL ? 0 : PyLong_AsLong(held);
    if (count == -1 && PyErr_Occurred()) return -1;
    if (count + delta == 0) return PyDict_DelItem(counts, key);
    PyObject *value = PyLong_FromLong(count + delta);
    if (value == NULL) return -1;
    int result = PyDict_SetItem(counts, key, value);
    Py_DECREF(value);
    return result;
}

/* Each argument of ``kinds`` ("h": HashMap, "m": MaskMap, "d": dict, ".": any) is one. */
int check_args(PyObject *const *args, Py_ssize_t nargs, const char *kinds) {
    Py_ssize_t count = (Py_ssize_t)strlen(kinds);
    if (nargs != count) {
        PyErr_Format(PyExc_TypeError, "takes %zd arguments (%zd given)", count, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyTypeObject *type = kinds[i] == 'h' ? &HashMapType
                             : kinds[i] == 'm' ? &MaskMapType
                             : kinds[i] == 'd' ? &PyDict_Type
                                               : NULL;
        if (type != NULL && !Py_IS_TYPE(args[i], type)) {
            PyErr_Format(PyExc_TypeError, "argument %zd must be a %s", i + 1, type->tp_name);
            return -1;
        }
    }
    return 0;
}

/* ``add_count`` keyed by ``hash``, whose int is ``object`` or (NULL) made here. */
static int add_hash_count(PyObject *counts, PyObject *object, uint64_t hash, long delta) {
    PyObject *key = object ? Py_NewRef(object) : PyLong_FromUnsignedLongLong(hash);
    int result = key == NULL ? -1 : add_count(counts, key, delta);
    Py_XDECREF(key);
    return result;
}

/* 1 when ``counts`` holds ``hash`` (one count fewer now), 0 when not, -1 on error. */
static int take_count(PyObject *counts, PyObject *object, uint64_t hash) {
    if (!PyDict_GET_SIZE(counts)) return 0;
    PyObject *key = object ? Py_NewRef(object) : PyLong_FromUnsignedLongLong(hash);
    int held = key == NULL ? -1 : PyDict_Contains(counts, key);
    if (held > 0) held = add_count(counts, key, -1) < 0 ? -1 : 1;
    Py_XDECREF(key);
    return held;
}

/* The owner holds one block more (a block it holds already counts one more copy; a prefix
 * it holds under another engine hash, one more extra ref). The hashes' ints are passed when
 * the caller has them, else NULL. 0, or -1 on error. */
int hold_block(const Holder *h, uint64_t engine_hash, uint64_t prefix_hash,
                      PyObject *engine_object, PyObject *prefix_object) {
    int created;
    uint64_t *slot = map_value_slot(h->by_engine_hash, engine_hash, &created);
    if (slot == NULL) return -1;
    if (!created) return add_hash_count(h->copies, engine_object, engine_hash, 1);
    *slot = prefix_hash;
    slot = map_value_slot(h->engine_prefix, engine_hash, &created);
    if (slot == NULL) return -1;
    if (created) {
        *slot = prefix_hash;
    } else if (add_hash_count(h->engine_refs, engine_object, engine_hash, 1) < 0) {
        return -1;
    }
    slot = map_value_slot(h->blocks, prefix_hash, &created);
    if (slot == NULL) return -1;
    if (created) {
        *slot = (uint64_t)(uintptr_t)Py_NewRef(h->bit);
        return 0;
    }
    PyObject *mask = (PyObject *)(uintptr_t)*slot;
    PyObject *both = PyNumber_And(mask, h->bit);
    if (both == NULL) return -1;
    int mine = PyObject_IsTrue(both);
    Py_DECREF(both);
    if (mine < 0) return -1;
    if (mine) return add_hash_count(h->extra_refs, prefix_object, prefix_hash, 1);
    PyObject *joined = PyNumber_Or(mask, h->bit);
    if (joined == NULL) return -1;
    *slot = (uint64_t)(uintptr_t)joined;  /* the map takes the new mask's reference */
    Py_DECREF(mask);
    return 0;
}

/* Clear the owner's bit (``others`` = ~bit) from ``mask``, the mask ``blocks`` holds for
 * the prefix; the entry goes with its last bit. */
static int unset_bit(Map *blocks, uint64_t prefix_hash, uint64_t mask, PyObject *bit,
                     PyObject *others) {
    uint64_t old;
    if ((PyObject *)(uintptr_t)mask == bit) {  /* its owner's own bit object: the last bit */
        if (map_erase(blocks, prefix_hash, &old)) release_value(blocks, old);
        return 0;
    }
    PyObject *left = PyNumber_And((PyObject *)(uintptr_t)mask, others);
    if (left == NULL) return -1;
    int kept = PyObject_IsTrue(left);
    int result = kept < 0 ? -1 : kept ? map_set(blocks, prefix_hash, left) : 0;
    Py_DECREF(left);
    if (result == 0 && !kept && map_erase(blocks, prefix_hash, &old)) release_value(blocks, old);
    return result;
}

/* One holder fewer of ``engine_hash``: a count less in ``engine_refs`` while others hold
 * it, else its entry in ``engine_prefix`` goes. ``object`` is its int, or NULL. 1 when
 * released, 0 when it had no entry, -1 on error. */
static int release_engine_hash(Map *engine_prefix, PyObject *engine_refs,
                               uint64_t engine_hash, PyObject *object) {
    int shared = take_count(engine_refs, object, engine_hash);
    if (shared) return shared;
    uint64_t old;
    return map_erase(engine_prefix, engine_hash, &old);
}

/* The owner holds one copy fewer of a block (``others`` = ~bit): 1 when it held it, 0 when
 * not, -1 on error. Its last copy gone, the block is forgotten; its prefix keeps the
 * owner's bit while another engine hash of the owner still stands for it. */
int release_block(const Holder *h, PyObject *others, uint64_t engine_hash,
                         PyObject *engine_object) {
    int copy = take_count(h->copies, engine_object, engine_hash);
    if (copy) return copy;
    uint64_t prefix_hash, mask;
    if (!map_erase(h->by_engine_hash, engine_hash, &prefix_hash)) return 0;
    int held = release_engine_hash(h->engine_prefix, h->engine_refs, engine_hash, engine_object);
    if (held == 0)
        PyErr_Format(PyExc_KeyError, "engine hash %llu", (unsigned long long)engine_hash);
    if (held <= 0) return -1;
    int extra = take_count(h->extra_refs, NULL, prefix_hash);
    if (extra) return extra;
    if (!map_lookup(h->blocks, prefix_hash, &mask)) {
        PyErr_Format(PyExc_KeyError, "prefix %llu", (unsigned long long)prefix_hash);
        return -1;
    }
    return unset_bit(h->blocks, prefix_hash, mask, h->bit, others) < 0 ? -1 : 1;
}

/* A Holder from 7 arguments (by_engine_hash, copies, extra_refs, engine_prefix,
 * engine_refs, blocks, bit) after ``check_args`` took their types ("hddhdm."). */
int holder_of(PyObject *const *args, Holder *h) {
    if (args[0] == args[3]) {  /* one map's slot would move while the other's is filled */
        PyErr_SetString(PyExc_ValueError, "by_engine_hash and engine_prefix are one map");
        return -1;
    }
    *h = (Holder){(Map *)args[0], args[1], args[2], (Map *)args[3], args[4], (Map *)args[5],
                  args[6]};
    return 0;
}

PyDoc_STRVAR(hold_doc,
"hold(" HOLDER_ARGS ",\n     engine_hashes, prefix_hashes, /)\n--\n\n"
"PrefixContext.hold's loop: record that the owner whose slot bit is ``bit`` holds these\n"
"blocks (pairs of the two sequences, up to the shorter) in its ``by_engine_hash`` (a block\n"
"it holds already counts one more copy), the context's ``engine_prefix`` (one more\n"
"holder in ``engine_refs`` when known) and the tier's ``blocks`` masks (a prefix it holds\n"
"under another engine hash counts in ``extra_refs``). Returns how many pairs it took.");

static PyObject *hold(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Holder h;
    if (check_args(args, nargs, "hddhdm...") < 0 || holder_of(args, &h) < 0) return NULL;
    PyObject *engine_seq = PySequence_Fast(args[7], "engine_hashes must be a sequence");
    if (engine_seq == NULL) return NULL;
    PyObject *prefix_seq = PySequence_Fast(args[8], "prefix_hashes must be a sequence");
    if (prefix_seq == NULL) {
        Py_DECREF(engine_seq);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(engine_seq);
    if (PySequence_Fast_GET_SIZE(prefix_seq) < count) count = PySequence_Fast_GET_SIZE(prefix_seq);
    PyObject **engine_hashes = PySequence_Fast_ITEMS(engine_seq);
    PyObject **prefix_hashes = PySequence_Fast_ITEMS(prefix_seq);
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t engine_hash, prefix_hash;
        if (required_key(engine_hashes[i], &engine_hash) < 0
            || required_key(prefix_hashes[i], &prefix_hash) < 0
            || hold_block(&h, engine_hash, prefix_hash, engine_hashes[i], prefix_hashes[i]) < 0)
            goto done;
    }
    result = PyLong_FromSsize_t(count);
done:
    Py_DECREF(engine_seq);
    Py_DECREF(prefix_seq);
    return result;
}

PyDoc_STRVAR(release_many_doc,
"release_many(" HOLDER_ARGS ",\n             engine_hashes, /)\n--\n\n"
"PrefixContext.release_many's loop: the owner whose slot bit is ``bit`` holds one copy\n"
"fewer of each of these blocks (hashes it does not hold are skipped). Its last copy gone,\n"
"a block leaves ``by_engine_hash`` and has one holder fewer in ``engine_prefix`` /\n"
"``engine_refs``; its prefix's mask in ``blocks`` loses ``bit`` (the entry goes with the\n"
"last bit) unless ``extra_refs`` counts another engine hash of the owner for it.\n"
"Returns how many it held.");

static PyObject *release_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Holder h;
    if (check_args(args, nargs, "hddhdm..") < 0 || holder_of(args, &h) < 0) return NULL;
    PyObject *others = PyNumber_Invert(h.bit);
    if (others == NULL) return NULL;
    PyObject *seq = PySequence_Fast(args[7], "engine_hashes must be a sequence");
    if (seq == NULL) {
        Py_DECREF(others);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), released = 0;
    PyObject **engine_hashes = PySequence_Fast_ITEMS(seq), *result = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t engine_hash;
        int found = key_of(engine_hashes[i], &engine_hash);
        if (found > 0) found = release_block(&h, others, engine_hash, engine_hashes[i]);
        if (found < 0) goto done;
        released += found;
    }
    result = PyLong_FromSsize_t(released);
done:
    Py_DECREF(others);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(release_all_doc,
"release_all(by_engine_hash, engine_prefix, engine_refs, blocks, bit, /)\n--\n\n"
"PrefixContext.clear_slot's loop for one tier: forget every engine hash the owner holds\n"
"(one holder fewer in ``engine_prefix``/``engine_refs``), clear ``bit`` from each of its\n"
"prefixes' masks in ``blocks`` (the entry goes with the last bit), and empty\n"
"``by_engine_hash``. Returns how many engine hashes it held.");

static PyObject *release_all(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(args, nargs, "hhdm.") < 0) return NULL;
    Map *by_engine_hash = (Map *)args[0], *engine_prefix = (Map *)args[1];
    Map *blocks = (Map *)args[3];
    PyObject *engine_refs = args[2], *bit = args[4];
    PyObject *others = PyNumber_Invert(bit);
    if (others == NULL) return NULL;
    Py_ssize_t held = map_length(by_engine_hash), shard = 0, position = 0;
    int zero = by_engine_hash->has_zero;  /* the key 0, kept beside the tables, first */
    for (;;) {
        uint64_t engine_hash, prefix_hash, mask;
        if (zero) {
            zero = 0;
            engine_hash = 0, prefix_hash = by_engine_hash->zero_value;
        } else {
            Entry *entry = next_entry(by_engine_hash, &shard, &position);
            if (entry == NULL) break;
            engine_hash = entry->key, prefix_hash = entry->value;
        }
        if (release_engine_hash(engine_prefix, engine_refs, engine_hash, NULL) < 0) goto fail;
        if (!map_lookup(blocks, prefix_hash, &mask)) continue;  /* unset already (extra_refs) */
        if (unset_bit(blocks, prefix_hash, mask, bit, others) < 0) goto fail;
    }
    map_clear_all(by_engine_hash);
    Py_DECREF(others);
    return PyLong_FromSsize_t(held);
fail:
    Py_DECREF(others);
    return NULL;
}

PyMethodDef blocks_methods[] = {
    {"hold", (PyCFunction)(void (*)(void))hold, METH_FASTCALL, hold_doc},
    {"release_many", (PyCFunction)(void (*)(void))release_many, METH_FASTCALL, release_many_doc},
    {"release_all", (PyCFunction)(void (*)(void))release_all, METH_FASTCALL, release_all_doc},
    {NULL, NULL, 0, NULL},
};

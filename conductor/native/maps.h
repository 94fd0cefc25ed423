/* Maps keyed by unsigned 64-bit hashes: HashMap and MaskMap (maps.c), and what the index's
 * loops in C use of them. */
#ifndef CONDUCTOR_NATIVE_MAPS_H
#define CONDUCTOR_NATIVE_MAPS_H

#include <Python.h>
#include <stdint.h>

#include "sync.h"

/* Why not dicts: a dict entry of an int key costs its slot plus the key's int object and,
 * for an int value, the value's; every lookup follows the key's pointer. Here a key
 * and its value are 16 bytes inline, at most 3/4 of the slots used (open addressing, linear
 * probing, deletion by backward shift: no tombstones).
 *
 * HashMap: uint64 -> uint64 (engine hash -> prefix hash, or a hash -> a count).
 * MaskMap: uint64 -> owner mask (prefix hash -> its owners' bits, masks.h; read and set
 *          as ints, of any width).
 * Both behave like dicts for what the index asks of them: len, in, [], get, pop, del,
 * iteration over keys / values / items (an error if the map changes meanwhile), clear, ==.
 * A key that is not an unsigned 64-bit int is never present, and cannot be stored.
 */

typedef struct {
    uint64_t key;  /* 0: a free slot (the key 0 itself is kept beside the table) */
    uint64_t value;  /* HashMap: the value; MaskMap: a mask (masks.h), owned by the map */
} Entry;

typedef struct {
    Entry *entries;  /* NULL while capacity is 0 */
    Py_ssize_t capacity;  /* 0, or 8 or more (any size: tables grow by half, see maps.c) */
    Py_ssize_t used;  /* entries in the table */
} Table;

/* A map grows by doubling a table, which rehashes all its keys at once: for millions of
 * keys, a stall every query would wait out. So a map of SHARD_AT keys splits into SHARDS
 * tables, chosen by a key's top hash bits, that grow one at a time: a growth then moves
 * 1/SHARDS of the keys (bench.index_bench's query percentiles show the stall is gone). Small maps (most: an owner's blocks) stay one table. */
#define SHARD_BITS 8
#define SHARDS (1 << SHARD_BITS)
#define SHARD_AT 65536

typedef struct {
    PyObject_HEAD
    Table one;  /* the table while the map is not split */
    Table *shards;  /* NULL, or SHARDS tables once it split */
    Py_ssize_t used;  /* keys in the tables, the key 0 not counted */
    int has_zero;
    uint64_t zero_value;
    uint64_t version;  /* bumped when a key comes or goes: iterators check it */
    Sync *sync;  /* its context's (sync.h), or NULL: Python's calls take it */
} Map;

extern PyTypeObject HashMapType;
extern PyTypeObject MaskMapType;

#define HOLDS_MASKS(map) Py_IS_TYPE((PyObject *)(map), &MaskMapType)

static inline uint64_t mix(uint64_t key) {
    key ^= key >> 30;  /* splitmix64's finalizer: keys that share low bits spread too */
    key *= 0xBF58476D1CE4E5B9ULL;
    key ^= key >> 27;
    key *= 0x94D049BB133111EBULL;
    return key ^ (key >> 31);
}

/* A key's first slot in a table: its mix's low 56 bits scaled to the capacity (a multiply,
 * not a modulo, so a table may have any size; its shard: the mix's top bits). */
static inline size_t home_of(uint64_t key, Py_ssize_t capacity) {
    return (size_t)(((unsigned __int128)(mix(key) << SHARD_BITS) * (uint64_t)capacity) >> 64);
}

/* The slot after ``i`` in a table of ``capacity`` slots, cyclically. */
static inline size_t next_slot(size_t i, Py_ssize_t capacity) {
    return ++i == (size_t)capacity ? 0 : i;
}

static inline Table *table_of(const Map *map, uint64_t key) {
    return map->shards ? &map->shards[mix(key) >> (64 - SHARD_BITS)] : (Table *)&map->one;
}

/* The entry of ``key`` (not 0), or NULL. */
static inline Entry *map_find(const Map *map, uint64_t key) {
    const Table *table = table_of(map, key);
    if (table->capacity == 0) return NULL;
    for (size_t i = home_of(key, table->capacity);; i = next_slot(i, table->capacity)) {
        Entry *entry = &table->entries[i];
        if (entry->key == key) return entry;
        if (entry->key == 0) return NULL;
    }
}

/* Where the value of ``key`` is stored, or NULL when it is absent. */
static inline uint64_t *map_value_of(Map *map, uint64_t key) {
    if (key == 0) return map->has_zero ? &map->zero_value : NULL;
    Entry *entry = map_find(map, key);
    return entry != NULL ? &entry->value : NULL;
}

static inline int map_lookup(const Map *map, uint64_t key, uint64_t *value) {
    if (key == 0) {
        if (map->has_zero) *value = map->zero_value;
        return map->has_zero;
    }
    Entry *entry = map_find(map, key);
    if (entry != NULL) *value = entry->value;
    return entry != NULL;
}

/* Ask the CPU to fetch the slot where a lookup of ``key`` starts (a hint: nothing changes).
 * At millions of keys each such slot is a cache miss; fetching those of a few keys at once
 * overlaps their misses instead of waiting out each in turn. */
static inline void map_prefetch(const Map *map, uint64_t key) {
    const Table *table = table_of(map, key);
    if (table->capacity != 0) __builtin_prefetch(&table->entries[home_of(key, table->capacity)]);
}

static inline Py_ssize_t map_length(const Map *map) { return map->used + map->has_zero; }

/* A place in a walk over a map's keys (MAP_START: before the first). */
typedef struct {
    Py_ssize_t shard, position;  /* position -1: the key 0 is next */
} MapCursor;
#define MAP_START {0, -1}

/* the rest is in maps.c, each with what it does */
int map_next(const Map *map, MapCursor *at, uint64_t *key, uint64_t *value);
uint64_t *map_value_slot(Map *map, uint64_t key, int *created);
int map_erase(Map *map, uint64_t key, uint64_t *old);
Map *map_of_context(PyTypeObject *type, Sync *sync);
int key_of(PyObject *object, uint64_t *key);
int required_key(PyObject *object, uint64_t *key);
void release_value(const Map *map, uint64_t value);
void map_clear_all(Map *map);

#endif

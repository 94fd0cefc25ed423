/* Who may touch a context's maps while the ingest thread (ingest.c) applies batches to it.
 *
 * The ingest thread applies a context's batches without the GIL, under the context's mutex,
 * a few dozen blocks at a time. Code holding the GIL takes the same mutex for what is one
 * call: a lookup, a walk (``sync_lock``). What changes a map, or walks it over several
 * calls (an iterator), first waits until the thread holds no batch of the context
 * (``sync_settle``): Python code then sees the maps change only where it calls into them,
 * as it did before there was a thread. The thread never takes the GIL, so a caller may
 * wait holding it. Waits are short both ways, as a mutex alone is not fair (who let it go
 * may take it again before a waiter wakes): the thread lets a waiting caller in between
 * two steps (``waiting``), a caller lets a waiting thread in first (``thread_waiting``), and
 * a settle waits out the context's queued batches at most.
 */
#ifndef CONDUCTOR_NATIVE_SYNC_H
#define CONDUCTOR_NATIVE_SYNC_H

#include <Python.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

typedef struct {
    pthread_mutex_t mutex;
    pthread_cond_t settled;  /* signalled when ``pending`` comes down to 0 */
    Py_ssize_t pending;  /* the context's batches the ingest thread holds (the mutex held) */
    atomic_int waiting;  /* callers holding the GIL that wait for the mutex */
    atomic_int thread_waiting;  /* the ingest thread waits for the mutex */
    Py_ssize_t refs;  /* the context and its maps (changed with the GIL held) */
} Sync;

static inline Sync *sync_new(void) {
    Sync *sync = PyMem_RawCalloc(1, sizeof(Sync));
    if (sync == NULL) return NULL;
    pthread_mutex_init(&sync->mutex, NULL);
    pthread_cond_init(&sync->settled, NULL);
    sync->refs = 1;
    return sync;
}

static inline Sync *sync_ref(Sync *sync) {
    if (sync != NULL) sync->refs++;
    return sync;
}

static inline void sync_release(Sync *sync) {
    if (sync == NULL || --sync->refs) return;
    pthread_mutex_destroy(&sync->mutex);
    pthread_cond_destroy(&sync->settled);
    PyMem_RawFree(sync);
}

/* The mutex, for a caller holding the GIL (NULL: a map of no context, nothing to take). */
static inline void sync_lock(Sync *sync) {
    if (sync == NULL) return;
    atomic_fetch_add(&sync->waiting, 1);
    while (atomic_load(&sync->thread_waiting)) sched_yield();
    pthread_mutex_lock(&sync->mutex);
    atomic_fetch_sub(&sync->waiting, 1);
}

/* The mutex, once the ingest thread holds no batch of the context. */
static inline void sync_settle(Sync *sync) {
    sync_lock(sync);
    while (sync != NULL && sync->pending) pthread_cond_wait(&sync->settled, &sync->mutex);
}

static inline void sync_unlock(Sync *sync) {
    if (sync != NULL) pthread_mutex_unlock(&sync->mutex);
}

/* For the ingest thread: the mutex, once the callers waiting for it had it (a mutex is not
 * fair: a thread taking it again at once could keep them waiting for a whole backlog). */
static inline void sync_after_waiters(Sync *sync) {
    while (atomic_load(&sync->waiting)) sched_yield();
    atomic_store(&sync->thread_waiting, 1);
    pthread_mutex_lock(&sync->mutex);
    atomic_store(&sync->thread_waiting, 0);
}

/* For the ingest thread between two steps: the mutex given up until the callers waiting
 * for it had it. */
static inline void sync_let_in(Sync *sync) {
    pthread_mutex_unlock(&sync->mutex);
    sync_after_waiters(sync);
}

#endif

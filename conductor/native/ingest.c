/* IngestThread: the lane's batches applied on a thread of their own, without the GIL.
 *
 * One thread applies the batches given to it in order, each under its context's mutex, a
 * step of STEP_BLOCKS blocks at a time (sync.h: a query's walk or lookup waits for one
 * step at most). The event loop keeps the rest (HTTP, the streams' sequence numbers,
 * reading and packing the next batches) and learns what finished through a pipe it
 * watches: a byte written when a batch finishes and none was waiting to be collected
 * (``finished()`` drains the pipe, then takes the batches). The thread never
 * touches a Python object; a batch's objects are held for it until ``finished()`` hands
 * them back. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "blocks.h"
#include "lane.h"
#include "sync.h"

#ifndef STEP_BLOCKS
#define STEP_BLOCKS 64  /* about 30 µs of applying at a million blocks */
#endif
#define PAUSE_MAX_NS 2000000  /* how long a request holds the thread back at most */

typedef struct Job {
    struct Job *next;
    PyObject *context, *packed, *owner, *token;  /* held until finished() hands them back */
    LaneTask task;
    Applied applied;
} Job;

typedef struct {
    Job *first, *last;
} Queue;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mutex;  /* the queues and ``stopping`` */
    pthread_cond_t wake, resumed;
    Queue queued, finished;
    int stopping, started;
    atomic_int paused;  /* requests are being answered (pause()) */
    atomic_ullong pauses;  /* pause(True) calls so far: each pause is waited for once */
    unsigned long long waited;  /* the thread's: the last pause it waited for */
    pthread_t thread;
    int pipe[2];  /* read end for the event loop, write end for the thread */
} IngestThread;

static void queue_push(Queue *queue, Job *job) {
    job->next = NULL;
    if (queue->last != NULL) queue->last->next = job;
    else queue->first = job;
    queue->last = job;
}

/* While requests are being answered the thread waits, PAUSE_MAX_NS at most per pause (so
 * queries that never stop cannot stop ingest): on a machine of few cores a query then has
 * a core to itself, as LoopShare gives it the loop. */
static void wait_while_paused(IngestThread *self) {
    unsigned long long pause = atomic_load(&self->pauses);
    if (!atomic_load(&self->paused) || pause == self->waited) return;
    self->waited = pause;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_nsec += PAUSE_MAX_NS;
    deadline.tv_sec += deadline.tv_nsec / 1000000000;
    deadline.tv_nsec %= 1000000000;
    pthread_mutex_lock(&self->mutex);
    while (atomic_load(&self->paused) && atomic_load(&self->pauses) == pause && !self->stopping
           && pthread_cond_timedwait(&self->resumed, &self->mutex, &deadline) == 0) {
    }
    pthread_mutex_unlock(&self->mutex);
}

/* Apply one batch in steps under its context's mutex (let go while paused); the context
 * settles with its last. */
static void apply_job(IngestThread *self, Job *job) {
    Sync *sync = ((ContextBlocks *)job->context)->sync;
    wait_while_paused(self);
    sync_after_waiters(sync);
    for (;;) {
        apply_steps(&job->task, STEP_BLOCKS, &job->applied);
        if (job->applied.fault.kind || job->applied.reached >= job->task.batch->count) break;
        if (atomic_load(&self->paused) && atomic_load(&self->pauses) != self->waited) {
            pthread_mutex_unlock(&sync->mutex);
            wait_while_paused(self);
            sync_after_waiters(sync);
        } else {
            sync_let_in(sync);
        }
    }
    if (--sync->pending == 0) pthread_cond_broadcast(&sync->settled);
    pthread_mutex_unlock(&sync->mutex);
}

static void *run(void *arg) {
    IngestThread *self = arg;
    pthread_mutex_lock(&self->mutex);
    for (;;) {
        while (self->queued.first == NULL && !self->stopping)
            pthread_cond_wait(&self->wake, &self->mutex);
        Job *job = self->queued.first;
        if (job == NULL) break;  /* stopping, every batch applied */
        self->queued.first = job->next;
        if (self->queued.first == NULL) self->queued.last = NULL;
        pthread_mutex_unlock(&self->mutex);
        apply_job(self, job);
        pthread_mutex_lock(&self->mutex);
        int unheard = self->finished.first == NULL;  /* else the loop was woken already */
        queue_push(&self->finished, job);
        if (unheard) {
            char one = 1;  /* a full pipe (EAGAIN) has bytes for the loop to read already */
            ssize_t written = write(self->pipe[1], &one, 1);
            (void)written;
        }
    }
    pthread_mutex_unlock(&self->mutex);
    return NULL;
}

static void stop(IngestThread *self) {
    if (!self->started) return;
    pthread_mutex_lock(&self->mutex);
    self->stopping = 1;
    pthread_cond_signal(&self->wake);
    pthread_cond_signal(&self->resumed);
    pthread_mutex_unlock(&self->mutex);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    self->started = 0;
}

static void job_free(Job *job) {
    Py_DECREF(job->context);
    Py_DECREF(job->packed);
    Py_DECREF(job->owner);
    Py_DECREF(job->token);
    PyMem_RawFree(job);
}

static PyObject *ingest_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "IngestThread() takes no arguments");
        return NULL;
    }
    IngestThread *self = (IngestThread *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->pipe[0] = self->pipe[1] = -1;
    pthread_mutex_init(&self->mutex, NULL);
    pthread_cond_init(&self->wake, NULL);
    pthread_cond_init(&self->resumed, NULL);
    if (pipe(self->pipe) < 0 || fcntl(self->pipe[0], F_SETFL, O_NONBLOCK) < 0
        || fcntl(self->pipe[1], F_SETFL, O_NONBLOCK) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    int failed = pthread_create(&self->thread, NULL, run, self);
    if (failed) {
        errno = failed;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    self->started = 1;
    return (PyObject *)self;
}

static void ingest_dealloc(IngestThread *self) {
    stop(self);
    for (Job *job = self->finished.first, *next; job != NULL; job = next) {
        next = job->next;
        job_free(job);
    }
    for (int end = 0; end < 2; end++) {
        if (self->pipe[end] >= 0) close(self->pipe[end]);
    }
    pthread_mutex_destroy(&self->mutex);
    pthread_cond_destroy(&self->wake);
    pthread_cond_destroy(&self->resumed);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(ingest_submit_doc,
"submit(blocks, packed, owner, start, root, token, /)\n--\n\n"
"Apply a PackedBatch from event ``start`` on, as ``blocks.apply_packed`` would (the same\n"
"arguments, with no bound on blocks), on the thread, after the batches given before it.\n"
"``finished()`` hands back ``token`` with the answer. Until then ``blocks``' methods that\n"
"change or iterate its maps wait for the batch; lookups and walks wait for a step.");

static PyObject *ingest_submit(IngestThread *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) return PyErr_Format(PyExc_TypeError, "submit takes 6 arguments (%zd given)", nargs);
    if (!PyObject_TypeCheck(args[0], &ContextBlocksType)) {
        PyErr_SetString(PyExc_TypeError, "blocks must be a ContextBlocks");
        return NULL;
    }
    ContextBlocks *context = (ContextBlocks *)args[0];
    LaneTask task;
    if (lane_task(context, args[1], args[2], args[4], &task) < 0) return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    if (start < 0 || start > task.batch->count) {
        PyErr_SetString(PyExc_ValueError, "submit: bad start");
        return NULL;
    }
    Job *job = PyMem_RawCalloc(1, sizeof(Job));
    if (job == NULL) return PyErr_NoMemory();
    job->context = Py_NewRef(args[0]);
    job->packed = Py_NewRef(args[1]);
    job->owner = Py_NewRef(args[2]);
    job->token = Py_NewRef(args[5]);
    job->task = task;
    job->applied.reached = start;
    Sync *sync = context->sync;
    sync_lock(sync);
    sync->pending++;  /* before the thread can see the job */
    sync_unlock(sync);
    pthread_mutex_lock(&self->mutex);  /* the check and the push at once: close() may run */
    int closed = self->stopping;
    if (!closed) {
        queue_push(&self->queued, job);
        pthread_cond_signal(&self->wake);
    }
    pthread_mutex_unlock(&self->mutex);
    if (!closed) Py_RETURN_NONE;
    sync_lock(sync);
    if (--sync->pending == 0) pthread_cond_broadcast(&sync->settled);
    sync_unlock(sync);
    job_free(job);
    PyErr_SetString(PyExc_RuntimeError, "the ingest thread is closed");
    return NULL;
}

/* The exception being raised, taken (3.11 has no PyErr_GetRaisedException). */
static PyObject *take_exception(void) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
}

PyDoc_STRVAR(ingest_finished_doc,
"finished()\n--\n\n"
"The batches applied since the last call, in the order given: a list of (token, answer),\n"
"the answer apply_packed's tuple, or the exception it would have raised.");

static PyObject *ingest_finished(IngestThread *self, PyObject *unused) {
    char drained[256];
    while (read(self->pipe[0], drained, sizeof drained) > 0) {
    }
    pthread_mutex_lock(&self->mutex);
    Job *job = self->finished.first;
    self->finished = (Queue){NULL, NULL};
    pthread_mutex_unlock(&self->mutex);
    PyObject *done = PyList_New(0);
    for (Job *next; job != NULL; job = next) {
        next = job->next;
        PyObject *answer = done != NULL ? applied_result(&job->applied) : NULL;
        if (answer == NULL && done != NULL && job->applied.fault.kind) {
            answer = take_exception();
        }
        PyObject *pair = answer != NULL ? PyTuple_Pack(2, job->token, answer) : NULL;
        if (pair == NULL || PyList_Append(done, pair) < 0) Py_CLEAR(done);
        Py_XDECREF(pair);
        Py_XDECREF(answer);
        job_free(job);
    }
    return done;
}

static PyObject *ingest_fileno(IngestThread *self, PyObject *unused) {
    return PyLong_FromLong(self->pipe[0]);
}

PyDoc_STRVAR(ingest_pause_doc,
"pause(answering, /)\n--\n\n"
"True: requests are being answered, the thread waits between two steps (2 ms at most for\n"
"this pause); False: none is left, it goes on.");

static PyObject *ingest_pause(IngestThread *self, PyObject *answering) {
    int paused = PyObject_IsTrue(answering);
    if (paused < 0) return NULL;
    if (paused) {
        atomic_fetch_add(&self->pauses, 1);
        atomic_store(&self->paused, 1);
    } else if (atomic_load(&self->paused)) {
        pthread_mutex_lock(&self->mutex);
        atomic_store(&self->paused, 0);
        pthread_cond_signal(&self->resumed);
        pthread_mutex_unlock(&self->mutex);
    }
    Py_RETURN_NONE;
}

static PyObject *ingest_close(IngestThread *self, PyObject *unused) {
    stop(self);
    Py_RETURN_NONE;
}

static PyMethodDef ingest_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))ingest_submit, METH_FASTCALL, ingest_submit_doc},
    {"finished", (PyCFunction)ingest_finished, METH_NOARGS, ingest_finished_doc},
    {"pause", (PyCFunction)ingest_pause, METH_O, ingest_pause_doc},
    {"fileno", (PyCFunction)ingest_fileno, METH_NOARGS,
     "fileno()\n--\n\nthe pipe to watch: readable when a batch finished"},
    {"close", (PyCFunction)ingest_close, METH_NOARGS,
     "close()\n--\n\nstop the thread once every batch given is applied (finished() still answers)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IngestThreadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "conductor._native.IngestThread",
    .tp_doc = "IngestThread()\n--\n\nA thread that applies packed batches without the GIL.",
    .tp_basicsize = sizeof(IngestThread),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = ingest_new,
    .tp_dealloc = (destructor)ingest_dealloc,
    .tp_methods = ingest_methods,
};

int ingest_exec(PyObject *module) {
    return PyType_Ready(&IngestThreadType) < 0 || PyModule_AddType(module, &IngestThreadType) < 0
               ? -1
               : 0;
}

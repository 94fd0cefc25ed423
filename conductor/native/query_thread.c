/* QueryThread: plain queries answered on a thread of its own, beside the event loop, with
 * its own listening sockets (conductor.query_thread).
 *
 * Why: the event loop is one Python thread; every query it answers waits for its ingest
 * steps and its other requests, and one core is all it has. The plain query's request
 * and answer are C already (request.c, answer.c), and the index's C state needs no GIL
 * (sync.h), so this thread serves plain queries without the GIL: it accepts on sockets
 * bound to the service's port with SO_REUSEPORT (the kernel spreads new connections over
 * them and the loop's), reads each request, answers it from the plan the loop published
 * for its context, and writes the answer. A request it does not answer (another route, a
 * header asking for more, a context it has no plan for, a request not whole within a
 * second) gives its whole connection to the loop: the socket and every byte not yet
 * answered, which the loop's query lane then serves as if it had accepted it.
 *
 * A context's plans come from the loop (``publish``); before the loop changes a context's
 * slots it ``hold``s the context, and a query of it waits (its connection parked, a
 * second at most) until the loop publishes again. The registry's mutex is held over each
 * answer, so once ``hold`` returns no answer uses the old plan.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "answer.h"
#include "hashing.h"
#include "profile.h"
#include "request.h"

#define MAX_HEAD 8190  /* lane_http.MAX_HEAD_BYTES: a longer head is the loop's */
#define WHOLE_WITHIN_S 1.0  /* a request (or a held context's plan) not there by then: the loop's */
#define MOST_BUCKETS 32
#define READ_CHUNK 65536
#define EVENTS 64

/* The names the plain head reader reads, in its order (api._PLAIN_HEADS). */
enum { ACCEPT, AUTHORIZATION, HITS_ONLY, REPLICA, LEASE, PROGRESS, READ_NAMES };

typedef struct {
    char *data;
    size_t start, used, size;  /* the bytes not yet taken are data[start:used] */
} Buffer;

enum { SOURCE_LISTENER, SOURCE_WAKE, SOURCE_CONNECTION };

typedef struct Connection {
    int kind;  /* SOURCE_CONNECTION: first, as epoll's data points at it */
    int fd;
    Buffer in, out;
    double active;  /* its last answer (or its accept): idle since */
    double began;  /* the first byte of a request not yet whole (0: none) */
    double parked;  /* waiting since for a held context's plan (0: not) */
    int leaving;  /* LEAVE_*: once its answers are written */
    int ended;  /* the client sent all it will (EOF): closed once its whole requests are */
    uint32_t watching;  /* the events epoll is asked for */
    struct Connection *prev, *next;
} Connection;

enum { STAY, LEAVE_TO_LOOP, LEAVE_CLOSED };

typedef struct PlanEntry {
    struct PlanEntry *next;
    char *key;  /* tenant, model, lora, each ended by a 0 byte, then the block size */
    size_t key_length;
    QueryPlan *plans[2];  /* JSON's, msgpack's (NULL: not plain in that dialect) */
    TierWalk pools;  /* its pools as the plans were made, and how wide a walk is */
    PyObject *chain;  /* a ProfileChain of no tokens, unsalted: how its blocks are keyed (NULL:
                       * by Go prefix hashes) */
    int held;  /* the loop changes its slots: queries wait for its next publish */
} PlanEntry;

typedef struct Handover {
    struct Handover *next;
    int fd;
    char *bytes;
    size_t length;
} Handover;

typedef struct {
    int kind;
    int fd;
} Listener;

typedef struct {
    PyObject_HEAD
    HeadReader *reader;
    PyObject *heads[2];  /* bytes: an answer's head up to its length, in JSON and msgpack */
    PyObject *msgpack_type, *token;  /* bytes; token None: no auth on /query */
    long long max_body, max_tokens;
    double keepalive_s;
    Py_ssize_t max_connections;
    Py_ssize_t listener_count;
    Listener *listeners;
    int epoll_fd;
    int wake_fd;  /* the thread's: stop, or a context published */
    int handover_fd;  /* the loop's: connections handed over */
    pthread_t thread;
    int ready;  /* __init__ made it whole */
    int started;
    atomic_int stopping, routed;
    _Atomic double last_request;  /* when a request last came whole (CLOCK_MONOTONIC s) */
    atomic_long loop_connections;
    /* the registry, and what the thread counts: under ``lock`` */
    pthread_mutex_t lock;
    PlanEntry **table;
    size_t table_size, entries;
    Handover *handovers, **handovers_end;
    double bounds[MOST_BUCKETS];
    Py_ssize_t bound_count;
    unsigned long long answered, handed_over, refused;
    unsigned long long buckets[MOST_BUCKETS + 1];
    double seconds;
    /* the thread's own */
    Connection *connections;
    atomic_long open_connections;  /* read by the loop too */
    Buffer scratch;  /* an answer's body before its head */
} QueryThread;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Room for ``more`` bytes after ``used``: 0, or -1 when memory ran out. */
static int reserve(Buffer *buffer, size_t more) {
    if (buffer->start > 0 && buffer->start == buffer->used) buffer->start = buffer->used = 0;
    if (buffer->used + more <= buffer->size) return 0;
    if (buffer->start > 0) {  /* move what is left to the front first */
        memmove(buffer->data, buffer->data + buffer->start, buffer->used - buffer->start);
        buffer->used -= buffer->start;
        buffer->start = 0;
        if (buffer->used + more <= buffer->size) return 0;
    }
    size_t size = buffer->size ? buffer->size : 4096;
    while (size < buffer->used + more) size *= 2;
    char *data = PyMem_RawRealloc(buffer->data, size);
    if (data == NULL) return -1;
    buffer->data = data;
    buffer->size = size;
    return 0;
}

static int append(Buffer *buffer, const void *bytes, size_t length) {
    if (reserve(buffer, length) < 0) return -1;
    memcpy(buffer->data + buffer->used, bytes, length);
    buffer->used += length;
    return 0;
}

/* -- the registry -------------------------------------------------------------------- */

static uint64_t key_hash(const char *key, size_t length) {
    return xxh64((const uint8_t *)key, length, 0);
}

/* The entry of ``key``, or NULL; ``lock`` is held. */
static PlanEntry *entry_of(QueryThread *self, const char *key, size_t length) {
    if (self->table_size == 0) return NULL;
    PlanEntry *entry = self->table[key_hash(key, length) & (self->table_size - 1)];
    while (entry != NULL && (entry->key_length != length || memcmp(entry->key, key, length) != 0))
        entry = entry->next;
    return entry;
}

/* A context's key as the registry holds it, from its parts: its length, or 0 if it does not
 * fit ``out`` (such a context is not served here). */
static size_t write_key(char *out, size_t size, Span tenant, Span model, Span lora,
                        uint64_t block_size) {
    size_t length = tenant.length + model.length + lora.length + 3 + sizeof block_size;
    if (length > size) return 0;
    char *p = out;
    Span parts[3] = {tenant, model, lora};
    for (int i = 0; i < 3; i++) {
        if (parts[i].length) memcpy(p, parts[i].text, parts[i].length);
        p += parts[i].length;
        *p++ = 0;
    }
    memcpy(p, &block_size, sizeof block_size);
    return length;
}

/* -- connections --------------------------------------------------------------------- */

static void wake(int fd) {
    uint64_t one = 1;
    ssize_t written = write(fd, &one, sizeof one);
    (void)written;  /* full (2**64 - 2 wakes unread): the reader wakes anyway */
}

static void forget(QueryThread *self, Connection *connection) {
    if (connection->prev) connection->prev->next = connection->next;
    else self->connections = connection->next;
    if (connection->next) connection->next->prev = connection->prev;
    atomic_fetch_sub(&self->open_connections, 1);
    PyMem_RawFree(connection->in.data);
    PyMem_RawFree(connection->out.data);
    PyMem_RawFree(connection);
}

static void close_connection(QueryThread *self, Connection *connection) {
    close(connection->fd);
    forget(self, connection);
}

/* The connection, and the bytes it has not had answered, to the loop. */
static void hand_over(QueryThread *self, Connection *connection) {
    epoll_ctl(self->epoll_fd, EPOLL_CTL_DEL, connection->fd, NULL);
    Handover *handover = PyMem_RawCalloc(1, sizeof *handover);
    size_t length = connection->in.used - connection->in.start;
    char *bytes = length ? PyMem_RawMalloc(length) : NULL;
    if (handover == NULL || (length && bytes == NULL)) {  /* no memory: the client retries */
        PyMem_RawFree(handover);
        PyMem_RawFree(bytes);
        close_connection(self, connection);
        return;
    }
    if (length) memcpy(bytes, connection->in.data + connection->in.start, length);
    handover->fd = connection->fd;
    handover->bytes = bytes;
    handover->length = length;
    pthread_mutex_lock(&self->lock);
    *self->handovers_end = handover;
    self->handovers_end = &handover->next;
    self->handed_over++;
    pthread_mutex_unlock(&self->lock);
    forget(self, connection);
    wake(self->handover_fd);
}

/* Readable (until its client ended), and writable when ``out``. */
static void watch(QueryThread *self, Connection *connection, int out) {
    uint32_t events = (connection->ended ? 0 : EPOLLIN | EPOLLRDHUP) | (out ? EPOLLOUT : 0);
    if (connection->watching == events) return;
    struct epoll_event event = {.events = events, .data.ptr = connection};
    epoll_ctl(self->epoll_fd, EPOLL_CTL_MOD, connection->fd, &event);
    connection->watching = events;
}

/* Its answers written as far as the socket takes them; then, once all are, it leaves if it
 * is to. 0, or -1 if it is gone. */
static int flush(QueryThread *self, Connection *connection) {
    Buffer *out = &connection->out;
    while (out->start < out->used) {
        ssize_t sent = send(connection->fd, out->data + out->start, out->used - out->start,
                            MSG_NOSIGNAL);
        if (sent < 0 && errno == EINTR) continue;
        if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            watch(self, connection, 1);
            return 0;
        }
        if (sent < 0) {
            close_connection(self, connection);
            return -1;
        }
        out->start += (size_t)sent;
    }
    out->start = out->used = 0;
    watch(self, connection, 0);
    if (connection->leaving == LEAVE_TO_LOOP) {
        hand_over(self, connection);
        return -1;
    }
    if (connection->leaving == LEAVE_CLOSED) {
        close_connection(self, connection);
        return -1;
    }
    return 0;
}

/* -- answering ----------------------------------------------------------------------- */

enum { ANSWERED, DECLINED, WAIT };

/* Whether ``authorization`` passes as security.Auth.accepts has it: ``Bearer <token>``,
 * the scheme in any case, compared in constant time. */
static int authorized(const QueryThread *self, Span authorization) {
    if (self->token == Py_None) return 1;
    if (authorization.text == NULL) return 0;
    const char *space = memchr(authorization.text, ' ', authorization.length);
    if (space == NULL) return 0;
    Span scheme = {authorization.text, (size_t)(space - authorization.text)};
    const char *given = space + 1, *end = authorization.text + authorization.length;
    while (given < end && Py_ISSPACE(*given)) given++;
    while (end > given && Py_ISSPACE(end[-1])) end--;
    size_t length = (size_t)(end - given), expected = (size_t)PyBytes_GET_SIZE(self->token);
    const char *token = PyBytes_AS_STRING(self->token);
    unsigned char differ = length != expected;
    for (size_t k = 0; k < expected; k++)
        differ |= (unsigned char)(token[k] ^ (k < length ? given[k] : 0));
    return equals_lower(scheme, "bearer") && !differ;
}

static void count_answer(QueryThread *self, double seconds) {
    Py_ssize_t bucket = 0;
    while (bucket < self->bound_count && seconds > self->bounds[bucket]) bucket++;
    self->answered++;
    self->seconds += seconds;
    self->buckets[bucket]++;
}

/* A whole request (its head read, its body ``body``) answered into the connection's
 * output, if it is plain and its context's plan is here. */
static int answer(QueryThread *self, Connection *connection, const HeadRead *head,
                  const char *body, double started) {
    Span media = head->media;
    const char *msgpack_type = PyBytes_AS_STRING(self->msgpack_type);
    int msgpack = media.text != NULL && equals_lower(media, msgpack_type);
    const Span *values = head->values;
    Span accept = values[ACCEPT];
    if ((!msgpack && accept.text != NULL
         && memmem(accept.text, accept.length, msgpack_type, strlen(msgpack_type)) != NULL)
        || values[REPLICA].text != NULL || values[PROGRESS].text != NULL
        || !authorized(self, values[AUTHORIZATION]) || atomic_load(&self->routed)) {
        return DECLINED;
    }
    Fields fields;
    int verdict = DECLINED;
    if (!fields_read(body, (size_t)head->length, msgpack, &fields)
        || (long long)(fields.token_bytes / 4) > self->max_tokens) {
        fields_free(&fields);
        return DECLINED;
    }
    Span tenant = fields.tenant.text != NULL && fields.tenant.length ? fields.tenant
                                                                     : (Span){"default", 7};
    Span lora = fields.lora.text != NULL ? fields.lora : (Span){"", 0};
    char key[1024];
    size_t key_length = write_key(key, sizeof key, tenant, fields.model, lora, fields.block_size);
    Span salt = fields.salt.text != NULL ? fields.salt : (Span){"", 0};
    uint64_t root = xxh64((const uint8_t *)salt.text, salt.length, 0);
    int hits_only = values[HITS_ONLY].length == 1 && values[HITS_ONLY].text[0] == '1';
    pthread_mutex_lock(&self->lock);
    PlanEntry *entry = key_length ? entry_of(self, key, key_length) : NULL;
    const QueryPlan *plan = entry != NULL ? entry->plans[msgpack] : NULL;
    if (entry != NULL && entry->held) {
        verdict = WAIT;
    } else if (plan != NULL && (entry->chain == NULL || salt.length == 0)) {  /* a salted
        * profiled query: its chain's root is the loop's to hash */
        PyObject *chain = entry->chain == NULL ? NULL
                          : profile_chain_like(entry->chain, fields.tokens, fields.token_bytes);
        TierWalk walk;
        Py_ssize_t blocks = plan_blocks(plan, (Py_ssize_t)fields.token_bytes, chain);
        if ((entry->chain == NULL || chain != NULL)
            && tier_walk_like(&walk, &entry->pools, blocks) == 0) {
            if (plan_walk(plan, &walk, fields.tokens, blocks, root, chain) == 0) {
                Buffer *scratch = &self->scratch;
                scratch->start = scratch->used = 0;
                Py_ssize_t written;
                size_t size = plan_answer_size(plan, &walk, NULL, hits_only, &written);
                if (reserve(scratch, size) == 0) {
                    char *end = plan_answer_write(plan, &walk, NULL, hits_only, written,
                                                  scratch->data);
                    scratch->used = (size_t)(end - scratch->data);
                    verdict = ANSWERED;
                }
            }
            tier_walk_end(&walk);
        }
        profile_chain_like_free(chain);
    }
    if (verdict == ANSWERED) {  /* the head, as lane_http.answer_head writes it */
        PyObject *prefix = self->heads[msgpack];
        char length[64];
        int written = snprintf(length, sizeof length, "%zu\r\n%s\r\n", self->scratch.used,
                               head->keep_alive ? "" : "Connection: close\r\n");
        if (append(&connection->out, PyBytes_AS_STRING(prefix), (size_t)PyBytes_GET_SIZE(prefix)) < 0
            || append(&connection->out, length, (size_t)written) < 0
            || append(&connection->out, self->scratch.data, self->scratch.used) < 0) {
            verdict = DECLINED;  /* no memory: the loop answers it */
        } else {
            count_answer(self, now_s() - started);
        }
    }
    pthread_mutex_unlock(&self->lock);
    fields_free(&fields);
    return verdict;
}

/* The connection's whole requests answered in order, until one it does not answer (then
 * it leaves to the loop), one not whole yet, or one of a held context. */
static void serve(QueryThread *self, Connection *connection) {
    double now = now_s();
    connection->parked = 0;
    while (connection->leaving == STAY) {
        Buffer *in = &connection->in;
        size_t available = in->used - in->start;
        if (available == 0) {
            connection->began = 0;
            break;
        }
        const char *p = in->data + in->start;
        size_t scan = available < MAX_HEAD + 4 ? available : MAX_HEAD + 4;
        const char *head_end = memmem(p, scan, "\r\n\r\n", 4);
        HeadRead head;
        if (head_end == NULL) {
            if (available > MAX_HEAD + 4) connection->leaving = LEAVE_TO_LOOP;
            else if (!connection->began) connection->began = now;
            break;
        }
        if (!head_read(self->reader, p, head_end, &head) || head.length > self->max_body) {
            connection->leaving = LEAVE_TO_LOOP;
            break;
        }
        size_t start = (size_t)(head_end + 4 - p);
        if (available - start < (size_t)head.length) {
            if (!connection->began) connection->began = now;
            break;
        }
        atomic_store(&self->last_request, now);
        int verdict = answer(self, connection, &head, p + start, now);
        if (verdict == DECLINED) {
            connection->leaving = LEAVE_TO_LOOP;
            break;
        }
        if (verdict == WAIT) {
            connection->parked = now;
            break;
        }
        in->start += start + (size_t)head.length;
        connection->began = 0;
        connection->active = now;
        if (!head.keep_alive) connection->leaving = LEAVE_CLOSED;
    }
    if (connection->ended && connection->leaving == STAY) connection->leaving = LEAVE_CLOSED;
    flush(self, connection);
}

/* What the socket holds, read; then served. */
static void readable(QueryThread *self, Connection *connection) {
    for (;;) {
        if (reserve(&connection->in, READ_CHUNK) < 0) {
            close_connection(self, connection);
            return;
        }
        Buffer *in = &connection->in;
        ssize_t got = recv(connection->fd, in->data + in->used, in->size - in->used, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (got < 0) {
            close_connection(self, connection);
            return;
        }
        if (got == 0) {  /* its whole requests are answered, then it is closed */
            connection->ended = 1;
            break;
        }
        in->used += (size_t)got;
        if (in->used - in->start > (size_t)self->max_body + MAX_HEAD + 4 + READ_CHUNK) {
            if (connection->parked) {  /* a pipeline this long waits in the loop */
                connection->leaving = LEAVE_TO_LOOP;
                flush(self, connection);
                return;
            }
            break;
        }
    }
    if (connection->parked && !connection->ended) return;  /* served once published */
    serve(self, connection);
}

static void accept_all(QueryThread *self, int listener) {
    for (;;) {
        int fd = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && errno == EINTR) continue;
        if (fd < 0) return;  /* none left (or the backlog's error, the next accept's) */
        if (atomic_load(&self->open_connections) + atomic_load(&self->loop_connections)
            >= self->max_connections) {
            close(fd);
            pthread_mutex_lock(&self->lock);
            self->refused++;
            pthread_mutex_unlock(&self->lock);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  /* as asyncio does */
        Connection *connection = PyMem_RawCalloc(1, sizeof *connection);
        struct epoll_event event = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = connection};
        if (connection == NULL || epoll_ctl(self->epoll_fd, EPOLL_CTL_ADD, fd, &event) < 0) {
            PyMem_RawFree(connection);
            close(fd);
            continue;
        }
        connection->kind = SOURCE_CONNECTION;
        connection->fd = fd;
        connection->watching = event.events;
        connection->active = now_s();
        connection->next = self->connections;
        if (self->connections) self->connections->prev = connection;
        self->connections = connection;
        atomic_fetch_add(&self->open_connections, 1);
    }
}

/* Idle past keep-alive: closed. A request not whole, or a context still held, a second
 * on: to the loop, whose timeouts then apply. Parked ones whose context came: served. */
static void look_over(QueryThread *self, int published) {
    double now = now_s();
    Connection *next;
    for (Connection *connection = self->connections; connection != NULL; connection = next) {
        next = connection->next;
        if (connection->parked && published) {
            serve(self, connection);
        } else if ((connection->parked && now - connection->parked > WHOLE_WITHIN_S)
                   || (connection->began && now - connection->began > WHOLE_WITHIN_S)) {
            connection->leaving = LEAVE_TO_LOOP;
            flush(self, connection);
        } else if (!connection->began && !connection->parked && connection->out.used == 0
                   && now - connection->active > self->keepalive_s) {
            close_connection(self, connection);
        }
    }
}

static void *run(void *arg) {
    QueryThread *self = arg;
    struct epoll_event events[EVENTS];
    double period = self->keepalive_s / 4 < 0.1 ? self->keepalive_s / 4 : 0.1;
    int timeout_ms = period * 1000 < 10 ? 10 : (int)(period * 1000);
    double looked = now_s();
    while (!atomic_load(&self->stopping)) {
        int count = epoll_wait(self->epoll_fd, events, EVENTS, timeout_ms);
        int published = 0;
        for (int i = 0; i < count; i++) {
            int kind = *(int *)events[i].data.ptr;
            if (kind == SOURCE_LISTENER) {
                accept_all(self, ((Listener *)events[i].data.ptr)->fd);
            } else if (kind == SOURCE_WAKE) {
                uint64_t value;
                ssize_t got = read(self->wake_fd, &value, sizeof value);
                (void)got;
                published = 1;
            } else {
                Connection *connection = events[i].data.ptr;
                uint32_t what = events[i].events;
                if (what & EPOLLOUT && flush(self, connection) < 0) continue;
                if (what & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) readable(self, connection);
            }
        }
        if (atomic_load(&self->stopping)) break;
        double now = now_s();
        if (published || now - looked >= period) {
            look_over(self, published);
            looked = now;
        }
    }
    while (self->connections != NULL) close_connection(self, self->connections);
    return NULL;
}

/* -- Python's side ------------------------------------------------------------------- */

/* Whether ``__init__`` made it whole (else a RuntimeError is set). */
static int made(const QueryThread *self) {
    if (self->ready) return 1;
    PyErr_SetString(PyExc_RuntimeError, "the QueryThread was not made (its __init__ failed)");
    return 0;
}


static int thread_init(QueryThread *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"reader", "listeners", "heads", "msgpack_type", "token",
                               "max_body", "max_tokens", "keepalive_s", "bounds",
                               "max_connections", NULL};
    PyObject *listeners, *heads, *token, *bounds;
    HeadReader *reader;
    if (self->reader != NULL) {
        PyErr_SetString(PyExc_TypeError, "a QueryThread is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "O!O!O!SOLLdO!n:QueryThread", keywords, &HeadReaderType, &reader,
            &PyTuple_Type, &listeners, &PyTuple_Type, &heads, &self->msgpack_type, &token,
            &self->max_body, &self->max_tokens, &self->keepalive_s, &PyTuple_Type, &bounds,
            &self->max_connections)) {
        self->msgpack_type = NULL;
        return -1;
    }
    if (reader->reads != READ_NAMES || PyTuple_GET_SIZE(heads) != 2
        || !PyBytes_Check(PyTuple_GET_ITEM(heads, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(heads, 1))
        || (token != Py_None && !PyBytes_Check(token)) || PyTuple_GET_SIZE(bounds) > MOST_BUCKETS
        || self->keepalive_s <= 0) {
        self->msgpack_type = NULL;
        PyErr_SetString(PyExc_ValueError,
                        "a QueryThread takes the plain head reader (6 names read), two answer "
                        "heads (bytes), a token (bytes or None), 32 bounds at most, a "
                        "keep-alive above 0");
        return -1;
    }
    self->bound_count = PyTuple_GET_SIZE(bounds);
    for (Py_ssize_t i = 0; i < self->bound_count; i++) {
        self->bounds[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(bounds, i));
        if (self->bounds[i] == -1.0 && PyErr_Occurred()) {
            self->msgpack_type = NULL;
            return -1;
        }
    }
    Py_INCREF(self->msgpack_type);
    self->reader = (HeadReader *)Py_NewRef(reader);
    self->heads[0] = Py_NewRef(PyTuple_GET_ITEM(heads, 0));
    self->heads[1] = Py_NewRef(PyTuple_GET_ITEM(heads, 1));
    self->token = Py_NewRef(token);
    self->handovers_end = &self->handovers;
    pthread_mutex_init(&self->lock, NULL);
    self->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    self->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    self->handover_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    self->listener_count = PyTuple_GET_SIZE(listeners);
    self->listeners = PyMem_RawCalloc((size_t)self->listener_count + 1, sizeof(Listener));
    if (self->epoll_fd < 0 || self->wake_fd < 0 || self->handover_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (self->listeners == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->listeners[self->listener_count] = (Listener){SOURCE_WAKE, self->wake_fd};
    struct epoll_event event = {.events = EPOLLIN,
                                .data.ptr = &self->listeners[self->listener_count]};
    if (epoll_ctl(self->epoll_fd, EPOLL_CTL_ADD, self->wake_fd, &event) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->listener_count; i++) {
        int fd = PyObject_AsFileDescriptor(PyTuple_GET_ITEM(listeners, i));
        if (fd < 0) return -1;
        self->listeners[i] = (Listener){SOURCE_LISTENER, fd};
        event = (struct epoll_event){.events = EPOLLIN, .data.ptr = &self->listeners[i]};
        if (epoll_ctl(self->epoll_fd, EPOLL_CTL_ADD, fd, &event) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
    }
    self->ready = 1;
    return 0;
}

static PyObject *thread_start(QueryThread *self, PyObject *unused) {
    if (!made(self)) return NULL;
    if (self->started) {
        PyErr_SetString(PyExc_RuntimeError, "a QueryThread starts once");
        return NULL;
    }
    int failed = pthread_create(&self->thread, NULL, run, self);
    if (failed) {
        errno = failed;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->started = 1;
    Py_RETURN_NONE;
}

static void stop_thread(QueryThread *self) {
    if (self->started != 1) return;
    atomic_store(&self->stopping, 1);
    wake(self->wake_fd);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    self->started = 2;
}

static PyObject *thread_stop(QueryThread *self, PyObject *unused) {
    stop_thread(self);
    Py_RETURN_NONE;
}

static int read_key(PyObject *key, char *out, size_t size, size_t *length) {
    const char *tenant, *model, *lora;
    Py_ssize_t tenant_length, model_length, lora_length;
    unsigned long long block_size;
    if (!PyArg_ParseTuple(key, "s#s#s#K", &tenant, &tenant_length, &model, &model_length, &lora,
                          &lora_length, &block_size)) {
        return -1;
    }
    *length = write_key(out, size, (Span){tenant, (size_t)tenant_length},
                        (Span){model, (size_t)model_length}, (Span){lora, (size_t)lora_length},
                        (uint64_t)block_size);
    return 0;
}

/* ``key``'s entry (made, held, when absent); ``lock`` is held. NULL: no memory. */
static PlanEntry *entry_for(QueryThread *self, const char *key, size_t length) {
    PlanEntry *entry = entry_of(self, key, length);
    if (entry != NULL) return entry;
    if (self->entries + 1 > self->table_size / 2) {  /* grown: chains stay short */
        size_t size = self->table_size ? 2 * self->table_size : 64;
        PlanEntry **table = PyMem_RawCalloc(size, sizeof *table);
        if (table == NULL) return NULL;
        for (size_t i = 0; i < self->table_size; i++) {
            for (PlanEntry *moved = self->table[i], *next; moved != NULL; moved = next) {
                next = moved->next;
                PlanEntry **bucket = &table[key_hash(moved->key, moved->key_length) & (size - 1)];
                moved->next = *bucket;
                *bucket = moved;
            }
        }
        PyMem_RawFree(self->table);
        self->table = table;
        self->table_size = size;
    }
    entry = PyMem_RawCalloc(1, sizeof *entry);
    char *copy = PyMem_RawMalloc(length);
    if (entry == NULL || copy == NULL) {
        PyMem_RawFree(entry);
        PyMem_RawFree(copy);
        return NULL;
    }
    memcpy(copy, key, length);
    entry->key = copy;
    entry->key_length = length;
    PlanEntry **bucket = &self->table[key_hash(key, length) & (self->table_size - 1)];
    entry->next = *bucket;
    *bucket = entry;
    self->entries++;
    return entry;
}

PyDoc_STRVAR(thread_publish_doc,
"publish(key, json_plan, msgpack_plan, chain, /)\n--\n\n"
"A context's plans (``key``: tenant, model, LoRA, block size): its queries are answered\n"
"here from now on (a plan None: not in that dialect; both None: none here, each query of\n"
"it goes to the loop with its connection); ``chain``: how its blocks are keyed, a\n"
"ProfileChain of no tokens and no salt (None: by Go prefix hashes). A query waiting for\n"
"the context is answered.");

PyDoc_STRVAR(thread_hold_doc,
"hold(key, /)\n--\n\n"
"The context's slots are about to change: once this returns no answer uses its plans, and\n"
"its queries wait (a second at most) for the next ``publish``.");

/* The entry of ``key`` set: held, or to these plans. */
static PyObject *set_entry(QueryThread *self, PyObject *key, PyObject *json, PyObject *msgpack,
                           PyObject *chain, int held) {
    if (!made(self)) return NULL;
    PyObject *plans[2] = {json, msgpack};
    if (chain != Py_None && !Py_IS_TYPE(chain, &ProfileChainType)) {
        return PyErr_Format(PyExc_TypeError, "a chain is a ProfileChain or None, not %.60R", chain);
    }
    for (int i = 0; i < 2; i++) {
        if (plans[i] != Py_None && !Py_IS_TYPE(plans[i], &QueryPlanType)) {
            return PyErr_Format(PyExc_TypeError, "a plan is a QueryPlan or None, not %.60R",
                                plans[i]);
        }
    }
    char text[1024];
    size_t length;
    if (read_key(key, text, sizeof text, &length) < 0) return NULL;
    if (length == 0) Py_RETURN_NONE;  /* a key this long is never looked up: the loop's */
    /* the pools as they are now (the loop holds the context before they change) */
    TierWalk pools = {0}, old_pools;
    Py_ssize_t words = 1;
    PyObject *pool_members = NULL;  /* the plans' context's: both plans are of one context */
    for (int i = 0; i < 2; i++) {
        if (plans[i] == Py_None) continue;
        QueryPlan *plan = (QueryPlan *)plans[i];
        if ((Py_ssize_t)plan->words > words) words = (Py_ssize_t)plan->words;
        pool_members = plan->pool_members;
    }
    if (pool_members != NULL && tier_walk_start(&pools, words, pool_members, 0) < 0) return NULL;
    QueryPlan *old[2] = {NULL, NULL};
    PyObject *old_chain = NULL;
    pthread_mutex_lock(&self->lock);
    PlanEntry *entry = entry_for(self, text, length);
    if (entry != NULL) {
        for (int i = 0; i < 2; i++) {
            old[i] = entry->plans[i];
            entry->plans[i] = plans[i] == Py_None ? NULL : (QueryPlan *)Py_NewRef(plans[i]);
        }
        old_pools = entry->pools;
        entry->pools = pools;
        old_chain = entry->chain;
        entry->chain = chain == Py_None ? NULL : Py_NewRef(chain);
        entry->held = held;
    } else {
        old_pools = pools;
    }
    pthread_mutex_unlock(&self->lock);
    tier_walk_end(&old_pools);
    Py_XDECREF(old_chain);
    Py_XDECREF(old[0]);
    Py_XDECREF(old[1]);
    if (entry == NULL) return PyErr_NoMemory();
    if (!held) wake(self->wake_fd);
    Py_RETURN_NONE;
}

static PyObject *thread_publish(QueryThread *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "publish takes 4 arguments");
    return set_entry(self, args[0], args[1], args[2], args[3], 0);
}

static PyObject *thread_hold(QueryThread *self, PyObject *key) {
    return set_entry(self, key, Py_None, Py_None, Py_None, 1);
}

PyDoc_STRVAR(thread_handovers_doc,
"handovers()\n--\n\n"
"The connections handed to the loop since the last call: (socket fd, the bytes not yet\n"
"answered) each, in order. The loop owns each fd from now on.");

static PyObject *thread_handovers(QueryThread *self, PyObject *unused) {
    if (!made(self)) return NULL;
    uint64_t value;
    ssize_t got = read(self->handover_fd, &value, sizeof value);  /* reset its wake */
    (void)got;
    pthread_mutex_lock(&self->lock);
    Handover *handovers = self->handovers;
    self->handovers = NULL;
    self->handovers_end = &self->handovers;
    pthread_mutex_unlock(&self->lock);
    PyObject *result = PyList_New(0);
    while (handovers != NULL) {
        Handover *next = handovers->next;
        PyObject *item = result == NULL ? NULL
                                        : Py_BuildValue("(iy#)", handovers->fd, handovers->bytes,
                                                        (Py_ssize_t)handovers->length);
        if (item == NULL || PyList_Append(result, item) < 0) {
            Py_CLEAR(result);
            close(handovers->fd);
        }
        Py_XDECREF(item);
        PyMem_RawFree(handovers->bytes);
        PyMem_RawFree(handovers);
        handovers = next;
    }
    return result;
}

PyDoc_STRVAR(thread_stats_doc,
"stats()\n--\n\n"
"(queries answered, their seconds, per bucket of ``bounds`` (and one past the last) the\n"
"answers that took that long, connections handed to the loop, refused over the limit):\n"
"counts since the start.");

static PyObject *thread_stats(QueryThread *self, PyObject *unused) {
    if (!made(self)) return NULL;
    pthread_mutex_lock(&self->lock);
    unsigned long long answered = self->answered, handed = self->handed_over,
                       refused = self->refused;
    double seconds = self->seconds;
    unsigned long long buckets[MOST_BUCKETS + 1];
    memcpy(buckets, self->buckets, sizeof buckets);
    pthread_mutex_unlock(&self->lock);
    PyObject *counts = PyTuple_New(self->bound_count + 1);
    if (counts == NULL) return NULL;
    for (Py_ssize_t i = 0; i <= self->bound_count; i++) {
        PyObject *count = PyLong_FromUnsignedLongLong(buckets[i]);
        if (count == NULL) {
            Py_DECREF(counts);
            return NULL;
        }
        PyTuple_SET_ITEM(counts, i, count);
    }
    return Py_BuildValue("(KdNKK)", answered, seconds, counts, handed, refused);
}

static PyObject *thread_set_routed(QueryThread *self, PyObject *held) {
    int routed = PyObject_IsTrue(held);
    if (routed < 0) return NULL;
    atomic_store(&self->routed, routed);
    Py_RETURN_NONE;
}

static PyObject *thread_set_loop_connections(QueryThread *self, PyObject *count) {
    long connections = PyLong_AsLong(count);
    if (connections == -1 && PyErr_Occurred()) return NULL;
    atomic_store(&self->loop_connections, connections);
    Py_RETURN_NONE;
}

static PyObject *thread_handover_fd(QueryThread *self, void *closure) {
    if (!made(self)) return NULL;
    return PyLong_FromLong(self->handover_fd);
}

static PyObject *thread_last_request(QueryThread *self, void *closure) {
    return PyFloat_FromDouble(atomic_load(&self->last_request));
}

static PyObject *thread_open(QueryThread *self, void *closure) {
    return PyLong_FromLong(atomic_load(&self->open_connections));
}

static void thread_dealloc(QueryThread *self) {
    stop_thread(self);
    for (size_t i = 0; i < self->table_size; i++) {
        for (PlanEntry *entry = self->table[i], *next; entry != NULL; entry = next) {
            next = entry->next;
            Py_XDECREF(entry->plans[0]);
            Py_XDECREF(entry->plans[1]);
            tier_walk_end(&entry->pools);
            Py_XDECREF(entry->chain);
            PyMem_RawFree(entry->key);
            PyMem_RawFree(entry);
        }
    }
    PyMem_RawFree(self->table);
    for (Handover *handover = self->handovers, *next; handover != NULL; handover = next) {
        next = handover->next;
        close(handover->fd);
        PyMem_RawFree(handover->bytes);
        PyMem_RawFree(handover);
    }
    if (self->reader != NULL) {
        close(self->epoll_fd);
        close(self->wake_fd);
        close(self->handover_fd);
        pthread_mutex_destroy(&self->lock);
    }
    PyMem_RawFree(self->listeners);
    PyMem_RawFree(self->scratch.data);
    Py_XDECREF(self->reader);
    Py_XDECREF(self->heads[0]);
    Py_XDECREF(self->heads[1]);
    Py_XDECREF(self->msgpack_type);
    Py_XDECREF(self->token);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef thread_methods[] = {
    {"start", (PyCFunction)thread_start, METH_NOARGS, "start()\n--\n\nThe thread started."},
    {"stop", (PyCFunction)thread_stop, METH_NOARGS,
     "stop()\n--\n\nThe thread stopped, its connections closed (its listeners are the caller's)."},
    {"publish", (PyCFunction)(void (*)(void))thread_publish, METH_FASTCALL, thread_publish_doc},
    {"hold", (PyCFunction)thread_hold, METH_O, thread_hold_doc},
    {"handovers", (PyCFunction)thread_handovers, METH_NOARGS, thread_handovers_doc},
    {"stats", (PyCFunction)thread_stats, METH_NOARGS, thread_stats_doc},
    {"set_routed", (PyCFunction)thread_set_routed, METH_O,
     "set_routed(held, /)\n--\n\nWhether routers' routed prompts are held (then the loop "
     "answers every query: they raise answers)."},
    {"set_loop_connections", (PyCFunction)thread_set_loop_connections, METH_O,
     "set_loop_connections(count, /)\n--\n\nThe connections the loop has open: the limit "
     "counts both."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef thread_getset[] = {
    {"handover_fd", (getter)thread_handover_fd, NULL,
     "readable when connections were handed to the loop (``handovers``)", NULL},
    {"connections", (getter)thread_open, NULL, "the connections the thread has open", NULL},
    {"last_request", (getter)thread_last_request, NULL,
     "when a request last came whole (time.monotonic's clock; 0.0: none yet)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject QueryThreadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "conductor._native.QueryThread",
    .tp_doc = PyDoc_STR(
        "QueryThread(reader, listeners, heads, msgpack_type, token, max_body, max_tokens,\n"
        "            keepalive_s, bounds, max_connections)\n--\n\n"
        "Plain queries answered on a thread of its own, from the connections it accepts on\n"
        "``listeners`` (listening sockets, non-blocking), read by ``reader`` (the plain head\n"
        "reader), answered with ``heads`` (an answer's head up to its length, JSON's and\n"
        "msgpack's); ``msgpack_type`` the media type of msgpack, ``token`` the bearer token\n"
        "/query needs (None: none); a body of ``max_body`` bytes at most, ``max_tokens`` token\n"
        "ids at most; idle connections closed after ``keepalive_s``; answer times counted\n"
        "per bucket of ``bounds``; ``max_connections`` open with the loop's."),
    .tp_basicsize = sizeof(QueryThread),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)thread_init,
    .tp_dealloc = (destructor)thread_dealloc,
    .tp_methods = thread_methods,
    .tp_getset = thread_getset,
};

int query_thread_exec(PyObject *module) {
    if (PyType_Ready(&QueryThreadType) < 0) return -1;
    return PyModule_AddObjectRef(module, "QueryThread", (PyObject *)&QueryThreadType);
}

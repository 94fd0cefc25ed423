/* A plain query's request read in C (request.c): by the query lane's Python, through
 * HeadReader.read and plain_query_fields, and by the query thread (query_thread.c), which
 * reads requests without the GIL: neither reader touches a Python object or allocates
 * with the GIL's allocator. */
#ifndef CONDUCTOR_NATIVE_REQUEST_H
#define CONDUCTOR_NATIVE_REQUEST_H

#include <Python.h>
#include <stdint.h>

#define READ_AT_MOST 16  /* header names a HeadReader reads, and declines */

typedef struct {
    const char *text;
    size_t length;
} Span;

typedef struct {
    PyObject_HEAD
    PyObject *target;  /* bytes: the request target read, e.g. b"/query" */
    Py_ssize_t reads, declines;
    Span read[READ_AT_MOST], declined[READ_AT_MOST];  /* lower case, owned */
} HeadReader;

extern PyTypeObject HeadReaderType;

/* A plain head, as spans of it: the body's length, keep-alive, the media type (text NULL:
 * no Content-Type; not yet in lower case), each read name's first value (NULL: absent). */
typedef struct {
    long long length;
    int keep_alive;
    Span media;
    Span values[READ_AT_MOST];
} HeadRead;

/* Whether ``value`` (any case) is ``lower`` (lower case, 0-terminated). */
int equals_lower(Span value, const char *lower);

/* 1 if the head from ``p`` to ``end`` (without the blank line) is plain, read into ``out``;
 * 0 if not (HeadReader.read's doc says which are). */
int head_read(const HeadReader *reader, const char *p, const char *end, HeadRead *out);

/* The fields of a plain /query body (config.QueryRequest's), as spans of the body. */
typedef struct {
    Span model, tenant, lora, salt;  /* text NULL: absent (salt: or null) */
    uint64_t block_size;  /* 0: absent */
    const uint8_t *tokens;  /* int32 little-endian */
    size_t token_bytes;
    uint8_t *owned;  /* the tokens, when read from JSON (else they are in the body) */
    int seen;  /* a bit per field: none twice */
} Fields;

/* 1 if ``body`` is a plain /query body, read into ``fields`` (plain_query_fields's doc
 * says which are); 0 if not. Either way ``fields_free`` lets go of what it holds. */
int fields_read(const char *body, size_t size, int msgpack, Fields *fields);
void fields_free(Fields *fields);

#endif

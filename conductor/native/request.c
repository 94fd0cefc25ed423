/* A plain query's request read in C: its head (HeadReader) and its body's fields
 * (plain_query_fields), for conductor.plain_query.
 *
 * Why: once the answer was C's (answer.c), reading the request in Python (the head's
 * regex and CIMultiDict, the body's msgspec and pydantic objects) was most of what was
 * left of a plain query's Python. Both readers are stricter than the Python ones they
 * stand for, never looser: what they do not read as plain (a header or a value out of
 * the ordinary) they decline, and the Python readers read it as before.
 * tests/conductor/test_plain_query.py holds them to the Python ones over random requests.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "json.h"
#include "msgpack.h"
#include "request.h"

/* -- the head ---------------------------------------------------------------------------- */

static void reader_dealloc(HeadReader *self) {
    Py_XDECREF(self->target);
    for (Py_ssize_t i = 0; i < self->reads; i++) PyMem_Free((void *)self->read[i].text);
    for (Py_ssize_t i = 0; i < self->declines; i++) PyMem_Free((void *)self->declined[i].text);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int is_token_char(unsigned char c) {  /* RFC 9110's tchar */
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
           || (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

/* Header names in lower case, from a sequence of str. */
static int lower_names(PyObject *names, Span *spans, Py_ssize_t *count) {
    PyObject *seq = PySequence_Fast(names, "header names must be a sequence of str");
    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) > READ_AT_MOST) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many header names");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        Py_ssize_t length;
        const char *name = PyUnicode_AsUTF8AndSize(PySequence_Fast_GET_ITEM(seq, i), &length);
        char *lower = name == NULL ? NULL : PyMem_Malloc((size_t)length + 1);
        if (lower == NULL) {
            Py_DECREF(seq);
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t k = 0; k < length; k++) {
            unsigned char c = (unsigned char)name[k];
            lower[k] = (char)(c >= 'A' && c <= 'Z' ? c + 32 : c);
        }
        spans[*count].text = lower;
        spans[(*count)++].length = (size_t)length;
    }
    Py_DECREF(seq);
    return 0;
}

static int reader_init(HeadReader *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"target", "read", "declined", NULL};
    PyObject *target, *read, *declined;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "SOO:HeadReader", keywords, &target, &read,
                                     &declined)) {
        return -1;
    }
    if (self->target != NULL) {
        PyErr_SetString(PyExc_TypeError, "a HeadReader is made once");
        return -1;
    }
    self->target = Py_NewRef(target);
    if (lower_names(read, self->read, &self->reads) < 0) return -1;
    return lower_names(declined, self->declined, &self->declines);
}

/* Whether ``name`` (any case) is ``lower``. */
static int same_name(const char *name, size_t length, Span lower) {
    if (length != lower.length) return 0;
    for (size_t k = 0; k < length; k++) {
        unsigned char c = (unsigned char)name[k];
        if ((char)(c >= 'A' && c <= 'Z' ? c + 32 : c) != lower.text[k]) return 0;
    }
    return 1;
}

static int is_ascii(const char *text, size_t length) {
    for (size_t k = 0; k < length; k++)
        if ((unsigned char)text[k] >= 0x80) return 0;
    return 1;
}

/* ``text`` without the spaces and tabs around it. */
static Span trimmed(const char *text, size_t length) {
    while (length && (*text == ' ' || *text == '\t')) text++, length--;
    while (length && (text[length - 1] == ' ' || text[length - 1] == '\t')) length--;
    return (Span){text, length};
}

int equals_lower(Span value, const char *lower) {
    return same_name(value.text, value.length, (Span){lower, strlen(lower)});
}

PyDoc_STRVAR(reader_read_doc,
"read(head, /)\n--\n\n"
"A request head (up to, not with, the blank line) if it is plain: ``POST <target>\n"
"HTTP/1.1`` or ``HTTP/1.0``, header lines of a token, a colon and a value without control\n"
"bytes, one ``Content-Length`` of digits, none of the declined names. (body length,\n"
"keep-alive, the media type in lower case (None: no Content-Type), then each read name's\n"
"first value without the spaces around it, or None). None for any other head, or one with\n"
"a value this reads (Content-Type, Connection, the read names) that is not ASCII: the\n"
"Python reader (lane_http.parse_head) then reads it.");

int head_read(const HeadReader *self, const char *p, const char *end, HeadRead *out) {
    const char *line_end = memchr(p, '\r', (size_t)(end - p));
    if (line_end == NULL) line_end = end;
    size_t target = (size_t)PyBytes_GET_SIZE(self->target);
    const char *version = p + 5 + target + 1;
    if (line_end - p != 5 + (Py_ssize_t)target + 1 + 8 || memcmp(p, "POST ", 5) != 0
        || memcmp(p + 5, PyBytes_AS_STRING(self->target), target) != 0 || version[-1] != ' '
        || memcmp(version, "HTTP/1.", 7) != 0 || (version[7] != '1' && version[7] != '0')) {
        return 0;
    }
    int http11 = version[7] == '1';
    memset(out, 0, sizeof *out);
    Span content_type = {0}, connection = {0};
    long long length = -1;
    for (p = line_end; p < end;) {
        if (end - p < 2 || p[0] != '\r' || p[1] != '\n') return 0;
        p += 2;
        const char *name = p;
        while (p < end && is_token_char((unsigned char)*p)) p++;
        if (p == name || p >= end || *p != ':') return 0;
        size_t name_length = (size_t)(p - name);
        const char *value = ++p;
        while (p < end && *p != '\r') {
            unsigned char c = (unsigned char)*p++;
            if ((c < 0x20 && c != '\t') || c == 0x7f) return 0;
        }
        Span text = trimmed(value, (size_t)(p - value));
        for (Py_ssize_t i = 0; i < self->declines; i++)
            if (same_name(name, name_length, self->declined[i])) return 0;
        if (same_name(name, name_length, (Span){"content-length", 14})) {
            if (length >= 0 || text.length == 0 || text.length > 15) return 0;
            length = 0;
            for (size_t k = 0; k < text.length; k++) {
                if (text.text[k] < '0' || text.text[k] > '9') return 0;
                length = 10 * length + (text.text[k] - '0');
            }
            continue;
        }
        Span *kept = NULL;
        if (same_name(name, name_length, (Span){"content-type", 12})) kept = &content_type;
        else if (same_name(name, name_length, (Span){"connection", 10})) kept = &connection;
        for (Py_ssize_t i = 0; kept == NULL && i < self->reads; i++)
            if (same_name(name, name_length, self->read[i])) kept = &out->values[i];
        if (kept == NULL || kept->text != NULL) continue;  /* the first value counts */
        if (!is_ascii(text.text, text.length)) return 0;
        *kept = text;
    }
    if (length < 0) return 0;
    out->length = length;
    out->keep_alive = http11 ? connection.text == NULL || !equals_lower(connection, "close")
                             : connection.text != NULL && equals_lower(connection, "keep-alive");
    out->media = content_type;
    if (content_type.text != NULL) {
        const char *semicolon = memchr(content_type.text, ';', content_type.length);
        Span type = content_type;
        if (semicolon != NULL) type.length = (size_t)(semicolon - type.text);
        while (type.length && Py_ISSPACE(type.text[type.length - 1])) type.length--;
        while (type.length && Py_ISSPACE(*type.text)) type.text++, type.length--;
        out->media = type;
    }
    return 1;
}

static PyObject *reader_read(HeadReader *self, PyObject *head) {
    if (!PyBytes_Check(head)) {
        return PyErr_Format(PyExc_TypeError, "head must be bytes, not %.60R", head);
    }
    HeadRead read;
    const char *p = PyBytes_AS_STRING(head);
    if (!head_read(self, p, p + PyBytes_GET_SIZE(head), &read)) Py_RETURN_NONE;
    PyObject *result = PyTuple_New(3 + self->reads);
    if (result == NULL) return NULL;
    PyTuple_SET_ITEM(result, 0, PyLong_FromLongLong(read.length));
    PyTuple_SET_ITEM(result, 1, PyBool_FromLong(read.keep_alive));
    PyObject *media = Py_NewRef(Py_None);
    if (read.media.text != NULL) {
        Py_DECREF(media);
        media = PyUnicode_New((Py_ssize_t)read.media.length, 127);
        if (media != NULL) {
            Py_UCS1 *out = PyUnicode_1BYTE_DATA(media);
            for (size_t k = 0; k < read.media.length; k++)
                out[k] = (Py_UCS1)Py_TOLOWER((unsigned char)read.media.text[k]);
        }
    }
    PyTuple_SET_ITEM(result, 2, media);
    for (Py_ssize_t i = 0; i < self->reads; i++) {
        Span value = read.values[i];
        PyObject *item = value.text == NULL
                             ? Py_NewRef(Py_None)
                             : PyUnicode_DecodeASCII(value.text, (Py_ssize_t)value.length, NULL);
        PyTuple_SET_ITEM(result, 3 + i, item);
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(result); i++) {
        if (PyTuple_GET_ITEM(result, i) == NULL) {
            Py_DECREF(result);
            return NULL;
        }
    }
    return result;
}

static PyMethodDef reader_methods[] = {
    {"read", (PyCFunction)reader_read, METH_O, reader_read_doc},
    {NULL, NULL, 0, NULL},
};

PyTypeObject HeadReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "conductor._native.HeadReader",
    .tp_doc = PyDoc_STR(
        "HeadReader(target, read, declined)\n--\n\n"
        "Reads the plain heads of ``POST <target>`` requests (bytes): the values of the\n"
        "header names ``read`` (a sequence of str), and none with a name in ``declined``."),
    .tp_basicsize = sizeof(HeadReader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)reader_init,
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_methods = reader_methods,
};

/* -- the body ---------------------------------------------------------------------------- */

enum { MODEL, BLOCK_SIZE, TENANT, LORA, SALT, TOKENS, INSTANCE };
static const char *const FIELD_NAMES[] = {"model", "block_size", "tenant_id", "lora_name",
                                          "cache_salt", "token_ids", "instance_id"};

static int field_of(const char *name, size_t length) {
    for (int f = 0; f < (int)(sizeof FIELD_NAMES / sizeof *FIELD_NAMES); f++)
        if (strlen(FIELD_NAMES[f]) == length && memcmp(FIELD_NAMES[f], name, length) == 0)
            return f;
    return -1;
}

/* A str field's value: printable ASCII (a body this reads needs no UTF-8 check). */
static int plain_text(const char *text, size_t length) {
    for (size_t k = 0; k < length; k++)
        if ((unsigned char)text[k] < 0x20 || (unsigned char)text[k] >= 0x7f) return 0;
    return 1;
}

/* ``field`` holds ``text`` (NULL: null); 0 when that is no value it may have. */
static int set_text(Fields *fields, int field, const char *text, size_t length) {
    if (text != NULL && !plain_text(text, length)) return 0;
    switch (field) {
        case MODEL: return text != NULL && length > 0 && (fields->model = (Span){text, length}, 1);
        case TENANT: return text != NULL && (fields->tenant = (Span){text, length}, 1);
        case LORA: return text != NULL && (fields->lora = (Span){text, length}, 1);
        case SALT: fields->salt = (Span){text, length}; return 1;
        case INSTANCE: return text == NULL || length == 0;  /* naming one: not plain */
        default: return 0;
    }
}

/* Past a JSON string without escapes at ``p`` (its quote), its text in ``*text``. */
static const char *json_plain_string(const char *p, const char *end, Span *text) {
    const char *start = ++p;
    while (p < end && *p != '"') {
        if (*p == '\\') return NULL;
        p++;
    }
    if (p >= end) return NULL;
    *text = (Span){start, (size_t)(p - start)};
    return p + 1;
}

static int read_json(const char *p, const char *end, Fields *fields) {
    p = json_space(p, end);
    if (p >= end || *p++ != '{') return 0;
    p = json_space(p, end);
    if (p < end && *p == '}') return 1;
    size_t capacity = 0;
    for (;;) {
        Span name;
        if (p >= end || *p != '"' || (p = json_plain_string(p, end, &name)) == NULL) return 0;
        int field = field_of(name.text, name.length);
        if (field < 0 || fields->seen & 1 << field) return 0;
        fields->seen |= 1 << field;
        p = json_space(p, end);
        if (p >= end || *p++ != ':') return 0;
        p = json_space(p, end);
        if (p >= end) return 0;
        if (field == TOKENS) {
            if (*p != '[') return 0;
            p = json_int32_array(p, end, &fields->owned, &fields->token_bytes, &capacity);
            if (p == NULL) return 0;
            fields->tokens = fields->owned;
        } else if (field == BLOCK_SIZE) {  /* a positive integer, no fraction or exponent */
            const char *digits = p;
            uint64_t value = 0;
            while (p < end && *p >= '0' && *p <= '9' && p - digits < 18) value = 10 * value + (uint64_t)(*p++ - '0');
            if (p == digits || *digits == '0' || (p < end && *p >= '0' && *p <= '9')) return 0;
            fields->block_size = value;
        } else if (*p == '"') {
            Span text;
            if ((p = json_plain_string(p, end, &text)) == NULL) return 0;
            if (!set_text(fields, field, text.text, text.length)) return 0;
        } else if (end - p >= 4 && memcmp(p, "null", 4) == 0) {
            p += 4;
            if (!set_text(fields, field, NULL, 0)) return 0;
        } else {
            return 0;
        }
        p = json_space(p, end);
        if (p < end && *p == '}') break;
        if (p >= end || *p++ != ',') return 0;
        p = json_space(p, end);
    }
    return json_space(p + 1, end) == end;
}

static int read_msgpack(const uint8_t *p, const uint8_t *end, Fields *fields) {
    MpReader r = {p, end};
    size_t count;
    if (!mp_map(&r, &count)) return 0;
    while (count--) {
        const uint8_t *name;
        size_t length;
        if (!mp_str(&r, &name, &length)) return 0;
        int field = field_of((const char *)name, length);
        if (field < 0 || fields->seen & 1 << field) return 0;
        fields->seen |= 1 << field;
        const uint8_t *text;
        uint64_t bits;
        int negative;
        if (field == TOKENS) {
            if (!mp_bin(&r, &fields->tokens, &fields->token_bytes)) return 0;
        } else if (field == BLOCK_SIZE) {
            if (!mp_int(&r, &bits, &negative) || negative || bits == 0 || bits > INT64_MAX)
                return 0;
            fields->block_size = bits;
        } else if (mp_str(&r, &text, &length)) {
            if (!set_text(fields, field, (const char *)text, length)) return 0;
        } else if (mp_nil(&r)) {
            if (!set_text(fields, field, NULL, 0)) return 0;
        } else {
            return 0;
        }
    }
    return r.p == r.end;
}

static PyObject *text_or(Span text, const char *otherwise) {
    if (text.text == NULL || (otherwise != NULL && text.length == 0))
        return otherwise == NULL ? Py_NewRef(Py_None) : PyUnicode_FromString(otherwise);
    return PyUnicode_DecodeASCII(text.text, (Py_ssize_t)text.length, NULL);
}

PyDoc_STRVAR(plain_query_fields_doc,
"plain_query_fields(body, msgpack, /)\n--\n\n"
"A plain /query body's fields, as config.QueryRequest reads them: (tenant_id, model,\n"
"lora_name, block_size, cache_salt or None, token ids as int32 little-endian bytes). Only\n"
"a map of those fields (and a null or empty instance_id), each once, strings of printable\n"
"ASCII without escapes, a positive integer block_size, the token ids a JSON array of\n"
"int32 or a msgpack bin of a multiple of 4 bytes; None for anything else, which\n"
"pydantic then reads.");

int fields_read(const char *body, size_t size, int msgpack, Fields *fields) {
    memset(fields, 0, sizeof *fields);
    const char *end = body + size;
    int read = msgpack ? read_msgpack((const uint8_t *)body, (const uint8_t *)end, fields)
                       : read_json(body, end, fields);
    int required = 1 << MODEL | 1 << BLOCK_SIZE | 1 << TOKENS;
    return read && (fields->seen & required) == required && fields->token_bytes % 4 == 0;
}

void fields_free(Fields *fields) {
    PyMem_RawFree(fields->owned);
    fields->owned = NULL;
}

static PyObject *plain_query_fields(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "plain_query_fields takes body (bytes), msgpack");
        return NULL;
    }
    int msgpack = PyObject_IsTrue(args[1]);
    if (msgpack < 0) return NULL;
    Fields fields;
    PyObject *result;
    if (!fields_read(PyBytes_AS_STRING(args[0]), (size_t)PyBytes_GET_SIZE(args[0]), msgpack,
                     &fields)) {
        result = Py_NewRef(Py_None);
    } else {
        result = Py_BuildValue(
            "(NNNKNy#)", text_or(fields.tenant, "default"), text_or(fields.model, NULL),
            text_or(fields.lora, ""), (unsigned long long)fields.block_size,
            text_or(fields.salt, NULL), fields.tokens ? (const char *)fields.tokens : "",
            (Py_ssize_t)fields.token_bytes);
    }
    fields_free(&fields);
    return result;
}

PyMethodDef request_methods[] = {
    {"plain_query_fields", (PyCFunction)(void (*)(void))plain_query_fields, METH_FASTCALL,
     plain_query_fields_doc},
    {NULL, NULL, 0, NULL},
};

int request_exec(PyObject *module) {
    if (PyType_Ready(&HeadReaderType) < 0) return -1;
    return PyModule_AddObjectRef(module, "HeadReader", (PyObject *)&HeadReaderType);
}

/* A JSON prompt's token ids, read in place (config.QueryRequest.from_plain_json). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "hashing.h"
#include "json.h"

const char *json_space(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

/* Past a JSON string at ``p`` (its opening quote); NULL if it does not end. ``*escaped``
 * says whether it holds a backslash. */
static const char *json_string_end(const char *p, const char *end, int *escaped) {
    *escaped = 0;
    for (p++; p < end; p++) {
        if (*p == '\\') {
            *escaped = 1;
            p++;
        } else if (*p == '"') {
            return p + 1;
        }
    }
    return NULL;
}

/* Past a JSON array of int32 integers at ``p`` (its '['), their int32 LE bytes appended
 * to ``out``; NULL if it is anything else (a fraction, an exponent, a leading zero, a
 * value outside int32, another type). */
const char *json_int32_array(const char *p, const char *end, uint8_t **out, size_t *used,
                             size_t *capacity) {
    p = json_space(p + 1, end);
    if (p < end && *p == ']') return p + 1;
    for (;;) {
        int negative = p < end && *p == '-';
        p += negative;
        const char *digits = p;
        int64_t value = 0;
        while (p < end && *p >= '0' && *p <= '9' && p - digits < 11)
            value = 10 * value + (*p++ - '0');
        if (p == digits || p - digits > 10 || (*digits == '0' && p - digits > 1)) return NULL;
        if (negative) value = -value;
        if (value < INT32_MIN || value > INT32_MAX) return NULL;
        if (*used + 4 > *capacity) {
            size_t grown = *capacity ? 2 * *capacity : 4096;
            uint8_t *buffer = PyMem_RawRealloc(*out, grown);  /* no GIL needed */
            if (buffer == NULL) return NULL;  /* declined: the Python reader then fails */
            *out = buffer, *capacity = grown;
        }
        put_le32(*out + *used, (uint32_t)value);
        *used += 4;
        p = json_space(p, end);
        if (p < end && *p == ']') return p + 1;
        if (p >= end || *p != ',') return NULL;
        p = json_space(p + 1, end);
    }
}

PyDoc_STRVAR(json_int32_field_doc,
"json_int32_field(body, key, /)\n--\n\n"
"A JSON object's ``key`` field, an array of int32 integers, read in place: (the body with\n"
"that array replaced by [], the values as int32 little-endian bytes). None when the body\n"
"is no flat object (only strings, numbers, true, false and null beside the array) with\n"
"the key once, unescaped, and such an array: the caller then parses it the general way.\n"
"Faster than pydantic's Python ints (bench.conductor_bench measures /query).");

static PyObject *json_int32_field(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "json_int32_field takes body (bytes), key (str)");
        return NULL;
    }
    Py_ssize_t key_length;
    const char *key = PyUnicode_AsUTF8AndSize(args[1], &key_length);
    if (key == NULL) return NULL;
    const char *start = PyBytes_AS_STRING(args[0]), *end = start + PyBytes_GET_SIZE(args[0]);
    const char *found = NULL, *found_end = NULL;
    uint8_t *packed = NULL;
    size_t used = 0, capacity = 0;
    PyObject *result = NULL;
    const char *p = json_space(start, end);
    if (p >= end || *p++ != '{') goto done;
    p = json_space(p, end);
    if (p < end && *p == '}') goto done;  /* no fields: nothing to read */
    for (;;) {
        int escaped;
        if (p >= end || *p != '"') goto done;
        const char *name = p + 1, *name_end = json_string_end(p, end, &escaped);
        if (name_end == NULL || escaped) goto done;  /* an escaped name might be the key */
        int is_key = name_end - 1 - name == key_length && memcmp(name, key, key_length) == 0;
        p = json_space(name_end, end);
        if (p >= end || *p++ != ':') goto done;
        p = json_space(p, end);
        if (p >= end) goto done;
        if (is_key) {
            if (found != NULL || *p != '[') goto done;
            found = p;
            p = found_end = json_int32_array(p, end, &packed, &used, &capacity);
            if (p == NULL) goto done;
        } else if (*p == '"') {
            p = json_string_end(p, end, &escaped);
            if (p == NULL) goto done;
        } else if (*p == '{' || *p == '[') {
            goto done;  /* nested values: the general parser's */
        } else {  /* a number or a literal: pydantic judges its spelling in the rest */
            while (p < end && *p != ',' && *p != '}' && *p != ' ' && *p != '\t' && *p != '\n'
                   && *p != '\r')
                p++;
        }
        p = json_space(p, end);
        if (p < end && *p == '}') break;
        if (p >= end || *p++ != ',') goto done;
        p = json_space(p, end);
    }
    if (found == NULL || json_space(p + 1, end) != end) goto done;
    PyObject *rest = PyBytes_FromStringAndSize(NULL, (found - start) + 2 + (end - found_end));
    if (rest == NULL) goto done;
    char *write = PyBytes_AS_STRING(rest);
    memcpy(write, start, found - start);
    memcpy(write + (found - start), "[]", 2);
    memcpy(write + (found - start) + 2, found_end, end - found_end);
    PyObject *tokens = PyBytes_FromStringAndSize((const char *)packed, (Py_ssize_t)used);
    result = tokens == NULL ? NULL : PyTuple_Pack(2, rest, tokens);
    Py_DECREF(rest);
    Py_XDECREF(tokens);
done:
    PyMem_RawFree(packed);
    if (result == NULL && !PyErr_Occurred()) result = Py_NewRef(Py_None);
    return result;
}

PyMethodDef json_methods[] = {
    {"json_int32_field", (PyCFunction)(void (*)(void))json_int32_field, METH_FASTCALL,
     json_int32_field_doc},
    {NULL, NULL, 0, NULL},
};

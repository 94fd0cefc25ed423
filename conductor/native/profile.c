/* The block keys of a profiled context's query (conductor.hash_profile): each block's
 * SHA-256 over its parent's digest and its tokens, as the engine hashed them.
 *
 * Why C: through hashlib, serializing and digesting a block cost ~4.6 µs (CBOR) in
 * Python, 1.2 ms for a 4,096-token prompt, on the event loop. The serializations stay
 * Python's where they do not depend on the tokens: the caller gives the bytes that follow
 * a block's tokens (vLLM's extras, serialized by conductor.vllm_hash), and C writes only
 * what vllm_hash's and sglang_hash's functions write around them. tests/conductor/
 * test_profile_chain.py holds every kind to those functions over random prompts.
 *
 *   vLLM, sha256_cbor   CBOR [parent digest, [tokens...], extras]; key: low 64 bits
 *   vLLM, sha256        pickle protocol 5 of the same triple; key: low 64 bits
 *   SGLang              parent digest (none at the root) || tokens as uint32 LE;
 *                       key: first 64 bits; bigram: each token with its successor
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "profile.h"
#include "sha256.h"

enum { CHAIN_CBOR, CHAIN_PICKLE, CHAIN_SGLANG, CHAIN_SGLANG_BIGRAM, CHAIN_KINDS };
#define DIGEST 32
#define PICKLE_FRAME_MAX 65536  /* a larger pickle is framed in parts: not written here */

typedef struct {
    PyObject_HEAD
    int kind;
    PyObject *tokens;  /* bytes: int32 little-endian (NULL in a chain made like another) */
    const uint8_t *data;  /* the tokens' bytes */
    Py_ssize_t block_size, count, position;
    uint8_t parent[DIGEST];
    int has_parent;  /* an SGLang chain without a salt starts from no parent */
    PyObject *first_suffix, *suffix;  /* bytes after block 0's tokens, after a later block's */
    uint8_t *buffer;  /* one block's serialization */
    size_t buffer_size;
} ProfileChain;

static void chain_dealloc(ProfileChain *self) {
    Py_XDECREF(self->tokens);
    Py_XDECREF(self->first_suffix);
    Py_XDECREF(self->suffix);
    PyMem_RawFree(self->buffer);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int32_t token_at(const ProfileChain *self, Py_ssize_t index) {
    uint32_t value;
    memcpy(&value, self->data + 4 * index, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    value = __builtin_bswap32(value);
#endif
    return (int32_t)value;
}

/* A CBOR head of an argument below 2**32: major type and argument in the shortest form
 * (vllm_hash._head). */
static uint8_t *cbor_head(uint8_t *out, uint8_t major, uint32_t value) {
    if (value < 24) {
        *out = major | (uint8_t)value;
        return out + 1;
    }
    if (value <= 0xff) {
        out[0] = major | 24;
        out[1] = (uint8_t)value;
        return out + 2;
    }
    if (value <= 0xffff) {
        out[0] = major | 25;
        out[1] = (uint8_t)(value >> 8);
        out[2] = (uint8_t)value;
        return out + 3;
    }
    out[0] = major | 26;
    out[1] = (uint8_t)(value >> 24);
    out[2] = (uint8_t)(value >> 16);
    out[3] = (uint8_t)(value >> 8);
    out[4] = (uint8_t)value;
    return out + 5;
}

/* An int as pickle writes one of 32 bits: BININT1, BININT2 or BININT. */
static uint8_t *pickle_int(uint8_t *out, int32_t value) {
    if (value >= 0 && value <= 0xff) {
        *out++ = 'K';
        *out++ = (uint8_t)value;
    } else if (value >= 0 && value <= 0xffff) {
        *out++ = 'M';
        *out++ = (uint8_t)value;
        *out++ = (uint8_t)(value >> 8);
    } else {
        *out++ = 'J';
        for (int i = 0; i < 4; i++) *out++ = (uint8_t)((uint32_t)value >> (8 * i));
    }
    return out;
}

static uint8_t *put_suffix(uint8_t *out, PyObject *suffix) {
    memcpy(out, PyBytes_AS_STRING(suffix), (size_t)PyBytes_GET_SIZE(suffix));
    return out + PyBytes_GET_SIZE(suffix);
}

/* vLLM's block: the triple (parent, tokens, extras) serialized, extras from ``suffix``. */
static size_t vllm_block(const ProfileChain *self, Py_ssize_t first, PyObject *suffix) {
    uint8_t *out = self->buffer;
    Py_ssize_t n = self->block_size;
    if (self->kind == CHAIN_CBOR) {
        *out++ = 0x83;
        out = cbor_head(out, 0x40, DIGEST);
        memcpy(out, self->parent, DIGEST);
        out = cbor_head(out + DIGEST, 0x80, (uint32_t)n);
        for (Py_ssize_t i = 0; i < n; i++) {
            int32_t token = token_at(self, first + i);
            out = token >= 0 ? cbor_head(out, 0x00, (uint32_t)token)
                             : cbor_head(out, 0x20, (uint32_t)(-1 - (int64_t)token));
        }
        return (size_t)(put_suffix(out, suffix) - self->buffer);
    }
    uint8_t *frame = out + 2;  /* PROTO 5, FRAME and its length, filled in below */
    out[0] = 0x80;
    out[1] = 5;
    out += 11;
    *out++ = 'C';
    *out++ = DIGEST;
    memcpy(out, self->parent, DIGEST);
    out += DIGEST;
    *out++ = 0x94;  /* MEMOIZE */
    if (n > 3) *out++ = '(';  /* MARK */
    for (Py_ssize_t i = 0; i < n; i++) out = pickle_int(out, token_at(self, first + i));
    *out++ = n > 3 ? 't' : (uint8_t)(0x84 + n);  /* TUPLE, or TUPLE1..3 */
    *out++ = 0x94;
    out = put_suffix(out, suffix);
    uint64_t length = (uint64_t)(out - frame - 9);
    frame[0] = 0x95;
    for (int i = 0; i < 8; i++) frame[1 + i] = (uint8_t)(length >> (8 * i));
    return (size_t)(out - self->buffer);
}

/* SGLang's page: the parent's digest, if any, and the page's tokens (or bigrams). */
static size_t sglang_page(const ProfileChain *self, Py_ssize_t first) {
    uint8_t *out = self->buffer;
    if (self->has_parent) {
        memcpy(out, self->parent, DIGEST);
        out += DIGEST;
    }
    const uint8_t *tokens = self->data;
    if (self->kind == CHAIN_SGLANG) {
        memcpy(out, tokens + 4 * first, 4 * (size_t)self->block_size);
        return (size_t)(out - self->buffer) + 4 * (size_t)self->block_size;
    }
    for (Py_ssize_t i = first; i < first + self->block_size; i++, out += 8)
        memcpy(out, tokens + 4 * i, 8);
    return (size_t)(out - self->buffer);
}

int profile_chain_next(PyObject *chain, uint64_t *key) {
    ProfileChain *self = (ProfileChain *)chain;
    if (self->position >= self->count) return 0;
    Py_ssize_t first = self->position * self->block_size;
    size_t length = self->kind >= CHAIN_SGLANG
                        ? sglang_page(self, first)
                        : vllm_block(self, first, self->position ? self->suffix : self->first_suffix);
    sha256_digest(self->buffer, length, self->parent, 0);
    self->has_parent = 1;
    self->position++;
    const uint8_t *bits = self->kind >= CHAIN_SGLANG ? self->parent : self->parent + DIGEST - 8;
    uint64_t value = 0;
    for (int i = 0; i < 8; i++) value = value << 8 | bits[i];
    *key = value;
    return 1;
}

Py_ssize_t profile_chain_length(PyObject *chain) {
    const ProfileChain *self = (const ProfileChain *)chain;
    return self->count - self->position;
}

/* How many keys ``tokens_count`` tokens make. */
static Py_ssize_t keys_of(int kind, Py_ssize_t tokens_count, Py_ssize_t block_size) {
    if (kind == CHAIN_SGLANG_BIGRAM) return tokens_count > 0 ? (tokens_count - 1) / block_size : 0;
    return tokens_count / block_size;
}

PyObject *profile_chain_like(PyObject *model, const uint8_t *tokens, size_t token_bytes) {
    const ProfileChain *like = (const ProfileChain *)model;
    ProfileChain *chain = PyMem_RawMalloc(sizeof *chain + like->buffer_size);
    if (chain == NULL) return NULL;
    *chain = *like;  /* its suffixes stay the model's: it outlives the chain */
    chain->tokens = NULL;
    chain->data = tokens;
    chain->count = keys_of(like->kind, (Py_ssize_t)(token_bytes / 4), like->block_size);
    chain->buffer = (uint8_t *)(chain + 1);
    return (PyObject *)chain;
}

void profile_chain_like_free(PyObject *chain) {
    PyMem_RawFree(chain);
}

static PyObject *chain_next(ProfileChain *self) {
    uint64_t key;
    return profile_chain_next((PyObject *)self, &key) ? PyLong_FromUnsignedLongLong(key) : NULL;
}

static int chain_init(ProfileChain *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"kind", "tokens", "block_size", "root", "first_suffix", "suffix",
                               NULL};
    int kind;
    Py_ssize_t block_size;
    PyObject *tokens, *root, *first_suffix, *suffix;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iSnSSS:ProfileChain", keywords, &kind,
                                     &tokens, &block_size, &root, &first_suffix, &suffix)) {
        return -1;
    }
    if (self->tokens != NULL) {
        PyErr_SetString(PyExc_TypeError, "a ProfileChain is made once");
        return -1;
    }
    Py_ssize_t root_size = PyBytes_GET_SIZE(root);
    Py_ssize_t suffix_size = Py_MAX(PyBytes_GET_SIZE(first_suffix), PyBytes_GET_SIZE(suffix));
    /* a block's serialization at most: a token is 9 bytes in CBOR, 5 in pickle, 8 in a bigram */
    size_t size = 11 + 2 + DIGEST + 1 + 9 + 9 * (size_t)block_size + 2 + (size_t)suffix_size;
    if (kind < 0 || kind >= CHAIN_KINDS || block_size < 1 || block_size > 1 << 20
        || (root_size != DIGEST && (kind < CHAIN_SGLANG || root_size != 0))
        || (kind == CHAIN_PICKLE && size > PICKLE_FRAME_MAX)) {
        PyErr_SetString(PyExc_ValueError,
                        "a kind 0-3, a block size 1 to 2**20, a 32-byte root (none for SGLang "
                        "unsalted), a pickled block within one frame");
        return -1;
    }
    self->buffer = PyMem_RawMalloc(size);
    self->buffer_size = size;
    if (self->buffer == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t tokens_count = PyBytes_GET_SIZE(tokens) / 4;
    self->kind = kind;
    self->block_size = block_size;
    self->count = keys_of(kind, tokens_count, block_size);
    memcpy(self->parent, PyBytes_AS_STRING(root), (size_t)root_size);
    self->has_parent = root_size == DIGEST;
    self->tokens = Py_NewRef(tokens);
    self->data = (const uint8_t *)PyBytes_AS_STRING(tokens);
    self->first_suffix = Py_NewRef(first_suffix);
    self->suffix = Py_NewRef(suffix);
    return 0;
}

PyTypeObject ProfileChainType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "conductor._native.ProfileChain",
    .tp_doc = PyDoc_STR(
        "ProfileChain(kind, tokens, block_size, root, first_suffix, suffix)\n--\n\n"
        "An iterator over the block keys of ``tokens`` (int32 little-endian bytes), each\n"
        "block ``block_size`` tokens, chained from ``root`` (a 32-byte digest; b'' for an\n"
        "SGLang chain without a salt). ``kind``: 0 vLLM sha256_cbor, 1 vLLM sha256 (pickle),\n"
        "2 SGLang, 3 SGLang bigrams; ``first_suffix`` and ``suffix`` are the bytes a vLLM\n"
        "block's serialization ends with after its tokens, block 0's and the others'."),
    .tp_basicsize = sizeof(ProfileChain),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)chain_init,
    .tp_dealloc = (destructor)chain_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)chain_next,
};

int profile_exec(PyObject *module) {
    if (PyType_Ready(&ProfileChainType) < 0) return -1;
    return PyModule_AddObjectRef(module, "ProfileChain", (PyObject *)&ProfileChainType);
}

/* conductor._native: the hot paths in C (ingestion, the plain query), one module built
 * from this directory.
 *
 * Why C: in Python the per-block loops (an 8-byte pack, a slice and an xxh64 call to hash
 * a block; six dict operations in bytecode to record it) were most of what the service
 * spent ingesting an event (bench.conductor_bench measures ingest), and reading and
 * answering a query most of what it spent on one. Each file is one concern and says which
 * Python code it stands for; tests/conductor/test_hashing.py, test_native.py, test_lane.py,
 * test_plain_query.py and the randomized model check in test_index.py pin their results.
 *
 *   hashing.c  the Go conductor's prefix hash chain (XXH64)
 *   maps.c     HashMap and MaskMap, compact dicts keyed by 64-bit hashes
 *   blocks.c   the index's hot state, ContextBlocks (a context's blocks) and Holdings
 *              (an owner's on one tier), changed only by its methods
 *   walk.c     ContextBlocks.walk and walk_tiers: a query's walk over the owner masks
 *   masks.c    owner masks in machine words, the values of a MaskMap
 *   lane.c     the ingest lane: a msgpack batch (msgpack.h) read whole, applied by
 *              ContextBlocks.apply_packed
 *   ingest.c   IngestThread: the lane's batches applied beside the event loop, without
 *              the GIL, under each context's mutex (sync.h)
 *   decode.c   the Python decoders' helpers: hashes normalized, token ids read in place
 *   json.c     a JSON prompt's token ids read in place
 *   answer.c   QueryPlan: the plain query's answer, from the index to its bytes
 *   request.c  HeadReader and plain_query_fields: the plain query's request read
 *   query_thread.c  QueryThread: plain queries answered on a thread of its own, with its
 *              own sockets, without the GIL
 *   sha256.c   SHA-256, with the CPU's SHA extensions when it has them
 *   profile.c  ProfileChain: a profiled context's block keys (vLLM's and SGLang's chains)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* what each file adds to the module */
extern PyMethodDef hashing_methods[], lane_methods[], decode_methods[], json_methods[],
    request_methods[], sha256_methods[];
int maps_exec(PyObject *module);  /* HashMap, MaskMap */
int blocks_exec(PyObject *module);  /* ContextBlocks, Holdings */
int lane_exec(PyObject *module);  /* PackedBatch */
int ingest_exec(PyObject *module);  /* IngestThread */
int answer_exec(PyObject *module);  /* QueryPlan */
int request_exec(PyObject *module);  /* HeadReader */
int profile_exec(PyObject *module);  /* ProfileChain */
int query_thread_exec(PyObject *module);  /* QueryThread */

static int native_exec(PyObject *module) {
    PyMethodDef *functions[] = {hashing_methods, lane_methods, decode_methods, json_methods,
                                request_methods, sha256_methods};
    for (size_t i = 0; i < sizeof functions / sizeof *functions; i++) {
        if (PyModule_AddFunctions(module, functions[i]) < 0) return -1;
    }
    return maps_exec(module) < 0 || blocks_exec(module) < 0 || lane_exec(module) < 0
                   || ingest_exec(module) < 0 || answer_exec(module) < 0
                   || request_exec(module) < 0 || profile_exec(module) < 0
                   || query_thread_exec(module) < 0
               ? -1
               : 0;
}

static PyModuleDef_Slot native_slots[] = {
    {Py_mod_exec, native_exec},
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "conductor._native",
    .m_doc = "The hot paths in C: prefix hash chains, the index's maps and state, the plain query.",
    .m_size = 0,
    .m_slots = native_slots,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&native_module); }

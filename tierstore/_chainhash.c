/*
 * tierstore._chainhash -- chained BLAKE3 block keys in C.
 *
 *   chain(prev, data, stride) -> bytes
 *
 * For n = len(data) // stride blocks, computes, in order,
 *     prev = BLAKE3(prev || data[i*stride : (i+1)*stride])
 * and returns the n 32-byte digests concatenated (n * 32 bytes). This is the
 * loop of tierstore.keys.chain_keys, run without the GIL and without one
 * Python call per block.
 *
 * BLAKE3 (default hash mode, 32-byte output), written from the specification:
 *
 *   compress()   The compression function: a 16-word state (chaining value,
 *                the first four IV words, 64-bit counter, block length,
 *                flags), 7 rounds of 8 G mixes (4 on columns, 4 on
 *                diagonals), the message words permuted between rounds. The
 *                first 8 output words are state[i] ^ state[i + 8]; a 32-byte
 *                digest never needs the other 8.
 *   chunk_cv()   A chunk is up to 1024 bytes, cut into 64-byte blocks (the
 *                last one zero-padded; block_len says how many bytes are
 *                real). Starting from the IV, each block is compressed into
 *                the running chaining value with counter = chunk index; the
 *                first block carries CHUNK_START, the last CHUNK_END.
 *   blake3_32()  The tree: chunk chaining values are pushed on a stack; after
 *                pushing chunk i (not the last), while the number of chunks
 *                done has a trailing zero bit, the top two entries are merged
 *                into a parent (compress(IV, left || right, 0, 64, PARENT)).
 *                The last chunk is then folded into every stack entry, right
 *                to left. The final compression (the only chunk, or the top
 *                parent) also carries ROOT; its counter is 0 either way.
 *
 * The message of one link is the 32-byte key followed by one block of data;
 * it is never assembled: a Msg names both pieces and gather() copies each
 * 64-byte compression block out of them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEY_LEN 32
#define BLOCK_LEN 64
#define CHUNK_LEN 1024

enum { CHUNK_START = 1, CHUNK_END = 2, PARENT = 4, ROOT = 8 };

/* The IV is SHA-256's initial hash value. */
static const uint32_t IV[8] = {
    0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
    0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u,
};

/* After each round, word i of the new message is word PERM[i] of the old. */
static const uint8_t PERM[16] = {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8};

static inline uint32_t rotr32(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t load_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void store_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* The quarter-round G, mixing message words x then y into a, b, c, d. */
#define G(s, a, b, c, d, x, y)                          \
    do {                                                \
        s[a] = s[a] + s[b] + (x);                       \
        s[d] = rotr32(s[d] ^ s[a], 16);                 \
        s[c] = s[c] + s[d];                             \
        s[b] = rotr32(s[b] ^ s[c], 12);                 \
        s[a] = s[a] + s[b] + (y);                       \
        s[d] = rotr32(s[d] ^ s[a], 8);                  \
        s[c] = s[c] + s[d];                             \
        s[b] = rotr32(s[b] ^ s[c], 7);                  \
    } while (0)

/* out[0..7] = first half of the compression output; out may alias cv. */
static void compress(const uint32_t cv[8], const uint32_t block[16], uint64_t counter,
                     uint32_t block_len, uint32_t flags, uint32_t out[8])
{
    uint32_t s[16], m[16], t[16];
    memcpy(s, cv, 8 * sizeof(uint32_t));
    memcpy(s + 8, IV, 4 * sizeof(uint32_t));
    s[12] = (uint32_t)counter;
    s[13] = (uint32_t)(counter >> 32);
    s[14] = block_len;
    s[15] = flags;
    memcpy(m, block, sizeof m);

    for (int round = 0; round < 7; round++) {
        G(s, 0, 4, 8, 12, m[0], m[1]);   /* columns */
        G(s, 1, 5, 9, 13, m[2], m[3]);
        G(s, 2, 6, 10, 14, m[4], m[5]);
        G(s, 3, 7, 11, 15, m[6], m[7]);
        G(s, 0, 5, 10, 15, m[8], m[9]);  /* diagonals */
        G(s, 1, 6, 11, 12, m[10], m[11]);
        G(s, 2, 7, 8, 13, m[12], m[13]);
        G(s, 3, 4, 9, 14, m[14], m[15]);
        if (round < 6) {
            for (int i = 0; i < 16; i++)
                t[i] = m[PERM[i]];
            memcpy(m, t, sizeof m);
        }
    }
    for (int i = 0; i < 8; i++)
        out[i] = s[i] ^ s[i + 8];
}

/* A message in two pieces: head (head_len bytes) then body; len is the total. */
typedef struct {
    const uint8_t *head;
    size_t head_len;
    const uint8_t *body;
    size_t len;
} Msg;

/* Copy bytes [off, off + n) of head || body to dst. */
static void gather(const Msg *msg, size_t off, size_t n, uint8_t *dst)
{
    if (off < msg->head_len) {
        size_t k = msg->head_len - off < n ? msg->head_len - off : n;
        memcpy(dst, msg->head + off, k);
        dst += k;
        off += k;
        n -= k;
    }
    if (n)
        memcpy(dst, msg->body + (off - msg->head_len), n);
}

/* Chaining value of chunk `index`; `root` is ROOT when it is the only chunk. */
static void chunk_cv(const Msg *msg, uint64_t index, uint32_t root, uint32_t cv[8])
{
    size_t start = (size_t)index * CHUNK_LEN;
    size_t end = msg->len - start > CHUNK_LEN ? start + CHUNK_LEN : msg->len;
    size_t nblocks = end > start ? (end - start + BLOCK_LEN - 1) / BLOCK_LEN : 1;
    uint8_t buf[BLOCK_LEN];
    uint32_t m[16];

    memcpy(cv, IV, sizeof IV);
    for (size_t b = 0; b < nblocks; b++) {
        size_t off = start + b * BLOCK_LEN;
        size_t blen = end - off < BLOCK_LEN ? end - off : BLOCK_LEN;
        uint32_t flags = 0;
        gather(msg, off, blen, buf);
        if (blen < BLOCK_LEN)
            memset(buf + blen, 0, BLOCK_LEN - blen);
        for (int i = 0; i < 16; i++)
            m[i] = load_le32(buf + 4 * i);
        if (b == 0)
            flags |= CHUNK_START;
        if (b == nblocks - 1)
            flags |= CHUNK_END | root;
        compress(cv, m, index, (uint32_t)blen, flags, cv);
    }
}

static void parent_cv(const uint32_t left[8], const uint32_t right[8], uint32_t flags,
                      uint32_t out[8])
{
    uint32_t m[16];
    memcpy(m, left, 8 * sizeof(uint32_t));
    memcpy(m + 8, right, 8 * sizeof(uint32_t));
    compress(IV, m, 0, BLOCK_LEN, PARENT | flags, out);
}

/* The 32-byte BLAKE3 digest of msg. */
static void blake3_32(const Msg *msg, uint8_t out[KEY_LEN])
{
    uint64_t nchunks = msg->len ? ((uint64_t)msg->len + CHUNK_LEN - 1) / CHUNK_LEN : 1;
    uint32_t stack[64][8]; /* depth <= log2(nchunks) < 64 */
    uint32_t cv[8];
    int depth = 0;

    if (nchunks == 1) {
        chunk_cv(msg, 0, ROOT, cv);
    } else {
        for (uint64_t i = 0; i + 1 < nchunks; i++) {
            chunk_cv(msg, i, 0, cv);
            for (uint64_t done = i + 1; (done & 1) == 0; done >>= 1)
                parent_cv(stack[--depth], cv, 0, cv);
            memcpy(stack[depth++], cv, sizeof cv);
        }
        chunk_cv(msg, nchunks - 1, 0, cv);
        while (depth > 0) {
            depth--;
            parent_cv(stack[depth], cv, depth == 0 ? ROOT : 0, cv);
        }
    }
    for (int i = 0; i < 8; i++)
        store_le32(out + 4 * i, cv[i]);
}

/* Each link hashes the previous digest (already in out) then one data block. */
static void chain_blocks(const uint8_t first[KEY_LEN], const uint8_t *data, size_t stride,
                         size_t n, uint8_t *out)
{
    const uint8_t *prev = first;
    for (size_t i = 0; i < n; i++) {
        Msg msg = {prev, KEY_LEN, data + i * stride, KEY_LEN + stride};
        blake3_32(&msg, out + i * KEY_LEN);
        prev = out + i * KEY_LEN;
    }
}

PyDoc_STRVAR(chain_doc,
"chain(prev, data, stride) -> bytes\n\n"
"For n = len(data) // stride blocks, compute\n"
"prev = BLAKE3(prev || data[i*stride:(i+1)*stride]) in order and return the\n"
"n 32-byte digests concatenated. prev: 32 bytes; data: any C-contiguous\n"
"buffer (its bytes are used; a trailing partial block is ignored); stride:\n"
"block size in bytes, >= 1. The GIL is released while hashing.");

static PyObject *chain(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"prev", "data", "stride", NULL};
    PyObject *prev_obj, *data_obj, *result = NULL;
    Py_ssize_t stride;
    Py_buffer pv, dv;
    uint8_t first[KEY_LEN];

    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOn:chain", kwlist, &prev_obj, &data_obj,
                                     &stride))
        return NULL;
    if (!PyObject_CheckBuffer(prev_obj)) {
        PyErr_Format(PyExc_TypeError, "chain: prev must be a bytes-like object, not %.100s",
                     Py_TYPE(prev_obj)->tp_name);
        return NULL;
    }
    if (!PyObject_CheckBuffer(data_obj)) {
        PyErr_Format(PyExc_TypeError, "chain: data must be a bytes-like object, not %.100s",
                     Py_TYPE(data_obj)->tp_name);
        return NULL;
    }
    if (stride < 1) {
        PyErr_Format(PyExc_ValueError, "chain: stride must be >= 1, got %zd", stride);
        return NULL;
    }
    if (PyObject_GetBuffer(prev_obj, &pv, PyBUF_FULL_RO) < 0)
        return NULL;
    if (!PyBuffer_IsContiguous(&pv, 'C') || pv.len != KEY_LEN) {
        PyErr_Format(PyExc_ValueError,
                     "chain: prev must be %d contiguous bytes, got %zd bytes%s", KEY_LEN,
                     pv.len, PyBuffer_IsContiguous(&pv, 'C') ? "" : " (not contiguous)");
        PyBuffer_Release(&pv);
        return NULL;
    }
    memcpy(first, pv.buf, KEY_LEN);
    PyBuffer_Release(&pv);

    if (PyObject_GetBuffer(data_obj, &dv, PyBUF_FULL_RO) < 0)
        return NULL;
    if (!PyBuffer_IsContiguous(&dv, 'C')) {
        PyErr_SetString(PyExc_ValueError, "chain: data must be a C-contiguous buffer");
        goto done;
    }
    Py_ssize_t n = dv.len / stride;
    if (n > PY_SSIZE_T_MAX / KEY_LEN) {
        PyErr_SetString(PyExc_OverflowError, "chain: too many blocks");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, n * KEY_LEN);
    if (result == NULL)
        goto done;
    if (n > 0) {
        uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
        Py_BEGIN_ALLOW_THREADS
        chain_blocks(first, (const uint8_t *)dv.buf, (size_t)stride, (size_t)n, out);
        Py_END_ALLOW_THREADS
    }
done:
    PyBuffer_Release(&dv);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_VARARGS | METH_KEYWORDS, chain_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "tierstore._chainhash",
    "Chained BLAKE3 block keys (see tierstore.keys.chain_keys), in C.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__chainhash(void) { return PyModule_Create(&module); }

/*
 * tierstore._fastcopy -- block-sized copies at memory bandwidth.
 *
 *   copy(dst, src) -> None
 *
 * Copies len(src) bytes from src into dst (both C-contiguous buffers of the
 * same length, dst writable) without the GIL.
 *
 * Why not memcpy: glibc's memcpy uses ordinary stores below its
 * "non-temporal threshold" (a share of the last-level cache, tens to
 * hundreds of MiB), so every KV block copy (64 KiB - 8 MiB) reads each
 * destination line into the cache before overwriting it and pushes the
 * engine's working set out. Measured on the 2-core development VM, 2 MiB
 * copies into the shared arena: memcpy 5.7 GB/s, this loop 9.0 GB/s; out of
 * it: memcpy 4.4-5.0 GB/s (the arena's 4 KiB pages defeat the hardware
 * prefetcher), this loop with software prefetch 8.3 GB/s; one 256 MiB
 * memcpy (non-temporal inside glibc) 9.9 GB/s.
 *
 * The loop (stream_copy_pages): four 4 KiB pages at a time, one 64-byte line
 * of each per step, unaligned 16-byte loads, non-temporal 16-byte stores
 * (SSE2, part of every x86-64 CPU) of whole destination lines, a prefetch
 * ahead in each page, and an sfence so the stores are visible before the
 * call returns (the caller may then publish the block to another process).
 * A later VM of the same kind, 1 GiB walked in runs of 320 KiB - 128 MiB:
 * into the arena 9.5-11 GB/s and out of it 8.9-9.3 GB/s, against glibc's
 * 6.0-7.3 GB/s (9.7-11.7 at 128 MiB, where its own four-page loop starts)
 * and 6.7-6.9 GB/s for the one-stream loop this replaced. Copies under
 * STREAM_MIN_BYTES, and every copy on other architectures, use memcpy: a
 * small copy is likely read again soon and is better left in the cache.
 *
 *   copy_runs(dst, src, dst_offsets, src_offsets, nbytes) -> None
 *
 * Many runs of nbytes between two buffers in one call (int64 offsets into
 * each), the GIL released once for all of them: the engines' page copies
 * (one run per block and layer) without Python per run. Its loop for runs
 * of STREAM_MIN_BYTES and more is stream_copy_avx2 where the CPU has AVX2
 * (a plain forward loop, 32-byte non-temporal stores), else
 * stream_copy_pages. Measured on the 2-core AMD EPYC (Zen 4) VM of
 * 2026-12-02, 372 MiB in 744 runs of 512 KiB between a tmpfs arena and
 * private memory (one thread, best of 12): the four-page loop 15.3-15.6
 * GB/s in both directions, glibc's memcpy 21.8-22.9, the same forward loop
 * with 16-byte stores 21.5-22.4, with 64-byte (AVX-512) stores 22.8-24.3,
 * stream_copy_avx2 24.8-26.7 (26.1 at 2 MiB runs); a second thread added
 * nothing (23.7): one thread reaches the VM's memory bandwidth.
 *
 * On Intel CPUs with AVX-512 the loop is stream_copy_pages512 instead: the
 * four-page loop with 64-byte non-temporal stores. Measured on the 2-core
 * Sapphire Rapids VM of 2026-12-03, 256 MiB in 64 runs of 4 MiB between two
 * private buffers (best of 4): glibc's memcpy 6.8-7.2 GB/s (ordinary stores
 * below its non-temporal threshold), rep movsb 7.0-7.2, the forward loop
 * with 32-byte stores (stream_copy_avx2) 9.6-10.1, with 64-byte ones
 * 9.8-10.0, the four-page loop with 32-byte stores 11.7-12.0, with 64-byte
 * ones 12.9. There one thread does not reach the memory bandwidth: two
 * threads, each on half the runs, gave 13.1-13.8 (memcpy), 17.9-19.3 (the
 * forward loops) and 23.1-24.4 (the four-page loop, 64-byte stores). Hence
 * copy_runs' threads argument: the runs cut into 2 MiB pieces that the
 * caller and helper threads take in turn.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#include <xmmintrin.h>
#define HAVE_STREAM 1
#if defined(__GNUC__) || defined(__clang__)
#include <immintrin.h>
#define HAVE_AVX2_LOOP 1 /* compiled for AVX2 by its target attribute, run if the CPU has it */
#endif
#else
#define HAVE_STREAM 0
#endif

#define STREAM_MIN_BYTES (256 * 1024)
#define PREFETCH_AHEAD 1024
#define GIL_FREE_MIN_BYTES (64 * 1024)

#if HAVE_STREAM
static void stream_copy(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        _mm_prefetch(src + i + PREFETCH_AHEAD, _MM_HINT_NTA);
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence();
    memcpy(dst + i, src + i, n - i);
}
#endif

/* Four pages at a time: one 64-byte line of each of four consecutive 4 KiB
 * pages per step. The hardware prefetcher follows a stream only within a
 * page, so a plain loop over 4 KiB pages (the arena's) keeps one stream
 * open; four interleaved ones keep four, as glibc's large memcpy does.
 * Measured on the 2-core VM, 1 GiB walked in runs of each size, out of a
 * tmpfs mapping into private memory: the one-stream loop 6.7-6.9 GB/s at
 * every size, glibc 7.2 GB/s up to 32 MiB and 11.4 GB/s at 128 MiB (its
 * four-page loop starts there). */
#define PAGE_BYTES 4096
#ifndef PAGES_PREFETCH_AHEAD
#define PAGES_PREFETCH_AHEAD 128
#endif

/* Copy the head up to the destination's next 64-byte line with memcpy and
 * advance past it, so that the loops' non-temporal stores fill whole lines:
 * one that fills part of a line is flushed as a partial write (half the
 * speed out of the arena into a buffer 16 bytes past a line boundary). */
static inline void line_align(char **dst, const char **src, size_t *n)
{
    size_t head = (64 - ((uintptr_t)*dst & 63)) & 63;
    if (head > *n)
        head = *n;
    memcpy(*dst, *src, head);
    *dst += head;
    *src += head;
    *n -= head;
}

static void stream_copy_pages(char *dst, const char *src, size_t n)
{
    line_align(&dst, &src, &n);
    const size_t group = PAGE_BYTES * 4;
    size_t done = 0;
    for (; done + group <= n; done += group) {
        const char *s = src + done;
        char *d = dst + done;
        for (size_t off = 0; off < PAGE_BYTES; off += 64) {
            const char *s0 = s + off, *s1 = s0 + PAGE_BYTES, *s2 = s1 + PAGE_BYTES,
                       *s3 = s2 + PAGE_BYTES;
            _mm_prefetch(s0 + PAGES_PREFETCH_AHEAD, _MM_HINT_T0);
            _mm_prefetch(s1 + PAGES_PREFETCH_AHEAD, _MM_HINT_T0);
            _mm_prefetch(s2 + PAGES_PREFETCH_AHEAD, _MM_HINT_T0);
            _mm_prefetch(s3 + PAGES_PREFETCH_AHEAD, _MM_HINT_T0);
            /* All sixteen loads, then the sixteen stores (sixteen xmm registers). */
            __m128i a0 = _mm_loadu_si128((const __m128i *)(s0));
            __m128i a1 = _mm_loadu_si128((const __m128i *)(s0 + 16));
            __m128i a2 = _mm_loadu_si128((const __m128i *)(s0 + 32));
            __m128i a3 = _mm_loadu_si128((const __m128i *)(s0 + 48));
            __m128i b0 = _mm_loadu_si128((const __m128i *)(s1));
            __m128i b1 = _mm_loadu_si128((const __m128i *)(s1 + 16));
            __m128i b2 = _mm_loadu_si128((const __m128i *)(s1 + 32));
            __m128i b3 = _mm_loadu_si128((const __m128i *)(s1 + 48));
            __m128i c0 = _mm_loadu_si128((const __m128i *)(s2));
            __m128i c1 = _mm_loadu_si128((const __m128i *)(s2 + 16));
            __m128i c2 = _mm_loadu_si128((const __m128i *)(s2 + 32));
            __m128i c3 = _mm_loadu_si128((const __m128i *)(s2 + 48));
            __m128i e0 = _mm_loadu_si128((const __m128i *)(s3));
            __m128i e1 = _mm_loadu_si128((const __m128i *)(s3 + 16));
            __m128i e2 = _mm_loadu_si128((const __m128i *)(s3 + 32));
            __m128i e3 = _mm_loadu_si128((const __m128i *)(s3 + 48));
            char *d0 = d + off, *d1 = d0 + PAGE_BYTES, *d2 = d1 + PAGE_BYTES,
                 *d3 = d2 + PAGE_BYTES;
            _mm_stream_si128((__m128i *)(d0), a0);
            _mm_stream_si128((__m128i *)(d0 + 16), a1);
            _mm_stream_si128((__m128i *)(d0 + 32), a2);
            _mm_stream_si128((__m128i *)(d0 + 48), a3);
            _mm_stream_si128((__m128i *)(d1), b0);
            _mm_stream_si128((__m128i *)(d1 + 16), b1);
            _mm_stream_si128((__m128i *)(d1 + 32), b2);
            _mm_stream_si128((__m128i *)(d1 + 48), b3);
            _mm_stream_si128((__m128i *)(d2), c0);
            _mm_stream_si128((__m128i *)(d2 + 16), c1);
            _mm_stream_si128((__m128i *)(d2 + 32), c2);
            _mm_stream_si128((__m128i *)(d2 + 48), c3);
            _mm_stream_si128((__m128i *)(d3), e0);
            _mm_stream_si128((__m128i *)(d3 + 16), e1);
            _mm_stream_si128((__m128i *)(d3 + 32), e2);
            _mm_stream_si128((__m128i *)(d3 + 48), e3);
        }
    }
    _mm_sfence();
    stream_copy(dst + done, src + done, n - done);
}

#ifndef HAVE_AVX2_LOOP
#define HAVE_AVX2_LOOP 0
#endif
static int use_avx2 = 0; /* set at import: the CPU has AVX2 */

#if HAVE_AVX2_LOOP
#define AVX2_PREFETCH_AHEAD 1024
__attribute__((target("avx2"))) static void stream_copy_avx2(char *dst, const char *src,
                                                             size_t n)
{
    line_align(&dst, &src, &n);
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        _mm_prefetch(src + i + AVX2_PREFETCH_AHEAD, _MM_HINT_T0);
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    _mm_sfence();
    memcpy(dst + i, src + i, n - i);
}
#endif

/* The four-page loop of stream_copy_pages with 64-byte loads and
 * non-temporal stores (AVX-512): one whole destination line per store, four
 * streams open. Chosen on Intel CPUs with AVX-512 (see the header). */
static int use_pages512 = 0; /* set at import: an Intel CPU with AVX-512F */
#if HAVE_AVX2_LOOP
#define PAGES512_PREFETCH_AHEAD 256
__attribute__((target("avx512f"))) static void stream_copy_pages512(char *dst, const char *src,
                                                                    size_t n)
{
    line_align(&dst, &src, &n);
    const size_t group = PAGE_BYTES * 4;
    size_t done = 0;
    for (; done + group <= n; done += group) {
        const char *s = src + done;
        char *d = dst + done;
        for (size_t off = 0; off < PAGE_BYTES; off += 64) {
            const char *s0 = s + off;
            _mm_prefetch(s0 + PAGES512_PREFETCH_AHEAD, _MM_HINT_T0);
            _mm_prefetch(s0 + PAGE_BYTES + PAGES512_PREFETCH_AHEAD, _MM_HINT_T0);
            _mm_prefetch(s0 + 2 * PAGE_BYTES + PAGES512_PREFETCH_AHEAD, _MM_HINT_T0);
            _mm_prefetch(s0 + 3 * PAGE_BYTES + PAGES512_PREFETCH_AHEAD, _MM_HINT_T0);
            __m512i a = _mm512_loadu_si512((const void *)s0);
            __m512i b = _mm512_loadu_si512((const void *)(s0 + PAGE_BYTES));
            __m512i c = _mm512_loadu_si512((const void *)(s0 + 2 * PAGE_BYTES));
            __m512i e = _mm512_loadu_si512((const void *)(s0 + 3 * PAGE_BYTES));
            char *d0 = d + off;
            _mm512_stream_si512((void *)d0, a);
            _mm512_stream_si512((void *)(d0 + PAGE_BYTES), b);
            _mm512_stream_si512((void *)(d0 + 2 * PAGE_BYTES), c);
            _mm512_stream_si512((void *)(d0 + 3 * PAGE_BYTES), e);
        }
    }
    _mm_sfence();
    stream_copy(dst + done, src + done, n - done);
}
#endif

/* One run of copy_runs (see the header). */
static void copy_run(char *dst, const char *src, size_t n)
{
#if HAVE_AVX2_LOOP
    if (n >= STREAM_MIN_BYTES && use_pages512) {
        stream_copy_pages512(dst, src, n);
        return;
    }
    if (n >= STREAM_MIN_BYTES && use_avx2) {
        stream_copy_avx2(dst, src, n);
        return;
    }
#endif
#if HAVE_STREAM
    if (n >= STREAM_MIN_BYTES) {
        stream_copy_pages(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

static void copy_bytes(char *dst, const char *src, size_t n)
{
#if HAVE_AVX2_LOOP
    if (n >= STREAM_MIN_BYTES && use_pages512) {
        stream_copy_pages512(dst, src, n);
        return;
    }
#endif
#if HAVE_STREAM
    if (n >= STREAM_MIN_BYTES) {
        stream_copy_pages(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* copy_runs on several threads: the runs cut into pieces of at most
 * PIECE_BYTES (or, for runs shorter than that, grouped into pieces of about
 * as many bytes: page_first's runs are a few hundred bytes), which the
 * calling thread and its helpers take in turn from one atomic counter, so a thread that gets less of its core (the engine's
 * own threads run there too) takes fewer pieces rather than holding up the
 * others. The helpers are started per call and joined before it returns; a
 * helper that cannot be started leaves its pieces to the others. */
#define PIECE_BYTES (2 * 1024 * 1024)
#define THREAD_MIN_BYTES (4 * 1024 * 1024) /* a helper per this many bytes at most */
#define MAX_THREADS 64

struct runs_job {
    char *dst;
    const char *src;
    const int64_t *doff, *soff;
    size_t count, nbytes;
    size_t piece;          /* bytes of a run a piece copies (all of it for short runs) */
    size_t pieces_per_run; /* 1 for short runs */
    size_t runs_per_piece; /* 1 for long runs */
    size_t pieces;
    size_t next; /* the next piece to take (atomic) */
};

static void *runs_worker(void *arg)
{
    struct runs_job *job = arg;
    for (;;) {
        size_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->pieces)
            return NULL;
        if (job->runs_per_piece > 1) {
            size_t first = i * job->runs_per_piece, end = first + job->runs_per_piece;
            for (size_t r = first; r < end && r < job->count; r++)
                copy_run(job->dst + job->doff[r], job->src + job->soff[r], job->nbytes);
            continue;
        }
        size_t run = i / job->pieces_per_run, at = (i % job->pieces_per_run) * job->piece;
        size_t n = job->nbytes - at < job->piece ? job->nbytes - at : job->piece;
        copy_run(job->dst + job->doff[run] + at, job->src + job->soff[run] + at, n);
    }
}

static void copy_runs_threaded(char *dst, const char *src, const int64_t *doff,
                               const int64_t *soff, size_t count, size_t nbytes, int threads)
{
    size_t total = count * nbytes;
    if ((size_t)threads > total / THREAD_MIN_BYTES)
        threads = (int)(total / THREAD_MIN_BYTES);
    if (threads <= 1 || nbytes == 0) {
        for (size_t i = 0; i < count; i++)
            copy_run(dst + doff[i], src + soff[i], nbytes);
        return;
    }
    struct runs_job job = {dst, src, doff, soff, count, nbytes, 0, 1, 1, 0, 0};
    if (nbytes >= PIECE_BYTES) {
        job.piece = PIECE_BYTES;
        job.pieces_per_run = (nbytes + PIECE_BYTES - 1) / PIECE_BYTES;
        job.pieces = job.pieces_per_run * count;
    } else {
        job.piece = nbytes;
        job.runs_per_piece = PIECE_BYTES / nbytes;
        job.pieces = (count + job.runs_per_piece - 1) / job.runs_per_piece;
    }
    pthread_t helpers[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&helpers[started], NULL, runs_worker, &job) == 0)
            started++;
    }
    runs_worker(&job);
    for (int t = 0; t < started; t++)
        pthread_join(helpers[t], NULL);
}

PyDoc_STRVAR(copy_doc,
"copy(dst, src) -> None\n\n"
"Copy the bytes of src into dst. Both must be C-contiguous buffers of the\n"
"same size in bytes; dst must be writable; they must not overlap. Large\n"
"copies use non-temporal stores and run without the GIL.");

static PyObject *copy(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj;
    Py_buffer dv, sv;

    (void)self;
    if (!PyArg_ParseTuple(args, "OO:copy", &dst_obj, &src_obj))
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &dv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &sv, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    PyObject *result = NULL;
    if (dv.len != sv.len) {
        PyErr_Format(PyExc_ValueError, "copy: destination has %zd bytes, source %zd", dv.len,
                     sv.len);
        goto done;
    }
    const char *d = (const char *)dv.buf, *s = (const char *)sv.buf;
    if (sv.len > 0 && d < s + sv.len && s < d + dv.len) {
        PyErr_SetString(PyExc_ValueError, "copy: source and destination overlap");
        goto done;
    }
    if (sv.len >= GIL_FREE_MIN_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        copy_bytes(dv.buf, sv.buf, (size_t)sv.len);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dv.buf, sv.buf, (size_t)sv.len);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return result;
}

/* An int64 offsets buffer (numpy's int64 is "l" on LP64, "q" elsewhere). */
static int get_offsets(PyObject *obj, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    char code = f[0] == '<' || f[0] == '=' || f[0] == '@' ? f[1] : f[0];
    if (view->itemsize != 8 || (code != 'l' && code != 'q') || f[f[0] == code ? 1 : 2]) {
        PyErr_Format(PyExc_TypeError, "copy_runs: %s must be int64, got format '%s'", name, f);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_runs_doc,
"copy_runs(dst, src, dst_offsets, src_offsets, nbytes, threads=1) -> None\n\n"
"For every i, copy nbytes from src at src_offsets[i] into dst at dst_offsets[i].\n"
"dst and src: C-contiguous buffers (dst writable); the offsets: int64 buffers of\n"
"one length. Every run is checked to lie inside its buffer and not to overlap\n"
"its own source before anything is copied; then all run without the GIL, on up\n"
"to threads threads (1-64; one per 4 MiB at most), the caller's among them.");

static PyObject *copy_runs(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj, *doff_obj, *soff_obj;
    Py_ssize_t nbytes;
    int threads = 1;
    Py_buffer dv, sv, dov, sov;

    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOn|i:copy_runs", &dst_obj, &src_obj, &doff_obj, &soff_obj,
                          &nbytes, &threads))
        return NULL;
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "copy_runs: threads is %d, not 1-%d", threads,
                     MAX_THREADS);
        return NULL;
    }
    if (nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "copy_runs: nbytes is %zd", nbytes);
        return NULL;
    }
    if (PyObject_GetBuffer(dst_obj, &dv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &sv, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    if (get_offsets(doff_obj, &dov, "dst_offsets") < 0) {
        PyBuffer_Release(&sv);
        PyBuffer_Release(&dv);
        return NULL;
    }
    if (get_offsets(soff_obj, &sov, "src_offsets") < 0) {
        PyBuffer_Release(&dov);
        PyBuffer_Release(&sv);
        PyBuffer_Release(&dv);
        return NULL;
    }
    PyObject *result = NULL;
    const int64_t *doff = (const int64_t *)dov.buf, *soff = (const int64_t *)sov.buf;
    Py_ssize_t count = dov.len / 8;
    if (sov.len / 8 != count) {
        PyErr_Format(PyExc_ValueError, "copy_runs: %zd destination offsets, %zd source offsets",
                     count, sov.len / 8);
        goto done;
    }
    char *d = (char *)dv.buf;
    const char *s = (const char *)sv.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (doff[i] < 0 || doff[i] > dv.len - nbytes || soff[i] < 0 || soff[i] > sv.len - nbytes) {
            PyErr_Format(PyExc_ValueError,
                         "copy_runs: run %zd of %zd bytes at %lld -> %lld lies outside the "
                         "source (%zd bytes) or destination (%zd bytes)",
                         i, nbytes, (long long)soff[i], (long long)doff[i], sv.len, dv.len);
            goto done;
        }
        const char *rd = d + doff[i], *rs = s + soff[i];
        if (nbytes > 0 && rd < rs + nbytes && rs < rd + nbytes) {
            PyErr_Format(PyExc_ValueError, "copy_runs: run %zd overlaps its source", i);
            goto done;
        }
    }
    if (nbytes * count >= GIL_FREE_MIN_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        copy_runs_threaded(d, s, doff, soff, (size_t)count, (size_t)nbytes, threads);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < count; i++)
            copy_run(d + doff[i], s + soff[i], (size_t)nbytes);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sov);
    PyBuffer_Release(&dov);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return result;
}

static int cpu_avx2 = 0, cpu_pages512 = 0; /* what the CPU allows (set at import) */

static const char *runs_loop_name(void)
{
    return use_pages512 ? "pages512" : use_avx2 ? "avx2" : HAVE_STREAM ? "pages" : "memcpy";
}

PyDoc_STRVAR(set_runs_loop_doc,
"set_runs_loop(name) -> str\n\n"
"Make copy_runs (and copy) use the loop name ('pages512', 'avx2', 'pages'),\n"
"for tests and measurements of each loop; returns the loop used before.\n"
"Raises ValueError for a loop this CPU cannot run. Not thread-safe: call it\n"
"when no copy runs.");

static PyObject *set_runs_loop(PyObject *self, PyObject *args)
{
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s:set_runs_loop", &name))
        return NULL;
    PyObject *before = PyUnicode_FromString(runs_loop_name());
    if (before == NULL)
        return NULL;
    if (strcmp(name, "pages512") == 0 && cpu_pages512) {
        use_pages512 = 1;
    } else if (strcmp(name, "avx2") == 0 && cpu_avx2) {
        use_pages512 = 0;
        use_avx2 = 1;
    } else if (strcmp(name, "pages") == 0 && HAVE_STREAM) {
        use_pages512 = 0;
        use_avx2 = 0;
    } else {
        Py_DECREF(before);
        PyErr_Format(PyExc_ValueError, "set_runs_loop: this CPU cannot run the loop '%s'", name);
        return NULL;
    }
    return before;
}

static PyMethodDef methods[] = {
    {"set_runs_loop", set_runs_loop, METH_VARARGS, set_runs_loop_doc},
    {"copy", copy, METH_VARARGS, copy_doc},
    {"copy_runs", copy_runs, METH_VARARGS, copy_runs_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "tierstore._fastcopy",
    "Block-sized copies with non-temporal stores (see tierstore.memcopy).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__fastcopy(void)
{
#if HAVE_AVX2_LOOP
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    cpu_avx2 = use_avx2;
    cpu_pages512 = __builtin_cpu_supports("avx512f") ? 1 : 0;
    use_pages512 = __builtin_cpu_is("intel") && cpu_pages512 ? 1 : 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "RUNS_AVX2", use_avx2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (m != NULL && PyModule_AddStringConstant(m, "RUNS_LOOP", runs_loop_name()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", HAVE_STREAM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* p2pkv._fastcopy: copy blocks and hash them (xxh3-64), with the GIL released.
 *
 * The same-host path (shm-v1) copies each block it is sent from the peer's mapped pool
 * into its own slot and verifies the block's xxh3-64 on the way. In Python, each segment
 * is one slice assignment and one hash call under the GIL, on one thread. Here a whole
 * message of blocks is copied and hashed in one call that holds no GIL, its blocks
 * shared out among the calling thread and up to seven helper threads of a small
 * process-wide pool.
 *
 *   copy_blocks(destinations, sources, checksums, threads) -> list[int] | None
 *   hash_blocks(blocks, threads) -> list[int]
 *   Scatter: a data stream's receiver, hashing as it lands (csrc/scatter.c)
 *
 * destinations and sources: one sequence of buffers (segments) per block, in the same
 * shape, each destination writable and as long as its source. The result holds each
 * block's xxh3-64 (seed 0) of its segments in order, as p2pkv.checksum.block_checksum
 * computes it, or is None when checksums is false. Every shape and buffer is checked
 * before any byte moves: a bad argument raises and copies nothing.
 *
 * The pool runs one call at a time; a call that finds it busy runs on its own thread
 * alone. After fork() the child starts with no helper threads and makes its own. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "fastcopy.h"

#define MAX_THREADS 8

typedef void (*copy_fn)(const p2pkv_seg *, size_t, int, uint64_t *);
typedef uint64_t (*hash_fn)(const p2pkv_seg *, size_t);

static copy_fn copy_block = p2pkv_copy_block_generic;
static hash_fn hash_block = p2pkv_hash_block_generic;
static const char *variant = "generic";
const p2pkv_hash_ops *p2pkv_hash = &p2pkv_hash_ops_generic;

/* -- one call's work -------------------------------------------------------------- */

typedef struct {
    const p2pkv_seg *segs;
    const size_t *first; /* nblocks + 1 offsets into segs */
    size_t nblocks;
    int copy;            /* copy then hash (1), or hash the sources only (0) */
    int hash;
    uint64_t *sums;
    atomic_size_t next;  /* the next block to take */
} job_t;

static void run_job(job_t *job)
{
    for (;;) {
        size_t i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (i >= job->nblocks)
            return;
        const p2pkv_seg *segs = job->segs + job->first[i];
        size_t nseg = job->first[i + 1] - job->first[i];
        if (job->copy)
            copy_block(segs, nseg, job->hash, job->sums + i);
        else
            job->sums[i] = hash_block(segs, nseg);
    }
}

/* -- the helper pool ---------------------------------------------------------------- */

static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_done = PTHREAD_COND_INITIALIZER;
static job_t *pool_job;
static unsigned long pool_gen;  /* bumped for each job handed out */
static int pool_helpers;        /* threads started */
static int pool_wanted;         /* helpers that take part in the current job */
static int pool_running;        /* helpers still working on it */
static unsigned long helper_start[MAX_THREADS]; /* pool_gen when each helper was made */

static void *helper_main(void *arg)
{
    int me = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool_mu);
    unsigned long seen = helper_start[me];
    for (;;) {
        while (pool_gen == seen)
            pthread_cond_wait(&pool_wake, &pool_mu);
        seen = pool_gen;
        if (me >= pool_wanted)
            continue;
        job_t *job = pool_job;
        pthread_mutex_unlock(&pool_mu);
        run_job(job);
        pthread_mutex_lock(&pool_mu);
        if (--pool_running == 0)
            pthread_cond_signal(&pool_done);
    }
    return NULL;
}

/* Start helpers up to `want` (under pool_busy); how many there are. */
static int grow_pool(int want)
{
    if (want > MAX_THREADS - 1)
        want = MAX_THREADS - 1;
    while (pool_helpers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        /* No job is out while the pool grows (the caller holds pool_busy): a helper
         * that first runs after the next job was handed out still sees it as new. */
        helper_start[pool_helpers] = pool_gen;
        int rc = pthread_create(&t, &attr, helper_main, (void *)(intptr_t)pool_helpers);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pthread_mutex_lock(&pool_mu);
        pool_helpers++;
        pthread_mutex_unlock(&pool_mu);
    }
    return pool_helpers;
}

static void run_shared(job_t *job, int threads)
{
    int helpers = threads - 1;
    if ((size_t)helpers > job->nblocks - 1)
        helpers = (int)(job->nblocks - 1);
    if (helpers <= 0 || pthread_mutex_trylock(&pool_busy) != 0) {
        run_job(job);
        return;
    }
    helpers = grow_pool(helpers) < helpers ? pool_helpers : helpers;
    if (helpers <= 0) {
        pthread_mutex_unlock(&pool_busy);
        run_job(job);
        return;
    }
    pthread_mutex_lock(&pool_mu);
    pool_job = job;
    pool_wanted = helpers;
    pool_running = helpers;
    pool_gen++;
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_mu);
    run_job(job);
    pthread_mutex_lock(&pool_mu);
    while (pool_running > 0)
        pthread_cond_wait(&pool_done, &pool_mu);
    pool_job = NULL;
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&pool_busy);
}

static void after_fork_child(void)
{
    /* Only the forking thread exists in the child: no helpers, nothing locked. */
    pthread_mutex_init(&pool_busy, NULL);
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pthread_cond_init(&pool_done, NULL);
    pool_job = NULL;
    pool_helpers = pool_wanted = pool_running = 0;
}

/* -- arguments ------------------------------------------------------------------------ */

typedef struct {
    Py_buffer *views;
    size_t nviews;
    p2pkv_seg *segs;
    size_t *first;
} batch_t;

static void batch_free(batch_t *b)
{
    for (size_t i = 0; i < b->nviews; i++)
        PyBuffer_Release(&b->views[i]);
    PyMem_Free(b->views);
    PyMem_Free(b->segs);
    PyMem_Free(b->first);
    memset(b, 0, sizeof(*b));
}

/* Count the segments of `blocks` (a sequence of sequences); -1 with an exception set. */
static Py_ssize_t count_segments(PyObject *blocks, const char *what)
{
    Py_ssize_t total = 0, n = PySequence_Fast_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = PySequence_Fast_GET_ITEM(blocks, i);
        Py_ssize_t k = PySequence_Size(block);
        if (k < 0) {
            PyErr_Format(PyExc_TypeError, "%s: block %zd is not a sequence of buffers", what,
                         i);
            return -1;
        }
        total += k;
    }
    return total;
}

/* Take a buffer of `obj` into b->views[b->nviews++]; 0, or -1 with an exception set. */
static int take_buffer(batch_t *b, PyObject *obj, int writable, const char *what,
                       Py_ssize_t block, Py_ssize_t seg)
{
    Py_buffer *view = &b->views[b->nviews];
    int flags = PyBUF_ANY_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_Format(writable && PyObject_CheckBuffer(obj) ? PyExc_ValueError
                                                           : PyExc_TypeError,
                     "%s: block %zd, segment %zd is not a %scontiguous buffer", what, block,
                     seg, writable ? "writable " : "");
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
    b->nviews++;
    return 0;
}

/* Fill `b` from the blocks' sources and (when dsts is not NULL) their destinations. */
static int batch_fill(batch_t *b, PyObject *dsts, PyObject *srcs)
{
    Py_ssize_t nblocks = PySequence_Fast_GET_SIZE(srcs);
    if (dsts != NULL && PySequence_Fast_GET_SIZE(dsts) != nblocks) {
        PyErr_Format(PyExc_ValueError, "%zd destination blocks for %zd source blocks",
                     PySequence_Fast_GET_SIZE(dsts), nblocks);
        return -1;
    }
    Py_ssize_t nseg = count_segments(srcs, "sources");
    if (nseg < 0)
        return -1;
    size_t nviews = (size_t)nseg * (dsts != NULL ? 2 : 1);
    b->views = PyMem_Calloc(nviews ? nviews : 1, sizeof(Py_buffer));
    b->segs = PyMem_Calloc(nseg ? (size_t)nseg : 1, sizeof(p2pkv_seg));
    b->first = PyMem_Calloc((size_t)nblocks + 1, sizeof(size_t));
    if (!b->views || !b->segs || !b->first) {
        PyErr_NoMemory();
        return -1;
    }
    size_t at = 0;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        b->first[i] = at;
        PyObject *sblock = PySequence_Fast(PySequence_Fast_GET_ITEM(srcs, i),
                                           "sources: a block is not a sequence of buffers");
        if (sblock == NULL)
            return -1;
        PyObject *dblock = NULL;
        if (dsts != NULL) {
            dblock = PySequence_Fast(PySequence_Fast_GET_ITEM(dsts, i),
                                     "destinations: a block is not a sequence of buffers");
            if (dblock == NULL) {
                Py_DECREF(sblock);
                return -1;
            }
        }
        Py_ssize_t k = PySequence_Fast_GET_SIZE(sblock);
        int rc = 0;
        if ((size_t)k > (size_t)nseg - at) {
            PyErr_Format(PyExc_ValueError, "sources: block %zd changed size", i);
            rc = -1;
        } else if (dblock != NULL && PySequence_Fast_GET_SIZE(dblock) != k) {
            PyErr_Format(PyExc_ValueError,
                         "block %zd: %zd destination segments for %zd source segments", i,
                         PySequence_Fast_GET_SIZE(dblock), k);
            rc = -1;
        }
        for (Py_ssize_t j = 0; rc == 0 && j < k; j++) {
            if (take_buffer(b, PySequence_Fast_GET_ITEM(sblock, j), 0, "sources", i, j)) {
                rc = -1;
                break;
            }
            Py_buffer *src = &b->views[b->nviews - 1];
            b->segs[at + j].src = src->buf;
            b->segs[at + j].len = (size_t)src->len;
            if (dblock == NULL)
                continue;
            if (take_buffer(b, PySequence_Fast_GET_ITEM(dblock, j), 1, "destinations", i,
                            j)) {
                rc = -1;
                break;
            }
            Py_buffer *dst = &b->views[b->nviews - 1];
            if (dst->len != src->len) {
                PyErr_Format(PyExc_ValueError,
                             "block %zd, segment %zd: destination of %zd bytes for a "
                             "source of %zd", i, j, dst->len, src->len);
                rc = -1;
                break;
            }
            b->segs[at + j].dst = dst->buf;
        }
        Py_DECREF(sblock);
        Py_XDECREF(dblock);
        if (rc)
            return -1;
        at += (size_t)k;
    }
    b->first[nblocks] = at;
    return 0;
}

static int check_threads(int threads)
{
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be between 1 and %d, got %d",
                     MAX_THREADS, threads);
        return -1;
    }
    return 0;
}

PyObject *p2pkv_sums_list(const uint64_t *sums, size_t n)
{
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (out == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    return out;
}

static PyObject *run_batch(PyObject *dsts_arg, PyObject *srcs_arg, int hash, int threads)
{
    PyObject *srcs = NULL, *dsts = NULL, *result = NULL;
    batch_t b = {0};
    uint64_t *sums = NULL;
    srcs = PySequence_Fast(srcs_arg, "sources must be a sequence of blocks");
    if (srcs == NULL)
        goto out;
    if (dsts_arg != NULL) {
        dsts = PySequence_Fast(dsts_arg, "destinations must be a sequence of blocks");
        if (dsts == NULL)
            goto out;
    }
    if (batch_fill(&b, dsts, srcs) != 0)
        goto out;
    size_t nblocks = (size_t)PySequence_Fast_GET_SIZE(srcs);
    sums = PyMem_Calloc(nblocks ? nblocks : 1, sizeof(uint64_t));
    if (sums == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (nblocks) {
        job_t job = {.segs = b.segs, .first = b.first, .nblocks = nblocks,
                     .copy = dsts != NULL, .hash = hash, .sums = sums};
        atomic_init(&job.next, 0);
        Py_BEGIN_ALLOW_THREADS
        run_shared(&job, threads);
        Py_END_ALLOW_THREADS
    }
    if (hash) {
        result = p2pkv_sums_list(sums, nblocks);
    } else {
        result = Py_None;
        Py_INCREF(result);
    }
out:
    batch_free(&b);
    PyMem_Free(sums);
    Py_XDECREF(srcs);
    Py_XDECREF(dsts);
    return result;
}

static PyObject *copy_blocks(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"destinations", "sources", "checksums", "threads", NULL};
    PyObject *dsts, *srcs;
    int checksums = 1, threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|$pi:copy_blocks", names, &dsts, &srcs,
                                     &checksums, &threads))
        return NULL;
    if (check_threads(threads))
        return NULL;
    return run_batch(dsts, srcs, checksums, threads);
}

static PyObject *hash_blocks(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"blocks", "threads", NULL};
    PyObject *blocks;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$i:hash_blocks", names, &blocks,
                                     &threads))
        return NULL;
    if (check_threads(threads))
        return NULL;
    return run_batch(NULL, blocks, 1, threads);
}

static PyMethodDef methods[] = {
    {"copy_blocks", (PyCFunction)(void (*)(void))copy_blocks, METH_VARARGS | METH_KEYWORDS,
     "copy_blocks(destinations, sources, *, checksums=True, threads=1) -> list[int] | None\n"
     "\n"
     "Copy each block's segments into its destinations, hashing each block (xxh3-64,\n"
     "seed 0) on the way, with the GIL released and the blocks shared out over up to\n"
     "`threads` threads. Checked whole before any byte moves."},
    {"hash_blocks", (PyCFunction)(void (*)(void))hash_blocks, METH_VARARGS | METH_KEYWORDS,
     "hash_blocks(blocks, *, threads=1) -> list[int]\n"
     "\n"
     "Each block's xxh3-64 (seed 0) of its segments in order, with the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "p2pkv._fastcopy",
    "Copy and hash blocks (xxh3-64) with the GIL released; see p2pkv.checksum.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastcopy(void)
{
#ifdef P2PKV_HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && getenv("P2PKV_FASTCOPY_GENERIC") == NULL) {
        copy_block = p2pkv_copy_block_avx2;
        hash_block = p2pkv_hash_block_avx2;
        p2pkv_hash = &p2pkv_hash_ops_avx2;
        variant = "avx2";
    }
#endif
    static int forked_handler = 0;
    if (!forked_handler) {
        pthread_atfork(NULL, NULL, after_fork_child);
        forked_handler = 1;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "VARIANT", variant) != 0 ||
        PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) != 0 ||
        p2pkv_add_scatter(m) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

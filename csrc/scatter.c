/* p2pkv._fastcopy.Scatter: receive a stream's bytes into a list of buffers, in order,
 * and hash each block (xxh3-64) as it lands.
 *
 * A data stream's block message is followed by its payload: every block's segments in
 * order, straight into the store slots (or caller buffers) they belong to. In Python,
 * each receive is one recvmsg_into of about 2 MiB under the loop's bookkeeping, and the
 * blocks it completed are hashed afterwards, when most of their bytes have left the
 * cache. Here one call receives up to `limit` bytes with the GIL released, in pieces of
 * at most PIECE bytes, and hashes each piece right after it arrived, while it is still in
 * L2: a block's running hash lives in the object, so a block may span any number of
 * pieces and calls.
 *
 *   Scatter(views, block=0)
 *     views: writable contiguous buffers, filled in order (empty ones take no part).
 *     block: bytes per block; above 0, every `block` bytes of the stream are one block,
 *            hashed as xxh3-64 (seed 0) of its bytes in order, as
 *            p2pkv.checksum.block_checksum computes it over the block's segments.
 *   .receive(sock, tail=None, limit=...) -> int | None
 *   .put(data) -> int
 *   .filled, .total, .spilled, .done, .sums, .close()
 *
 * The buffers are held from construction until the last byte landed or close(). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "fastcopy.h"

/* Bytes asked of one recvmsg: small enough to still be in L2 when they are hashed. */
#define PIECE ((Py_ssize_t)256 * 1024)
/* Buffers per recvmsg, as p2pkv.transport.datachannel.IOV_MAX (Linux allows 1024). */
#define IOV_LIMIT 1000

typedef struct {
    PyObject_HEAD
    Py_buffer *views;     /* the non-empty buffers, held while `held` */
    Py_ssize_t nviews;
    Py_ssize_t *ends;     /* stream offset at which each buffer ends */
    Py_ssize_t at;        /* the first buffer not filled yet */
    Py_ssize_t filled;
    Py_ssize_t total;
    Py_ssize_t spilled;   /* bytes the last receive put into its tail */
    Py_ssize_t block;     /* bytes per block; 0: no hashing */
    p2pkv_hash_state *state; /* the running hash of the block in progress */
    uint64_t *sums;       /* the digests of the blocks completed so far */
    Py_ssize_t nsums;
    int held;
    int busy;             /* a call is under way without the GIL */
} Scatter;

static void release_views(Scatter *self)
{
    if (!self->held)
        return;
    for (Py_ssize_t i = 0; i < self->nviews; i++)
        PyBuffer_Release(&self->views[i]);
    self->held = 0;
}

static void Scatter_dealloc(Scatter *self)
{
    release_views(self);
    PyMem_Free(self->views);
    PyMem_Free(self->ends);
    PyMem_Free(self->sums);
    free(self->state);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Scatter_init(Scatter *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"views", "block", NULL};
    PyObject *arg;
    Py_ssize_t block = 0;
    if (self->views != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Scatter is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n:Scatter", names, &arg, &block))
        return -1;
    if (block < 0) {
        PyErr_Format(PyExc_ValueError, "block must be 0 or more bytes, got %zd", block);
        return -1;
    }
    PyObject *seq = PySequence_Fast(arg, "views must be a sequence of buffers");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    self->views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    self->ends = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_ssize_t));
    if (self->views == NULL || self->ends == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    self->held = 1;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer *view = &self->views[self->nviews];
        PyObject *obj = PySequence_Fast_GET_ITEM(seq, i);
        if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
            PyErr_Clear();
            PyErr_Format(PyObject_CheckBuffer(obj) ? PyExc_ValueError : PyExc_TypeError,
                         "views: item %zd is not a writable contiguous buffer", i);
            Py_DECREF(seq);
            return -1;
        }
        if (view->len == 0) {
            PyBuffer_Release(view);
            continue;
        }
        total += view->len;
        self->ends[self->nviews++] = total;
    }
    Py_DECREF(seq);
    self->total = total;
    self->block = block;
    if (block) {
        if (total % block) {
            PyErr_Format(PyExc_ValueError,
                         "views hold %zd bytes, not a whole number of %zd-byte blocks", total,
                         block);
            return -1;
        }
        self->sums = PyMem_Calloc((size_t)(total / block) + 1, sizeof(uint64_t));
        if (posix_memalign((void **)&self->state, _Alignof(p2pkv_hash_state),
                           sizeof(p2pkv_hash_state)) != 0)
            self->state = NULL;
        if (self->sums == NULL || self->state == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        p2pkv_hash->reset(self->state);
    }
    if (total == 0)
        release_views(self);
    return 0;
}

/* Hash `len` bytes at `data`, the stream's bytes from offset self->filled on (GIL free). */
static void hash_bytes(Scatter *self, const char *data, Py_ssize_t len, Py_ssize_t pos)
{
    Py_ssize_t block = self->block;
    while (len > 0) {
        Py_ssize_t end = (pos / block + 1) * block;
        Py_ssize_t k = end - pos < len ? end - pos : len;
        p2pkv_hash->update(self->state, data, (size_t)k);
        data += k;
        len -= k;
        pos += k;
        if (pos == end) {
            self->sums[self->nsums++] = p2pkv_hash->digest(self->state);
            p2pkv_hash->reset(self->state);
        }
    }
}

/* What is left of buffer `i` from stream offset `pos` on. */
static inline char *rest_of(Scatter *self, Py_ssize_t i, Py_ssize_t pos, Py_ssize_t *len)
{
    Py_ssize_t start = self->ends[i] - self->views[i].len;
    *len = self->ends[i] - pos;
    return (char *)self->views[i].buf + (pos - start);
}

/* Bytes landed in the buffers: hash them, move past them (GIL free). */
static void landed(Scatter *self, Py_ssize_t n)
{
    Py_ssize_t pos = self->filled, left = n, i = self->at;
    while (left > 0) {
        Py_ssize_t len;
        char *p = rest_of(self, i, pos, &len);
        Py_ssize_t k = len < left ? len : left;
        if (self->block)
            hash_bytes(self, p, k, pos);
        pos += k;
        left -= k;
        if (pos == self->ends[i])
            i++;
    }
    self->filled = pos;
    self->at = i;
}

static int enter(Scatter *self)
{
    if (!self->held && self->filled < self->total) {
        PyErr_SetString(PyExc_ValueError, "the Scatter is closed: nothing more lands");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Scatter is in use by another thread");
        return -1;
    }
    self->busy = 1;
    return 0;
}

static void leave(Scatter *self)
{
    self->busy = 0;
    if (self->filled >= self->total)
        release_views(self);
}

static PyObject *Scatter_receive(Scatter *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"sock", "tail", "limit", NULL};
    PyObject *sock, *tail_obj = Py_None;
    Py_ssize_t limit = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|On:receive", names, &sock, &tail_obj,
                                     &limit))
        return NULL;
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0)
        return NULL;
    if (limit < 1) {
        PyErr_Format(PyExc_ValueError, "limit must be at least 1 byte, got %zd", limit);
        return NULL;
    }
    Py_buffer tail = {0};
    int have_tail = tail_obj != Py_None;
    if (have_tail && PyObject_GetBuffer(tail_obj, &tail, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS))
        return NULL;
    if (enter(self)) {
        if (have_tail)
            PyBuffer_Release(&tail);
        return NULL;
    }
    struct iovec iov[IOV_LIMIT + 1];
    Py_ssize_t got = 0;
    int err = 0, eof = 0;
    self->spilled = 0;
    Py_BEGIN_ALLOW_THREADS
    while (got < limit) {
        /* One piece: the buffers from `at` on, up to PIECE bytes or IOV_LIMIT buffers. */
        int niov = 0;
        Py_ssize_t want = 0, pos = self->filled;
        for (Py_ssize_t i = self->at; i < self->nviews && niov < IOV_LIMIT && want < PIECE;
             i++) {
            Py_ssize_t len;
            char *p = rest_of(self, i, pos, &len);
            if (len > PIECE - want)
                len = PIECE - want;
            iov[niov].iov_base = p;
            iov[niov].iov_len = (size_t)len;
            niov++;
            want += len;
            pos += len;
        }
        int to_tail = have_tail && pos == self->total && tail.len > 0;
        if (to_tail) {
            iov[niov].iov_base = tail.buf;
            iov[niov].iov_len = (size_t)tail.len;
            niov++;
        }
        if (niov == 0)
            break;
        struct msghdr msg;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)niov;
        ssize_t n = recvmsg(fd, &msg, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                err = errno;
            break;
        }
        if (n == 0) {
            eof = 1;
            break;
        }
        Py_ssize_t used = n < want ? n : want;
        landed(self, used);
        got += n;
        if (n > used) {
            self->spilled = n - used;
            break;
        }
        if (used < want || self->filled >= self->total)
            break; /* the socket is empty for now, or the payload is all here */
    }
    Py_END_ALLOW_THREADS
    leave(self);
    if (have_tail)
        PyBuffer_Release(&tail);
    if (got > 0)
        return PyLong_FromSsize_t(got); /* an error or the end shows on the next call */
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (eof)
        return PyLong_FromLong(0);
    Py_RETURN_NONE;
}

static PyObject *Scatter_put(Scatter *self, PyObject *arg)
{
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_C_CONTIGUOUS))
        return NULL;
    if (enter(self)) {
        PyBuffer_Release(&data);
        return NULL;
    }
    Py_ssize_t taken = 0;
    while (taken < data.len && self->filled < self->total) {
        Py_ssize_t len;
        char *p = rest_of(self, self->at, self->filled, &len);
        Py_ssize_t k = data.len - taken < len ? data.len - taken : len;
        memcpy(p, (const char *)data.buf + taken, (size_t)k);
        landed(self, k);
        taken += k;
    }
    leave(self);
    PyBuffer_Release(&data);
    return PyLong_FromSsize_t(taken);
}

static PyObject *Scatter_close(Scatter *self, PyObject *unused)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Scatter is in use by another thread");
        return NULL;
    }
    release_views(self);
    Py_RETURN_NONE;
}

static PyObject *Scatter_get_done(Scatter *self, void *closure)
{
    return PyBool_FromLong(self->filled >= self->total);
}

static PyObject *Scatter_get_sums(Scatter *self, void *closure)
{
    if (!self->block)
        Py_RETURN_NONE;
    return p2pkv_sums_list(self->sums, (size_t)self->nsums);
}

static PyMethodDef Scatter_methods[] = {
    {"receive", (PyCFunction)(void (*)(void))Scatter_receive, METH_VARARGS | METH_KEYWORDS,
     "receive(sock, tail=None, limit=...) -> int | None\n"
     "\n"
     "Receive about `limit` bytes (at least one piece) into the next buffers, hashing\n"
     "each piece as it lands; `tail` takes what follows the last buffer. Bytes received\n"
     "(0: the peer closed the stream), None when nothing is there now. OSError when the\n"
     "stream failed before any byte came in."},
    {"put", (PyCFunction)Scatter_put, METH_O,
     "put(data) -> int\n\nCopy already-received bytes into the next buffers (and hash\n"
     "them); how many were taken."},
    {"close", (PyCFunction)Scatter_close, METH_NOARGS,
     "close()\n\nLet go of the buffers now: nothing more can land (receive and put\n"
     "raise ValueError). Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Scatter_members[] = {
    {"filled", T_PYSSIZET, offsetof(Scatter, filled), READONLY, "Bytes landed so far."},
    {"total", T_PYSSIZET, offsetof(Scatter, total), READONLY, "Bytes of all the buffers."},
    {"spilled", T_PYSSIZET, offsetof(Scatter, spilled), READONLY,
     "Bytes the last receive put into its tail."},
    {"block", T_PYSSIZET, offsetof(Scatter, block), READONLY,
     "Bytes per hashed block (0: no hashing)."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Scatter_getset[] = {
    {"done", (getter)Scatter_get_done, NULL, "Every buffer is full.", NULL},
    {"sums", (getter)Scatter_get_sums, NULL,
     "The xxh3-64 of each block completed so far, in order (None: no hashing).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ScatterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "p2pkv._fastcopy.Scatter",
    .tp_doc = "Receive a stream into buffers in order, hashing each block as it lands.",
    .tp_basicsize = sizeof(Scatter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Scatter_init,
    .tp_dealloc = (destructor)Scatter_dealloc,
    .tp_methods = Scatter_methods,
    .tp_members = Scatter_members,
    .tp_getset = Scatter_getset,
};

int p2pkv_add_scatter(PyObject *module)
{
    if (PyType_Ready(&ScatterType) < 0)
        return -1;
    Py_INCREF(&ScatterType);
    if (PyModule_AddObject(module, "Scatter", (PyObject *)&ScatterType) < 0) {
        Py_DECREF(&ScatterType);
        return -1;
    }
    return 0;
}

/* Shared declarations of p2pkv._fastcopy. */
#ifndef P2PKV_FASTCOPY_H
#define P2PKV_FASTCOPY_H

#include <stddef.h>
#include <stdint.h>

/* One segment of a block: len bytes from src to dst (dst unused when only hashing). */
typedef struct {
    char *dst;
    const char *src;
    size_t len;
} p2pkv_seg;

/* Room for one running xxh3-64 (XXH3_state_t, checked where it is defined), aligned as
 * xxhash wants it. */
typedef struct {
    _Alignas(64) unsigned char bytes[640];
} p2pkv_hash_state;

/* A running hash, one set per compiled variant. */
typedef struct {
    void (*reset)(p2pkv_hash_state *state);
    void (*update)(p2pkv_hash_state *state, const void *data, size_t len);
    uint64_t (*digest)(const p2pkv_hash_state *state);
} p2pkv_hash_ops;

void p2pkv_copy_block_generic(const p2pkv_seg *segs, size_t nseg, int hash, uint64_t *sum);
uint64_t p2pkv_hash_block_generic(const p2pkv_seg *segs, size_t nseg);
extern const p2pkv_hash_ops p2pkv_hash_ops_generic;
#if defined(__x86_64__) || defined(__i386__)
#define P2PKV_HAVE_AVX2 1
void p2pkv_copy_block_avx2(const p2pkv_seg *segs, size_t nseg, int hash, uint64_t *sum);
uint64_t p2pkv_hash_block_avx2(const p2pkv_seg *segs, size_t nseg);
extern const p2pkv_hash_ops p2pkv_hash_ops_avx2;
#endif

/* The running hash of the variant chosen at import (set before any Scatter exists). */
extern const p2pkv_hash_ops *p2pkv_hash;

#ifdef Py_PYTHON_H
/* Add the Scatter type (csrc/scatter.c) to the module; 0, or -1 with an exception set. */
int p2pkv_add_scatter(PyObject *module);
/* A new list of the sums as Python ints (csrc/fastcopy.c); NULL with an exception set. */
PyObject *p2pkv_sums_list(const uint64_t *sums, size_t n);
#endif

#endif

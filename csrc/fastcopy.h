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

void p2pkv_copy_block_generic(const p2pkv_seg *segs, size_t nseg, int hash, uint64_t *sum);
uint64_t p2pkv_hash_block_generic(const p2pkv_seg *segs, size_t nseg);
#if defined(__x86_64__) || defined(__i386__)
#define P2PKV_HAVE_AVX2 1
void p2pkv_copy_block_avx2(const p2pkv_seg *segs, size_t nseg, int hash, uint64_t *sum);
uint64_t p2pkv_hash_block_avx2(const p2pkv_seg *segs, size_t nseg);
#endif

#endif

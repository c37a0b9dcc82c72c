/* The copy-and-hash loop of p2pkv._fastcopy, compiled once per instruction set.
 *
 * The file that includes this one defines P2PKV_VARIANT (the suffix of the exported
 * function) and may select a vector width for xxh3 before including it. xxhash.h is
 * used header-only (XXH_INLINE_ALL), so each variant carries its own static copy. */

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <string.h>

#include "fastcopy.h"

#define P2PKV_CAT2(a, b) a##b
#define P2PKV_CAT(a, b) P2PKV_CAT2(a, b)

/* Bytes copied before they are hashed: small enough that the copied bytes are still
 * in L1/L2 when xxh3 reads them back. */
#define P2PKV_CHUNK ((size_t)64 * 1024)

void P2PKV_CAT(p2pkv_copy_block_, P2PKV_VARIANT)(const p2pkv_seg *segs, size_t nseg,
                                                 int hash, uint64_t *sum)
{
    if (!hash) {
        for (size_t i = 0; i < nseg; i++)
            memcpy(segs[i].dst, segs[i].src, segs[i].len);
        return;
    }
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    for (size_t i = 0; i < nseg; i++) {
        char *dst = segs[i].dst;
        const char *src = segs[i].src;
        size_t left = segs[i].len;
        while (left) {
            size_t n = left < P2PKV_CHUNK ? left : P2PKV_CHUNK;
            memcpy(dst, src, n);
            XXH3_64bits_update(&state, dst, n);
            dst += n;
            src += n;
            left -= n;
        }
    }
    *sum = XXH3_64bits_digest(&state);
}

uint64_t P2PKV_CAT(p2pkv_hash_block_, P2PKV_VARIANT)(const p2pkv_seg *segs, size_t nseg)
{
    if (nseg == 1)
        return XXH3_64bits(segs[0].src, segs[0].len);
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    for (size_t i = 0; i < nseg; i++)
        XXH3_64bits_update(&state, segs[i].src, segs[i].len);
    return XXH3_64bits_digest(&state);
}

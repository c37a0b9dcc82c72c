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

_Static_assert(sizeof(XXH3_state_t) <= sizeof(p2pkv_hash_state),
               "p2pkv_hash_state is too small for XXH3_state_t");
_Static_assert(_Alignof(XXH3_state_t) <= _Alignof(p2pkv_hash_state),
               "p2pkv_hash_state is not aligned enough for XXH3_state_t");

static void P2PKV_CAT(hash_reset_, P2PKV_VARIANT)(p2pkv_hash_state *state)
{
    XXH3_state_t *s = (XXH3_state_t *)(void *)state->bytes;
    XXH3_INITSTATE(s);
    XXH3_64bits_reset(s);
}

static void P2PKV_CAT(hash_update_, P2PKV_VARIANT)(p2pkv_hash_state *state, const void *data,
                                                   size_t len)
{
    XXH3_64bits_update((XXH3_state_t *)(void *)state->bytes, data, len);
}

static uint64_t P2PKV_CAT(hash_digest_, P2PKV_VARIANT)(const p2pkv_hash_state *state)
{
    return XXH3_64bits_digest((const XXH3_state_t *)(const void *)state->bytes);
}

const p2pkv_hash_ops P2PKV_CAT(p2pkv_hash_ops_, P2PKV_VARIANT) = {
    P2PKV_CAT(hash_reset_, P2PKV_VARIANT),
    P2PKV_CAT(hash_update_, P2PKV_VARIANT),
    P2PKV_CAT(hash_digest_, P2PKV_VARIANT),
};

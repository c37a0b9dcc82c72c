/* The copy-and-hash loop with xxh3 on AVX2, used when the CPU has it (checked at import). */
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2")
#define XXH_VECTOR XXH_AVX2
#define P2PKV_VARIANT avx2
#include "copy_impl.h"
#endif

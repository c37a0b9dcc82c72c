/* The copy-and-hash loop with xxh3's default vector width for the build target. */
#define P2PKV_VARIANT generic
#include "copy_impl.h"

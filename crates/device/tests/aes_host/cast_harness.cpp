// Host launcher for the dtype conversion kernel source (see shim.h). Built by
// crates/device/tests/cast_kernel.rs.
#include "shim.h"
#include TURBOIO_CAST_CU

thread_local turboio_dim3 threadIdx, blockIdx, blockDim, gridDim;

// Runs the kernel over a grid of `grid` blocks of one thread each.
extern "C" void turboio_host_cast(const turboio_u8* src, turboio_u8* dst, turboio_u64 n, turboio_u32 from,
                                  turboio_u32 to, unsigned int grid) {
    gridDim = turboio_dim3{grid, 1, 1};
    blockDim = turboio_dim3{1, 1, 1};
    threadIdx = turboio_dim3{0, 0, 0};
    for (unsigned int b = 0; b < grid; b++) {
        blockIdx = turboio_dim3{b, 0, 0};
        turboio_cast(src, dst, n, from, to);
    }
}

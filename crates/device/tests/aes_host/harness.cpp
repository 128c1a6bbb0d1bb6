// Host launcher for the AES-CTR kernel source (see shim.h). Built by crates/device/tests/aes_kernel.rs.
#include "shim.h"
#include TURBOIO_AES_CU

thread_local turboio_dim3 threadIdx, blockIdx, blockDim, gridDim;

// Runs the kernel over a grid of `grid` blocks of one thread each.
extern "C" void turboio_host_launch(turboio_u8* data, turboio_u64 len, const turboio_u32* round_keys,
                                    turboio_u32 rounds, turboio_u64 iv_hi, turboio_u64 iv_lo, turboio_u64 pos,
                                    unsigned int grid) {
    gridDim = turboio_dim3{grid, 1, 1};
    blockDim = turboio_dim3{1, 1, 1};
    threadIdx = turboio_dim3{0, 0, 0};
    for (unsigned int b = 0; b < grid; b++) {
        blockIdx = turboio_dim3{b, 0, 0};
        turboio_aes_ctr_xor(data, len, round_keys, rounds, iv_hi, iv_lo, pos);
    }
}

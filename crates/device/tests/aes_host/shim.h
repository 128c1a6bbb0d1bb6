// Lets src/cuda/aes_ctr.cu compile as plain C++ for the host, so the test suite can compare the
// kernel's output with crates/cipher on machines without a GPU.
//
// The CUDA qualifiers become ordinary C++; threadIdx/blockIdx/blockDim/gridDim are thread-local
// variables that the harness sets before each emulated thread. Emulated threads run one after
// another, which cannot honour __syncthreads() inside a block, so the harness launches blocks of
// one thread (any number of blocks): the kernel's grid-stride indexing is the same arithmetic.
#pragma once
#include <stdint.h>

#define TURBOIO_AES_HOST 1
typedef uint8_t turboio_u8;
typedef uint32_t turboio_u32;
typedef unsigned long long turboio_u64;
typedef long long turboio_i64;

struct turboio_dim3 {
    unsigned int x, y, z;
};
extern thread_local turboio_dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
// Shared memory is per block; blocks run one after another on the calling thread, and tests
// call the kernel from several threads at once, so each OS thread gets its own copy.
#define __shared__ static thread_local
#define __syncthreads() ((void)0)

// turboio: AES-CTR decryption in device memory (AES-128 and AES-256).
//
// turboio_aes_ctr_xor XORs the AES-CTR keystream into `len` bytes at `data`, in place. The
// keystream is the one of crates/cipher (OpenSSL's EVP_aes_*_ctr, veTurboIO's CtrDecrypter):
// byte p of the stream is AES_K(IV + p / 16)[p % 16], where IV + n adds n to the IV read as one
// 128-bit big-endian integer (the carry runs through all 16 bytes). data[0] is stream byte `pos`,
// so any chunk of a file decrypts on its own, at any offset (random access).
//
// One thread encrypts one 16-byte counter block and XORs it into the (up to) 16 data bytes it
// covers; a grid-stride loop lets any launch shape cover any length. The T-table (1 KiB) and the
// S-box are copied into shared memory by each block; the round keys (expanded on the host, 44 or
// 60 words) come from device memory that the host zeroes after the load.
//
// This file is compiled twice: by NVRTC at run time (the CUDA build), and as plain C++ by the test
// suite (crates/device/tests/aes_kernel.rs) with the shim in tests/aes_host/shim.h, which defines
// TURBOIO_AES_HOST, the CUDA qualifiers and threadIdx/blockIdx/blockDim/gridDim, so that the very
// same code is compared with crates/cipher on the host. Keep it to the common subset: no CUDA
// intrinsics, no headers, fixed-width types spelled out below.

#ifndef TURBOIO_AES_HOST
typedef unsigned char turboio_u8;
typedef unsigned int turboio_u32;
typedef unsigned long long turboio_u64;
typedef long long turboio_i64;
#endif

// Te0[x] = S[x] * {02, 01, 01, 03} as a big-endian word; Te1..Te3 are its byte rotations.
__device__ const turboio_u32 TURBOIO_TE0[256] = {
    0xc66363a5u, 0xf87c7c84u, 0xee777799u, 0xf67b7b8du, 0xfff2f20du, 0xd66b6bbdu, 0xde6f6fb1u, 0x91c5c554u,
    0x60303050u, 0x02010103u, 0xce6767a9u, 0x562b2b7du, 0xe7fefe19u, 0xb5d7d762u, 0x4dababe6u, 0xec76769au,
    0x8fcaca45u, 0x1f82829du, 0x89c9c940u, 0xfa7d7d87u, 0xeffafa15u, 0xb25959ebu, 0x8e4747c9u, 0xfbf0f00bu,
    0x41adadecu, 0xb3d4d467u, 0x5fa2a2fdu, 0x45afafeau, 0x239c9cbfu, 0x53a4a4f7u, 0xe4727296u, 0x9bc0c05bu,
    0x75b7b7c2u, 0xe1fdfd1cu, 0x3d9393aeu, 0x4c26266au, 0x6c36365au, 0x7e3f3f41u, 0xf5f7f702u, 0x83cccc4fu,
    0x6834345cu, 0x51a5a5f4u, 0xd1e5e534u, 0xf9f1f108u, 0xe2717193u, 0xabd8d873u, 0x62313153u, 0x2a15153fu,
    0x0804040cu, 0x95c7c752u, 0x46232365u, 0x9dc3c35eu, 0x30181828u, 0x379696a1u, 0x0a05050fu, 0x2f9a9ab5u,
    0x0e070709u, 0x24121236u, 0x1b80809bu, 0xdfe2e23du, 0xcdebeb26u, 0x4e272769u, 0x7fb2b2cdu, 0xea75759fu,
    0x1209091bu, 0x1d83839eu, 0x582c2c74u, 0x341a1a2eu, 0x361b1b2du, 0xdc6e6eb2u, 0xb45a5aeeu, 0x5ba0a0fbu,
    0xa45252f6u, 0x763b3b4du, 0xb7d6d661u, 0x7db3b3ceu, 0x5229297bu, 0xdde3e33eu, 0x5e2f2f71u, 0x13848497u,
    0xa65353f5u, 0xb9d1d168u, 0x00000000u, 0xc1eded2cu, 0x40202060u, 0xe3fcfc1fu, 0x79b1b1c8u, 0xb65b5bedu,
    0xd46a6abeu, 0x8dcbcb46u, 0x67bebed9u, 0x7239394bu, 0x944a4adeu, 0x984c4cd4u, 0xb05858e8u, 0x85cfcf4au,
    0xbbd0d06bu, 0xc5efef2au, 0x4faaaae5u, 0xedfbfb16u, 0x864343c5u, 0x9a4d4dd7u, 0x66333355u, 0x11858594u,
    0x8a4545cfu, 0xe9f9f910u, 0x04020206u, 0xfe7f7f81u, 0xa05050f0u, 0x783c3c44u, 0x259f9fbau, 0x4ba8a8e3u,
    0xa25151f3u, 0x5da3a3feu, 0x804040c0u, 0x058f8f8au, 0x3f9292adu, 0x219d9dbcu, 0x70383848u, 0xf1f5f504u,
    0x63bcbcdfu, 0x77b6b6c1u, 0xafdada75u, 0x42212163u, 0x20101030u, 0xe5ffff1au, 0xfdf3f30eu, 0xbfd2d26du,
    0x81cdcd4cu, 0x180c0c14u, 0x26131335u, 0xc3ecec2fu, 0xbe5f5fe1u, 0x359797a2u, 0x884444ccu, 0x2e171739u,
    0x93c4c457u, 0x55a7a7f2u, 0xfc7e7e82u, 0x7a3d3d47u, 0xc86464acu, 0xba5d5de7u, 0x3219192bu, 0xe6737395u,
    0xc06060a0u, 0x19818198u, 0x9e4f4fd1u, 0xa3dcdc7fu, 0x44222266u, 0x542a2a7eu, 0x3b9090abu, 0x0b888883u,
    0x8c4646cau, 0xc7eeee29u, 0x6bb8b8d3u, 0x2814143cu, 0xa7dede79u, 0xbc5e5ee2u, 0x160b0b1du, 0xaddbdb76u,
    0xdbe0e03bu, 0x64323256u, 0x743a3a4eu, 0x140a0a1eu, 0x924949dbu, 0x0c06060au, 0x4824246cu, 0xb85c5ce4u,
    0x9fc2c25du, 0xbdd3d36eu, 0x43acacefu, 0xc46262a6u, 0x399191a8u, 0x319595a4u, 0xd3e4e437u, 0xf279798bu,
    0xd5e7e732u, 0x8bc8c843u, 0x6e373759u, 0xda6d6db7u, 0x018d8d8cu, 0xb1d5d564u, 0x9c4e4ed2u, 0x49a9a9e0u,
    0xd86c6cb4u, 0xac5656fau, 0xf3f4f407u, 0xcfeaea25u, 0xca6565afu, 0xf47a7a8eu, 0x47aeaee9u, 0x10080818u,
    0x6fbabad5u, 0xf0787888u, 0x4a25256fu, 0x5c2e2e72u, 0x381c1c24u, 0x57a6a6f1u, 0x73b4b4c7u, 0x97c6c651u,
    0xcbe8e823u, 0xa1dddd7cu, 0xe874749cu, 0x3e1f1f21u, 0x964b4bddu, 0x61bdbddcu, 0x0d8b8b86u, 0x0f8a8a85u,
    0xe0707090u, 0x7c3e3e42u, 0x71b5b5c4u, 0xcc6666aau, 0x904848d8u, 0x06030305u, 0xf7f6f601u, 0x1c0e0e12u,
    0xc26161a3u, 0x6a35355fu, 0xae5757f9u, 0x69b9b9d0u, 0x17868691u, 0x99c1c158u, 0x3a1d1d27u, 0x279e9eb9u,
    0xd9e1e138u, 0xebf8f813u, 0x2b9898b3u, 0x22111133u, 0xd26969bbu, 0xa9d9d970u, 0x078e8e89u, 0x339494a7u,
    0x2d9b9bb6u, 0x3c1e1e22u, 0x15878792u, 0xc9e9e920u, 0x87cece49u, 0xaa5555ffu, 0x50282878u, 0xa5dfdf7au,
    0x038c8c8fu, 0x59a1a1f8u, 0x09898980u, 0x1a0d0d17u, 0x65bfbfdau, 0xd7e6e631u, 0x844242c6u, 0xd06868b8u,
    0x824141c3u, 0x299999b0u, 0x5a2d2d77u, 0x1e0f0f11u, 0x7bb0b0cbu, 0xa85454fcu, 0x6dbbbbd6u, 0x2c16163au,
};

#define TURBOIO_ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

// The keystream word, big-endian in the block, XORed into four data bytes read as a
// little-endian word (GPUs and the hosts this runs on are little-endian).
__device__ static inline turboio_u32 turboio_bswap(turboio_u32 k) {
    return (k >> 24) | ((k >> 8) & 0xff00u) | ((k << 8) & 0xff0000u) | (k << 24);
}

extern "C" __global__ void turboio_aes_ctr_xor(turboio_u8* data, turboio_u64 len, const turboio_u32* round_keys,
                                               turboio_u32 rounds, turboio_u64 iv_hi, turboio_u64 iv_lo,
                                               turboio_u64 pos) {
    __shared__ turboio_u32 te[256];
    __shared__ turboio_u8 sbox[256];
    __shared__ turboio_u32 rk[60];
    for (turboio_u32 i = threadIdx.x; i < 256; i += blockDim.x) {
        turboio_u32 v = TURBOIO_TE0[i];
        te[i] = v;
        sbox[i] = (turboio_u8)(v >> 16);
    }
    const turboio_u32 nwords = 4 * (rounds + 1);
    for (turboio_u32 i = threadIdx.x; i < nwords && i < 60; i += blockDim.x) {
        rk[i] = round_keys[i];
    }
    __syncthreads();

    const turboio_u64 head = pos & 15;      // stream bytes of the first block before data[0]
    const turboio_u64 first = pos >> 4;     // counter offset of the first block
    const turboio_u64 nblocks = (head + len + 15) >> 4;
    const turboio_u64 stride = (turboio_u64)gridDim.x * blockDim.x;
    for (turboio_u64 b = (turboio_u64)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks; b += stride) {
        // The counter block: IV + first + b, 128-bit big-endian with carry.
        const turboio_u64 n = first + b;
        const turboio_u64 lo = iv_lo + n;
        const turboio_u64 hi = iv_hi + (lo < iv_lo ? 1 : 0);
        turboio_u32 s0 = (turboio_u32)(hi >> 32) ^ rk[0];
        turboio_u32 s1 = (turboio_u32)hi ^ rk[1];
        turboio_u32 s2 = (turboio_u32)(lo >> 32) ^ rk[2];
        turboio_u32 s3 = (turboio_u32)lo ^ rk[3];
        for (turboio_u32 r = 1; r < rounds; r++) {
            const turboio_u32* k = rk + 4 * r;
            turboio_u32 t0 = te[s0 >> 24] ^ TURBOIO_ROTR(te[(s1 >> 16) & 0xff], 8) ^
                             TURBOIO_ROTR(te[(s2 >> 8) & 0xff], 16) ^ TURBOIO_ROTR(te[s3 & 0xff], 24) ^ k[0];
            turboio_u32 t1 = te[s1 >> 24] ^ TURBOIO_ROTR(te[(s2 >> 16) & 0xff], 8) ^
                             TURBOIO_ROTR(te[(s3 >> 8) & 0xff], 16) ^ TURBOIO_ROTR(te[s0 & 0xff], 24) ^ k[1];
            turboio_u32 t2 = te[s2 >> 24] ^ TURBOIO_ROTR(te[(s3 >> 16) & 0xff], 8) ^
                             TURBOIO_ROTR(te[(s0 >> 8) & 0xff], 16) ^ TURBOIO_ROTR(te[s1 & 0xff], 24) ^ k[2];
            turboio_u32 t3 = te[s3 >> 24] ^ TURBOIO_ROTR(te[(s0 >> 16) & 0xff], 8) ^
                             TURBOIO_ROTR(te[(s1 >> 8) & 0xff], 16) ^ TURBOIO_ROTR(te[s2 & 0xff], 24) ^ k[3];
            s0 = t0;
            s1 = t1;
            s2 = t2;
            s3 = t3;
        }
        const turboio_u32* k = rk + 4 * rounds;
        turboio_u32 ks[4];
        ks[0] = ((turboio_u32)sbox[s0 >> 24] << 24) ^ ((turboio_u32)sbox[(s1 >> 16) & 0xff] << 16) ^
                ((turboio_u32)sbox[(s2 >> 8) & 0xff] << 8) ^ (turboio_u32)sbox[s3 & 0xff] ^ k[0];
        ks[1] = ((turboio_u32)sbox[s1 >> 24] << 24) ^ ((turboio_u32)sbox[(s2 >> 16) & 0xff] << 16) ^
                ((turboio_u32)sbox[(s3 >> 8) & 0xff] << 8) ^ (turboio_u32)sbox[s0 & 0xff] ^ k[1];
        ks[2] = ((turboio_u32)sbox[s2 >> 24] << 24) ^ ((turboio_u32)sbox[(s3 >> 16) & 0xff] << 16) ^
                ((turboio_u32)sbox[(s0 >> 8) & 0xff] << 8) ^ (turboio_u32)sbox[s1 & 0xff] ^ k[2];
        ks[3] = ((turboio_u32)sbox[s3 >> 24] << 24) ^ ((turboio_u32)sbox[(s0 >> 16) & 0xff] << 16) ^
                ((turboio_u32)sbox[(s1 >> 8) & 0xff] << 8) ^ (turboio_u32)sbox[s2 & 0xff] ^ k[3];

        // This block covers data[start, start + 16), clipped to [0, len).
        const turboio_i64 start = (turboio_i64)(b * 16) - (turboio_i64)head;
        if (start >= 0 && (turboio_u64)start + 16 <= len && (((turboio_u64)data + (turboio_u64)start) & 3) == 0) {
            turboio_u32* w = (turboio_u32*)(data + start);
            w[0] ^= turboio_bswap(ks[0]);
            w[1] ^= turboio_bswap(ks[1]);
            w[2] ^= turboio_bswap(ks[2]);
            w[3] ^= turboio_bswap(ks[3]);
        } else {
            for (int j = 0; j < 16; j++) {
                const turboio_i64 at = start + j;
                if (at >= 0 && (turboio_u64)at < len) {
                    data[at] ^= (turboio_u8)(ks[j >> 2] >> (24 - 8 * (j & 3)));
                }
            }
        }
    }
}

// turboio: element type conversion in device memory, bit-identical to torch's CPU `.to()` and to
// crates/format/src/cast.rs (which documents the rules: round to nearest even, F64 narrowed through
// F32, F8_E4M3 saturating at +-448, and torch's NaN bits for each pair).
//
// turboio_cast converts `n` elements at `src` (dtype `from`) into `dst` (dtype `to`). Dtype codes:
// 0 F64, 1 F32, 2 F16, 3 BF16, 4 F8_E4M3, 5 F8_E5M2. Elements are read and written byte by byte
// (little-endian), so any alignment works. One thread converts one element; a grid-stride loop
// lets any launch shape cover any count.
//
// Like aes_ctr.cu, this file is compiled twice: by NVRTC at run time, and as plain C++ by the test
// suite (crates/device/tests/cast_kernel.rs, with tests/aes_host/shim.h), which compares it with
// turboio_format::cast on every 8- and 16-bit pattern and random wider ones. Keep it to the common
// subset: no intrinsics, no headers.

#ifndef TURBOIO_AES_HOST
typedef unsigned char turboio_u8;
typedef unsigned int turboio_u32;
typedef unsigned long long turboio_u64;
typedef long long turboio_i64;
#endif

union turboio_f32bits {
    float f;
    turboio_u32 u;
};
union turboio_f64bits {
    double f;
    turboio_u64 u;
};

__device__ static float turboio_f32(turboio_u32 u) {
    turboio_f32bits b;
    b.u = u;
    return b.f;
}
__device__ static turboio_u32 turboio_f32_bits(float f) {
    turboio_f32bits b;
    b.f = f;
    return b.u;
}
__device__ static double turboio_f64(turboio_u64 u) {
    turboio_f64bits b;
    b.u = u;
    return b.f;
}
__device__ static turboio_u64 turboio_f64_bits(double f) {
    turboio_f64bits b;
    b.f = f;
    return b.u;
}

__device__ static int turboio_size(turboio_u32 code) {
    return code == 0 ? 8 : code == 1 ? 4 : code <= 3 ? 2 : 1;
}

__device__ static turboio_u64 turboio_load(const turboio_u8* p, int size) {
    turboio_u64 v = 0;
    for (int i = size - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

__device__ static void turboio_store(turboio_u8* p, int size, turboio_u64 v) {
    for (int i = 0; i < size; i++) p[i] = (turboio_u8)(v >> (8 * i));
}

__device__ static bool turboio_is_nan(turboio_u32 code, turboio_u64 b) {
    switch (code) {
        case 0: return (b & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull;
        case 1: return (b & 0x7FFFFFFFull) > 0x7F800000ull;
        case 2: return (b & 0x7FFF) > 0x7C00;
        case 3: return (b & 0x7FFF) > 0x7F80;
        case 4: return (b & 0x7F) == 0x7F;
        default: return (b & 0x7F) > 0x7C;
    }
}

// The bits torch gives for the NaN `b` of `from` converted to `to` (cast.rs: nan_bits).
__device__ static turboio_u64 turboio_nan_bits(turboio_u32 from, turboio_u32 to, turboio_u64 b) {
    bool neg = from == 0 ? (b >> 63) != 0 : from == 1 ? (b >> 31) != 0 : from <= 3 ? (b >> 15) != 0 : (b >> 7) != 0;
    if (to == 0) {
        turboio_u64 s = neg ? (1ull << 63) : 0;
        turboio_u64 payload = from == 1   ? (b & 0x7FFFFFull) << 29
                              : from == 2 ? (b & 0x3FFull) << 42
                              : from == 3 ? (b & 0x7Full) << 45
                              : from == 4 ? 0x7ull << 49
                              : from == 5 ? ((b << 8) & 0x3FFull) << 42
                                          : 0;
        return s | 0x7FF8000000000000ull | payload;
    }
    if (to == 1) {
        turboio_u64 s = neg ? (1ull << 31) : 0;
        if (from == 0) return s | 0x7FC00000ull | ((b & 0xFFFFFFFFFFFFFull) >> 29);
        if (from == 2) return s | 0x7FC00000ull | ((b & 0x3FFull) << 13);
        if (from == 3) return b << 16;
        if (from == 4) return s | 0x7FF00000ull;
        return s | 0x7FC00000ull | (((b << 8) & 0x3FFull) << 13);
    }
    if (to == 2) {
        turboio_u64 s = neg ? 0x8000 : 0;
        turboio_u64 payload = from == 0   ? (b & 0xFFFFFFFFFFFFFull) >> 42
                              : from == 1 ? (b & 0x7FFFFFull) >> 13
                              : from == 3 ? (b & 0x7Full) << 3
                              : from == 4 ? 0x380
                                          : (b << 8) & 0x3FF;
        return s | 0x7E00 | payload;
    }
    if (to == 3) return (from == 0 || from == 1) ? 0xFFFF : 0x7FC0;
    return neg ? 0xFF : 0x7F;
}

// A narrow format: exponent and mantissa bits, saturating (E4M3FN) or not.
struct turboio_narrow {
    int exp, man;
    bool saturate;
};

__device__ static int turboio_bias(turboio_narrow f) { return (1 << (f.exp - 1)) - 1; }
__device__ static turboio_u32 turboio_sign_bit(turboio_narrow f) { return 1u << (f.exp + f.man); }
__device__ static turboio_u32 turboio_inf(turboio_narrow f) { return ((1u << f.exp) - 1) << f.man; }
__device__ static turboio_u32 turboio_max_finite(turboio_narrow f) {
    return f.saturate ? (turboio_inf(f) | ((1u << f.man) - 2)) : turboio_inf(f) - 1;
}

__device__ static double turboio_pow2(int k) { return turboio_f64(((turboio_u64)(k + 1023)) << 52); }

// The exact value of non-NaN bits.
__device__ static double turboio_narrow_decode(turboio_narrow f, turboio_u32 bits) {
    bool neg = (bits & turboio_sign_bit(f)) != 0;
    turboio_u32 e = (bits >> f.man) & ((1u << f.exp) - 1);
    turboio_u32 m = bits & ((1u << f.man) - 1);
    double mag;
    if (!f.saturate && e == (1u << f.exp) - 1) {
        mag = turboio_f64(0x7FF0000000000000ull);  // infinity
    } else if (e == 0) {
        mag = (double)m * turboio_pow2(1 - turboio_bias(f) - f.man);
    } else {
        mag = (double)((1u << f.man) | m) * turboio_pow2((int)e - turboio_bias(f) - f.man);
    }
    return neg ? -mag : mag;
}

// `x` (not NaN) rounded to nearest even.
__device__ static turboio_u32 turboio_narrow_encode(turboio_narrow f, float x) {
    turboio_u32 bits = turboio_f32_bits(x);
    turboio_u32 sign = (bits >> 31) != 0 ? turboio_sign_bit(f) : 0;
    turboio_u32 abs = bits & 0x7FFFFFFFu;
    if (abs >= 0x7F800000u) return sign | (f.saturate ? turboio_max_finite(f) : turboio_inf(f));
    if (abs == 0) return sign;
    turboio_u64 sig;
    int exp;
    if ((abs >> 23) == 0) {
        sig = abs;
        exp = -149;
    } else {
        sig = (turboio_u64)(abs & 0x7FFFFFu) | (1ull << 23);
        exp = (int)(abs >> 23) - 150;
    }
    int top = 63;
    while (((sig >> top) & 1) == 0) top--;
    int emin = 1 - turboio_bias(f);
    int te = top + exp > emin ? top + exp : emin;
    int shift = te - f.man - exp;
    turboio_u64 n;
    if (shift == 0) {
        n = sig;
    } else if (shift >= 40) {
        n = 0;
    } else {
        turboio_u64 q = sig >> shift;
        turboio_u64 rem = sig & ((1ull << shift) - 1);
        turboio_u64 half = 1ull << (shift - 1);
        n = (rem > half || (rem == half && (q & 1) == 1)) ? q + 1 : q;
    }
    turboio_u64 enc = (((turboio_u64)(te + turboio_bias(f) - 1)) << f.man) + n;
    if (enc > turboio_max_finite(f)) return sign | (f.saturate ? turboio_max_finite(f) : turboio_inf(f));
    return sign | (turboio_u32)enc;
}

__device__ static turboio_narrow turboio_fmt(turboio_u32 code) {
    turboio_narrow f;
    f.exp = code == 2 ? 5 : code == 4 ? 4 : 5;
    f.man = code == 2 ? 10 : code == 4 ? 3 : 2;
    f.saturate = code == 4;
    return f;
}

// Non-NaN bits of a format narrower than F64, as the F32 value they are exactly.
__device__ static float turboio_decode32(turboio_u32 code, turboio_u64 b) {
    if (code == 1) return turboio_f32((turboio_u32)b);
    if (code == 3) return turboio_f32(((turboio_u32)b) << 16);
    if (code == 2) {
        turboio_u32 h = (turboio_u32)b;
        turboio_u32 sign = (h & 0x8000u) << 16;
        turboio_u32 e = (h >> 10) & 0x1F;
        turboio_u32 m = h & 0x3FF;
        if (e == 0) {
            float mag = (float)m * turboio_f32(0x33800000u);  // m * 2^-24, exact
            return turboio_f32(turboio_f32_bits(mag) | sign);
        }
        if (e == 0x1F) return turboio_f32(sign | 0x7F800000u | (m << 13));
        return turboio_f32(sign | ((e + 112) << 23) | (m << 13));
    }
    return (float)turboio_narrow_decode(turboio_fmt(code), (turboio_u32)b);
}

__device__ static double turboio_decode(turboio_u32 code, turboio_u64 b) {
    if (code == 0) return turboio_f64(b);
    return (double)turboio_decode32(code, b);
}

// An F32 value (not NaN) in format `code` (not F64).
__device__ static turboio_u64 turboio_encode32(turboio_u32 code, float x) {
    if (code == 1) return turboio_f32_bits(x);
    if (code == 3) {
        turboio_u32 u = turboio_f32_bits(x);
        return (turboio_u32)(u + 0x7FFFu + ((u >> 16) & 1)) >> 16;
    }
    if (code == 2) {
        turboio_u32 bits = turboio_f32_bits(x);
        turboio_u32 abs = bits & 0x7FFFFFFFu;
        turboio_u32 sign = (bits >> 16) & 0x8000u;
        if (abs >= 0x38800000u && abs < 0x47800000u) {
            turboio_u32 v = abs - 0x38000000u;
            turboio_u32 r = v + 0x0FFFu + ((v >> 13) & 1);
            return sign | (r >> 13);
        }
    }
    return turboio_narrow_encode(turboio_fmt(code), x);
}

__device__ static turboio_u64 turboio_encode(turboio_u32 code, double v) {
    if (code == 0) return turboio_f64_bits(v);
    return turboio_encode32(code, (float)v);  // torch narrows F64 through F32
}

extern "C" __global__ void turboio_cast(const turboio_u8* src, turboio_u8* dst, turboio_u64 n, turboio_u32 from,
                                        turboio_u32 to) {
    int fs = turboio_size(from), ts = turboio_size(to);
    turboio_u64 stride = (turboio_u64)blockDim.x * gridDim.x;
    for (turboio_u64 i = (turboio_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        turboio_u64 b = turboio_load(src + i * fs, fs);
        turboio_u64 out;
        if (from == to) {
            out = b;
        } else if (turboio_is_nan(from, b)) {
            out = turboio_nan_bits(from, to, b);
        } else if (fs <= 4 && ts <= 4) {
            out = turboio_encode32(to, turboio_decode32(from, b));
        } else {
            out = turboio_encode(to, turboio_decode(from, b));
        }
        turboio_store(dst + i * ts, ts, out);
    }
}

// GGUF (ggml) block formats kept quantized: the CPU kernels behind jaxkv.kernels.quantized.
//
//   JaxkvQuantMatmul      out[n, r] = sum_c x[n, c] * w[layer, r, c]   (decode: a few activation rows)
//   JaxkvQuantDequantize  out[r, c] = w[layer, r, c]                  (float32, bit-exact against gguf-py)
//
// Operands: `blocks` uint8 [*stack, rows, row_bytes] (a GGUF tensor's raw rows, stacked or not: the
// stack is flattened and `layer` picks one matrix of it in place), `layer` int32 scalar, `x` float32
// [..., columns]. Attributes: `columns` (int64, values a row) and `formats` (int32 array): one ggml
// type number (GGMLQuantizationType) for the whole stack, or one per layer of a mixed stack (each
// layer's rows padded to the widest layer's bytes: Gemma 3's Q4_K_M mixes Q4_K and Q6_K layers):
//
//   q4_0 = 2, q4_1 = 3, q5_0 = 6, q8_0 = 8, q4_k = 12, q6_k = 14
//
// A weight value is computed exactly as gguf-py's numpy dequantization computes it (float32, each
// product and sum rounded apart: this file is built with -ffp-contract=off), so the dequantize
// kernel is bit-exact and the matmul multiplies the very float32 weights of the dequantized model
// (float32 FMA accumulation in per-lane partial sums: within float32 rounding of x @ w.T).
//
// SIMD (AVX-512, else AVX2 + FMA + F16C: the building machine's, -march=native): 32 values of a
// block are decoded into registers (the 4-bit formats on AVX-512 by a lookup in a table of the
// block's 16 values) and FMA'd with every activation row of a tile, so each block is read from
// memory once per call. Without them, a scalar decoder fills a small float buffer.
#include <cstdint>
#include <cstring>
#include <string>

#include "parallel.h"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define JAXKV_QUANT_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXKV_QUANT_SIMD 256
#endif

namespace jaxkv {
namespace quant {
namespace {

namespace ffi = xla::ffi;

// ---------------------------------------------------------------------------------------------
// Scalars.

inline float HalfToFloat(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int shifts = 0;
      while (!(mantissa & 0x400u)) {
        mantissa <<= 1;
        ++shifts;
      }
      bits = sign | static_cast<uint32_t>(127 - 14 - shifts) << 23 | (mantissa & 0x3ffu) << 13;
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | mantissa << 13;
  } else {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return HalfToFloat(h);
}

inline uint32_t U32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// q4_k's eight 6-bit scales and mins (gguf-py's Q4_K.get_scale_min) from its 12 scale bytes s.
inline void ScaleMinK4(const uint8_t* s, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The same for all eight at once, a byte each (scales, mins).
inline void ScalesMinsK4(const uint8_t* s, uint64_t* scales, uint64_t* mins) {
  const uint32_t s0 = U32(s), s1 = U32(s + 4), s2 = U32(s + 8);
  *scales = (s0 & 0x3F3F3F3Fu) | uint64_t{(s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u)} << 32;
  *mins = (s1 & 0x3F3F3F3Fu) | uint64_t{((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u)} << 32;
}

// ---------------------------------------------------------------------------------------------
// The vector of the SIMD path: Vec holds kLanes floats, kVecs of them 32 values.

#if JAXKV_QUANT_SIMD == 512
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec VZero() { return _mm512_setzero_ps(); }
inline Vec VLoad(const float* p) { return _mm512_loadu_ps(p); }
inline void VStore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec VFma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec VAdd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float VSum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif JAXKV_QUANT_SIMD == 256
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec VZero() { return _mm256_setzero_ps(); }
inline Vec VLoad(const float* p) { return _mm256_loadu_ps(p); }
inline void VStore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec VFma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec VAdd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float VSum(Vec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif
#ifdef JAXKV_QUANT_SIMD
constexpr int kVecs = 32 / kLanes;
inline __m128i Load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i Load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// 16 bytes' low (shift 0) or high (shift 4) nibbles; the same for 32.
inline __m128i Nibbles(__m128i v, int shift) {
  return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(0x0F));
}
inline __m256i Nibbles(__m256i v, int shift) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(0x0F));
}
#endif

#if JAXKV_QUANT_SIMD == 512
inline __m512 I8ToPs(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
inline __m512 Iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
// 16 bytes as 16 dwords: each byte's low nibble indexes a 16-entry table with vpermps (which reads
// the low 4 bits of each index), its high nibble after a shift by 4.
inline __m512i Bytes(const uint8_t* p) { return _mm512_cvtepu8_epi32(Load16(p)); }
inline __m512 LowNibbles(__m512i bytes, __m512 table) { return _mm512_permutexvar_ps(bytes, table); }
inline __m512 HighNibbles(__m512i bytes, __m512 table) {
  return _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
#elif JAXKV_QUANT_SIMD == 256
// Bytes 8k .. 8k+7 of v as 8 float32 (unsigned, signed).
inline __m128i Eighth(__m128i v, int k) { return k ? _mm_srli_si128(v, 8) : v; }
inline __m256 U8ToPs(__m128i v, int k) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(Eighth(v, k))); }
inline __m256 I8ToPs(__m128i v, int k) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(Eighth(v, k))); }
inline __m128i Half128(__m256i v, int h) { return h ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v); }
#endif

// ---------------------------------------------------------------------------------------------
// The formats. Each: kType (ggml's number), kValues per block, kBytes per block, kChunks = kValues / 32;
//   Scalar(block, out[kValues])           the block's float32 values (gguf-py's expression order)
//   kScaleDword, kScaleHigh               the block's float16 scale d is the low (high) half of the
//                                         dword at byte kScaleDword, a second one (q4_1's m, q4_k's
//                                         dmin) its high half
//   Prepare(block, d, m) -> Scales, Chunk(scales, block, j, w[kVecs])
//                                         (SIMD) values 32j .. 32j+31 of the block
// The 4-bit formats on AVX-512 decode through a table of the block's 16 possible values computed
// with gguf-py's expression (so each looked-up value is the very float32 gguf-py computes).

struct Q8_0 {
  static constexpr int kType = 8, kValues = 32, kBytes = 34, kChunks = 1;
  static constexpr int kScaleDword = 0, kScaleHigh = 0;
  static void Scalar(const uint8_t* __restrict b, float* __restrict out) {
    const float d = Half(b);
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
  }
#if JAXKV_QUANT_SIMD == 512
  struct Scales {
    __m512 d;
  };
  static Scales Prepare(const uint8_t*, float d, float) { return {_mm512_set1_ps(d)}; }
  static void Chunk(const Scales& s, const uint8_t* b, int, Vec* w) {
    w[0] = _mm512_mul_ps(I8ToPs(Load16(b + 2)), s.d);
    w[1] = _mm512_mul_ps(I8ToPs(Load16(b + 18)), s.d);
  }
#elif JAXKV_QUANT_SIMD == 256
  struct Scales {
    __m256 d;
  };
  static Scales Prepare(const uint8_t*, float d, float) { return {_mm256_set1_ps(d)}; }
  static void Chunk(const Scales& s, const uint8_t* b, int, Vec* w) {
    const __m128i q0 = Load16(b + 2), q1 = Load16(b + 18);
    for (int k = 0; k < 4; ++k) w[k] = _mm256_mul_ps(I8ToPs(k < 2 ? q0 : q1, k & 1), s.d);
  }
#endif
};

struct Q4_0 {
  static constexpr int kType = 2, kValues = 32, kBytes = 18, kChunks = 1;
  static constexpr int kScaleDword = 0, kScaleHigh = 0;
  static void Scalar(const uint8_t* __restrict b, float* __restrict out) {
    const float d = Half(b);
    for (int i = 0; i < 16; ++i) out[i] = d * static_cast<float>((b[2 + i] & 0x0F) - 8);
    for (int i = 0; i < 16; ++i) out[i + 16] = d * static_cast<float>((b[2 + i] >> 4) - 8);
  }
#if JAXKV_QUANT_SIMD == 512
  struct Scales {
    __m512 table;  // d * (q - 8)
  };
  static Scales Prepare(const uint8_t*, float d, float) {
    return {_mm512_mul_ps(_mm512_set1_ps(d), _mm512_sub_ps(Iota(), _mm512_set1_ps(8.0f)))};
  }
  static void Chunk(const Scales& s, const uint8_t* b, int, Vec* w) {
    const __m512i q = Bytes(b + 2);
    w[0] = LowNibbles(q, s.table);
    w[1] = HighNibbles(q, s.table);
  }
#elif JAXKV_QUANT_SIMD == 256
  struct Scales {
    __m256 d;
  };
  static Scales Prepare(const uint8_t*, float d, float) { return {_mm256_set1_ps(d)}; }
  static void Chunk(const Scales& s, const uint8_t* b, int, Vec* w) {
    const __m128i q = Load16(b + 2);
    const __m256 eight = _mm256_set1_ps(8.0f);  // q - 8 is exact in float32
    for (int k = 0; k < 4; ++k) w[k] = _mm256_mul_ps(s.d, _mm256_sub_ps(U8ToPs(Nibbles(q, 4 * (k / 2)), k & 1), eight));
  }
#endif
};

struct Q4_1 {
  static constexpr int kType = 3, kValues = 32, kBytes = 20, kChunks = 1;
  static constexpr int kScaleDword = 0, kScaleHigh = 0;
  static void Scalar(const uint8_t* __restrict b, float* __restrict out) {
    const float d = Half(b), m = Half(b + 2);
    for (int i = 0; i < 16; ++i) out[i] = d * static_cast<float>(b[4 + i] & 0x0F) + m;
    for (int i = 0; i < 16; ++i) out[i + 16] = d * static_cast<float>(b[4 + i] >> 4) + m;
  }
#if JAXKV_QUANT_SIMD == 512
  struct Scales {
    __m512 table;  // d * q + m
  };
  static Scales Prepare(const uint8_t*, float d, float m) {
    return {_mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), Iota()), _mm512_set1_ps(m))};
  }
  static void Chunk(const Scales& s, const uint8_t* b, int, Vec* w) {
    const __m512i q = Bytes(b + 4);
    w[0] = LowNibbles(q, s.table);
    w[1] = HighNibbles(q, s.table);
  }
#elif JAXKV_QUANT_SIMD == 256
  struct Scales {
    __m256 d, m;
  };
  static Scales Prepare(const uint8_t*, float d, float m) { return {_mm256_set1_ps(d), _mm256_set1_ps(m)}; }
  static void Chunk(const Scales& s, const uint8_t* b, int, Vec* w) {
    const __m128i q = Load16(b + 4);
    for (int k = 0; k < 4; ++k) w[k] = _mm256_add_ps(_mm256_mul_ps(s.d, U8ToPs(Nibbles(q, 4 * (k / 2)), k & 1)), s.m);
  }
#endif
};

struct Q5_0 {
  static constexpr int kType = 6, kValues = 32, kBytes = 22, kChunks = 1;
  static constexpr int kScaleDword = 0, kScaleHigh = 0;
  static void Scalar(const uint8_t* __restrict b, float* __restrict out) {
    const float d = Half(b);
    const uint32_t qh = U32(b + 2);
    for (int i = 0; i < 16; ++i) {
      const int lo = (b[6 + i] & 0x0F) | static_cast<int>((qh >> i) & 1u) << 4;
      const int hi = (b[6 + i] >> 4) | static_cast<int>((qh >> (i + 16)) & 1u) << 4;
      out[i] = d * static_cast<float>(lo - 16);
      out[i + 16] = d * static_cast<float>(hi - 16);
    }
  }
#if JAXKV_QUANT_SIMD == 512
  struct Scales {
    __m512 low, high;  // d * (q - 16) for q < 16 and q >= 16 (the fifth bit, one bit of qh a value)
  };
  static Scales Prepare(const uint8_t*, float scale, float) {
    const __m512 d = _mm512_set1_ps(scale);
    return {_mm512_mul_ps(d, _mm512_sub_ps(Iota(), _mm512_set1_ps(16.0f))), _mm512_mul_ps(d, Iota())};
  }
  static void Chunk(const Scales& s, const uint8_t* b, int, Vec* w) {
    const uint32_t qh = U32(b + 2);
    const __m512i q = Bytes(b + 6), q_high = _mm512_srli_epi32(q, 4);
    w[0] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q, s.low), static_cast<__mmask16>(qh), q, s.high);
    w[1] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q_high, s.low), static_cast<__mmask16>(qh >> 16),
                                      q_high, s.high);
  }
#elif JAXKV_QUANT_SIMD == 256
  struct Scales {
    __m256 d;
  };
  static Scales Prepare(const uint8_t*, float d, float) { return {_mm256_set1_ps(d)}; }
  static void Chunk(const Scales& s, const uint8_t* b, int, Vec* w) {
    const __m256i qh = _mm256_set1_epi32(static_cast<int>(U32(b + 2)));
    const __m128i q = Load16(b + 6);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int k = 0; k < 4; ++k) {
      const __m256i low = _mm256_cvtepu8_epi32(Eighth(Nibbles(q, 4 * (k / 2)), k & 1));
      const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(qh, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * k))),
                                           _mm256_set1_epi32(1));
      const __m256i code = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(bit, 4)), _mm256_set1_epi32(16));
      w[k] = _mm256_mul_ps(s.d, _mm256_cvtepi32_ps(code));
    }
  }
#endif
};

struct Q4_K {
  static constexpr int kType = 12, kValues = 256, kBytes = 144, kChunks = 8;
  static constexpr int kScaleDword = 0, kScaleHigh = 0;
  // d f16, dmin f16, scales[12], qs[128]: sub-block j (32 values) is nibble j % 2 of qs[32 (j / 2) ..],
  // times d * scale_j, minus dmin * min_j.
  static void Scalar(const uint8_t* __restrict b, float* __restrict out) {
    const float d = Half(b), dmin = Half(b + 2);
    const uint8_t* qs = b + 16;
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      ScaleMinK4(b + 4, j, &sc, &m);
      const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
      const int shift = 4 * (j & 1);
      for (int l = 0; l < 32; ++l) {
        out[32 * j + l] = ds * static_cast<float>((qs[32 * (j / 2) + l] >> shift) & 0x0F) - dm;
      }
    }
  }
#ifdef JAXKV_QUANT_SIMD
  struct Scales {
    alignas(32) float ds[8];
    alignas(32) float dm[8];
  };
  static Scales Prepare(const uint8_t* b, float d, float dmin) {
    uint64_t sc, mn;
    ScalesMinsK4(b + 4, &sc, &mn);
    const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
    const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn))));
    Scales s;
    _mm256_store_ps(s.ds, _mm256_mul_ps(_mm256_set1_ps(d), scf));
    _mm256_store_ps(s.dm, _mm256_mul_ps(_mm256_set1_ps(dmin), mnf));
    return s;
  }
#endif
#if JAXKV_QUANT_SIMD == 512
  static void Chunk(const Scales& s, const uint8_t* b, int j, Vec* w) {
    const uint8_t* q = b + 16 + 32 * (j / 2);
    const __m512 table = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s.ds[j]), Iota()), _mm512_set1_ps(s.dm[j]));
    if (j & 1) {
      w[0] = HighNibbles(Bytes(q), table);
      w[1] = HighNibbles(Bytes(q + 16), table);
    } else {
      w[0] = LowNibbles(Bytes(q), table);
      w[1] = LowNibbles(Bytes(q + 16), table);
    }
  }
#elif JAXKV_QUANT_SIMD == 256
  static void Chunk(const Scales& s, const uint8_t* b, int j, Vec* w) {
    const __m256i q = Nibbles(Load32(b + 16 + 32 * (j / 2)), 4 * (j & 1));
    const __m256 ds = _mm256_set1_ps(s.ds[j]), dm = _mm256_set1_ps(s.dm[j]);
    for (int k = 0; k < 4; ++k) w[k] = _mm256_sub_ps(_mm256_mul_ps(ds, U8ToPs(Half128(q, k / 2), k & 1)), dm);
  }
#endif
};

struct Q6_K {
  static constexpr int kType = 14, kValues = 256, kBytes = 210, kChunks = 8;
  static constexpr int kScaleDword = 206, kScaleHigh = 1;
  // ql[128], qh[64], scales int8[16], d f16. Value e (half h = e / 128, g = (e % 128) / 32,
  // l = e % 32): low 4 bits from ql[64 h + 32 (g % 2) + l] >> 4 (g / 2), high 2 from qh[32 h + l] >> 2 g,
  // minus 32, times d * scales[e / 16].
  static void Scalar(const uint8_t* __restrict b, float* __restrict out) {
    const float d = Half(b + 208);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      for (int g = 0; g < 4; ++g) {
        for (int half = 0; half < 2; ++half) {  // 16 values of one scale
          const int e0 = 128 * h + 32 * g + 16 * half;
          const float ds = d * static_cast<float>(static_cast<int8_t>(b[192 + e0 / 16]));
          for (int l = 16 * half; l < 16 * half + 16; ++l) {
            const int low = (ql[32 * (g % 2) + l] >> (4 * (g / 2))) & 0x0F;
            const int high = (qh[l] >> (2 * g)) & 0x03;
            out[128 * h + 32 * g + l] = ds * static_cast<float>((low | high << 4) - 32);
          }
        }
      }
    }
  }
#ifdef JAXKV_QUANT_SIMD
  struct Scales {
    alignas(64) float ds[16];
  };
  static Scales Prepare(const uint8_t* b, float d, float) {
    Scales s;
    const __m128i scales = Load16(b + 192);
    const __m256 dd = _mm256_set1_ps(d);
    _mm256_store_ps(s.ds, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales))));
    _mm256_store_ps(s.ds + 8, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8)))));
    return s;
  }
  // The 32 codes of sub-block j minus 32, as int8 (-32 .. 31).
  static __m256i Codes(const uint8_t* b, int j) {
    const int h = j / 4, g = j % 4;
    const __m256i low = Nibbles(Load32(b + 64 * h + 32 * (g % 2)), 4 * (g / 2));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(Load32(b + 128 + 32 * h), _mm_cvtsi32_si128(2 * g)),
                                          _mm256_set1_epi8(0x03));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
  }
#endif
#if JAXKV_QUANT_SIMD == 512
  static void Chunk(const Scales& s, const uint8_t* b, int j, Vec* w) {
    const __m256i q = Codes(b, j);
    w[0] = _mm512_mul_ps(_mm512_set1_ps(s.ds[2 * j]), I8ToPs(_mm256_castsi256_si128(q)));
    w[1] = _mm512_mul_ps(_mm512_set1_ps(s.ds[2 * j + 1]), I8ToPs(_mm256_extracti128_si256(q, 1)));
  }
#elif JAXKV_QUANT_SIMD == 256
  static void Chunk(const Scales& s, const uint8_t* b, int j, Vec* w) {
    const __m256i q = Codes(b, j);
    for (int k = 0; k < 4; ++k) w[k] = _mm256_mul_ps(_mm256_set1_ps(s.ds[2 * j + k / 2]), I8ToPs(Half128(q, k / 2), k & 1));
  }
#endif
};

// Calls fn(F{}) for the format with ggml type number `type`.
template <typename Fn>
ffi::Error WithFormat(int32_t type, const Fn& fn) {
  switch (type) {
    case Q8_0::kType:
      return fn(Q8_0{});
    case Q4_0::kType:
      return fn(Q4_0{});
    case Q4_1::kType:
      return fn(Q4_1{});
    case Q5_0::kType:
      return fn(Q5_0{});
    case Q4_K::kType:
      return fn(Q4_K{});
    case Q6_K::kType:
      return fn(Q6_K{});
    default:
      return ffi::Error::InvalidArgument("jaxkv quant: unknown format (ggml type) " + std::to_string(type));
  }
}

#ifdef JAXKV_QUANT_SIMD
// The float16 scales of blocks b0 .. b0 + count - 1 (count <= 16) of a row: d[i] (and m[i], the
// second scale of q4_1 / q4_k) of block b0 + i; on AVX-512 gathered and converted 16 at a time.
template <class F>
inline void BlockScales(const uint8_t* row, int64_t b0, int64_t count, float* d, float* m) {
#if JAXKV_QUANT_SIMD == 512
  const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(F::kBytes));
  const __mmask16 valid = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  const __m512i dwords = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets,
                                                     row + b0 * F::kBytes + F::kScaleDword, 1);
  const __m512i high = _mm512_srli_epi32(dwords, 16);
  _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(F::kScaleHigh ? high : dwords)));
  _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high)));
#else
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* scales = row + (b0 + i) * F::kBytes + F::kScaleDword;
    d[i] = Half(scales + 2 * F::kScaleHigh);
    m[i] = Half(scales + 2);
  }
#endif
}
#endif

// ---------------------------------------------------------------------------------------------
// Dequantization of rows [r0, r1) of one matrix.

template <class F>
void DequantizeRows(const uint8_t* w, int64_t stride, int64_t columns, int64_t r0, int64_t r1, float* out) {
  const int64_t blocks = columns / F::kValues;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * stride;
    float* o = out + r * columns;
#ifdef JAXKV_QUANT_SIMD
    for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
      const int64_t count = std::min<int64_t>(16, blocks - b0);
      alignas(64) float d[16], m[16];
      BlockScales<F>(row, b0, count, d, m);
      for (int64_t i = 0; i < count; ++i) {
        const uint8_t* block = row + (b0 + i) * F::kBytes;
        float* ob = o + (b0 + i) * F::kValues;
        const typename F::Scales s = F::Prepare(block, d[i], m[i]);
        for (int j = 0; j < F::kChunks; ++j) {
          Vec v[kVecs];
          F::Chunk(s, block, j, v);
          for (int k = 0; k < kVecs; ++k) VStore(ob + 32 * j + kLanes * k, v[k]);
        }
      }
    }
#else
    for (int64_t b = 0; b < blocks; ++b) F::Scalar(row + b * F::kBytes, o + b * F::kValues);
#endif
  }
}

// ---------------------------------------------------------------------------------------------
// The matmul of rows [r0, r1): out[n, r] = x[n, :] . w[r, :] for every n < N.

constexpr int kTileN = 8;  // activation rows per register tile

#ifdef JAXKV_QUANT_SIMD
// R weight rows (from w, `stride` bytes apart: a row is its first columns / kValues blocks) against
// NT activation rows (x, row stride `columns`), A accumulators per pair: every 32 values of the R
// rows are decoded once into registers and FMA'd into the R x NT x A accumulators (A > 1:
// independent FMA chains when R x NT is small).
template <class F, int R, int NT, int A>
inline void Tile(const uint8_t* w, int64_t stride, const float* x, int64_t columns, float* out,
                 int64_t out_stride) {
  static_assert(A == 1 || A == kVecs, "A: one accumulator per pair, or one per vector of 32 values");
  const int64_t blocks = columns / F::kValues;
  Vec acc[R][NT][A];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NT; ++n)
      for (int a = 0; a < A; ++a) acc[r][n][a] = VZero();
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int64_t count = std::min<int64_t>(16, blocks - b0);
    alignas(64) float d[R][16], m[R][16];
    for (int r = 0; r < R; ++r) BlockScales<F>(w + r * stride, b0, count, d[r], m[r]);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t b = b0 + i;
      const uint8_t* block[R];
      typename F::Scales s[R];
      for (int r = 0; r < R; ++r) {
        block[r] = w + r * stride + b * F::kBytes;
        s[r] = F::Prepare(block[r], d[r][i], m[r][i]);
      }
      for (int j = 0; j < F::kChunks; ++j) {
        Vec v[R][kVecs];
        for (int r = 0; r < R; ++r) F::Chunk(s[r], block[r], j, v[r]);
        const float* xc = x + b * F::kValues + 32 * j;
        for (int n = 0; n < NT; ++n) {
          for (int k = 0; k < kVecs; ++k) {
            const Vec xv = VLoad(xc + n * columns + kLanes * k);
            for (int r = 0; r < R; ++r) acc[r][n][A == 1 ? 0 : k] = VFma(v[r][k], xv, acc[r][n][A == 1 ? 0 : k]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NT; ++n) {
      Vec sum = acc[r][n][0];
      for (int a = 1; a < A; ++a) sum = VAdd(sum, acc[r][n][a]);
      out[n * out_stride + r] = VSum(sum);
    }
  }
}

// Rows [r0, r1) against NT activation rows, R rows at a time, then the rest one by one. Enough
// independent accumulator chains to hide the FMA latency, few enough to stay in registers (32
// zmm on AVX-512, 16 ymm on AVX2).
template <class F, int NT>
void TileRows(const uint8_t* w, int64_t stride, int64_t r0, int64_t r1, const float* x, int64_t columns,
              float* out, int64_t out_stride) {
#if JAXKV_QUANT_SIMD == 512
  constexpr int R = NT == 1 ? 4 : 2, A = 1;
#else
  constexpr int R = NT == 1 ? 2 : 1, A = NT <= 2 ? kVecs : 1;
#endif
  int64_t r = r0;
  for (; r + R <= r1; r += R) Tile<F, R, NT, A>(w + r * stride, stride, x, columns, out + r, out_stride);
  for (; r < r1; ++r) Tile<F, 1, NT, A>(w + r * stride, stride, x, columns, out + r, out_stride);
}

template <class F>
void MatmulRows(const uint8_t* w, int64_t stride, int64_t r0, int64_t r1, const float* x, int64_t n_rows,
                int64_t columns, float* out, int64_t out_stride) {
  // Each group of rows is read once per tile of kTileN activation rows: from L1 after the first.
  constexpr int64_t kGroup = 8;
  for (int64_t g0 = r0; g0 < r1; g0 += kGroup) {
    const int64_t g1 = std::min(r1, g0 + kGroup);
    for (int64_t n0 = 0; n0 < n_rows; n0 += kTileN) {
      const float* xt = x + n0 * columns;
      float* ot = out + n0 * out_stride;
      switch (std::min<int64_t>(kTileN, n_rows - n0)) {
        case 1: TileRows<F, 1>(w, stride, g0, g1, xt, columns, ot, out_stride); break;
        case 2: TileRows<F, 2>(w, stride, g0, g1, xt, columns, ot, out_stride); break;
        case 3: TileRows<F, 3>(w, stride, g0, g1, xt, columns, ot, out_stride); break;
        case 4: TileRows<F, 4>(w, stride, g0, g1, xt, columns, ot, out_stride); break;
        case 5: TileRows<F, 5>(w, stride, g0, g1, xt, columns, ot, out_stride); break;
        case 6: TileRows<F, 6>(w, stride, g0, g1, xt, columns, ot, out_stride); break;
        case 7: TileRows<F, 7>(w, stride, g0, g1, xt, columns, ot, out_stride); break;
        default: TileRows<F, 8>(w, stride, g0, g1, xt, columns, ot, out_stride); break;
      }
    }
  }
}
#else
template <class F>
void MatmulRows(const uint8_t* w, int64_t stride, int64_t r0, int64_t r1, const float* x, int64_t n_rows,
                int64_t columns, float* out, int64_t out_stride) {
  const int64_t blocks = columns / F::kValues;
  alignas(64) float values[F::kValues];
  alignas(64) float acc[kTileN][16];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * stride;
    for (int64_t n0 = 0; n0 < n_rows; n0 += kTileN) {
      const int64_t nt = std::min<int64_t>(kTileN, n_rows - n0);
      for (int64_t n = 0; n < nt; ++n)
        for (int l = 0; l < 16; ++l) acc[n][l] = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        F::Scalar(row + b * F::kBytes, values);
        for (int64_t n = 0; n < nt; ++n) {
          const float* xb = x + (n0 + n) * columns + b * F::kValues;
          for (int i = 0; i < F::kValues; i += 16)
            for (int l = 0; l < 16; ++l) acc[n][l] += values[i + l] * xb[i + l];
        }
      }
      for (int64_t n = 0; n < nt; ++n) {
        float sum = 0.0f;
        for (int l = 0; l < 16; ++l) sum += acc[n][l];
        out[(n0 + n) * out_stride + r] = sum;
      }
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// The handlers.

struct Matrix {
  const uint8_t* data;  // the layer's first row
  int64_t rows;
  int64_t stride;   // bytes from a row to the next: the row's blocks, then padding in a mixed stack
  int64_t columns;  // values a row
  int32_t type;     // the layer's format (ggml type number)
};

// Matrix `layer` of `blocks` [*stack, rows, stride] of `columns` values a row, in format
// formats[0] (one format) or formats[layer] (a stack of mixed formats, one per layer of the
// flattened stack, each layer's rows padded to the widest's bytes), or an error.
ffi::Error Locate(const ffi::Buffer<ffi::U8>& blocks, const ffi::Buffer<ffi::S32>& layer,
                  ffi::Span<const int32_t> formats, int64_t columns, Matrix* m) {
  const auto dims = blocks.dimensions();
  if (dims.size() < 2) {
    return ffi::Error::InvalidArgument("jaxkv quant: blocks must be [*stack, rows, row_bytes], got rank " +
                                       std::to_string(dims.size()));
  }
  const int64_t rows = dims[dims.size() - 2], stride = dims[dims.size() - 1];
  int64_t stack = 1;
  for (size_t i = 0; i + 2 < dims.size(); ++i) stack *= dims[i];
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("jaxkv quant: layer must be a scalar");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= stack) {
    return ffi::Error::InvalidArgument("jaxkv quant: layer " + std::to_string(index) + " out of range [0, " +
                                       std::to_string(stack) + ")");
  }
  if (formats.size() != 1 && static_cast<int64_t>(formats.size()) != stack) {
    return ffi::Error::InvalidArgument("jaxkv quant: " + std::to_string(formats.size()) + " formats for a stack of " +
                                       std::to_string(stack));
  }
  m->type = formats[formats.size() == 1 ? 0 : index];
  const ffi::Error checked = WithFormat(m->type, [&](auto f) -> ffi::Error {
    using F = decltype(f);
    if (columns <= 0 || columns % F::kValues != 0 || columns / F::kValues * F::kBytes > stride) {
      return ffi::Error::InvalidArgument("jaxkv quant: rows of " + std::to_string(columns) + " values in format " +
                                         std::to_string(F::kType) + " do not fit blocks' rows of " +
                                         std::to_string(stride) + " bytes");
    }
    return ffi::Error::Success();
  });
  if (checked.failure()) return checked;
  m->data = blocks.typed_data() + index * rows * stride;
  m->rows = rows;
  m->stride = stride;
  m->columns = columns;
  return ffi::Error::Success();
}

// Rows per work chunk: about 32 KiB of blocks, and a whole number of 8-row groups.
int64_t Grain(int64_t stride) { return std::max<int64_t>(8, (32768 / std::max<int64_t>(stride, 1)) & ~7); }

// The rows of one call split over XLA's intra-op pool (built with -DJAXKV_QUANT_SERIAL: on the
// calling thread alone, to measure the kernels' single-thread speed).
template <typename Fn>
void RunParallel(ffi::ThreadPool& pool, int64_t n, int64_t grain, const Fn& fn) {
#ifdef JAXKV_QUANT_SERIAL
  if (n > 0) fn(int64_t{0}, n);
#else
  ParallelFor(pool, n, grain, fn);
#endif
}

ffi::Error QuantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> blocks, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out, ffi::Span<const int32_t> formats,
                       int64_t columns) {
  Matrix m;
  if (ffi::Error e = Locate(blocks, layer, formats, columns, &m); e.failure()) return e;
  const auto xdims = x.dimensions();
  if (xdims.size() < 1 || xdims[xdims.size() - 1] != m.columns) {
    return ffi::Error::InvalidArgument("jaxkv quant: x must be [..., " + std::to_string(m.columns) + "]");
  }
  const int64_t n_rows = static_cast<int64_t>(x.element_count()) / m.columns;
  if (static_cast<int64_t>(out->element_count()) != n_rows * m.rows) {
    return ffi::Error::InvalidArgument("jaxkv quant: out must be [..., " + std::to_string(m.rows) + "]");
  }
  const float* xd = x.typed_data();
  float* od = out->typed_data();
  return WithFormat(m.type, [&](auto f) -> ffi::Error {
    using F = decltype(f);
    RunParallel(pool, m.rows, Grain(m.stride), [&](int64_t r0, int64_t r1) {
      MatmulRows<F>(m.data, m.stride, r0, r1, xd, n_rows, m.columns, od, m.rows);
    });
    return ffi::Error::Success();
  });
}

ffi::Error QuantDequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> blocks, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> out, ffi::Span<const int32_t> formats, int64_t columns) {
  Matrix m;
  if (ffi::Error e = Locate(blocks, layer, formats, columns, &m); e.failure()) return e;
  if (static_cast<int64_t>(out->element_count()) != m.rows * m.columns) {
    return ffi::Error::InvalidArgument("jaxkv quant: out must be [" + std::to_string(m.rows) + ", " +
                                       std::to_string(m.columns) + "]");
  }
  float* od = out->typed_data();
  return WithFormat(m.type, [&](auto f) -> ffi::Error {
    using F = decltype(f);
    RunParallel(pool, m.rows, Grain(m.stride), [&](int64_t r0, int64_t r1) {
      DequantizeRows<F>(m.data, m.stride, m.columns, r0, r1, od);
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace quant
}  // namespace jaxkv

// Attributes: formats (int32 array: one ggml type, or one per layer of a mixed stack), columns (int64).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvQuantMatmul, jaxkv::quant::QuantMatmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // blocks [*stack, rows, row_bytes]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer []
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x [..., columns]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // out [..., rows]
                                  .Attr<xla::ffi::Span<const int32_t>>("formats")
                                  .Attr<int64_t>("columns"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvQuantDequantize, jaxkv::quant::QuantDequantize,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // blocks [*stack, rows, row_bytes]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer []
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // out [rows, columns]
                                  .Attr<xla::ffi::Span<const int32_t>>("formats")
                                  .Attr<int64_t>("columns"));

// jaxkv_JaxkvPagedAttention: attention of query blocks over jaxkv's paged K/V stacks, read in place
// (jaxkv/kernels/cpu_paged.py is its Python side; docs/kernels.md, "CPU kernel").
//
// Operands (shapes as jaxkv stores them, nothing copied out of the pools):
//   queries    [Z, Q, H_q, D] float32: Z query blocks of Q tokens (a decode token: Q = 1)
//   positions  [Z, Q] int32: each query's position (-1: padding, which reads nothing)
//   tables     [Z, W] int32: each block's row's block table (entry 0, the null page, is never read)
//   index      [] int32: the layer of the stacks to read
//   keys, values  the stacks: [L, P, page, H_kv, Dc] ('tokens' layout) or [L, P, H_kv, page, Dc]
//              ('heads'), float32 / bfloat16 / float16 values, or codes: float8 (e4m3fn, e5m2)
//              or uint8 int codes of `bits` bits packed as jaxkv.quantization packs them
//   key_scales, value_scales, key_zeros, value_zeros  float16 [L, P, ·, ·, D / group] per token and
//              head (codes: value = code * scale (+ zero)); [0] when absent
// Attributes: scale (multiplies q.k), softcap (cap * tanh(logit / cap); 0: none), window (a query at
// q reads positions > q - window; 0: none), heads_layout, bits (int codes; 0: none), min_partition.
// Result: [Z, Q, H_q, D] float32.
//
// One task per (block, K/V head, partition): its G = H_q / H_kv query heads (times Q tokens) read each
// visible K and V row once, page by page, with an online softmax in float32. A block's slots are split
// into partitions of at least min_partition tokens only when blocks * heads leave threads idle; the
// partitions' (max, total, weighted values) are merged after. Vectorised with AVX-512 or AVX2 + FMA
// intrinsics (whichever the build's -march gives), else scalar.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel.h"

namespace {

namespace ffi = xla::ffi;

// ------------------------------------------------------------------------------------------------
// Vectors of kLanes floats.

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Splat(float x) { return _mm512_set1_ps(x); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec MulAdd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float Largest(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec Round(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n for integral n in [-126, 127].
inline Vec Pow2(Vec n) {
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_castsi512_ps(bits);
}
inline Vec ZeroBelow(Vec y, Vec x, Vec low) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GE_OQ), y);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Splat(float x) { return _mm256_set1_ps(x); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec MulAdd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec Min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline float Sum(Vec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float Largest(Vec v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline Vec Round(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec Pow2(Vec n) {
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(bits);
}
inline Vec ZeroBelow(Vec y, Vec x, Vec low) { return _mm256_and_ps(y, _mm256_cmp_ps(x, low, _CMP_GE_OQ)); }
#else
constexpr int64_t kLanes = 1;
using Vec = float;
inline Vec Load(const float* p) { return *p; }
inline void Store(float* p, Vec v) { *p = v; }
inline Vec Splat(float x) { return x; }
inline Vec Add(Vec a, Vec b) { return a + b; }
inline Vec Sub(Vec a, Vec b) { return a - b; }
inline Vec Mul(Vec a, Vec b) { return a * b; }
inline Vec MulAdd(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec Max(Vec a, Vec b) { return std::max(a, b); }
inline Vec Min(Vec a, Vec b) { return std::min(a, b); }
inline float Sum(Vec v) { return v; }
inline float Largest(Vec v) { return v; }
#endif

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// e^x, Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial): within 2 ulp of
// std::exp for x in [-87.3, 88]; 0 below (-inf included).
inline Vec Exp(Vec x) {
  const Vec low = Splat(-87.3365447f);
  Vec y = Min(Max(x, low), Splat(88.0f));
  Vec n = Round(Mul(y, Splat(1.44269504088896341f)));
  y = Sub(y, Mul(n, Splat(0.693359375f)));
  y = Sub(y, Mul(n, Splat(-2.12194440e-4f)));
  Vec p = Splat(1.9875691500e-4f);
  p = Add(Mul(p, y), Splat(1.3981999507e-3f));
  p = Add(Mul(p, y), Splat(8.3334519073e-3f));
  p = Add(Mul(p, y), Splat(4.1665795894e-2f));
  p = Add(Mul(p, y), Splat(1.6666665459e-1f));
  p = Add(Mul(p, y), Splat(5.0000001201e-1f));
  p = Add(Add(Mul(Mul(p, y), y), y), Splat(1.0f));
  return ZeroBelow(Mul(p, Pow2(n)), x, low);
}
#else
inline Vec Exp(Vec x) { return std::exp(x); }
#endif

// ------------------------------------------------------------------------------------------------
// Stored numbers to float32.

float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(float(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(float(mantissa | 0x400), int(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// The 256 values of a float8 format: e4m3fn (no infinity, 0x7f / 0xff NaN) or e5m2 (IEEE-like).
struct Fp8Table {
  float values[256];
  Fp8Table(int mantissa_bits, int bias, bool ieee) {
    const int exponent_mask = (1 << (7 - mantissa_bits)) - 1, mantissa_mask = (1 << mantissa_bits) - 1;
    for (int code = 0; code < 256; ++code) {
      const int exponent = (code >> mantissa_bits) & exponent_mask, mantissa = code & mantissa_mask;
      float magnitude;
      if (ieee && exponent == exponent_mask) {
        magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      } else if (!ieee && exponent == exponent_mask && mantissa == mantissa_mask) {
        magnitude = std::numeric_limits<float>::quiet_NaN();
      } else if (exponent == 0) {
        magnitude = std::ldexp(float(mantissa), 1 - bias - mantissa_bits);
      } else {
        magnitude = std::ldexp(float(mantissa | (1 << mantissa_bits)), exponent - bias - mantissa_bits);
      }
      values[code] = (code & 0x80) ? -magnitude : magnitude;
    }
  }
};

const Fp8Table kE4M3(3, 7, false), kE5M2(2, 15, true);

// One stack (keys or values) of a layer group, as stored.
struct Stack {
  const uint8_t* data;
  ffi::DataType type;
  int64_t row_bytes;        // bytes of one token's head: D values or D * bits / 8 code bytes
  const uint16_t* scales;   // float16 [rows, groups], or null
  const uint16_t* zeros;    // float16 [rows, groups], or null
  int64_t groups, bits;
  const float* fp8;         // the code table of float8 codes, else null
};

// Token `row` of the stack (its flat (layer, page, slot, head) index) as D float32 values and zeros to
// `padded`: a pointer into the stack itself for float32 values of a whole number of vectors, else
// `buffer` filled.
const float* ReadRow(const Stack& stack, int64_t row, int64_t dim, int64_t padded, float* buffer) {
  const uint8_t* src = stack.data + row * stack.row_bytes;
  if (stack.type == ffi::DataType::F32 && dim == padded) return reinterpret_cast<const float*>(src);
  switch (stack.type) {
    case ffi::DataType::F32:
      std::memcpy(buffer, src, dim * sizeof(float));
      break;
    case ffi::DataType::BF16: {
      const uint16_t* half = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < dim; ++i) {
        const uint32_t bits = uint32_t(half[i]) << 16;
        std::memcpy(buffer + i, &bits, 4);
      }
      break;
    }
    case ffi::DataType::F16: {
      const uint16_t* half = reinterpret_cast<const uint16_t*>(src);
#if defined(__AVX512F__)
      int64_t i = 0;
      for (; i + 16 <= dim; i += 16) {
        _mm512_storeu_ps(buffer + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + i))));
      }
      for (; i < dim; ++i) buffer[i] = HalfToFloat(half[i]);
#else
      for (int64_t i = 0; i < dim; ++i) buffer[i] = HalfToFloat(half[i]);
#endif
      break;
    }
    default: {  // codes: numbers, then * scale (+ zero) per group, rounded apart as jaxkv dequantizes
      if (stack.fp8 != nullptr) {
        for (int64_t i = 0; i < dim; ++i) buffer[i] = stack.fp8[src[i]];
      } else {
        const int64_t per_byte = 8 / stack.bits, bytes = dim / per_byte, mask = (1 << stack.bits) - 1;
        for (int64_t part = 0; part < per_byte; ++part) {  // byte j holds codes j, j + D/k, ... (k per byte)
          const int shift = int(part * stack.bits);
          for (int64_t j = 0; j < bytes; ++j) buffer[part * bytes + j] = float((src[j] >> shift) & mask);
        }
      }
      const int64_t group = dim / stack.groups;
      const uint16_t* scales = stack.scales + row * stack.groups;
      for (int64_t g = 0; g < stack.groups; ++g) {
        const float scale = HalfToFloat(scales[g]);
        for (int64_t i = g * group; i < (g + 1) * group; ++i) buffer[i] *= scale;
      }
      if (stack.zeros != nullptr) {
        const uint16_t* zeros = stack.zeros + row * stack.groups;
        for (int64_t g = 0; g < stack.groups; ++g) {
          const float zero = HalfToFloat(zeros[g]);
          for (int64_t i = g * group; i < (g + 1) * group; ++i) buffer[i] += zero;
        }
      }
    }
  }
  for (int64_t i = dim; i < padded; ++i) buffer[i] = 0.0f;
  return buffer;
}

// ------------------------------------------------------------------------------------------------
// A chunk's dot products, register-blocked: NV vectors per row (head_dim / kLanes, padded).

constexpr int64_t kChunk = 16;  // K/V rows per softmax step (at most a page): a multiple of kLanes

#if defined(__AVX512F__)
constexpr int kAccumulators = 16;  // of the 32 vector registers
// A vector whose lane i is the sum of part[i]'s lanes (a transposing reduction: 45 operations for 16 sums).
inline Vec SumEach(const Vec* part) {
  Vec pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // 128-bit block k: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of (a, b)'s block k
    const Vec a = part[2 * i], b = part[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // block k: the block-k sums of parts 4i .. 4i + 3
    const Vec a = pairs[2 * i], b = pairs[2 * i + 1];
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const Vec ab = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const Vec cd = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kAccumulators = 8;  // of the 16 vector registers
inline Vec SumEach(const Vec* part) {
  Vec pairs[4], quads[2];
  for (int i = 0; i < 4; ++i) {
    const Vec a = part[2 * i], b = part[2 * i + 1];
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 2; ++i) {
    const Vec a = pairs[2 * i], b = pairs[2 * i + 1];
    quads[i] = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
#else
constexpr int kAccumulators = 8;
inline Vec SumEach(const Vec* part) { return part[0]; }
#endif

// logits[r * kChunk + i] = q_r . k_i for query rows r < rows (q: rows x NV vectors) and chunk rows i < n
// (lanes past n: junk). Each query row's vectors stay in registers over the chunk.
template <int NV>
void Logits(const float* q, int64_t rows, int64_t, const float* const* k, int64_t n, float* logits) {
  for (int64_t r = 0; r < rows; ++r) {
    Vec query[NV];
    for (int v = 0; v < NV; ++v) query[v] = Load(q + (r * NV + v) * kLanes);
    for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
      const float* row[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) row[j] = k[std::min(i0 + j, n - 1)];
      Vec part[kLanes];  // kLanes independent chains, vector by vector
      for (int64_t j = 0; j < kLanes; ++j) part[j] = Mul(query[0], Load(row[j]));
      for (int v = 1; v < NV; ++v) {
        for (int64_t j = 0; j < kLanes; ++j) part[j] = MulAdd(query[v], Load(row[j] + v * kLanes), part[j]);
      }
      Store(logits + r * kChunk + i0, SumEach(part));
    }
  }
}

void LogitsAny(const float* q, int64_t rows, int64_t padded, const float* const* k, int64_t n, float* logits) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      const float* row = k[i];
      Vec sum = Mul(Load(q + r * padded), Load(row));
      for (int64_t d = kLanes; d < padded; d += kLanes) sum = MulAdd(Load(q + r * padded + d), Load(row + d), sum);
      logits[r * kChunk + i] = Sum(sum);
    }
  }
}

// acc_r += sum over chunk rows i in [lo, hi) of p[r * kChunk + i] * v_i, for R query rows whose R * NV
// accumulators stay in registers over the chunk.
template <int NV, int R>
void AddValues(const float* p, const float* const* v, int64_t lo, int64_t hi, float* acc) {
  Vec sum[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int x = 0; x < NV; ++x) sum[r][x] = Load(acc + (r * NV + x) * kLanes);
  }
  for (int64_t i = lo; i < hi; ++i) {
    const float* row = v[i];
    for (int r = 0; r < R; ++r) {
      const Vec weight = Splat(p[r * kChunk + i]);
      for (int x = 0; x < NV; ++x) sum[r][x] = MulAdd(weight, Load(row + x * kLanes), sum[r][x]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int x = 0; x < NV; ++x) Store(acc + (r * NV + x) * kLanes, sum[r][x]);
  }
}

template <int NV, int R>
void AddValuesTail(int64_t left, const float* p, const float* const* v, int64_t lo, int64_t hi, float* acc) {
  if constexpr (R > 0) {
    if (left == R) return AddValues<NV, R>(p, v, lo, hi, acc);
    AddValuesTail<NV, R - 1>(left, p, v, lo, hi, acc);
  }
}

// AddValues over `rows` query rows, in tiles of as many rows as the accumulators hold.
template <int NV>
void AddValuesRows(const float* p, const float* const* v, int64_t lo, int64_t hi, float* acc, int64_t rows, int64_t) {
  constexpr int kTile = std::max(1, std::min(8, kAccumulators / NV));
  int64_t r = 0;
  for (; r + kTile <= rows; r += kTile) AddValues<NV, kTile>(p + r * kChunk, v, lo, hi, acc + r * NV * kLanes);
  AddValuesTail<NV, kTile - 1>(rows - r, p + r * kChunk, v, lo, hi, acc + r * NV * kLanes);
}

void AddValuesAny(const float* p, const float* const* v, int64_t lo, int64_t hi, float* acc, int64_t rows,
                  int64_t padded) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < padded; d += kLanes) {
      Vec sum = Load(acc + r * padded + d);
      for (int64_t i = lo; i < hi; ++i) sum = MulAdd(Splat(p[r * kChunk + i]), Load(v[i] + d), sum);
      Store(acc + r * padded + d, sum);
    }
  }
}

struct ChunkKernels {
  void (*logits)(const float*, int64_t, int64_t, const float* const*, int64_t, float*);
  void (*add_values)(const float*, const float* const*, int64_t, int64_t, float*, int64_t, int64_t);
};

// The register-blocked kernels for rows of `vectors` vectors, else the generic loops.
ChunkKernels PickKernels(int64_t vectors) {
  switch (kLanes == 1 ? 0 : vectors) {
    case 1: return {Logits<1>, AddValuesRows<1>};
    case 2: return {Logits<2>, AddValuesRows<2>};
    case 3: return {Logits<3>, AddValuesRows<3>};
    case 4: return {Logits<4>, AddValuesRows<4>};
    case 5: return {Logits<5>, AddValuesRows<5>};
    case 6: return {Logits<6>, AddValuesRows<6>};
    case 8: return {Logits<8>, AddValuesRows<8>};
    case 16: return {Logits<16>, AddValuesRows<16>};
    default: return {LogitsAny, AddValuesAny};
  }
}

// ------------------------------------------------------------------------------------------------
// One task.

struct Geometry {
  int64_t blocks, block_size, num_heads, num_kv_heads, group, dim, padded, width;
  int64_t layers, pages, page_size;
  bool heads_layout;
  int64_t window;
  float scale, softcap;
  ChunkKernels kernels;

  // The flat row index of (layer, page, slot, K/V head) in either layout.
  int64_t Row(int64_t layer, int64_t page, int64_t slot, int64_t head) const {
    const int64_t base = layer * pages + page;
    return heads_layout ? (base * num_kv_heads + head) * page_size + slot
                        : (base * page_size + slot) * num_kv_heads + head;
  }
  // Positions [first, end) query position `position` reads (empty for padding).
  void Span(int32_t position, int64_t* first, int64_t* end) const {
    if (position < 0) {
      *first = *end = 0;
      return;
    }
    *end = std::min<int64_t>(int64_t(position) + 1, width * page_size);
    *first = window > 0 ? std::max<int64_t>(int64_t(position) - window + 1, 0) : 0;
  }
};

// Per-thread working memory of a task, reused across tasks and calls.
struct Scratch {
  std::vector<float> queries, acc, peak, total, logits, keys, values;
  std::vector<int64_t> first, end;  // per query of the block: the positions it reads
  void Fit(const Geometry& geo) {
    const int64_t rows = geo.block_size * geo.group;
    first.resize(geo.block_size);
    end.resize(geo.block_size);
    queries.resize(rows * geo.padded);
    acc.resize(rows * geo.padded);
    peak.resize(rows);
    total.resize(rows);
    logits.resize(rows * kChunk);
    keys.resize(kChunk * geo.padded);
    values.resize(kChunk * geo.padded);
  }
};

// One online-softmax step of query row r over a chunk's logits s[0 .. kChunk) of which [lo, hi) are
// visible: s becomes the weights (0 where invisible), the row's peak, total and acc are updated.
void SoftmaxStep(const Geometry& geo, float* s, int64_t lo, int64_t hi, float* peak, float* total, float* acc) {
  for (int64_t i = 0; i < kChunk; i += kLanes) Store(s + i, Mul(Load(s + i), Splat(geo.scale)));
  if (geo.softcap > 0.0f) {
    for (int64_t i = lo; i < hi; ++i) s[i] = geo.softcap * std::tanh(s[i] / geo.softcap);
  }
  for (int64_t i = 0; i < lo; ++i) s[i] = kMinusInf;
  for (int64_t i = hi; i < kChunk; ++i) s[i] = kMinusInf;
  Vec largest = Load(s);
  for (int64_t i = kLanes; i < kChunk; i += kLanes) largest = Max(largest, Load(s + i));
  const float new_peak = std::max(*peak, Largest(largest));
  const float shrink = *peak == new_peak ? 1.0f : std::exp(*peak - new_peak);
  Vec sum = Splat(0.0f);
  const Vec shift = Splat(new_peak);
  for (int64_t i = 0; i < kChunk; i += kLanes) {
    const Vec p = Exp(Sub(Load(s + i), shift));
    Store(s + i, p);
    sum = Add(sum, p);
  }
  *total = *total * shrink + Sum(sum);
  *peak = new_peak;
  if (shrink != 1.0f) {
    const Vec factor = Splat(shrink);
    for (int64_t d = 0; d < geo.padded; d += kLanes) Store(acc + d, Mul(Load(acc + d), factor));
  }
}

// Block `block`'s queries of K/V head `head` over positions [from, to) of its row: the online softmax
// state of its Q * G query rows (row r = q * G + g) left in `scratch` (peak, total, unnormalised acc).
void RunTask(const Geometry& geo, const float* queries, const int32_t* positions, const int32_t* table, int64_t layer,
             const Stack& keys, const Stack& values, int64_t block, int64_t head, int64_t from, int64_t to,
             Scratch& scratch) {
  const int64_t group = geo.group, dim = geo.dim, padded = geo.padded, rows = geo.block_size * group;
  float* q = scratch.queries.data();
  float* acc = scratch.acc.data();
  float* logits = scratch.logits.data();
  std::fill(acc, acc + rows * padded, 0.0f);
  std::fill(scratch.peak.begin(), scratch.peak.end(), kMinusInf);
  std::fill(scratch.total.begin(), scratch.total.end(), 0.0f);
  int64_t* first = scratch.first.data();
  int64_t* end = scratch.end.data();
  int64_t low = to, high = from;  // what any of the block's queries reads, within [from, to)
  for (int64_t t = 0; t < geo.block_size; ++t) {
    geo.Span(positions[block * geo.block_size + t], &first[t], &end[t]);
    first[t] = std::max(first[t], from);
    end[t] = std::min(end[t], to);
    if (first[t] < end[t]) {
      low = std::min(low, first[t]);
      high = std::max(high, end[t]);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* src = queries + ((block * geo.block_size + t) * geo.num_heads + head * group + g) * dim;
      float* dst = q + (t * group + g) * padded;
      std::memcpy(dst, src, dim * sizeof(float));
      std::fill(dst + dim, dst + padded, 0.0f);
    }
  }
  const float* key_rows[kChunk];
  const float* value_rows[kChunk];
  for (int64_t start = low; start < high;) {
    const int64_t column = start / geo.page_size, page = table[column];
    const int64_t stop = std::min({high, (column + 1) * geo.page_size, start + kChunk});
    const int64_t count = stop - start;
    if (page == 0) {  // the null page: nothing of a row is there
      start = stop;
      continue;
    }
    for (int64_t i = 0; i < count; ++i) {
      const int64_t row = geo.Row(layer, page, (start + i) % geo.page_size, head);
      key_rows[i] = ReadRow(keys, row, dim, padded, scratch.keys.data() + i * padded);
    }
    geo.kernels.logits(q, rows, padded, key_rows, count, logits);
    int64_t seen_low = count, seen_high = 0;  // chunk rows any query sees
    for (int64_t t = 0; t < geo.block_size; ++t) {
      const int64_t lo = std::max<int64_t>(first[t] - start, 0), hi = std::min<int64_t>(end[t] - start, count);
      for (int64_t g = 0, r = t * group; g < group; ++g, ++r) {
        if (lo >= hi) {
          std::fill(logits + r * kChunk, logits + (r + 1) * kChunk, 0.0f);
          continue;
        }
        SoftmaxStep(geo, logits + r * kChunk, lo, hi, &scratch.peak[r], &scratch.total[r], acc + r * padded);
      }
      if (lo < hi) seen_low = std::min(seen_low, lo), seen_high = std::max(seen_high, hi);
    }
    for (int64_t i = seen_low; i < seen_high; ++i) {
      const int64_t row = geo.Row(layer, page, (start + i) % geo.page_size, head);
      value_rows[i] = ReadRow(values, row, dim, padded, scratch.values.data() + i * padded);
    }
    if (seen_low < seen_high) geo.kernels.add_values(logits, value_rows, seen_low, seen_high, acc, rows, padded);
    start = stop;
  }
}

// ------------------------------------------------------------------------------------------------
// The handler.

ffi::Error CheckStack(const char* what, ffi::AnyBuffer stack, ffi::Buffer<ffi::F16> scales,
                      ffi::Buffer<ffi::F16> zeros, int64_t bits, int64_t dim, Stack* out,
                      ffi::Span<const int64_t> shape) {
  auto dims = stack.dimensions();
  if (dims.size() != 5 || dims[0] != shape[0] || dims[1] != shape[1] || dims[2] != shape[2] || dims[3] != shape[3]) {
    return ffi::Error::InvalidArgument(std::string(what) + ": stacks must be [L, P, ·, ·, D] alike");
  }
  out->data = static_cast<const uint8_t*>(stack.untyped_data());
  out->type = stack.element_type();
  out->scales = out->zeros = nullptr;
  out->fp8 = nullptr;
  out->groups = 0;
  out->bits = bits;
  const bool codes = out->type == ffi::DataType::U8 || out->type == ffi::DataType::F8E4M3FN ||
                     out->type == ffi::DataType::F8E5M2;
  if (!codes) {
    if (out->type != ffi::DataType::F32 && out->type != ffi::DataType::BF16 && out->type != ffi::DataType::F16) {
      return ffi::Error::InvalidArgument(std::string(what) + ": float32, bfloat16, float16 or code pages");
    }
    if (dims[4] != dim) return ffi::Error::InvalidArgument(std::string(what) + ": head_dim differs from the queries'");
    out->row_bytes = dim * ffi::ByteWidth(out->type);
    return ffi::Error::Success();
  }
  if (out->type == ffi::DataType::U8) {
    if (bits != 2 && bits != 4 && bits != 8) return ffi::Error::InvalidArgument("int codes need bits 2, 4 or 8");
    if (dims[4] * (8 / bits) != dim) return ffi::Error::InvalidArgument(std::string(what) + ": packed codes' width");
  } else {
    out->fp8 = out->type == ffi::DataType::F8E4M3FN ? kE4M3.values : kE5M2.values;
    if (dims[4] != dim) return ffi::Error::InvalidArgument(std::string(what) + ": fp8 codes' width");
  }
  out->row_bytes = dims[4];
  auto scale_dims = scales.dimensions();
  if (scale_dims.size() != 5 || scale_dims[4] <= 0 || dim % scale_dims[4] ||
      !std::equal(scale_dims.begin(), scale_dims.begin() + 4, dims.begin())) {
    return ffi::Error::InvalidArgument(std::string(what) + ": codes need float16 scales [L, P, ·, ·, D / group]");
  }
  out->groups = scale_dims[4];
  out->scales = reinterpret_cast<const uint16_t*>(scales.typed_data());
  if (zeros.element_count() > 0) {
    if (zeros.dimensions().size() != 5 ||
        !std::equal(scale_dims.begin(), scale_dims.end(), zeros.dimensions().begin())) {
      return ffi::Error::InvalidArgument(std::string(what) + ": zero points must be shaped as the scales");
    }
    out->zeros = reinterpret_cast<const uint16_t*>(zeros.typed_data());
  } else if (out->type == ffi::DataType::U8) {
    return ffi::Error::InvalidArgument(std::string(what) + ": int codes need their zero points");
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> queries, ffi::Buffer<ffi::S32> positions,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> index, ffi::AnyBuffer keys,
                          ffi::AnyBuffer values, ffi::Buffer<ffi::F16> key_scales, ffi::Buffer<ffi::F16> value_scales,
                          ffi::Buffer<ffi::F16> key_zeros, ffi::Buffer<ffi::F16> value_zeros,
                          ffi::ResultBuffer<ffi::F32> out, float scale, float softcap, int64_t window,
                          bool heads_layout, int64_t bits, int64_t min_partition) {
  auto q_dims = queries.dimensions();
  auto k_dims = keys.dimensions();
  if (q_dims.size() != 4 || k_dims.size() != 5) {
    return ffi::Error::InvalidArgument("paged attention: queries [Z, Q, H_q, D], stacks [L, P, ·, ·, D]");
  }
  Geometry geo;
  geo.blocks = q_dims[0];
  geo.block_size = q_dims[1];
  geo.num_heads = q_dims[2];
  geo.dim = q_dims[3];
  geo.padded = (geo.dim + kLanes - 1) / kLanes * kLanes;
  geo.layers = k_dims[0];
  geo.pages = k_dims[1];
  geo.heads_layout = heads_layout;
  geo.page_size = heads_layout ? k_dims[3] : k_dims[2];
  geo.num_kv_heads = heads_layout ? k_dims[2] : k_dims[3];
  geo.window = window;
  geo.scale = scale;
  geo.softcap = softcap;
  geo.kernels = PickKernels(geo.padded / kLanes);
  if (geo.num_kv_heads <= 0 || geo.num_heads % geo.num_kv_heads) {
    return ffi::Error::InvalidArgument("paged attention: query heads must be a multiple of the K/V heads");
  }
  geo.group = geo.num_heads / geo.num_kv_heads;
  auto p_dims = positions.dimensions();
  auto t_dims = tables.dimensions();
  if (p_dims.size() != 2 || p_dims[0] != geo.blocks || p_dims[1] != geo.block_size || t_dims.size() != 2 ||
      t_dims[0] != geo.blocks) {
    return ffi::Error::InvalidArgument("paged attention: positions [Z, Q] and tables [Z, W] for queries [Z, Q, ·, ·]");
  }
  geo.width = t_dims[1];
  Stack k, v;
  if (auto error = CheckStack("keys", keys, key_scales, key_zeros, bits, geo.dim, &k, k_dims); error.failure()) {
    return error;
  }
  if (auto error = CheckStack("values", values, value_scales, value_zeros, bits, geo.dim, &v, k_dims);
      error.failure()) {
    return error;
  }
  const int64_t layer = index.typed_data()[0];
  if (layer < 0 || layer >= geo.layers) return ffi::Error::InvalidArgument("paged attention: layer index out of range");
  const int32_t* table = tables.typed_data();
  for (int64_t i = 0; i < geo.blocks * geo.width; ++i) {
    if (table[i] < 0 || table[i] >= geo.pages) {
      return ffi::Error::InvalidArgument("paged attention: a block-table entry is not a page of the pool");
    }
  }
  const int32_t* pos = positions.typed_data();
  // Partitions: only when blocks * K/V heads leave the pool's threads idle.
  int64_t longest = 0;
  for (int64_t z = 0; z < geo.blocks; ++z) {
    int64_t low = std::numeric_limits<int64_t>::max(), high = 0;
    for (int64_t t = 0; t < geo.block_size; ++t) {
      int64_t first, end;
      geo.Span(pos[z * geo.block_size + t], &first, &end);
      if (first < end) low = std::min(low, first), high = std::max(high, end);
    }
    longest = std::max(longest, high - std::min(low, high));
  }
  const int64_t workers = std::max<int64_t>(pool.num_threads(), 1) + 1, tasks = geo.blocks * geo.num_kv_heads;
  int64_t parts = 1;
  if (min_partition > 0 && tasks < 2 * workers) {
    parts = std::max<int64_t>(1, std::min((2 * workers + tasks - 1) / tasks, longest / min_partition));
  }
  const int64_t rows = geo.block_size * geo.group, state = geo.padded + 2;
  std::vector<float> partial(parts > 1 ? tasks * parts * rows * state : 0);
  float* result = out->typed_data();
  const float* q = queries.typed_data();

  jaxkv::ParallelFor(pool, tasks * parts, 1, [&](int64_t begin, int64_t finish) {
    thread_local Scratch scratch;
    scratch.Fit(geo);
    for (int64_t task = begin; task < finish; ++task) {
      const int64_t block = task / (geo.num_kv_heads * parts), head = task / parts % geo.num_kv_heads;
      const int64_t part = task % parts;
      int64_t from = 0, to = geo.width * geo.page_size;
      if (parts > 1) {  // equal shares of the block's span, whole pages each
        int64_t low = to, high = 0;
        for (int64_t t = 0; t < geo.block_size; ++t) {
          int64_t first, end;
          geo.Span(pos[block * geo.block_size + t], &first, &end);
          if (first < end) low = std::min(low, first), high = std::max(high, end);
        }
        const int64_t pages = (std::max(high, low) - low + geo.page_size - 1) / geo.page_size;
        const int64_t base = low / geo.page_size * geo.page_size;
        from = std::max(low, base + pages * part / parts * geo.page_size);
        to = std::min(high, base + pages * (part + 1) / parts * geo.page_size);
      }
      RunTask(geo, q, pos, table + block * geo.width, layer, k, v, block, head, from, to, scratch);
      if (parts > 1) {
        float* dst = partial.data() + task * rows * state;
        for (int64_t r = 0; r < rows; ++r) {
          dst[r * state] = scratch.peak[r];
          dst[r * state + 1] = scratch.total[r];
          std::memcpy(dst + r * state + 2, scratch.acc.data() + r * geo.padded, geo.dim * sizeof(float));
        }
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = r / geo.group, g = r % geo.group;
        float* dst = result + ((block * geo.block_size + t) * geo.num_heads + head * geo.group + g) * geo.dim;
        const float total = scratch.total[r];
        const float* a = scratch.acc.data() + r * geo.padded;
        for (int64_t d = 0; d < geo.dim; ++d) dst[d] = total > 0.0f ? a[d] / total : 0.0f;
      }
    }
  });
  if (parts > 1) {
    jaxkv::ParallelFor(pool, tasks, 1, [&](int64_t begin, int64_t finish) {
      for (int64_t task = begin; task < finish; ++task) {
        const int64_t block = task / geo.num_kv_heads, head = task % geo.num_kv_heads;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = r / geo.group, g = r % geo.group;
          float* dst = result + ((block * geo.block_size + t) * geo.num_heads + head * geo.group + g) * geo.dim;
          float peak = kMinusInf, total = 0.0f;
          for (int64_t part = 0; part < parts; ++part) {
            peak = std::max(peak, partial[((task * parts + part) * rows + r) * state]);
          }
          std::fill(dst, dst + geo.dim, 0.0f);
          for (int64_t part = 0; part < parts; ++part) {
            const float* src = partial.data() + ((task * parts + part) * rows + r) * state;
            if (src[1] == 0.0f) continue;
            const float weight = std::exp(src[0] - peak);
            total += src[1] * weight;
            for (int64_t d = 0; d < geo.dim; ++d) dst[d] += src[2 + d] * weight;
          }
          for (int64_t d = 0; d < geo.dim; ++d) dst[d] = total > 0.0f ? dst[d] / total : 0.0f;
        }
      }
    });
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedAttention, PagedAttention,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // queries [Z, Q, H_q, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // positions [Z, Q]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // tables [Z, W]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // index []
                                  .Arg<xla::ffi::AnyBuffer>()              // keys
                                  .Arg<xla::ffi::AnyBuffer>()              // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::F16>>()  // key scales
                                  .Arg<xla::ffi::Buffer<xla::ffi::F16>>()  // value scales
                                  .Arg<xla::ffi::Buffer<xla::ffi::F16>>()  // key zeros
                                  .Arg<xla::ffi::Buffer<xla::ffi::F16>>()  // value zeros
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // [Z, Q, H_q, D]
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("heads_layout")
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("min_partition"));

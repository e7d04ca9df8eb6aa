// The decode hot path on CPU: a skinny GEMM that streams weights once, attention of decoding
// queries read straight from the paged KV pool, and the elementwise steps around them. Written
// with GCC vector extensions so one source serves every variant: built once per variant with
// -DHC_NS=<name> -DHC_VW=<floats per vector> and that variant's instruction-set flags (build.py);
// api.cpp picks one at load time.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace HC_NS {
using namespace hc;

constexpr int W = HC_VW;
typedef float vf __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

static inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return vf{} + x; }
static inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// W elements of dtype DT at element index i, as float32
template <int DT> static inline vf load(const void* base, long i);
template <> inline vf load<F32>(const void* b, long i) { return vload(static_cast<const float*>(b) + i); }
template <> inline vf load<BF16>(const void* b, long i) {  // bf16 is float32's upper half
  const uint16_t* p = static_cast<const uint16_t*>(b) + i;
  vf v;
#if HC_VW == 8
  const __m256i r = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  std::memcpy(&v, &r, sizeof v);
#elif defined(__AVX512F__)
  const __m512i r = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  std::memcpy(&v, &r, sizeof v);
#else
  for (int h = 0; h < W / 8; ++h) {
    const __m256i r =
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h))), 16);
    std::memcpy(reinterpret_cast<char*>(&v) + 32 * h, &r, 32);
  }
#endif
  return v;
}
template <> inline vf load<F16>(const void* b, long i) {
  const uint16_t* p = static_cast<const uint16_t*>(b) + i;
  vf v;
#if HC_VW == 8
  __m256 r = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &r, sizeof v);
#elif defined(__AVX512F__)
  __m512 r = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &r, sizeof v);
#else
  for (int h = 0; h < W / 8; ++h) {
    __m256 r = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h)));
    std::memcpy(reinterpret_cast<char*>(&v) + 32 * h, &r, 32);
  }
#endif
  return v;
}

template <int DT> static inline float get(const void* b, long i);
template <> inline float get<F32>(const void* b, long i) { return static_cast<const float*>(b)[i]; }
template <> inline float get<BF16>(const void* b, long i) { return bf16_to_f32(static_cast<const uint16_t*>(b)[i]); }
template <> inline float get<F16>(const void* b, long i) { return _cvtsh_ss(static_cast<const uint16_t*>(b)[i]); }

template <int DT> static inline void put(void* b, long i, float x);
template <> inline void put<F32>(void* b, long i, float x) { static_cast<float*>(b)[i] = x; }
template <> inline void put<BF16>(void* b, long i, float x) { static_cast<uint16_t*>(b)[i] = f32_to_bf16(x); }
template <> inline void put<F16>(void* b, long i, float x) {
  static_cast<uint16_t*>(b)[i] = static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}

// ------------------------------------------------------------------------------------ linear
// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), accumulated in float32 and rounded once, as torch's
// F.linear does. Threads split the output columns, so each streams its own run of w's rows once,
// front to back (one sequential stream per thread, as a copy reads); each weight vector is
// converted to float32 in registers once and used for up to 4 rows of x (float32 copies in L1).
// bf16 weights are read 2W at a time as W 32-bit lanes: a lane shifted left is the even element,
// the lane masked is the odd one, so x is stored with each block of 2W split into evens and odds.
constexpr int MT_MAX = 4;

template <int DT> constexpr int step() { return DT == BF16 ? 2 * W : W; }

// x row (k elements of dtype DT) -> float32, in the order linear_row reads it
template <int DT>
static void stage_x(const void* x, long k, float* out) {
  constexpr int S = step<DT>();
  long i = 0;
  if (DT == BF16)
    for (; i + S <= k; i += S)
      for (int e = 0; e < W; ++e) {
        out[i + e] = get<DT>(x, i + 2 * e);
        out[i + W + e] = get<DT>(x, i + 2 * e + 1);
      }
  for (; i < k; ++i) out[i] = get<DT>(x, i);
}

// One weight row against MT rows of x: out[m] = sum_k x[m, k] w[k]. U steps of S per iteration
// keep 2U (bf16) or U independent accumulators per row of x in flight.
template <int DT, int MT>
static inline void linear_row(const float* x, long k, const void* w, long off, float* out) {
  constexpr int S = step<DT>();
  constexpr int U = DT == BF16 ? (MT == 1 ? 2 : 1) : (MT == 1 ? 4 : MT == 2 ? 2 : 1);
  vf acc[MT][2 * U];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < 2 * U; ++a) acc[m][a] = vf{};
  auto one = [&](long at, int u) {
    if constexpr (DT == BF16) {
      vu lanes;
      std::memcpy(&lanes, static_cast<const uint16_t*>(w) + off + at, sizeof lanes);
      const vf even = reinterpret_cast<vf>(lanes << 16), odd = reinterpret_cast<vf>(lanes & 0xffff0000u);
      for (int m = 0; m < MT; ++m) {
        acc[m][2 * u] += vload(x + m * k + at) * even;
        acc[m][2 * u + 1] += vload(x + m * k + at + W) * odd;
      }
    } else {
      const vf wv = load<DT>(w, off + at);
      for (int m = 0; m < MT; ++m) acc[m][u] += vload(x + m * k + at) * wv;
    }
  };
  long i = 0;
  for (; i + U * S <= k; i += U * S)
    for (int u = 0; u < U; ++u) one(i + u * S, u);
  for (; i + S <= k; i += S) one(i, 0);
  for (int m = 0; m < MT; ++m) {
    vf t = acc[m][0];
    for (int a = 1; a < 2 * U; ++a) t += acc[m][a];
    out[m] = hsum(t);
  }
  for (; i < k; ++i) {
    const float wf = get<DT>(w, off + i);
    for (int m = 0; m < MT; ++m) out[m] += x[m * k + i] * wf;
  }
}

// Rows of x are taken MB at a time (their float32 copies stay in L2 while w streams past them);
// each block is one parallel pass over w.
constexpr long MB = 16;

template <int DT>
static void linear_t(const void* x, long m, long k, long ldx, const void* w, long n, long ldw, const void* bias,
                     void* y, long ldy, int threads) {
  static thread_local std::vector<float> xs;
  xs.resize(size_t(std::min(m, MB)) * k);
  constexpr long elem = DT == F32 ? 4 : 2;
  const float* xf = xs.data();
  const long grain = std::max(1L, (64L << 10) / (k * elem));  // ~64 KiB of w per chunk
  for (long r0 = 0; r0 < m; r0 += MB) {
    const long mb = std::min(MB, m - r0);
    for (long r = 0; r < mb; ++r)
      stage_x<DT>(static_cast<const char*>(x) + (r0 + r) * ldx * elem, k, xs.data() + r * k);
    parallel_for(n, grain, threads, [&](long n0, long n1) {
      float res[MT_MAX];
      for (long col = n0; col < n1; ++col) {
        const float b = bias ? get<DT>(bias, col) : 0.f;
        for (long r = 0; r < mb; r += MT_MAX) {
          const long mt = std::min<long>(MT_MAX, mb - r);
          switch (mt) {
            case 4: linear_row<DT, 4>(xf + r * k, k, w, col * ldw, res); break;
            case 3: linear_row<DT, 3>(xf + r * k, k, w, col * ldw, res); break;
            case 2: linear_row<DT, 2>(xf + r * k, k, w, col * ldw, res); break;
            default: linear_row<DT, 1>(xf + r * k, k, w, col * ldw, res); break;
          }
          for (long a = 0; a < mt; ++a) put<DT>(y, (r0 + r + a) * ldy + col, res[a] + b);
        }
      }
    });
  }
}

static void linear(const void* x, long m, long k, long ldx, const void* w, long n, long ldw, const void* bias,
                   void* y, long ldy, int dt, int threads) {
  switch (dt) {
    case F32: return linear_t<F32>(x, m, k, ldx, w, n, ldw, bias, y, ldy, threads);
    case F16: return linear_t<F16>(x, m, k, ldx, w, n, ldw, bias, y, ldy, threads);
    case BF16: return linear_t<BF16>(x, m, k, ldx, w, n, ldw, bias, y, ldy, threads);
  }
}

// ------------------------------------------------------------------------------------ attention
// exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), r = x - n ln2, |r| <= ln2/2, a
// degree-6 polynomial (relative error ~2e-7); below -87.3 the result is 0.
static inline vf vexp(vf x) {
  const vf lo = vsplat(-87.3f);
  const vi under = x < lo;
  x = x < lo ? lo : x;
  const vf t = x * 1.44269504088896341f;
  const vf nf = (t + 12582912.f) - 12582912.f;  // round to nearest
  vf r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  vf p = vsplat(1.f / 720);
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi bits = reinterpret_cast<vi>(p) + (__builtin_convertvector(nf, vi) << 23);
  return reinterpret_cast<vf>(bits & ~under);
}

// Scores of G query heads against T keys at a time: G*T float32 accumulators.
template <int KDT, int G, int T>
static inline void scores_block(const float* qf, long dk, const void* kp, const long* krow, float* sc, long stride) {
  vf acc[T][G];
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) acc[t][g] = vf{};
  long i = 0;
  for (; i + W <= dk; i += W) {
    vf qv[G];
    for (int g = 0; g < G; ++g) qv[g] = vload(qf + g * dk + i);
    for (int t = 0; t < T; ++t) {
      const vf kv = load<KDT>(kp, krow[t] + i);
      for (int g = 0; g < G; ++g) acc[t][g] += qv[g] * kv;
    }
  }
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) {
      float s = hsum(acc[t][g]);
      for (long j = i; j < dk; ++j) s += qf[g * dk + j] * get<KDT>(kp, krow[t] + j);
      sc[g * stride + t] = s;
    }
}

// One query group (G heads sharing a KV head) over one sequence's context: scores, softmax in
// float32, then the probability-weighted sum of values, B vectors of the value row at a time.
template <int KDT, int IODT, int G>
static void attend_group(const void* q, long q_row, long q_head, long dk, const void* kp, long k_slot, long k_off,
                         const void* vp, long v_slot, long v_off, long dv, long len, const int64_t* slots, float scale,
                         void* out, long o_row, long o_head, long row, long head0, std::vector<float>& buf) {
  constexpr int T = G >= 8 ? 1 : 8 / G;
  constexpr int B = G >= 8 ? 1 : 8 / G;
  buf.resize(size_t(G) * dk + size_t(G) * len);
  float* qf = buf.data();
  float* sc = qf + G * dk;
  for (int g = 0; g < G; ++g)
    for (long i = 0; i < dk; ++i) qf[g * dk + i] = get<IODT>(q, row * q_row + (head0 + g) * q_head + i);
  long t = 0;
  long krow[T];
  for (; t + T <= len; t += T) {
    for (int a = 0; a < T; ++a) krow[a] = slots[t + a] * k_slot + k_off;
    scores_block<KDT, G, T>(qf, dk, kp, krow, sc + t, len);
  }
  for (; t < len; ++t) {
    krow[0] = slots[t] * k_slot + k_off;
    scores_block<KDT, G, 1>(qf, dk, kp, krow, sc + t, len);
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* s = sc + g * len;
    float mx = -INFINITY;
    for (long j = 0; j < len; ++j) mx = std::max(mx, s[j]);
    mx *= scale;
    const vf vs = vsplat(scale), vm = vsplat(mx);
    vf vsum{};
    long j = 0;
    for (; j + W <= len; j += W) {
      const vf e = vexp(vload(s + j) * vs - vm);
      vstore(s + j, e);
      vsum += e;
    }
    float sum = hsum(vsum);
    for (; j < len; ++j) {
      s[j] = std::exp(s[j] * scale - mx);
      sum += s[j];
    }
    inv[g] = 1.f / sum;
  }
  long d = 0;
  for (; d + B * W <= dv; d += B * W) {
    vf acc[G][B];
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < B; ++b) acc[g][b] = vf{};
    for (long j = 0; j < len; ++j) {
      const long base = slots[j] * v_slot + v_off + d;
      vf vv[B];
      for (int b = 0; b < B; ++b) vv[b] = load<KDT>(vp, base + b * W);
      for (int g = 0; g < G; ++g) {
        const vf p = vsplat(sc[g * len + j]);
        for (int b = 0; b < B; ++b) acc[g][b] += p * vv[b];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < B; ++b)
        for (int e = 0; e < W; ++e)
          put<IODT>(out, row * o_row + (head0 + g) * o_head + d + b * W + e, acc[g][b][e] * inv[g]);
  }
  for (; d < dv; ++d)
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
      for (long j = 0; j < len; ++j) s += sc[g * len + j] * get<KDT>(vp, slots[j] * v_slot + v_off + d);
      put<IODT>(out, row * o_row + (head0 + g) * o_head + d, s * inv[g]);
    }
}

template <int KDT, int IODT>
static void attention_t(const void* q, long q_row, long q_head, long hq, long dk, const void* kp, long k_slot,
                        long k_head, const void* vp, long v_slot, long v_head, long dv, long hkv, long n,
                        const int64_t* rows, const int64_t* offsets, const int64_t* slots, float scale, void* out,
                        long o_row, long o_head, int threads) {
  const long group = hq / hkv;
  const long sub = group % 8 == 0 ? 8 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;  // heads per work item
  const long per_seq = hkv * (group / sub);
  const long items = n * per_seq;
  parallel_for(items, 1, threads, [&](long first, long last) {
    static thread_local std::vector<float> buf;
    for (long it = first; it < last; ++it) {
      const long i = it / per_seq, within = it % per_seq;
      const long h = within / (group / sub), head0 = h * group + (within % (group / sub)) * sub;
      const long len = offsets[i + 1] - offsets[i];
      const int64_t* sl = slots + offsets[i];
      const long row = rows[i];
#define HC_ATTEND(G)                                                                                        \
  attend_group<KDT, IODT, G>(q, q_row, q_head, dk, kp, k_slot, h * k_head, vp, v_slot, h * v_head, dv, len, sl, \
                             scale, out, o_row, o_head, row, head0, buf)
      switch (sub) {
        case 8: HC_ATTEND(8); break;
        case 4: HC_ATTEND(4); break;
        case 2: HC_ATTEND(2); break;
        default: HC_ATTEND(1); break;
      }
#undef HC_ATTEND
    }
  });
}

static void decode_attention(const void* q, long q_row, long q_head, long hq, long dk, const void* kp, long k_slot,
                             long k_head, const void* vp, long v_slot, long v_head, long dv, long hkv, int kv_dt,
                             int io_dt, long n, const int64_t* rows, const int64_t* offsets, const int64_t* slots,
                             float scale, void* out, long o_row, long o_head, int threads) {
#define HC_CASE(K, I)                                                                                        \
  if (kv_dt == K && io_dt == I)                                                                              \
    return attention_t<K, I>(q, q_row, q_head, hq, dk, kp, k_slot, k_head, vp, v_slot, v_head, dv, hkv, n, rows, \
                             offsets, slots, scale, out, o_row, o_head, threads);
  HC_CASE(F32, F32) HC_CASE(F32, F16) HC_CASE(F32, BF16)
  HC_CASE(F16, F32) HC_CASE(F16, F16) HC_CASE(F16, BF16)
  HC_CASE(BF16, F32) HC_CASE(BF16, F16) HC_CASE(BF16, BF16)
#undef HC_CASE
}

// ------------------------------------------------------------------------------------ elementwise
// Each rounds to the activations' dtype where torch's op sequence does, so results match it.
// Rows are split across threads only when there are enough of them to pay for the team.
static inline long row_grain(long rows, long width) { return std::max(1L, (1L << 16) / std::max(1L, width)); }

// x rounded to DT, as float32. For float32 a barrier instead, so the product it wraps is not
// contracted with a following add into one fused multiply-add (torch rounds each op).
template <int DT> static inline float rnd(float x);
template <> inline float rnd<F32>(float x) {
  asm("" : "+x"(x));
  return x;
}
template <> inline float rnd<BF16>(float x) { return bf16_to_f32(f32_to_bf16(x)); }
template <> inline float rnd<F16>(float x) { return _cvtsh_ss(static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT))); }

// h += delta (when given, rounded), then out = weight * rms_norm(h) as transformers computes it:
// normalised in float32 and rounded, then scaled by the weight and rounded again.
template <int DT>
static void add_rms_norm_t(void* h, const void* delta, const void* w, long rows, long dim, float eps, void* out,
                           int threads) {
  parallel_for(rows, row_grain(rows, dim), threads, [&](long r0, long r1) {
  for (long r = r0; r < r1; ++r) {
    const long base = r * dim;
    if (delta)
      for (long i = 0; i < dim; ++i) put<DT>(h, base + i, get<DT>(h, base + i) + get<DT>(delta, base + i));
    vf acc{};
    long i = 0;
    for (; i + W <= dim; i += W) {
      const vf x = load<DT>(h, base + i);
      acc += x * x;
    }
    float ss = hsum(acc);
    for (; i < dim; ++i) {
      const float x = get<DT>(h, base + i);
      ss += x * x;
    }
    const float inv = 1.f / std::sqrt(ss / dim + eps);
    for (long j = 0; j < dim; ++j) put<DT>(out, base + j, get<DT>(w, j) * rnd<DT>(get<DT>(h, base + j) * inv));
  }
  });
}

static void add_rms_norm(void* h, const void* delta, const void* w, long rows, long dim, float eps, void* out, int dt,
                         int threads) {
  switch (dt) {
    case F32: return add_rms_norm_t<F32>(h, delta, w, rows, dim, eps, out, threads);
    case F16: return add_rms_norm_t<F16>(h, delta, w, rows, dim, eps, out, threads);
    case BF16: return add_rms_norm_t<BF16>(h, delta, w, rows, dim, eps, out, threads);
  }
}

// out[r, j] = silu(x[r, j]) * x[r, inter + j]: silu in float32 and rounded, then the product rounded.
template <int DT>
static void silu_mul_t(const void* x, long rows, long inter, void* out, int threads) {
  parallel_for(rows, row_grain(rows, 2 * inter), threads, [&](long r0, long r1) {
  for (long r = r0; r < r1; ++r) {
    const long in = r * 2 * inter;
    long j = 0;
    for (; j + W <= inter; j += W) {  // silu = g / (1 + exp(-g)); vexp takes arguments <= 0
      const vf g = load<DT>(x, in + j);
      const vf e = vexp(g > 0 ? -g : g);  // exp(-|g|)
      const vf sig = g > 0 ? 1.f / (1.f + e) : e / (1.f + e);
      const vf silu = g * sig;
      const vf up = load<DT>(x, in + inter + j);
      for (int a = 0; a < W; ++a) put<DT>(out, r * inter + j + a, rnd<DT>(silu[a]) * up[a]);
    }
    for (; j < inter; ++j) {
      const float g = get<DT>(x, in + j);
      put<DT>(out, r * inter + j, rnd<DT>(g / (1.f + std::exp(-g))) * get<DT>(x, in + inter + j));
    }
  }
  });
}

static void silu_mul(const void* x, long rows, long inter, void* out, int dt, int threads) {
  switch (dt) {
    case F32: return silu_mul_t<F32>(x, rows, inter, out, threads);
    case F16: return silu_mul_t<F16>(x, rows, inter, out, threads);
    case BF16: return silu_mul_t<BF16>(x, rows, inter, out, threads);
  }
}

// Rotary embedding (split halves) in place on q's and k's heads, each product and sum rounded as
// in torch's (x1 cos - x2 sin, x2 cos + x1 sin); then k and v written to their pool rows
// (pool[slots[r]] = row r, converted to the pool's dtype).
template <int DT, int KVDT>
static void rope_store_t(void* q, long q_row, long q_head, long hq, void* k, long k_row, long k_head, const void* v,
                         long v_row, long v_head, long hkv, long dim, long rows, const void* cos, const void* sin,
                         void* k_pool, long kp_slot, long kp_head, void* v_pool, long vp_slot, long vp_head,
                         const int64_t* slots, int threads) {
  const long half = dim / 2;
  parallel_for(rows, row_grain(rows, (hq + 2 * hkv) * dim), threads, [&](long r0, long r1) {
  for (long r = r0; r < r1; ++r) {
    for (long hh = 0; hh < hq + hkv; ++hh) {
      void* x = hh < hq ? q : k;
      const long base = hh < hq ? r * q_row + hh * q_head : r * k_row + (hh - hq) * k_head;
      for (long j = 0; j < half; ++j) {
        const float c = get<DT>(cos, r * half + j), s = get<DT>(sin, r * half + j);
        const float x1 = get<DT>(x, base + j), x2 = get<DT>(x, base + half + j);
        put<DT>(x, base + j, rnd<DT>(x1 * c) - rnd<DT>(x2 * s));
        put<DT>(x, base + half + j, rnd<DT>(x2 * c) + rnd<DT>(x1 * s));
      }
    }
    const long slot = slots[r];
    for (long h = 0; h < hkv; ++h)
      for (long j = 0; j < dim; ++j) {
        put<KVDT>(k_pool, slot * kp_slot + h * kp_head + j, get<DT>(k, r * k_row + h * k_head + j));
        put<KVDT>(v_pool, slot * vp_slot + h * vp_head + j, get<DT>(v, r * v_row + h * v_head + j));
      }
  }
  });
}

static void rope_store(void* q, long q_row, long q_head, long hq, void* k, long k_row, long k_head, const void* v,
                       long v_row, long v_head, long hkv, long dim, long rows, const void* cos, const void* sin,
                       void* k_pool, long kp_slot, long kp_head, void* v_pool, long vp_slot, long vp_head,
                       const int64_t* slots, int dt, int kv_dt, int threads) {
#define HC_CASE(D, K)                                                                                           \
  if (dt == D && kv_dt == K)                                                                                    \
    return rope_store_t<D, K>(q, q_row, q_head, hq, k, k_row, k_head, v, v_row, v_head, hkv, dim, rows, cos, sin, \
                              k_pool, kp_slot, kp_head, v_pool, vp_slot, vp_head, slots, threads);
  HC_CASE(F32, F32) HC_CASE(F32, F16) HC_CASE(F32, BF16)
  HC_CASE(F16, F32) HC_CASE(F16, F16) HC_CASE(F16, BF16)
  HC_CASE(BF16, F32) HC_CASE(BF16, F16) HC_CASE(BF16, BF16)
#undef HC_CASE
}

}  // namespace HC_NS

namespace hc {
extern const Ops HC_OPS_SYMBOL;
const Ops HC_OPS_SYMBOL = {HC_VARIANT_NAME, HC_NS::linear,     HC_NS::decode_attention,
                           HC_NS::add_rms_norm,  HC_NS::silu_mul, HC_NS::rope_store};
}  // namespace hc

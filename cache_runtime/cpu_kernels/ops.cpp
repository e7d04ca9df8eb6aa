// The decode hot path on CPU: a skinny GEMM that streams weights once, attention of decoding
// queries read straight from the paged KV pool, the elementwise steps around them, and a
// Llama-family decoder stack that runs them all for a decode step in one call. Written
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
#if HC_VW == 8
  __m256 r;
  std::memcpy(&r, &v, sizeof r);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
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
// F.linear does. Threads claim chunks of the output columns and read each chunk as R streams
// (R = 4 with one row of x, 2 with more) a 1/R of the chunk apart, R weight rows at a time: a core
// then keeps several DRAM pages in flight, as a copy does, where one sequential stream is held to
// ~3/4 of the bandwidth by the hardware prefetcher (2 Zen 3 cores, one row of x: ~27 GiB/s for
// one stream, ~40 for four). Each weight vector is converted to float32 in registers once and
// used against up to 4 rows of x (float32 copies, 64-byte aligned, in L1/L2), so with R = 2 a
// step loads half as much per FMA as one weight row at a time (~1.6x the FMA rate at 16 rows).
// bf16 weights are read 2W at a time as W 32-bit lanes: a lane shifted left is the even element,
// the lane masked is the odd one, so x is stored with each block of 2W split into evens and odds.
constexpr int MT_MAX = 4;
// A single stream (R = 1) prefetches this far ahead: the hardware prefetchers stop at page
// boundaries and ramp up again after each (~10% on Zen 3).
constexpr long PREFETCH = 1024;

template <int DT> constexpr int step() { return DT == BF16 ? 2 * W : W; }

// x row (k elements of dtype DT) -> float32, in the order linear_rows reads it
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

// 2W bf16 elements of w at element i as W 32-bit lanes: the evens (lane << 16) and the odds (lane
// masked), each as float32
static inline void bf16_pair(const void* w, long i, vf& even, vf& odd) {
  vu lanes;
  std::memcpy(&lanes, static_cast<const uint16_t*>(w) + i, sizeof lanes);
  even = reinterpret_cast<vf>(lanes << 16), odd = reinterpret_cast<vf>(lanes & 0xffff0000u);
}

// R weight rows (element offsets off[r]) against MT rows of x: out[r * MT + m] = sum_k x[m, k] w_r[k].
// Each step converts S elements of every weight row once and loads S of every x row once (the
// smaller set is held in registers while the other streams past it), then runs the MT x R FMAs.
// Accumulators per (row, x row) pair: bf16 keeps evens and odds apart (2U), float32/fp16 U; U steps
// per iteration while few pairs leave FMA latency exposed; at more than 4 pairs bf16 sums evens and
// odds into one, so accumulators and operands fit 16 registers.
template <int DT, int MT, int R>
static inline void linear_rows(const float* x, long k, const void* w, const long* off, float* out) {
  constexpr int S = step<DT>(), P = MT * R;
  constexpr int U = P == 1 ? (DT == BF16 ? 2 : 4) : P == 2 && DT != BF16 ? 2 : 1;
  constexpr int A = DT == BF16 && P <= 4 ? 2 * U : U;  // accumulators per pair
  vf acc[R][MT][A];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < A; ++a) acc[r][m][a] = vf{};
  auto one = [&](long at, int u) {
    if constexpr (DT == BF16) {
      constexpr int odd_slot = A == 2 * U ? 1 : 0;
      auto fma2 = [&](int r, int m, vf xe, vf xo, vf we, vf wo) {
        acc[r][m][A == 2 * U ? 2 * u : u] += xe * we;
        acc[r][m][(A == 2 * U ? 2 * u : u) + odd_slot] += xo * wo;
      };
      if constexpr (MT <= R) {
        vf xe[MT], xo[MT];
        for (int m = 0; m < MT; ++m) xe[m] = vload(x + m * k + at), xo[m] = vload(x + m * k + at + W);
        for (int r = 0; r < R; ++r) {
          vf we, wo;
          bf16_pair(w, off[r] + at, we, wo);
          for (int m = 0; m < MT; ++m) fma2(r, m, xe[m], xo[m], we, wo);
        }
      } else {
        vf we[R], wo[R];
        for (int r = 0; r < R; ++r) bf16_pair(w, off[r] + at, we[r], wo[r]);
        for (int m = 0; m < MT; ++m) {
          const vf xe = vload(x + m * k + at), xo = vload(x + m * k + at + W);
          for (int r = 0; r < R; ++r) fma2(r, m, xe, xo, we[r], wo[r]);
        }
      }
    } else {
      vf wv[R];
      for (int r = 0; r < R; ++r) wv[r] = load<DT>(w, off[r] + at);
      for (int m = 0; m < MT; ++m) {
        const vf xv = vload(x + m * k + at);
        for (int r = 0; r < R; ++r) acc[r][m][u] += xv * wv[r];
      }
    }
  };
  constexpr long elem = DT == F32 ? 4 : 2, bytes = U * S * elem;  // of w per iteration
  const char* wb = static_cast<const char*>(w) + off[0] * elem;
  long i = 0;
  for (; i + U * S <= k; i += U * S) {
    if constexpr (R == 1)
      for (long b = 0; b < bytes; b += 64)
        if (bytes >= 64 || ((i * elem) & 63) == 0) _mm_prefetch(wb + i * elem + b + PREFETCH, _MM_HINT_T0);
    for (int u = 0; u < U; ++u) one(i + u * S, u);
  }
  for (; i + S <= k; i += S) one(i, 0);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      vf t = acc[r][m][0];
      for (int a = 1; a < A; ++a) t += acc[r][m][a];
      float o = hsum(t);
      for (long j = i; j < k; ++j) o += x[m * k + j] * get<DT>(w, off[r] + j);
      out[r * MT + m] = o;
    }
}

// Output columns [c0, c1) for the mb rows of x at xf (rows of k floats): R streams
// a (c1 - c0) / R apart, R weight rows at a time, each against every block of up to 4 rows of x
// (the weight rows come from memory once, then from L1); what is left one row at a time.
template <int DT, int R>
static void linear_cols(const float* xf, long k, long mb, const void* w, long ldw, const void* bias, long c0,
                        long c1, void* y, long ldy) {
  float res[R * MT_MAX];
  const long q = (c1 - c0) / R;
  auto cols = [&](auto rt, long col, long stride) {
    constexpr int RR = decltype(rt)::value;
    long off[RR];
    for (int r = 0; r < RR; ++r) off[r] = (col + r * stride) * ldw;
    for (long r0 = 0; r0 < mb; r0 += MT_MAX) {
      const long mt = std::min<long>(MT_MAX, mb - r0);
      const float* xb = xf + r0 * k;
      switch (mt) {
        case 4: linear_rows<DT, 4, RR>(xb, k, w, off, res); break;
        case 3: linear_rows<DT, 3, RR>(xb, k, w, off, res); break;
        case 2: linear_rows<DT, 2, RR>(xb, k, w, off, res); break;
        default: linear_rows<DT, 1, RR>(xb, k, w, off, res); break;
      }
      for (int r = 0; r < RR; ++r) {
        const long c = col + r * stride;
        const float b = bias ? get<DT>(bias, c) : 0.f;
        for (long m = 0; m < mt; ++m) put<DT>(y, (r0 + m) * ldy + c, res[r * mt + m] + b);
      }
    }
  };
  if constexpr (R > 1)
    for (long col = c0; col < c0 + q; ++col) cols(std::integral_constant<int, R>{}, col, q);
  for (long col = c0 + (R > 1 ? R * q : 0); col < c1; ++col) cols(std::integral_constant<int, 1>{}, col, 0);
}

// Rows of x are taken MB at a time (their float32 copies stay in L2 while w streams past them);
// each block is one parallel pass over w.
constexpr long MB = 16;

template <int DT>
static void linear_t(const void* x, long m, long k, long ldx, const void* w, long n, long ldw, const void* bias,
                     void* y, long ldy, int threads) {
  static thread_local std::vector<float> xs;
  xs.resize(size_t(std::min(m, MB)) * k + 16);
  float* xa = xs.data() + ((64 - reinterpret_cast<uintptr_t>(xs.data()) % 64) % 64) / 4;  // 64-byte aligned
  constexpr long elem = DT == F32 ? 4 : 2;
  // Chunks of w's rows, guided: up to 512 KiB of w while much is left (long runs keep each
  // thread's streams and prefetch going), shrinking to 64 KiB as the matrix runs out (each a
  // 1/(2 x threads) share of what is left), so the threads finish together.
  static thread_local std::vector<long> bounds;
  bounds.assign(1, 0);
  const long big = std::max(1L, (512L << 10) / (k * elem)), small = std::max(1L, (64L << 10) / (k * elem));
  for (long at = 0; at < n;)
    bounds.push_back(at += std::min(n - at, std::max(small, std::min(big, (n - at) / (2L * threads)))));
  const long chunks = long(bounds.size()) - 1, *bound = bounds.data();  // workers see the caller's
  for (long r0 = 0; r0 < m; r0 += MB) {
    const long mb = std::min(MB, m - r0);
    for (long r = 0; r < mb; ++r)
      stage_x<DT>(static_cast<const char*>(x) + (r0 + r) * ldx * elem, k, xa + r * k);
    char* yb = static_cast<char*>(y) + r0 * ldy * elem;
    parallel_for(chunks, 1, threads, [&](long c0, long c1) {
      if (mb == 1) return linear_cols<DT, 4>(xa, k, mb, w, ldw, bias, bound[c0], bound[c1], yb, ldy);
      linear_cols<DT, 2>(xa, k, mb, w, ldw, bias, bound[c0], bound[c1], yb, ldy);
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

// Decoding queries over their context in the paged pool, flash-decoding style: each sequence's
// context is cut into chunks of keys, the chunks of every sequence are the work items the threads
// share, and each item reads whole pool rows (every KV head of a token), T_KEYS tokens at a
// time, so contiguous slots stream like an array. An item scores every query head against its
// keys, takes its softmax partials (max, sum) and the unnormalised probability-weighted sum of its
// value rows; the partials of a sequence then merge into its row of the output. Scores and
// softmax in float32.
constexpr int T_KEYS = 4;

struct AttnShape {
  long q_row, q_head, hq, dk, k_slot, k_head, v_slot, v_head, dv, hkv, group;
  float scale;
};

// scores of every query head against the NT keys at pool slots sl: sc[head * stride + t]
template <int KDT, int NT>
static inline void scores_rows(const AttnShape& a, const float* qf, const void* kp, const int64_t* sl, float* sc,
                               long stride) {
  for (long hq = 0; hq < a.hq; ++hq) {
    const float* qh = qf + hq * a.dk;
    long kb[NT];
    for (int t = 0; t < NT; ++t) kb[t] = sl[t] * a.k_slot + (hq / a.group) * a.k_head;
    vf acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = vf{};
    long i = 0;
    for (; i + W <= a.dk; i += W) {
      const vf qv = vload(qh + i);
      for (int t = 0; t < NT; ++t) acc[t] += qv * load<KDT>(kp, kb[t] + i);
    }
    for (int t = 0; t < NT; ++t) {
      float s = hsum(acc[t]);
      for (long j = i; j < a.dk; ++j) s += qh[j] * get<KDT>(kp, kb[t] + j);
      sc[hq * stride + t] = s;
    }
  }
}

// acc[head][dv] += sum over the NT value rows at pool slots sl of p[head * stride + t] * row
template <int KDT, int NT>
static inline void accumulate_rows(const AttnShape& a, const float* p, long stride, const void* vp, const int64_t* sl,
                                   float* acc) {
  for (long hq = 0; hq < a.hq; ++hq) {
    long vb[NT];
    for (int t = 0; t < NT; ++t) vb[t] = sl[t] * a.v_slot + (hq / a.group) * a.v_head;
    float* o = acc + hq * a.dv;
    vf ps[NT];
    for (int t = 0; t < NT; ++t) ps[t] = vsplat(p[hq * stride + t]);
    long d = 0;
    for (; d + W <= a.dv; d += W) {
      vf x = vload(o + d);
      for (int t = 0; t < NT; ++t) x += ps[t] * load<KDT>(vp, vb[t] + d);
      vstore(o + d, x);
    }
    for (; d < a.dv; ++d)
      for (int t = 0; t < NT; ++t) o[d] += p[hq * stride + t] * get<KDT>(vp, vb[t] + d);
  }
}

// One item: query row `row` over keys sl[0..len). part = [acc (hq x dv) | max (hq) | sum (hq)],
// acc unnormalised and max in scaled units.
template <int KDT, int IODT>
static void attend_chunk(const AttnShape& a, const void* q, long row, const void* kp, const void* vp,
                         const int64_t* sl, long len, float* part, std::vector<float>& buf) {
  buf.resize(size_t(a.hq * a.dk + a.hq * len));
  float* qf = buf.data();
  float* sc = qf + a.hq * a.dk;
  for (long h = 0; h < a.hq; ++h) {
    const long base = row * a.q_row + h * a.q_head;
    long i = 0;
    for (; i + W <= a.dk; i += W) vstore(qf + h * a.dk + i, load<IODT>(q, base + i));
    for (; i < a.dk; ++i) qf[h * a.dk + i] = get<IODT>(q, base + i);
  }
  long t = 0;
  for (; t + T_KEYS <= len; t += T_KEYS) scores_rows<KDT, T_KEYS>(a, qf, kp, sl + t, sc + t, len);
  for (; t < len; ++t) scores_rows<KDT, 1>(a, qf, kp, sl + t, sc + t, len);
  float* acc = part;
  float* mx_out = part + a.hq * a.dv;
  float* sum_out = mx_out + a.hq;
  for (long h = 0; h < a.hq; ++h) {
    float* s = sc + h * len;
    float mx = -INFINITY;
    for (long j = 0; j < len; ++j) mx = std::max(mx, s[j]);
    mx *= a.scale;
    const vf vs = vsplat(a.scale), vm = vsplat(mx);
    vf vsum{};
    long j = 0;
    for (; j + W <= len; j += W) {
      const vf e = vexp(vload(s + j) * vs - vm);
      vstore(s + j, e);
      vsum += e;
    }
    float sum = hsum(vsum);
    for (; j < len; ++j) {
      s[j] = std::exp(s[j] * a.scale - mx);
      sum += s[j];
    }
    mx_out[h] = mx;
    sum_out[h] = sum;
  }
  std::fill(acc, acc + a.hq * a.dv, 0.f);
  for (t = 0; t + T_KEYS <= len; t += T_KEYS) accumulate_rows<KDT, T_KEYS>(a, sc + t, len, vp, sl + t, acc);
  for (; t < len; ++t) accumulate_rows<KDT, 1>(a, sc + t, len, vp, sl + t, acc);
}

template <int KDT, int IODT>
static void attention_t(const void* q, const AttnShape& a, const void* kp, const void* vp, long n, const int64_t* rows,
                        const int64_t* offsets, const int64_t* slots, void* out, long o_row, long o_head, int threads) {
  // chunk length: about four items per thread over the whole batch, 32..512 keys each
  const long total = offsets[n] - offsets[0];
  const long chunk = std::min(512L, std::max(32L, (total + 4L * threads - 1) / (4L * threads)));
  std::vector<long> first(n + 1, 0);  // first item of each sequence
  for (long i = 0; i < n; ++i) first[i + 1] = first[i] + (offsets[i + 1] - offsets[i] + chunk - 1) / chunk;
  const long items = first[n], part = a.hq * (a.dv + 2);
  std::vector<float> parts(size_t(items * part));
  parallel_for(items, 1, threads, [&](long lo, long hi) {
    static thread_local std::vector<float> buf;
    long i = long(std::upper_bound(first.begin(), first.end(), lo) - first.begin()) - 1;
    for (long it = lo; it < hi; ++it) {
      while (first[i + 1] <= it) ++i;
      const long k0 = offsets[i] + (it - first[i]) * chunk, k1 = std::min(offsets[i + 1], k0 + chunk);
      attend_chunk<KDT, IODT>(a, q, rows[i], kp, vp, slots + k0, k1 - k0, parts.data() + it * part, buf);
    }
  });
  // merge: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c
  parallel_for(n, std::max(1L, 4096L / std::max(1L, a.hq * a.dv)), threads, [&](long s0, long s1) {
    std::vector<float> weight;
    for (long i = s0; i < s1; ++i)
      for (long h = 0; h < a.hq; ++h) {
        const long o = rows[i] * o_row + h * o_head;
        if (first[i] == first[i + 1]) {  // no context: nothing to attend
          for (long d = 0; d < a.dv; ++d) put<IODT>(out, o + d, 0.f);
          continue;
        }
        const long c0 = first[i], nc = first[i + 1] - c0;
        float m = -INFINITY, l = 0.f;
        for (long c = 0; c < nc; ++c) m = std::max(m, parts[(c0 + c) * part + a.hq * a.dv + h]);
        weight.resize(size_t(nc));
        for (long c = 0; c < nc; ++c) {
          const float* pc = parts.data() + (c0 + c) * part;
          weight[c] = std::exp(pc[a.hq * a.dv + h] - m);
          l += weight[c] * pc[a.hq * a.dv + a.hq + h];
        }
        for (long d = 0; d < a.dv; ++d) {
          float x = 0.f;
          for (long c = 0; c < nc; ++c) x += weight[c] * parts[(c0 + c) * part + h * a.dv + d];
          put<IODT>(out, o + d, x / l);
        }
      }
  });
}

static void decode_attention(const void* q, long q_row, long q_head, long hq, long dk, const void* kp, long k_slot,
                             long k_head, const void* vp, long v_slot, long v_head, long dv, long hkv, int kv_dt,
                             int io_dt, long n, const int64_t* rows, const int64_t* offsets, const int64_t* slots,
                             float scale, void* out, long o_row, long o_head, int threads) {
  const AttnShape a{q_row, q_head, hq, dk, k_slot, k_head, v_slot, v_head, dv, hkv, hq / hkv, scale};
#define HC_CASE(K, I) \
  if (kv_dt == K && io_dt == I) return attention_t<K, I>(q, a, kp, vp, n, rows, offsets, slots, out, o_row, o_head, threads);
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

// ------------------------------------------------------------------------------------ decoder stack
// Every layer of a Llama-family decoder for a batch of decoding rows, in one call: the ops above
// in the order the model's Python forward runs them (norm, q/k/v, q/k norm, RoPE and the KV
// store, attention, o, norm, gate/up, SiLU x up, down), so a decode step crosses into Python once
// instead of about ten times a layer. h (n x hidden) is the residual stream: on return it holds
// the last layer's output added in. Biases of o and down are added inside their matmul.
template <int DT>
static void add_into(void* h, const void* delta, long count) {
  for (long i = 0; i < count; ++i) put<DT>(h, i, get<DT>(h, i) + get<DT>(delta, i));
}

static void decode_stack(const DecoderLayer* layers, const DecoderShape* s, void* h, long n, const void* cos,
                         const void* sin, const int64_t* out_slots, const int64_t* rows, const int64_t* offsets,
                         const int64_t* slots, int threads) {
  const long H = s->hidden, D = s->head_dim, nq = s->heads, nkv = s->kv_heads, I = s->inter;
  const long qkv_w = (nq + 2 * nkv) * D, elem = s->dt == F32 ? 4 : 2;
  static thread_local std::vector<char> scratch;
  scratch.resize(size_t(n * (3 * H + qkv_w + nq * D + 3 * I) * elem));
  char* x = scratch.data();
  char* delta = x + n * H * elem;
  char* o = delta + n * H * elem;
  char* qkv = o + n * H * elem;
  char* attn = qkv + n * qkv_w * elem;
  char* gate_up = attn + n * nq * D * elem;
  char* act = gate_up + n * 2 * I * elem;
  for (long l = 0; l < s->layers; ++l) {
    const DecoderLayer& L = layers[l];
    add_rms_norm(h, l ? delta : nullptr, L.ln1, n, H, s->eps, x, s->dt, threads);
    linear(x, n, H, H, L.wqkv, qkv_w, H, L.bqkv, qkv, qkv_w, s->dt, threads);
    if (L.q_norm)
      for (long r = 0; r < n; ++r) {
        char* qr = qkv + r * qkv_w * elem;
        add_rms_norm(qr, nullptr, L.q_norm, nq, D, s->eps, qr, s->dt, threads);
        add_rms_norm(qr + nq * D * elem, nullptr, L.k_norm, nkv, D, s->eps, qr + nq * D * elem, s->dt, threads);
      }
    rope_store(qkv, qkv_w, D, nq, qkv + nq * D * elem, qkv_w, D, qkv + (nq + nkv) * D * elem, qkv_w, D, nkv, D, n,
               cos, sin, L.k_pool, s->kp_slot, s->kp_head, L.v_pool, s->vp_slot, s->vp_head, out_slots, s->dt,
               s->kv_dt, threads);
    decode_attention(qkv, qkv_w, D, nq, D, L.k_pool, s->kp_slot, s->kp_head, L.v_pool, s->vp_slot, s->vp_head, D, nkv,
                     s->kv_dt, s->dt, n, rows, offsets, slots, s->scale, attn, nq * D, D, threads);
    linear(attn, n, nq * D, nq * D, L.wo, H, nq * D, L.bo, o, H, s->dt, threads);
    add_rms_norm(h, o, L.ln2, n, H, s->eps, x, s->dt, threads);
    linear(x, n, H, H, L.w_gate_up, 2 * I, H, L.b_gate_up, gate_up, 2 * I, s->dt, threads);
    silu_mul(gate_up, n, I, act, s->dt, threads);
    linear(act, n, I, I, L.w_down, H, I, L.b_down, delta, H, s->dt, threads);
  }
  if (s->layers == 0) return;
  switch (s->dt) {
    case F32: return add_into<F32>(h, delta, n * H);
    case F16: return add_into<F16>(h, delta, n * H);
    case BF16: return add_into<BF16>(h, delta, n * H);
  }
}

}  // namespace HC_NS

namespace hc {
extern const Ops HC_OPS_SYMBOL;
const Ops HC_OPS_SYMBOL = {HC_VARIANT_NAME,     HC_NS::linear,   HC_NS::decode_attention, HC_NS::add_rms_norm,
                           HC_NS::silu_mul,     HC_NS::rope_store, HC_NS::decode_stack};
}  // namespace hc

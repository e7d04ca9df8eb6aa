// Shared by every variant of ops.cpp and by api.cpp: dtype codes, scalar conversions, the op table.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace hc {

// dtype codes, as cache_runtime/cpu_kernels/__init__.py passes them
enum DType : int { F32 = 0, F16 = 1, BF16 = 2 };

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// round to nearest even, as torch rounds float32 to bfloat16
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Runs fn(ctx, begin, end) over [0, n) in chunks of `grain` on up to `threads` threads (pool.cpp).
typedef void (*ParallelFn)(void* ctx, long begin, long end);
void run_parallel(long n, long grain, int threads, ParallelFn fn, void* ctx);

template <class F>
inline void parallel_for(long n, long grain, int threads, F&& f) {
  if (threads <= 1 || n <= grain) return f(0L, n);
  run_parallel(n, grain, threads, [](void* c, long b, long e) { (*static_cast<std::remove_reference_t<F>*>(c))(b, e); },
               &f);
}

// One Llama-family decoder layer: its tensors (null where the model has none) and its KV pools.
struct DecoderLayer {
  const void *ln1, *wqkv, *bqkv, *q_norm, *k_norm, *wo, *bo, *ln2, *w_gate_up, *b_gate_up, *w_down, *b_down;
  void *k_pool, *v_pool;
};

// What the layers of a decoder stack share: sizes, pool strides (elements), eps, scale, dtypes.
struct DecoderShape {
  long layers, hidden, heads, kv_heads, head_dim, inter, kp_slot, kp_head, vp_slot, vp_head;
  float eps, scale;
  int dt, kv_dt;
};

// The kernels of one instruction-set variant (see ops.cpp for what each computes).
struct Ops {
  const char* name;
  void (*linear)(const void* x, long m, long k, long ldx, const void* w, long n, long ldw, const void* bias,
                 void* y, long ldy, int dt, int threads);
  void (*decode_attention)(const void* q, long q_row, long q_head, long hq, long dk, const void* kp, long k_slot,
                           long k_head, const void* vp, long v_slot, long v_head, long dv, long hkv, int kv_dt,
                           int io_dt, long n, const int64_t* rows, const int64_t* offsets, const int64_t* slots,
                           float scale, void* out, long o_row, long o_head, int threads);
  void (*add_rms_norm)(void* h, const void* delta, const void* w, long rows, long dim, float eps, void* out, int dt,
                       int threads);
  void (*silu_mul)(const void* x, long rows, long inter, void* out, int dt, int threads);
  void (*rope_store)(void* q, long q_row, long q_head, long hq, void* k, long k_row, long k_head, const void* v,
                     long v_row, long v_head, long hkv, long dim, long rows, const void* cos, const void* sin,
                     void* k_pool, long kp_slot, long kp_head, void* v_pool, long vp_slot, long vp_head,
                     const int64_t* slots, int dt, int kv_dt, int threads);
  void (*decode_stack)(const DecoderLayer* layers, const DecoderShape* shape, void* h, long n, const void* cos,
                       const void* sin, const int64_t* out_slots, const int64_t* rows, const int64_t* offsets,
                       const int64_t* slots, int threads);
};

}  // namespace hc

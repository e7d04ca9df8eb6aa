// The C ABI ctypes loads: which variants this CPU runs, the one in use, and the ops through it.
// Built without instruction-set flags, so loading it is safe on any x86-64 CPU: a CPU without
// AVX2+FMA+F16C gets no variant (hc_select fails) and the runtime keeps to torch.
#include <cstring>

#include "common.h"

namespace hc {
extern const Ops ops_avx2;      // 8 floats a vector, AVX2+FMA+F16C
extern const Ops ops_avx2_w16;  // the same code at 16 floats a vector (the AVX-512 variant's logic, for tests)
extern const Ops ops_avx512;    // 16 floats a vector, AVX-512 F/BW/VL/DQ
}  // namespace hc

namespace {
const hc::Ops* active = nullptr;

bool runs(const hc::Ops& ops) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (&ops == &hc::ops_avx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return avx2;
}

const hc::Ops* const all[] = {&hc::ops_avx512, &hc::ops_avx2, &hc::ops_avx2_w16};  // preference order
}  // namespace

extern "C" {

// sha256 of the sources this library was built from (build.py)
const char* hc_sources() { return HC_SOURCES; }

// Comma-separated variants this CPU can run, best first.
const char* hc_variants() {
  static char out[128];
  out[0] = 0;
  for (const hc::Ops* ops : all)
    if (runs(*ops)) {
      if (out[0]) std::strcat(out, ",");
      std::strcat(out, ops->name);
    }
  return out;
}

// Makes `name` the active variant ("" = the best this CPU runs); 0 on success, -1 if it cannot run here.
int hc_select(const char* name) {
  for (const hc::Ops* ops : all)
    if (runs(*ops) && (!name[0] || !std::strcmp(name, ops->name))) {
      active = ops;
      return 0;
    }
  return -1;
}

const char* hc_active() { return active ? active->name : ""; }

void hc_linear(const void* x, long m, long k, long ldx, const void* w, long n, long ldw, const void* bias, void* y,
               long ldy, int dt, int threads) {
  active->linear(x, m, k, ldx, w, n, ldw, bias, y, ldy, dt, threads);
}

void hc_decode_attention(const void* q, long q_row, long q_head, long hq, long dk, const void* kp, long k_slot,
                         long k_head, const void* vp, long v_slot, long v_head, long dv, long hkv, int kv_dt,
                         int io_dt, long n, const int64_t* rows, const int64_t* offsets, const int64_t* slots,
                         float scale, void* out, long o_row, long o_head, int threads) {
  active->decode_attention(q, q_row, q_head, hq, dk, kp, k_slot, k_head, vp, v_slot, v_head, dv, hkv, kv_dt, io_dt,
                           n, rows, offsets, slots, scale, out, o_row, o_head, threads);
}

void hc_add_rms_norm(void* h, const void* delta, const void* w, long rows, long dim, float eps, void* out, int dt,
                     int threads) {
  active->add_rms_norm(h, delta, w, rows, dim, eps, out, dt, threads);
}

void hc_silu_mul(const void* x, long rows, long inter, void* out, int dt, int threads) {
  active->silu_mul(x, rows, inter, out, dt, threads);
}

void hc_rope_store(void* q, long q_row, long q_head, long hq, void* k, long k_row, long k_head, const void* v,
                   long v_row, long v_head, long hkv, long dim, long rows, const void* cos, const void* sin,
                   void* k_pool, long kp_slot, long kp_head, void* v_pool, long vp_slot, long vp_head,
                   const int64_t* slots, int dt, int kv_dt, int threads) {
  active->rope_store(q, q_row, q_head, hq, k, k_row, k_head, v, v_row, v_head, hkv, dim, rows, cos, sin, k_pool,
                     kp_slot, kp_head, v_pool, vp_slot, vp_head, slots, dt, kv_dt, threads);
}

void hc_decode_stack(const hc::DecoderLayer* layers, const hc::DecoderShape* shape, void* h, long n, const void* cos,
                     const void* sin, const int64_t* out_slots, const int64_t* rows, const int64_t* offsets,
                     const int64_t* slots, int threads) {
  active->decode_stack(layers, shape, h, n, cos, sin, out_slots, rows, offsets, slots, threads);
}

}  // extern "C"

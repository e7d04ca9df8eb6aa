// KV-cache transfer between the device pool (L1, one (slots, H, D) tensor per
// layer and K/V) and the pinned host pool (L2, SGLang layer_first / page_first /
// page_first_direct). Exposed as a C ABI so a ctypes wrapper can call it with
// raw data_ptr()s and torch's current stream; no libtorch dependency, so the
// same .so builds on a CPU-only CI machine and on any GPU machine.
//
// Address arithmetic lives in __host__ __device__ functions: the kernel, the
// DMA planner and the exported hc_host_offsets() share it, which is what lets
// CI (no GPU) check the compiled offsets against torch's strides.

#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#include <mutex>
#include <vector>

#define HC_API extern "C" __attribute__((visibility("default")))

// Bumped whenever a struct or signature below changes; the Python loader refuses
// a library with another value.
#define HC_ABI_VERSION 1

enum { HC_LAYER_FIRST = 0, HC_PAGE_FIRST = 1, HC_PAGE_FIRST_DIRECT = 2 };

enum {
  HC_OK = 0,
  HC_E_LAYOUT = -1,      // host layout description is inconsistent
  HC_E_ARGS = -2,        // transfer arguments are inconsistent
  HC_E_CAPACITY = -3,    // output buffer of hc_plan_direct too small
  HC_E_NOT_PINNED = -4,  // kernel path: the host pool is not page-locked memory
  HC_E_DEVICE_PTR = -5,  // a device plane is not memory of `device`
};

// Every field is 8 bytes wide so the ctypes mirror has no padding to get wrong.
typedef struct {
  int64_t kind;        // HC_LAYER_FIRST / HC_PAGE_FIRST / HC_PAGE_FIRST_DIRECT
  int64_t has_v;       // 1 = MHA (K and V halves), 0 = MLA (one latent buffer)
  int64_t num_layers;
  int64_t num_slots;   // tokens in the host pool (page_num * page_size)
  int64_t page_size;
  int64_t item_bytes;  // one token of one layer of K (or V): H * D * elem
} hc_host_layout;

typedef struct {
  hc_host_layout host;
  uint64_t host_base;     // host_kv.data_ptr()
  const uint64_t* dev_k;  // layer_count device K (or latent) base pointers
  const uint64_t* dev_v;  // layer_count device V base pointers; NULL for MLA
  int64_t dev_slots;      // rows of each device tensor
  int64_t layer_begin;    // host layer that dev_k[0] pairs with
  int64_t layer_count;
  const int64_t* host_idx;  // token slots; device memory for the kernel path,
  const int64_t* dev_idx;   // host memory for the DMA path and the planner
  int64_t n;
  int64_t to_host;   // 0: host -> device (load), 1: device -> host (write-back)
  int64_t num_ctas;  // <= 0: kDefaultCtas
  int64_t device;
  uint64_t stream;  // cudaStream_t as an integer (torch: stream.cuda_stream)
} hc_transfer_args;

namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 1024;
constexpr int kUnroll = 4;       // vectors per lane loaded before any store
constexpr int kMaxPlanes = 128;  // (layer, K/V) planes per launch: 64 MHA layers
constexpr int kDefaultCtas = 8;

// Where token `slot` of one plane starts, relative to the plane base. A page is
// page_size consecutive slots; layouts without page-level grouping use
// page_size 1 with page_stride == token_stride.
struct SlotGeom {
  int64_t page_size;
  int64_t page_stride;
  int64_t token_stride;
};

__host__ __device__ inline int64_t slot_offset(const SlotGeom& g, int64_t slot) {
  if (g.page_size == 1) return slot * g.page_stride;
  return (slot / g.page_size) * g.page_stride + (slot % g.page_size) * g.token_stride;
}

__host__ __device__ inline SlotGeom host_slot_geom(const hc_host_layout& h) {
  const int64_t item = h.item_bytes;
  switch (h.kind) {
    case HC_LAYER_FIRST:  // (L, size, item): token after token
      return SlotGeom{1, item, item};
    case HC_PAGE_FIRST:  // (size, L, item): a token holds every layer
      return SlotGeom{1, h.num_layers * item, h.num_layers * item};
    default:  // (page_num, L, P, item): a page holds every layer, P tokens each
      return SlotGeom{h.page_size, h.num_layers * h.page_size * item, item};
  }
}

// Byte offset of (kv, layer, slot 0) in the host pool; K is the first half.
__host__ __device__ inline int64_t host_plane_offset(const hc_host_layout& h, int64_t kv,
                                                     int64_t layer) {
  const int64_t item = h.item_bytes;
  const int64_t half = h.num_layers * h.num_slots * item;
  int64_t layer_off;
  switch (h.kind) {
    case HC_LAYER_FIRST: layer_off = layer * h.num_slots * item; break;
    case HC_PAGE_FIRST: layer_off = layer * item; break;
    default: layer_off = layer * h.page_size * item; break;
  }
  return kv * half + layer_off;
}

__host__ __device__ inline int64_t host_offset(const hc_host_layout& h, int64_t kv,
                                               int64_t layer, int64_t slot) {
  return host_plane_offset(h, kv, layer) + slot_offset(host_slot_geom(h), slot);
}

// Device pool: one contiguous (slots, H, D) tensor per plane.
__host__ __device__ inline SlotGeom device_slot_geom(int64_t item_bytes) {
  return SlotGeom{1, item_bytes, item_bytes};
}

bool layout_ok(const hc_host_layout& h) {
  if (h.kind < HC_LAYER_FIRST || h.kind > HC_PAGE_FIRST_DIRECT) return false;
  if (h.has_v != 0 && h.has_v != 1) return false;
  if (h.num_layers < 1 || h.num_slots < 0 || h.page_size < 1 || h.item_bytes < 1) return false;
  return h.num_slots % h.page_size == 0;
}

bool args_ok(const hc_transfer_args& a) {
  if (!layout_ok(a.host)) return false;
  if (a.host_base == 0 || a.dev_k == nullptr) return false;
  if ((a.dev_v != nullptr) != (a.host.has_v == 1)) return false;
  if (a.layer_begin < 0 || a.layer_count < 1) return false;
  if (a.layer_begin + a.layer_count > a.host.num_layers) return false;
  if (a.n < 0 || a.dev_slots < 0) return false;
  if (a.n > 0 && (a.host_idx == nullptr || a.dev_idx == nullptr)) return false;
  return a.to_host == 0 || a.to_host == 1;
}

// One side (source or destination) of a transfer as the copy loops see it.
struct Side {
  SlotGeom geom;
  int64_t slots;
  const int64_t* idx;
};

struct Sides {
  Side src, dst;
};

Sides sides_of(const hc_transfer_args& a) {
  Side host{host_slot_geom(a.host), a.host.num_slots, a.host_idx};
  Side dev{device_slot_geom(a.host.item_bytes), a.dev_slots, a.dev_idx};
  return a.to_host ? Sides{dev, host} : Sides{host, dev};
}

int64_t num_planes(const hc_transfer_args& a) { return a.layer_count * (a.host.has_v ? 2 : 1); }

// Plane p = kv * layer_count + l: K planes of every layer, then V planes.
void plane_bases(const hc_transfer_args& a, int64_t p, uint64_t* src, uint64_t* dst) {
  const int64_t kv = p / a.layer_count, l = p % a.layer_count;
  const uint64_t host =
      a.host_base + (uint64_t)host_plane_offset(a.host, kv, a.layer_begin + l);
  const uint64_t dev = (kv ? a.dev_v : a.dev_k)[l];
  *src = a.to_host ? dev : host;
  *dst = a.to_host ? host : dev;
}

__host__ __device__ inline bool pair_in_range(int64_t s, int64_t d, int64_t s_slots, int64_t d_slots) {
  return s >= 0 && d >= 0 && s < s_slots && d < d_slots;
}

// ---------------------------------------------------------------------------
// SM copy kernel. A warp moves one item (one token of one plane); each lane
// issues kUnroll 16-byte loads before its stores, so a 1024-thread CTA keeps
// 64 KiB in flight, which PCIe reads (non-posted, ~1-2 us) need to approach
// the link rate. Loads bypass L1 (.nc + L1::no_allocate); stores to host
// stream past the caches (.cs), stores to the device pool stop at L2 (.cg)
// where the forward pass will read them.

template <int VEC>
struct Vec;
template <>
struct Vec<16> { uint4 v; };
template <>
struct Vec<8> { uint2 v; };
template <>
struct Vec<4> { uint32_t v; };
template <>
struct Vec<1> { uint32_t v; };

__device__ __forceinline__ void load_nc(Vec<16>& r, const void* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.v.x), "=r"(r.v.y), "=r"(r.v.z), "=r"(r.v.w)
               : "l"(p));
}
__device__ __forceinline__ void load_nc(Vec<8>& r, const void* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
               : "=r"(r.v.x), "=r"(r.v.y)
               : "l"(p));
}
__device__ __forceinline__ void load_nc(Vec<4>& r, const void* p) {
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r.v) : "l"(p));
}
__device__ __forceinline__ void load_nc(Vec<1>& r, const void* p) {
  asm volatile("ld.global.nc.L1::no_allocate.u8 %0, [%1];" : "=r"(r.v) : "l"(p));
}

// TO_HOST: .cs (evict-first streaming); to device: .cg (cache at L2 only).
template <bool TO_HOST>
__device__ __forceinline__ void store(void* p, const Vec<16>& r) {
  if (TO_HOST)
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(r.v.x), "r"(r.v.y),
                 "r"(r.v.z), "r"(r.v.w)
                 : "memory");
  else
    asm volatile("st.global.cg.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(r.v.x), "r"(r.v.y),
                 "r"(r.v.z), "r"(r.v.w)
                 : "memory");
}
template <bool TO_HOST>
__device__ __forceinline__ void store(void* p, const Vec<8>& r) {
  if (TO_HOST)
    asm volatile("st.global.cs.v2.u32 [%0], {%1,%2};" ::"l"(p), "r"(r.v.x), "r"(r.v.y) : "memory");
  else
    asm volatile("st.global.cg.v2.u32 [%0], {%1,%2};" ::"l"(p), "r"(r.v.x), "r"(r.v.y) : "memory");
}
template <bool TO_HOST>
__device__ __forceinline__ void store(void* p, const Vec<4>& r) {
  if (TO_HOST)
    asm volatile("st.global.cs.u32 [%0], %1;" ::"l"(p), "r"(r.v) : "memory");
  else
    asm volatile("st.global.cg.u32 [%0], %1;" ::"l"(p), "r"(r.v) : "memory");
}
template <bool TO_HOST>
__device__ __forceinline__ void store(void* p, const Vec<1>& r) {
  if (TO_HOST)
    asm volatile("st.global.cs.u8 [%0], %1;" ::"l"(p), "r"(r.v) : "memory");
  else
    asm volatile("st.global.cg.u8 [%0], %1;" ::"l"(p), "r"(r.v) : "memory");
}

struct PlaneTable {
  uint64_t src[kMaxPlanes];
  uint64_t dst[kMaxPlanes];
};

struct KernelArgs {
  Side src, dst;
  int64_t n;
  int64_t planes;
  int64_t item_bytes;
};

template <int VEC, bool TO_HOST>
__global__ void __launch_bounds__(kThreads, 1) copy_items(KernelArgs a, PlaneTable t) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  const int64_t warps = (int64_t)gridDim.x * blockDim.x / kWarp;
  const int64_t total = a.n * a.planes;
  constexpr int64_t kStep = (int64_t)kWarp * VEC;
  for (int64_t item = warp; item < total; item += warps) {
    // Consecutive warps take consecutive indices of one plane, so sorted runs
    // of slots become neighbouring addresses.
    const int64_t plane = item / a.n, i = item - plane * a.n;
    const int64_t s = a.src.idx[i], d = a.dst.idx[i];
    // Negative = skip; out of range is rejected by the wrapper, and skipped
    // here too so a bad index can never write outside a buffer.
    if (!pair_in_range(s, d, a.src.slots, a.dst.slots)) continue;
    const char* src = (const char*)t.src[plane] + slot_offset(a.src.geom, s);
    char* dst = (char*)t.dst[plane] + slot_offset(a.dst.geom, d);
    for (int64_t base = lane * VEC; base < a.item_bytes; base += kStep * kUnroll) {
      Vec<VEC> r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * kStep < a.item_bytes) load_nc(r[u], src + base + u * kStep);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * kStep < a.item_bytes) store<TO_HOST>(dst + base + u * kStep, r[u]);
    }
  }
}

int64_t gcd64(int64_t a, int64_t b) {
  while (b) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a < 0 ? -a : a;
}

// Widest vector every address of the transfer is aligned to.
int vector_width(const hc_transfer_args& a) {
  const Sides s = sides_of(a);
  int64_t g = gcd64(a.host.item_bytes, 16);
  g = gcd64(g, s.src.geom.page_stride);
  g = gcd64(g, s.src.geom.token_stride);
  g = gcd64(g, s.dst.geom.page_stride);
  g = gcd64(g, s.dst.geom.token_stride);
  for (int64_t p = 0; p < num_planes(a); ++p) {
    uint64_t src, dst;
    plane_bases(a, p, &src, &dst);
    g = gcd64(g, (int64_t)(src % 16));
    g = gcd64(g, (int64_t)(dst % 16));
  }
  if (g >= 16) return 16;
  if (g >= 8) return 8;
  if (g >= 4) return 4;
  return 1;
}

template <int VEC>
void launch(const KernelArgs& k, const PlaneTable& t, bool to_host, int grid, int threads,
            cudaStream_t stream) {
  if (to_host)
    copy_items<VEC, true><<<grid, threads, 0, stream>>>(k, t);
  else
    copy_items<VEC, false><<<grid, threads, 0, stream>>>(k, t);
}

// ---------------------------------------------------------------------------
// DMA path: copies merged into runs of contiguous bytes on both sides.

struct Run {
  uint64_t dst, src, bytes;
};

void plan_runs(const hc_transfer_args& a, std::vector<Run>* out) {
  const Sides s = sides_of(a);
  const uint64_t item = (uint64_t)a.host.item_bytes;
  for (int64_t p = 0; p < num_planes(a); ++p) {
    uint64_t src_base, dst_base;
    plane_bases(a, p, &src_base, &dst_base);
    for (int64_t i = 0; i < a.n; ++i) {
      const int64_t si = s.src.idx[i], di = s.dst.idx[i];
      if (!pair_in_range(si, di, s.src.slots, s.dst.slots)) continue;
      const uint64_t src = src_base + (uint64_t)slot_offset(s.src.geom, si);
      const uint64_t dst = dst_base + (uint64_t)slot_offset(s.dst.geom, di);
      if (!out->empty()) {
        Run& r = out->back();
        if (r.src + r.bytes == src && r.dst + r.bytes == dst) {
          r.bytes += item;
          continue;
        }
      }
      out->push_back(Run{dst, src, item});
    }
  }
}

// Driver functions through the runtime's entry-point query (the library links no
// libcuda): a driver without `name` at ABI `version` yields an error, not a crash.
template <typename Fn>
cudaError_t driver_entry(const char* name, int version, Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &q);
  if (err != cudaSuccess) return err;
  if (q != cudaDriverEntryPointSuccess) return cudaErrorSymbolNotFound;
  *out = (Fn)fn;
  return cudaSuccess;
}

PFN_cuMemcpyBatchAsync_v12080 batch_fn = nullptr;
std::once_flag batch_once;

// 12.8 ABI, so a driver without the batch API (older than 12.8) leaves it null.
PFN_cuMemcpyBatchAsync_v12080 batch_memcpy() {
  std::call_once(batch_once, [] {
    if (driver_entry("cuMemcpyBatchAsync", 12080, &batch_fn) != cudaSuccess) {
      batch_fn = nullptr;
      cudaGetLastError();
    }
  });
  return batch_fn;
}

bool try_batch(const std::vector<Run>& runs, cudaStream_t stream) {
  // The batch API refuses the legacy NULL stream (torch's default stream).
  if (stream == nullptr || runs.empty()) return false;
  PFN_cuMemcpyBatchAsync_v12080 fn = batch_memcpy();
  if (fn == nullptr) return false;
  std::vector<CUdeviceptr> dsts(runs.size()), srcs(runs.size());
  std::vector<size_t> sizes(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    dsts[i] = (CUdeviceptr)runs[i].dst;
    srcs[i] = (CUdeviceptr)runs[i].src;
    sizes[i] = (size_t)runs[i].bytes;
  }
  CUmemcpyAttributes attr = {};
  attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  attr.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;
  size_t attr_idx = 0, fail_idx = 0;
  return fn(dsts.data(), srcs.data(), sizes.data(), runs.size(), &attr, &attr_idx, 1, &fail_idx,
            (CUstream)stream) == CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Every entry point that touches a device runs inside a DeviceScope: it makes
// `device` current for the calling thread and, on exit, puts back the context
// that was current before (none included). The runtime API alone cannot do
// that: cudaSetDevice(previous) would create a context on a device the thread
// never used, and leaving `device` current would move torch's current device
// in a process that drives several GPUs.

PFN_cuCtxGetCurrent_v4000 ctx_get = nullptr;
PFN_cuCtxSetCurrent_v4000 ctx_set = nullptr;
cudaError_t ctx_status = cudaSuccess;
std::once_flag ctx_once;

class DeviceScope {
 public:
  explicit DeviceScope(int64_t device) {
    std::call_once(ctx_once, [] {
      ctx_status = driver_entry("cuCtxGetCurrent", 4000, &ctx_get);
      if (ctx_status == cudaSuccess) ctx_status = driver_entry("cuCtxSetCurrent", 4000, &ctx_set);
      if (ctx_status != cudaSuccess) cudaGetLastError();
    });
    status_ = ctx_status;
    if (status_ != cudaSuccess) return;
    if (ctx_get(&prev_) != CUDA_SUCCESS) prev_ = nullptr;  // driver not initialised yet
    saved_ = true;
    status_ = cudaSetDevice((int)device);
  }
  ~DeviceScope() {
    CUcontext now = nullptr;
    if (saved_ && ctx_get(&now) == CUDA_SUCCESS && now != prev_) ctx_set(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t status() const { return status_; }

 private:
  CUcontext prev_ = nullptr;
  bool saved_ = false;
  cudaError_t status_ = cudaSuccess;
};

// The kernel dereferences every pointer it is given, so a pageable host pool or
// a plane on another device would fault the whole context. Checked per launch
// (cuPointerGetAttributes, well under a microsecond each) rather than trusted.
int check_pointers(const hc_transfer_args& a, bool host_pinned) {
  cudaPointerAttributes attr;
  if (host_pinned) {
    const uint64_t span = (uint64_t)(a.host.has_v ? 2 : 1) * (uint64_t)a.host.num_layers *
                          (uint64_t)a.host.num_slots * (uint64_t)a.host.item_bytes;
    const uint64_t ends[2] = {a.host_base, a.host_base + (span ? span - 1 : 0)};
    for (uint64_t p : ends) {
      const cudaError_t err = cudaPointerGetAttributes(&attr, (const void*)p);
      if (err != cudaSuccess) return (int)err;
      if (attr.type != cudaMemoryTypeHost && attr.type != cudaMemoryTypeManaged)
        return HC_E_NOT_PINNED;
    }
  }
  for (int64_t kv = 0; kv < (a.host.has_v ? 2 : 1); ++kv) {
    for (int64_t l = 0; l < a.layer_count; ++l) {
      const uint64_t p = (kv ? a.dev_v : a.dev_k)[l];
      const cudaError_t err = cudaPointerGetAttributes(&attr, (const void*)p);
      if (err != cudaSuccess) return (int)err;
      const bool device_mem = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
      if (!device_mem || attr.device != (int)a.device) return HC_E_DEVICE_PTR;
    }
  }
  return HC_OK;
}

}  // namespace

// ---------------------------------------------------------------------------
// Exported C ABI. Return values: 0 ok, > 0 a cudaError_t, < 0 an HC_E_* code.

HC_API int hc_abi_version(void) { return HC_ABI_VERSION; }

HC_API int hc_cudart_version(void) { return CUDART_VERSION; }

HC_API const char* hc_error_string(int code) {
  switch (code) {
    case HC_OK: return "ok";
    case HC_E_LAYOUT: return "inconsistent host layout description";
    case HC_E_ARGS: return "inconsistent transfer arguments";
    case HC_E_CAPACITY: return "plan output buffer too small";
    case HC_E_NOT_PINNED: return "host pool is not pinned (page-locked) memory, which the kernel path needs";
    case HC_E_DEVICE_PTR: return "a device pool plane is not memory of the transfer's CUDA device";
    default: return code > 0 ? cudaGetErrorString((cudaError_t)code) : "unknown error";
  }
}

// cudaGetDeviceCount's status (e.g. 35 = no driver, 100 = no device) and count.
HC_API int hc_device_count(int64_t* count) {
  int c = 0;
  const cudaError_t err = cudaGetDeviceCount(&c);
  if (err != cudaSuccess) cudaGetLastError();
  *count = err == cudaSuccess ? c : 0;
  return (int)err;
}

// Byte offsets of (kv[i], layer[i], slot[i]) in the host pool, computed with the
// same functions the kernel and the DMA planner use.
HC_API int hc_host_offsets(const hc_host_layout* h, int64_t n, const int64_t* kv,
                           const int64_t* layer, const int64_t* slot, int64_t* out) {
  if (!layout_ok(*h)) return HC_E_LAYOUT;
  for (int64_t i = 0; i < n; ++i) out[i] = host_offset(*h, kv[i], layer[i], slot[i]);
  return HC_OK;
}

// Vector width (bytes) the kernel would use for these arguments.
HC_API int hc_vector_width(const hc_transfer_args* a) {
  if (!args_ok(*a)) return HC_E_ARGS;
  return vector_width(*a);
}

// The DMA path's copy list (absolute dst, src, bytes), without touching CUDA:
// CI replays it with memmove on CPU tensors. Returns the number of runs, or
// HC_E_CAPACITY if more than cap (n * planes always suffices).
HC_API int64_t hc_plan_direct(const hc_transfer_args* a, uint64_t* dst, uint64_t* src,
                              uint64_t* bytes, int64_t cap) {
  if (!args_ok(*a)) return HC_E_ARGS;
  std::vector<Run> runs;
  plan_runs(*a, &runs);
  if ((int64_t)runs.size() > cap) return HC_E_CAPACITY;
  for (size_t i = 0; i < runs.size(); ++i) {
    dst[i] = runs[i].dst;
    src[i] = runs[i].src;
    bytes[i] = runs[i].bytes;
  }
  return (int64_t)runs.size();
}

// 1 if the driver offers cuMemcpyBatchAsync (needs a driver; 0 without one).
HC_API int hc_batch_memcpy_available(void) { return batch_memcpy() != nullptr; }

// SM-copy path; indices must be device-accessible. Thread-safe and stateless:
// concurrent calls on different streams are independent launches.
HC_API int hc_transfer_kernel(const hc_transfer_args* a) {
  if (!args_ok(*a)) return HC_E_ARGS;
  if (a->n == 0) return HC_OK;
  DeviceScope scope(a->device);
  cudaError_t err = scope.status();
  if (err != cudaSuccess) return (int)err;
  const int bad = check_pointers(*a, true);
  if (bad != HC_OK) return bad;
  const Sides s = sides_of(*a);
  const int vec = vector_width(*a);
  const int64_t planes = num_planes(*a);
  const cudaStream_t stream = (cudaStream_t)a->stream;
  for (int64_t p0 = 0; p0 < planes; p0 += kMaxPlanes) {
    const int64_t chunk = planes - p0 < kMaxPlanes ? planes - p0 : kMaxPlanes;
    PlaneTable t;
    for (int64_t p = 0; p < chunk; ++p) plane_bases(*a, p0 + p, &t.src[p], &t.dst[p]);
    const KernelArgs k{s.src, s.dst, a->n, chunk, a->host.item_bytes};
    const int64_t warps = a->n * chunk;
    const int threads = warps * kWarp < kThreads ? (int)(warps * kWarp) : kThreads;
    const int64_t want = (warps * kWarp + threads - 1) / threads;
    const int64_t ctas = a->num_ctas > 0 ? a->num_ctas : kDefaultCtas;
    const int grid = (int)(want < ctas ? want : ctas);
    switch (vec) {
      case 16: launch<16>(k, t, a->to_host, grid, threads, stream); break;
      case 8: launch<8>(k, t, a->to_host, grid, threads, stream); break;
      case 4: launch<4>(k, t, a->to_host, grid, threads, stream); break;
      default: launch<1>(k, t, a->to_host, grid, threads, stream); break;
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
  }
  return HC_OK;
}

// DMA path; indices must be host memory. allow_batch = 0 forces one
// cudaMemcpyAsync per run (the baseline the benchmark compares against).
HC_API int hc_transfer_direct(const hc_transfer_args* a, int allow_batch) {
  if (!args_ok(*a)) return HC_E_ARGS;
  if (a->n == 0) return HC_OK;
  DeviceScope scope(a->device);
  cudaError_t err = scope.status();
  if (err != cudaSuccess) return (int)err;
  const int bad = check_pointers(*a, false);
  if (bad != HC_OK) return bad;
  std::vector<Run> runs;
  plan_runs(*a, &runs);
  const cudaStream_t stream = (cudaStream_t)a->stream;
  if (allow_batch && try_batch(runs, stream)) return HC_OK;
  cudaGetLastError();
  for (const Run& r : runs) {
    err = cudaMemcpyAsync((void*)r.dst, (const void*)r.src, (size_t)r.bytes, cudaMemcpyDefault,
                          stream);
    if (err != cudaSuccess) return (int)err;
  }
  return HC_OK;
}

// The kernels' worker threads. A job is a range cut into chunks that the caller and the workers
// claim one at a time; the caller returns as soon as every chunk is done, not when every worker
// has checked in, so a worker the OS has descheduled (cores shared with the HTTP thread, other
// processes) costs a step nothing unless it holds a chunk. Workers spin briefly between jobs (a
// decode step issues them back to back) and then sleep on a futex. One job runs at a time; a
// caller that finds the pool busy (another engine thread in the same process) runs its job alone.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

namespace hc {
namespace {

inline void cpu_relax() { __builtin_ia32_pause(); }

void futex_wait(std::atomic<uint32_t>* word, uint32_t value) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

constexpr int kSpinBeforeSleep = 3000;  // ~50-100 us of pause instructions: the gap between a step's ops
constexpr int kSpinBeforeYield = 2000;
constexpr uint64_t kField = (uint64_t(1) << 20) - 1;  // ticket fields: generation:24 | next:20 | total:20

class Pool {
 public:
  void run(long n, long grain, int threads, ParallelFn fn, void* ctx) {
    std::unique_lock<std::mutex> busy(mu_, std::try_to_lock);
    if (!busy.owns_lock()) return fn(ctx, 0, n);
    grow(threads - 1);
    long chunks = (n + grain - 1) / grain;
    if (chunks > long(kField)) {
      grain = (n + long(kField) - 1) / long(kField);
      chunks = (n + grain - 1) / grain;
    }
    fn_ = fn, ctx_ = ctx, n_ = n, grain_ = grain, helpers_.store(threads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    gen_ = (gen_ + 1) & ((1u << 24) - 1);
    ticket_.store((uint64_t(gen_) << 40) | uint64_t(chunks), std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&wake_);
    work(gen_);
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < kSpinBeforeYield) {
        cpu_relax();
      } else {
        std::this_thread::yield();  // a descheduled worker holds a chunk: give it the core
      }
    }
  }

 private:
  // Claims and runs chunks of generation `gen` until none is left.
  void work(uint32_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = (t >> 20) & kField, total = t & kField;
      if ((t >> 40) != gen || next >= total) return;
      if (!ticket_.compare_exchange_weak(t, t + (uint64_t(1) << 20), std::memory_order_acq_rel,
                                         std::memory_order_acquire))
        continue;
      const long begin = long(next) * grain_, end = std::min(n_, begin + grain_);
      fn_(ctx_, begin, end);
      done_.fetch_add(1, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void grow(int want) {
    while (int(workers_.size()) < want) {
      const int index = int(workers_.size());
      workers_.emplace_back([this, index] { loop(index); });
      workers_.back().detach();  // lives as long as the process
    }
  }

  void loop(int index) {
    uint32_t seen = wake_.load(std::memory_order_acquire);
    for (;;) {
      int spins = 0;
      while (wake_.load(std::memory_order_acquire) == seen) {
        if (++spins < kSpinBeforeSleep) {
          cpu_relax();
          continue;
        }
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (wake_.load(std::memory_order_seq_cst) == seen) futex_wait(&wake_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      seen = wake_.load(std::memory_order_acquire);
      if (index < helpers_.load(std::memory_order_relaxed)) work(uint32_t(ticket_.load(std::memory_order_acquire) >> 40));
    }
  }

  std::mutex mu_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<long> done_{0};
  std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> helpers_{0};
  uint32_t gen_ = 0;
  ParallelFn fn_ = nullptr;
  void* ctx_ = nullptr;
  long n_ = 0, grain_ = 1;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: detached workers may still read it at exit
  return *p;
}

}  // namespace

void run_parallel(long n, long grain, int threads, ParallelFn fn, void* ctx) {
  if (threads <= 1 || n <= grain) return fn(ctx, 0, n);
  pool().run(n, grain, threads, fn, ctx);
}

}  // namespace hc

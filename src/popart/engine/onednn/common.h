// popart-xla: what the oneDNN handlers (conv.cc, matmul.cc) share: the CPU engine, the lock
// that runs one oneDNN call at a time (each uses every OpenMP thread, and XLA may run
// independent custom calls concurrently on its own threads), and a growing scratch buffer.
#pragma once
#include <cstdlib>
#include <mutex>

#include "dnnl.hpp"

namespace popart_onednn {

inline dnnl::engine& cpu() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

inline std::mutex& run_mutex() {
  static std::mutex mu;
  return mu;
}

struct Scratch {  // a per-thread, 64-byte aligned buffer that only grows
  void* p = nullptr;
  size_t n = 0;
  void* get(size_t need) {
    if (need > n) {
      std::free(p);
      n = (need + 63) / 64 * 64;
      p = std::aligned_alloc(64, n);
    }
    return p;
  }
  ~Scratch() { std::free(p); }
};

}  // namespace popart_onednn

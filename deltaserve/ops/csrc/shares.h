// Per-thread timing of a decode GEMV's shares, for the benchmark only (bench/kernels.py): as probe.h's rates,
// each thread's rows over its own seconds, so that a thread preempted by another job on a shared machine costs
// that call's figure, not the measure of what the kernel reaches while it runs. Off (null) outside the benchmark.
#pragma once
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

namespace deltaserve {

// set by a timed call (the benchmark's thread) around one kernel call; read by the threads of its parallel region
inline std::vector<std::pair<int64_t, double>>* g_share_times = nullptr;

// records (rows, seconds) of the enclosing share into g_share_times[thread] when timing is on
class ShareClock {
 public:
  explicit ShareClock(int64_t rows) : rows_(rows) {
    if (g_share_times != nullptr) start_ = std::chrono::steady_clock::now();
  }
  ~ShareClock() {
    if (g_share_times == nullptr) return;
    const size_t t = static_cast<size_t>(at::get_thread_num());
    if (t < g_share_times->size())
      (*g_share_times)[t] = {rows_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count()};
  }

 private:
  int64_t rows_;
  std::chrono::steady_clock::time_point start_;
};

// For kernels whose threads take many units from a counter (f16gemm.h): records (rows, seconds) of the enclosing unit
// into g_share_times[thread] when it is that thread's fastest so far, as the probes keep each thread's fastest round
// (a thread's whole share of a long call is rarely left to run whole on a shared machine).
class UnitClock {
 public:
  explicit UnitClock(int64_t rows) : rows_(rows) {
    if (g_share_times != nullptr) start_ = std::chrono::steady_clock::now();
  }
  ~UnitClock() {
    if (g_share_times == nullptr) return;
    const size_t t = static_cast<size_t>(at::get_thread_num());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (t >= g_share_times->size() || s <= 0) return;
    auto& best = (*g_share_times)[t];
    if (best.first == 0 || rows_ / s > best.first / best.second) best = {rows_, s};
  }

 private:
  int64_t rows_;
  std::chrono::steady_clock::time_point start_;
};

// f() with its parallel region's shares timed: [(rows, seconds)] per thread (0 rows: the thread had no share)
template <class F>
inline std::vector<std::pair<int64_t, double>> timed_shares(F&& f) {
  std::vector<std::pair<int64_t, double>> out(at::get_num_threads(), {0, 0.0});
  g_share_times = &out;
  try {
    f();
  } catch (...) {
    g_share_times = nullptr;
    throw;
  }
  g_share_times = nullptr;
  return out;
}

}  // namespace deltaserve

// Intel AMX (Sapphire Rapids and later): eight tile registers of 16 rows x 64 bytes and a matrix unit that multiplies
// them, tdpbf16ps (bfloat16 pairs, float32 sums: 16 x 16 x 32 products an instruction) and tdpbusd / tdpbssd (int8,
// int32 sums: 16 x 16 x 64). Where the build has the instructions (-march=native on such a CPU), they still run only
// where Linux grants this process the tiles' 8 KB of state (arch_prctl ARCH_REQ_XCOMP_PERM, kernel 5.16 and later; a
// hypervisor may hide it): asked once, at the first kernel that would use them; refused, the AVX-512 paths run. A
// thread loads the tile configuration at the start of each call and releases the tiles at its end, since other
// libraries in the process (oneDNN under torch) configure the same registers on the same threads.
#pragma once
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <cstdlib>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define DELTASERVE_AMX 1
#endif

namespace deltaserve {
namespace amx {

#if defined(DELTASERVE_AMX)
constexpr bool kBuilt = true;

inline bool granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// palette 1: tiles 0 .. 7 of 16 rows x 64 bytes, or the shapes given (rows, bytes a row) for the first few
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  Config() = default;
  Config(std::initializer_list<std::pair<uint8_t, uint16_t>> shapes) {
    int t = 0;
    for (const auto& [r, c] : shapes) rows[t] = r, colsb[t++] = c;
  }
};

// the tiles configured for this thread while in scope (all 16 x 64 bytes unless given)
class Scope {
 public:
  Scope() : Scope(Config{}) {}
  explicit Scope(const Config& config) { _tile_loadconfig(&config); }
  ~Scope() { _tile_release(); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
};
#else
constexpr bool kBuilt = false;
inline bool granted() { return false; }
#endif

// DELTASERVE_AMX=0 in the environment turns the tiles off for the process (to measure without them); tests and the
// benchmark turn them off and on to run the AVX-512 paths on the same machine.
inline std::atomic<bool> g_wanted{[] {
  const char* v = std::getenv("DELTASERVE_AMX");
  return v == nullptr || std::strcmp(v, "0") != 0;
}()};

// whether the kernels take the AMX paths now
inline bool enabled() { return kBuilt && g_wanted.load(std::memory_order_relaxed) && granted(); }

// asks for the AMX paths (on) or the AVX-512 ones; returns whether the AMX paths now run
inline bool set_enabled(bool on) {
  g_wanted.store(on, std::memory_order_relaxed);
  return enabled();
}

}  // namespace amx
}  // namespace deltaserve

// Activations rounded per 32 to Q8_0, as llama.cpp rounds them for its integer dot products with Q8_0, Q4_0, Q4_1,
// Q5_0 and Q5_1 weights (quantize_row_q8_0 / _q8_1: d = max|x| / 127 kept as float16, q = round(x / d) with the
// float32 d): the input of int8q8.h's, int8legacy.h's and int8legacy_avx2.h's kernels.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace deltaserve {
namespace q8 {

// A view of one of Q8Acts' arrays (data() and [] as the kernels used them on std::vector). Defined outside the
// pragma below: GCC inlines no function whose optimize options differ from its caller's, and the kernels call these
// in their inner loops (inside it, each call was a call, and the float sums around it spilled to the stack).
template <class T>
struct Part {
  T* p = nullptr;
  T* data() const { return p; }
  T& operator[](int64_t i) const { return p[i]; }
};

// x [M, K] rounded to Q8_0: q [M, K] (and zero rows to a multiple of 16); per block of 32: d (float16 value as
// float), start = -128 sum(q); per 4 (a vpdpbusd lane): starts = -128 sum(q), so that each lane's sum is its own exact
// dot (offsets summed in other lanes would cancel only after rounding); dl: each block's d 8 times (its lanes in a
// vpdpbusd of 64 weights)
// (the divisions as llama.cpp's C makes them: -ffast-math would take x * (1 / 127) for x / 127, a different float)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
struct Q8Acts {
  Part<int8_t> q;
  Part<float> d, dl;
  Part<int32_t> start, starts;
  int64_t M = 0, K = 0, nb = 0;

  // x [rows, cols] with rows ldx floats apart. Decode's acts (thread_local, reused) keep their arrays in a vector;
  // a prefill's come from torch's allocator (blocks.h once a model has loaded), as int8gemm.h's XBlocks do: 2-8 MB
  // taken and freed at every call split glibc's heap around smaller long-lived allocations.
  void quantize(const float* x, int64_t rows, int64_t cols, int64_t ldx, bool prefill) {
    M = rows, K = cols, nb = cols / 32;
    const int64_t padded = (M + 15) / 16 * 16;  // whole tiles of 16 rows for tdpbsud (q8_amx_rows); the rest zero
    const int64_t sizes[5] = {padded * K, M * nb * 4, M * nb * 8 * 4, M * nb * 4, M * nb * 8 * 4};
    int64_t off[5], bytes = 0;
    for (int i = 0; i < 5; ++i) off[i] = bytes, bytes += (sizes[i] + 63) / 64 * 64;  // each array 64-byte aligned
    uint8_t* base;
    if (prefill) {
      held = at::empty({bytes + 64}, at::kByte);
      base = held.data_ptr<uint8_t>();
      base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
    } else {
      if (static_cast<int64_t>(own.size()) < bytes + 64) own.resize(bytes + 64);
      base = own.data() + (64 - reinterpret_cast<uintptr_t>(own.data()) % 64) % 64;
    }
    q.p = reinterpret_cast<int8_t*>(base + off[0]);
    d.p = reinterpret_cast<float*>(base + off[1]);
    dl.p = reinterpret_cast<float*>(base + off[2]);
    start.p = reinterpret_cast<int32_t*>(base + off[3]);
    starts.p = reinterpret_cast<int32_t*>(base + off[4]);
    std::fill(q.p + M * K, q.p + padded * K, int8_t{0});
    at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t m = lo; m < hi; ++m)
        for (int64_t k = 0; k < nb; ++k) block(x + m * ldx + 32 * k, m * nb + k, q.p + m * K + 32 * k);
    });
  }

  // rows m0 .. m0 + count as acts of their own: a view into these arrays, for kernels that take their rows from 0
  Q8Acts rows(int64_t m0, int64_t count) const {
    Q8Acts v;
    v.M = count, v.K = K, v.nb = nb;
    v.q.p = q.p + m0 * K, v.d.p = d.p + m0 * nb, v.dl.p = dl.p + m0 * nb * 8;
    v.start.p = start.p + m0 * nb, v.starts.p = starts.p + m0 * nb * 8;
    return v;
  }

  void block(const float* xb, int64_t at, int8_t* qb) {
    int32_t four[8];
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float dk = amax / 127.f, id = dk != 0.f ? 1.f / dk : 0.f;
    const __m512 is = _mm512_set1_ps(id);  // products rounded to nearest, ties to even (std::nearbyint's)
    const __m128i q0 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, is)));
    const __m128i q1 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, is)));
    const __m256i q32 = _mm256_set_m128i(q1, q0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), q32);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(four), _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), q32));
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4];
    __m256 amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(xb + 8 * i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float dk = amax / 127.f, id = dk != 0.f ? 1.f / dk : 0.f;
    __m256i q[4];  // products rounded to nearest, ties to even (std::nearbyint's)
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    // packs interleave 128-bit halves: elements come out in dword order 0 4 1 5 2 6 3 7, put back by one permute
    const __m256i q8 = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), q8);
    // per 4 codes: pairs summed (vpmaddubsw of ones by the codes), then pairs of pairs (vpmaddwd)
    const __m256i fours = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(four), fours);
#else
    float amax = 0.f;
    for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(xb[e]));
    const float dk = amax / 127.f, id = dk != 0.f ? 1.f / dk : 0.f;
    for (int l = 0; l < 8; ++l) {
      four[l] = 0;
      for (int e = 4 * l; e < 4 * l + 4; ++e) four[l] += qb[e] = static_cast<int8_t>(std::nearbyint(xb[e] * id));
    }
#endif
    int sum = 0;
    for (int l = 0; l < 8; ++l) {
      starts[at * 8 + l] = -128 * four[l];
      sum += four[l];
    }
    // llama.cpp keeps the activations' d as float16 (rounded to nearest even, as c10::Half rounds: whose conversion,
    // inside this pragma, would not be inlined)
#if defined(__F16C__)
    const float dh = _cvtsh_ss(_cvtss_sh(dk, _MM_FROUND_TO_NEAREST_INT));
#else
    const float dh = static_cast<float>(c10::Half(dk));
#endif
    d[at] = dh;
    start[at] = -128 * sum;
    for (int l = 0; l < 8; ++l) dl[at * 8 + l] = dh;
  }

 private:
  std::vector<uint8_t> own;
  at::Tensor held;
};
#pragma GCC pop_options

}  // namespace q8
}  // namespace deltaserve

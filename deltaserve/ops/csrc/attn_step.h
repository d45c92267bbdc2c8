// The two passes of a decode step's attention over one kv head's cached rows (attention_step in layers.h): the
// scores of the kv head's G query heads against every visible key, then the values weighted by their softmax.
// At long spans these passes are the step: at 8k tokens the loops of one key at a time (a key widened into a
// buffer, each dot product reduced on its own, the outputs added to in memory) ran at 5 GB/s of cache rows on
// a Zen 4 core. Here, with AVX-512 and a head size a multiple of 16, four keys meet up to four query heads in
// registers (16 sums in flight), and the values are taken a tile of keys at a time (kept in L2) with up to
// four heads x 64 output columns held in registers across the tile. Elsewhere the plain loops below run.
#pragma once
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>

namespace deltaserve {
namespace step {

// a cache row as float32: float32 caches read where they lie, float16 ones widened into buf
inline const float* widen(const float* p, float*, int64_t) { return p; }

inline const float* widen(const at::Half* p, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return buf;
}

// s[h * ss + t] = scale * q[h] . key t for h < G (q rows hd apart), t < n, key t at k + t * ks. buf: hd floats.
template <typename C>
inline void scores_plain(const float* q, int64_t G, const C* k, int64_t ks, int64_t n, int64_t hd, float scale,
                         float* s, int64_t ss, float* buf) {
  for (int64_t t = 0; t < n; ++t) {
    const float* kt = widen(k + t * ks, buf, hd);
    for (int64_t h = 0; h < G; ++h) {
      float d = 0.f;
      for (int64_t i = 0; i < hd; ++i) d += q[h * hd + i] * kt[i];
      s[h * ss + t] = d * scale;
    }
  }
}

// o[h] = sum over t < n of p[h * ps + t] * value t, for h < G (o rows hd apart), value t at v + t * vs.
template <typename C>
inline void values_plain(const float* p, int64_t ps, int64_t G, const C* v, int64_t vs, int64_t n, int64_t hd,
                         float* o, float* buf) {
  std::fill(o, o + G * hd, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const float* vt = widen(v + t * vs, buf, hd);
    for (int64_t h = 0; h < G; ++h)
      for (int64_t i = 0; i < hd; ++i) o[h * hd + i] += p[h * ps + t] * vt[i];
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename C>
inline void prefetch_row(const C* p, int64_t n) {
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(C)); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T1);
}

// The scores of GH heads against KB keys (t0 .. t0 + KB), hd a multiple of 16.
template <int GH, int KB, typename C>
inline void scores_block(const float* q, const C* k, int64_t ks, int64_t hd, float scale, float* s, int64_t ss) {
  __m512 acc[GH][KB];
  for (int h = 0; h < GH; ++h)
    for (int c = 0; c < KB; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < hd; i += 16) {
    __m512 kv[KB];
    for (int c = 0; c < KB; ++c) kv[c] = load16(k + c * ks + i);
    for (int h = 0; h < GH; ++h) {
      const __m512 qv = _mm512_loadu_ps(q + h * hd + i);
      for (int c = 0; c < KB; ++c) acc[h][c] = _mm512_fmadd_ps(qv, kv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < GH; ++h)
    for (int c = 0; c < KB; ++c) s[h * ss + c] = scale * _mm512_reduce_add_ps(acc[h][c]);
}

template <int GH, typename C>
inline void scores_heads(const float* q, const C* k, int64_t ks, int64_t n, int64_t hd, float scale, float* s,
                         int64_t ss) {
  constexpr int64_t kAhead = 96;  // keys prefetched ahead (from memory at long spans; rows nkv * hd apart)
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    if (t + kAhead + 4 <= n)
      for (int c = 0; c < 4; ++c) prefetch_row(k + (t + kAhead + c) * ks, hd);
    scores_block<GH, 4>(q, k + t * ks, ks, hd, scale, s + t, ss);
  }
  for (; t < n; ++t) scores_block<GH, 1>(q, k + t * ks, ks, hd, scale, s + t, ss);
}

// o[h, c0 .. c0 + 64) for GH heads over keys t < n: 4 x GH sums held in registers, o written once.
// pf: rows after these n (the next tile) to prefetch whole, one per row taken here.
template <int GH, typename C>
inline void values_columns(const float* p, int64_t ps, const C* v, int64_t vs, int64_t n, int64_t hd, int64_t c0,
                           float* o, bool first, int64_t pf) {
  __m512 acc[GH][4];
  for (int h = 0; h < GH; ++h)
    for (int j = 0; j < 4; ++j) acc[h][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o + h * hd + c0 + 16 * j);
  for (int64_t t = 0; t < n; ++t) {
    if (t < pf) prefetch_row(v + (n + t) * vs, hd);
    __m512 vv[4];
    for (int j = 0; j < 4; ++j) vv[j] = load16(v + t * vs + c0 + 16 * j);
    for (int h = 0; h < GH; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * ps + t]);
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_fmadd_ps(w, vv[j], acc[h][j]);
    }
  }
  for (int h = 0; h < GH; ++h)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + h * hd + c0 + 16 * j, acc[h][j]);
}

// The same for 16 columns (a head size of 16 x odd)
template <int GH, typename C>
inline void values_column(const float* p, int64_t ps, const C* v, int64_t vs, int64_t n, int64_t hd, int64_t c0,
                          float* o, bool first) {
  __m512 acc[GH];
  for (int h = 0; h < GH; ++h) acc[h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o + h * hd + c0);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 vv = load16(v + t * vs + c0);
    for (int h = 0; h < GH; ++h) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * ps + t]), vv, acc[h]);
  }
  for (int h = 0; h < GH; ++h) _mm512_storeu_ps(o + h * hd + c0, acc[h]);
}

template <int GH, typename C>
inline void values_heads(const float* p, int64_t ps, const C* v, int64_t vs, int64_t n, int64_t hd, float* o) {
  constexpr int64_t kTile = 128;  // keys per tile: 128 rows of 256 float16 values are 64 KB, kept in L2
  if (n == 0) std::fill(o, o + GH * hd, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t cnt = std::min(kTile, n - t0);
    const int64_t pf = cnt == kTile ? std::min(kTile, n - t0 - kTile) : 0;  // the next tile, in the first pass
    int64_t c0 = 0;
    for (; c0 + 64 <= hd; c0 += 64)
      values_columns<GH>(p + t0, ps, v + t0 * vs, vs, cnt, hd, c0, o, t0 == 0, c0 == 0 ? pf : 0);
    for (; c0 < hd; c0 += 16) values_column<GH>(p + t0, ps, v + t0 * vs, vs, cnt, hd, c0, o, t0 == 0);
  }
}

// f(GH constant) for each group of up to four heads h0 .. h0 + GH of G
template <class F>
inline void head_groups(int64_t G, F&& f) {
  for (int64_t h0 = 0; h0 < G; h0 += 4) {
    switch (std::min<int64_t>(4, G - h0)) {
      case 1: f(h0, std::integral_constant<int, 1>{}); break;
      case 2: f(h0, std::integral_constant<int, 2>{}); break;
      case 3: f(h0, std::integral_constant<int, 3>{}); break;
      default: f(h0, std::integral_constant<int, 4>{}); break;
    }
  }
}
#endif

// The scores pass: s[h * ss + t] = scale * q[h] . key t (h < G, t < n)
template <typename C>
inline void scores(const float* q, int64_t G, const C* k, int64_t ks, int64_t n, int64_t hd, float scale, float* s,
                   int64_t ss, float* buf) {
#if defined(__AVX512F__)
  if (hd % 16 == 0) {
    head_groups(G, [&](int64_t h0, auto gh) {
      scores_heads<decltype(gh)::value>(q + h0 * hd, k, ks, n, hd, scale, s + h0 * ss, ss);
    });
    return;
  }
#endif
  scores_plain(q, G, k, ks, n, hd, scale, s, ss, buf);
}

// The values pass: o[h] = sum over t < n of p[h * ps + t] * value t (h < G)
template <typename C>
inline void values(const float* p, int64_t ps, int64_t G, const C* v, int64_t vs, int64_t n, int64_t hd, float* o,
                   float* buf) {
#if defined(__AVX512F__)
  if (hd % 16 == 0) {
    head_groups(G, [&](int64_t h0, auto gh) {
      values_heads<decltype(gh)::value>(p + h0 * ps, ps, v, vs, n, hd, o + h0 * hd);
    });
    return;
  }
#endif
  values_plain(p, ps, G, v, vs, n, hd, o, buf);
}

}  // namespace step
}  // namespace deltaserve

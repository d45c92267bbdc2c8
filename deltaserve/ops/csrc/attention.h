// Attention over a KV cache for long spans: tiled, with an online softmax (no score matrix over the span is
// ever held), the query heads of a kv head sharing each key / value tile, causal tiles skipped, and the
// float16 or float32 cache read where it lies (float16 widened with F16C a tile at a time).
//
// Work items are (sequence, kv head, query tile, key split). A prefill chunk has enough query tiles to keep
// every thread busy; a decode step (one query token) has only sequences x kv heads of them, so the visible
// keys are split across threads too, each split keeping its own running max / sum / output, merged after by
// log-sum-exp weights.
//
// With AVX-512 a tile's two products and its softmax run in the register kernels of attn_tiles.h (at the
// 0.8B shapes, 256 query rows x 64 keys a tile, ~100 GFLOP/s a Zen 4 core against ~58 for the loops below); with
// AVX2 its two products in attn_tiles.h's ymm kernels and the softmax in the loops below; portable builds the loops.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attn_tiles.h"

namespace deltaserve {
namespace attn {

constexpr int64_t kKeys = 64;      // keys per tile
constexpr int64_t kTileRows = 256;  // query rows (tokens x heads of one kv head) per tile, about: each key /
// value tile widened from the cache serves this many rows (64 -> 128 -> 256: 84 -> 91 -> 98 GFLOP/s at 0.8B
// shapes on a Zen 4 core); a tile's queries and outputs, 256 KB each, still sit in L2
constexpr int64_t kVec = 16;       // rows are padded to a multiple of this (one AVX-512 register of floats)
constexpr int64_t kKeyBlock = 4;   // keys per register block of the score kernel
constexpr int64_t kRowBlock = 4;   // rows per register block of the output kernel
constexpr int64_t kCols = 32;      // output columns per register block
constexpr float kNoMax = -1e30f;   // running max before any key (finite: the build assumes no infinities)

inline void to_f32(const float* p, float* out, int64_t n) { std::copy(p, p + n, out); }

inline void to_f32(const at::Half* p, float* out, int64_t n) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(p[i]);
}

// Asks for n cache rows of d elements (stride apart) to be brought into L2 ahead of their widening: every query
// tile reads its span from L3 or memory, and waiting on those loads was a quarter of the tile's time.
template <typename C>
inline void prefetch_rows(const C* p, int64_t stride, int64_t n, int64_t d) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(C)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + r * stride) + b, _MM_HINT_T1);
}

// What every work item reads: strides in elements; cache rows of slot s, token t, kv head j at
// base + s * s0 + t * s1 + j * s2 (the last dim contiguous).
template <typename C>
struct Args {
  const float* q;
  int64_t qn, qt, qh;  // q [N, T, nh, dk] strides
  const C *k, *v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const int64_t *slot, *start;
  float* out;  // [N, T, nh, dv] contiguous
  int64_t T, nh, nkv, group, dk, dv, tile_tokens;
  float scale;
};

// Per-thread buffers of one tile (rows padded to kVec): queries [rows, dk] and transposed [dk, rows], keys
// [kKeys, dk], values [kKeys, dv], scores transposed [kKeys, rows] (a key's scores for all rows side by side,
// so the softmax runs across rows in vector registers), the running output [rows, dv] with its max and sum
// per row, and each row's position.
struct Scratch {
  std::vector<float> q, qt, k, v, s, acc, m, l, pos, mx, corr, sum;
  Scratch(int64_t rows, int64_t dk, int64_t dv)
      : q(rows * dk), qt(dk * rows), k(kKeys * dk), v(kKeys * dv), s(kKeys * rows), acc(rows * dv), m(rows),
        l(rows), pos(rows), mx(rows), corr(rows), sum(rows) {}
};

// (plain loops) s[c, r] = k[c] . q[r] for c < kKeys from the transposed queries: a key's element broadcast against
// kVec rows at a time (no transpose of the keys, which change every tile; the queries are transposed once).
inline void scores_wide(const float* qt, const float* k, float* s, int64_t rows, int64_t dk) {
  for (int64_t c0 = 0; c0 < kKeys; c0 += kKeyBlock)
    for (int64_t r0 = 0; r0 < rows; r0 += 2 * kVec) {
      const int64_t w = std::min<int64_t>(2 * kVec, rows - r0);  // 32, or 16 at the end
      float a[kKeyBlock][2 * kVec] = {};
      for (int64_t i = 0; i < dk; ++i) {
        const float* qi = qt + i * rows + r0;
        for (int64_t cc = 0; cc < kKeyBlock; ++cc) {
          const float x = k[(c0 + cc) * dk + i];
          if (w == 2 * kVec) {
#pragma omp simd
            for (int64_t r = 0; r < 2 * kVec; ++r) a[cc][r] += x * qi[r];
          } else {
#pragma omp simd
            for (int64_t r = 0; r < kVec; ++r) a[cc][r] += x * qi[r];
          }
        }
      }
      for (int64_t cc = 0; cc < kKeyBlock; ++cc) std::copy_n(a[cc], w, s + (c0 + cc) * rows + r0);
    }
}

// The same for a few real rows (a decode step): dot products along the head, each key row read once, two keys
// by four rows at a time so that eight sums are in flight (rows padded to kVec are zero; n even or padded).
inline void scores_few(const float* q, const float* k, float* s, int64_t rows, int64_t real, int64_t dk,
                       int64_t cnt) {
  const int64_t full = dk - dk % kVec;
  for (int64_t c = 0; c < cnt; c += 2)
    for (int64_t r0 = 0; r0 < real; r0 += kRowBlock) {
      float a[2][kRowBlock][kVec] = {};
      for (int64_t i0 = 0; i0 < full; i0 += kVec)
        for (int64_t cc = 0; cc < 2; ++cc)
          for (int64_t rr = 0; rr < kRowBlock; ++rr) {
            const float *qr = q + (r0 + rr) * dk + i0, *kc = k + (c + cc) * dk + i0;
#pragma omp simd
            for (int64_t i = 0; i < kVec; ++i) a[cc][rr][i] += qr[i] * kc[i];
          }
      for (int64_t cc = 0; cc < 2; ++cc)
        for (int64_t rr = 0; rr < kRowBlock; ++rr) {
          float d = 0.f;
          for (int64_t i = 0; i < kVec; ++i) d += a[cc][rr][i];
          for (int64_t i = full; i < dk; ++i) d += q[(r0 + rr) * dk + i] * k[(c + cc) * dk + i];
          s[(c + cc) * rows + r0 + rr] = d;
        }
    }
}

// (plain loops) acc[r] += sum_c p[c, r] v[c] over the first n keys; rows a multiple of kRowBlock.
inline void accumulate(const float* p, const float* v, float* acc, int64_t rows, int64_t real, int64_t n,
                       int64_t dv) {
  const int64_t full = dv - dv % kCols;
  for (int64_t r0 = 0; r0 < real; r0 += kRowBlock) {
    for (int64_t d0 = 0; d0 < full; d0 += kCols) {
      float a[kRowBlock][kCols];
      for (int64_t rr = 0; rr < kRowBlock; ++rr) std::copy_n(acc + (r0 + rr) * dv + d0, kCols, a[rr]);
      for (int64_t c = 0; c < n; ++c) {
        const float* vc = v + c * dv + d0;
        for (int64_t rr = 0; rr < kRowBlock; ++rr) {
          const float x = p[c * rows + r0 + rr];
#pragma omp simd
          for (int64_t d = 0; d < kCols; ++d) a[rr][d] += x * vc[d];
        }
      }
      for (int64_t rr = 0; rr < kRowBlock; ++rr) std::copy_n(a[rr], kCols, acc + (r0 + rr) * dv + d0);
    }
    for (int64_t rr = 0; rr < kRowBlock && full < dv; ++rr)  // the columns past the last full block
      for (int64_t c = 0; c < n; ++c) {
        const float x = p[c * rows + r0 + rr];
        for (int64_t d = full; d < dv; ++d) acc[(r0 + rr) * dv + d] += x * v[c * dv + d];
      }
  }
}

// The online softmax of one tile of n keys from position `key`: row r sees the keys at or before pos[r]
// (causal; padding rows sit at position -1 and see none). The scores become probabilities relative to the
// new running max (0 where not visible), and each row's sum and output are rescaled to that max.
inline void softmax_tile(Scratch& w, int64_t rows, int64_t real, int64_t dv, int64_t key, int64_t n, bool masked) {
  float *s = w.s.data(), *pos = w.pos.data(), *corr = w.corr.data();
#if defined(__AVX512F__)
  zmm::softmax(s, rows, n, key, masked, pos, w.m.data(), w.l.data(), corr);
#else
  float *mx = w.mx.data(), *sum = w.sum.data();
  std::copy_n(w.m.data(), rows, mx);
  std::fill_n(sum, rows, 0.f);
  for (int64_t c = 0; c < n; ++c) {
    const float kp = static_cast<float>(key + c);
    float* sc = s + c * rows;
#pragma omp simd
    for (int64_t r = 0; r < rows; ++r) mx[r] = std::max(mx[r], (!masked || kp <= pos[r]) ? sc[r] : kNoMax);
  }
  for (int64_t c = 0; c < n; ++c) {
    const float kp = static_cast<float>(key + c);
    float* sc = s + c * rows;
#pragma omp simd
    for (int64_t r = 0; r < rows; ++r) {
      const float e = (!masked || kp <= pos[r]) ? std::exp(sc[r] - mx[r]) : 0.f;
      sc[r] = e;
      sum[r] += e;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    corr[r] = std::exp(w.m[r] - mx[r]);
    w.l[r] = w.l[r] * corr[r] + sum[r];
    w.m[r] = mx[r];
  }
#endif
  for (int64_t r = 0; r < real; ++r) {
    if (corr[r] == 1.f) continue;  // the running max did not move: nothing to rescale
    float* a = w.acc.data() + r * dv;
#pragma omp simd
    for (int64_t d = 0; d < dv; ++d) a[d] *= corr[r];
  }
}

// One work item: sequence n, kv head j, query tokens [t0, t1), keys [k0, k1). Leaves the unnormalised
// output, running max and sum of each of its (t1 - t0) * group rows in w.acc, w.m, w.l.
template <typename C>
void run_item(const Args<C>& a, Scratch& w, int64_t n, int64_t j, int64_t t0, int64_t t1, int64_t k0, int64_t k1) {
  const int64_t real = (t1 - t0) * a.group, rows = (real + kVec - 1) / kVec * kVec;
  const int64_t dk = a.dk, dv = a.dv, first_pos = a.start[n] + t0;
  const bool few = real < kVec;  // a decode step: dot products beat padding the rows to a full register
  for (int64_t r = 0; r < rows; ++r) {  // queries, scaled (padding rows zero, at position -1)
    float* dst = w.q.data() + r * dk;
    w.pos[r] = r < real ? static_cast<float>(first_pos + r / a.group) : -1.f;
    if (r >= real) {
      std::fill(dst, dst + dk, 0.f);
      continue;
    }
    const float* src = a.q + n * a.qn + (t0 + r / a.group) * a.qt + (j * a.group + r % a.group) * a.qh;
    for (int64_t i = 0; i < dk; ++i) dst[i] = src[i] * a.scale;
  }
  if (!few)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < dk; ++i) w.qt[i * rows + r] = w.q[r * dk + i];
  std::fill(w.acc.begin(), w.acc.begin() + rows * dv, 0.f);
  std::fill(w.m.begin(), w.m.begin() + rows, kNoMax);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.f);
  const C* kb = a.k + a.slot[n] * a.ks0 + j * a.ks2;
  const C* vb = a.v + a.slot[n] * a.vs0 + j * a.vs2;
  for (int64_t key = k0; key < k1; key += kKeys) {
    const int64_t cnt = std::min(kKeys, k1 - key);
    for (int64_t c = 0; c < kKeys; ++c) {  // missing keys zero: their scores are computed, then masked
      if (c < cnt)
        to_f32(kb + (key + c) * a.ks1, w.k.data() + c * dk, dk);
      else
        std::fill_n(w.k.data() + c * dk, dk, 0.f);
    }
    prefetch_rows(vb + key * a.vs1, a.vs1, cnt, dv);  // the values this tile reads after its scores
    if (few)
      scores_few(w.q.data(), w.k.data(), w.s.data(), rows, real, dk, cnt);
    else
#if defined(__AVX512F__)
      zmm::scores(w.qt.data(), w.k.data(), w.s.data(), rows, dk, cnt);
#elif defined(__AVX2__) && defined(__FMA__)
      ymm::scores(w.qt.data(), w.k.data(), w.s.data(), rows, dk, cnt);
#else
      scores_wide(w.qt.data(), w.k.data(), w.s.data(), rows, dk);
#endif
    softmax_tile(w, rows, real, dv, key, cnt, key + cnt - 1 > first_pos);  // masks only where a key is unseen
    for (int64_t c = 0; c < cnt; ++c) to_f32(vb + (key + c) * a.vs1, w.v.data() + c * dv, dv);
    prefetch_rows(kb + (key + cnt) * a.ks1, a.ks1, std::min(kKeys, k1 - key - cnt), dk);  // the next tile's keys
#if defined(__AVX512F__)
    zmm::values(w.s.data(), w.v.data(), w.acc.data(), rows, real, cnt, dv);
#elif defined(__AVX2__) && defined(__FMA__)
    ymm::values(w.s.data(), w.v.data(), w.acc.data(), rows, real, cnt, dv);
#else
    accumulate(w.s.data(), w.v.data(), w.acc.data(), rows, real, cnt, dv);
#endif
  }
}

// Row r of item (n, j, t0) is query token t0 + r / group, head j * group + r % group.
inline float* out_row(float* out, int64_t n, int64_t t, int64_t h, int64_t T, int64_t nh, int64_t dv) {
  return out + ((n * T + t) * nh + h) * dv;
}

template <typename C>
void attend_impl(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                 at::Tensor start, double scale, at::Tensor out) {
  Args<C> a{q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2),
            k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            slots.data_ptr<int64_t>(), start.data_ptr<int64_t>(), out.data_ptr<float>(),
            q.size(1), q.size(2), k_cache.size(2), q.size(2) / k_cache.size(2), q.size(3), v_cache.size(3), 1,
            static_cast<float>(scale)};
  const int64_t N = q.size(0), threads = at::get_num_threads();
  a.tile_tokens = std::max<int64_t>(1, kTileRows / a.group);
  const int64_t qtiles = (a.T + a.tile_tokens - 1) / a.tile_tokens, base = N * a.nkv * qtiles;
  int64_t longest = 0;
  for (int64_t n = 0; n < N; ++n) longest = std::max(longest, a.start[n] + a.T);
  // Split the keys only when the queries alone leave threads idle, and never below 4 tiles a split.
  const int64_t splits = base >= threads ? 1 : std::clamp<int64_t>((2 * threads + base - 1) / base, 1,
                                                                   std::max<int64_t>(1, longest / (4 * kKeys)));
  // (a decode step's buffers sized for its one token: they are zeroed per call)
  const int64_t rows_max = (std::min(a.tile_tokens, a.T) * a.group + kVec - 1) / kVec * kVec;
  // split partials: [base, splits] x (rows_max x dv outputs, rows_max maxima, rows_max sums)
  std::vector<float> part(splits > 1 ? base * splits * rows_max * (a.dv + 2) : 0);
  const int64_t part_stride = rows_max * (a.dv + 2);
#pragma omp parallel num_threads(threads)
  {
    Scratch w(rows_max, a.dk, a.dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < base * splits; ++item) {
      // the last query tiles first: they see the most keys, and handed out last they left threads idle
      const int64_t b = item / splits, sp = item % splits, tile = qtiles - 1 - b % qtiles, j = (b / qtiles) % a.nkv;
      const int64_t n = b / (qtiles * a.nkv), t0 = tile * a.tile_tokens, t1 = std::min(a.T, t0 + a.tile_tokens);
      const int64_t visible = a.start[n] + t1;  // keys past the tile's last query are never read
      const int64_t per = (visible + splits * kKeys - 1) / (splits * kKeys) * kKeys;
      const int64_t k0 = std::min(visible, sp * per), k1 = std::min(visible, k0 + per);
      run_item(a, w, n, j, t0, t1, k0, k1);
      const int64_t real = (t1 - t0) * a.group;
      for (int64_t r = 0; r < real; ++r) {
        const float* acc = w.acc.data() + r * a.dv;
        if (splits == 1) {
          float* o = out_row(a.out, n, t0 + r / a.group, j * a.group + r % a.group, a.T, a.nh, a.dv);
          const float inv = 1.f / w.l[r];
          for (int64_t d = 0; d < a.dv; ++d) o[d] = acc[d] * inv;
        } else {
          float* p = part.data() + item * part_stride;
          std::copy_n(acc, a.dv, p + r * a.dv);
          p[rows_max * a.dv + r] = w.m[r];
          p[rows_max * (a.dv + 1) + r] = w.l[r];
        }
      }
    }
    if (splits > 1) {  // merge the splits of each row by their log-sum-exp weights
#pragma omp for schedule(static)
      for (int64_t b = 0; b < base; ++b) {
        const int64_t tile = qtiles - 1 - b % qtiles, j = (b / qtiles) % a.nkv, n = b / (qtiles * a.nkv);
        const int64_t t0 = tile * a.tile_tokens, real = (std::min(a.T, t0 + a.tile_tokens) - t0) * a.group;
        for (int64_t r = 0; r < real; ++r) {
          float mx = kNoMax, sum = 0.f;
          for (int64_t sp = 0; sp < splits; ++sp) {
            const float* p = part.data() + (b * splits + sp) * part_stride;
            if (p[rows_max * (a.dv + 1) + r] > 0.f) mx = std::max(mx, p[rows_max * a.dv + r]);
          }
          float* o = out_row(a.out, n, t0 + r / a.group, j * a.group + r % a.group, a.T, a.nh, a.dv);
          std::fill(o, o + a.dv, 0.f);
          for (int64_t sp = 0; sp < splits; ++sp) {
            const float* p = part.data() + (b * splits + sp) * part_stride;
            const float l = p[rows_max * (a.dv + 1) + r];
            if (l <= 0.f) continue;
            const float wgt = std::exp(p[rows_max * a.dv + r] - mx);
            sum += wgt * l;
            for (int64_t d = 0; d < a.dv; ++d) o[d] += wgt * p[r * a.dv + d];
          }
          const float inv = 1.f / sum;
          for (int64_t d = 0; d < a.dv; ++d) o[d] *= inv;
        }
      }
    }
  }
}

}  // namespace attn

// out [N, T, nh, dv] (float32, contiguous) = softmax(q k^T * scale) v per query head over its sequence's
// cache row: query t of sequence n sits at position start[n] + t and sees the keys at positions 0 .. itself.
// q float32 [N, T, nh, dk] (any strides, last dim contiguous); caches [S, L, nkv, d] float32 or float16
// (same dtype; any strides, last dim contiguous: the values may be a slice of the keys' rows); slots, start
// [N] int64. Query head h reads kv head h / (nh / nkv). The new tokens must be in the cache already.
void attention_cached(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                      at::Tensor start, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4, "attention_cached: 4-D q and caches");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "attention_cached: float32 q and contiguous float32 out");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && q.stride(3) == 1 && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "attention_cached: caches of one dtype, last dims contiguous");
  TORCH_CHECK(q.size(3) == k_cache.size(3) && k_cache.size(2) == v_cache.size(2) && q.size(2) % k_cache.size(2) == 0,
              "attention_cached: q [N, T, nh, dk] against caches [S, L, nkv, d] with nh a multiple of nkv");
  TORCH_CHECK(slots.scalar_type() == at::kLong && start.scalar_type() == at::kLong && slots.is_contiguous() &&
                  start.is_contiguous() && slots.numel() == q.size(0) && start.numel() == q.size(0),
              "attention_cached: int64 slots and start, one per sequence");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == q.size(2) &&
                  out.size(3) == v_cache.size(3),
              "attention_cached: out [N, T, nh, dv]");
  for (int64_t n = 0; n < q.size(0); ++n) {  // every row read lies inside the caches
    const int64_t s = slots.data_ptr<int64_t>()[n], p = start.data_ptr<int64_t>()[n];
    TORCH_CHECK(s >= 0 && s < k_cache.size(0) && s < v_cache.size(0) && p >= 0 && p + q.size(1) <= k_cache.size(1) &&
                    p + q.size(1) <= v_cache.size(1),
                "attention_cached: slot ", s, " from position ", p, " outside the caches");
  }
  if (k_cache.scalar_type() == at::kHalf)
    attn::attend_impl<at::Half>(q, k_cache, v_cache, slots, start, scale, out);
  else if (k_cache.scalar_type() == at::kFloat)
    attn::attend_impl<float>(q, k_cache, v_cache, slots, start, scale, out);
  else
    TORCH_CHECK(false, "attention_cached: float32 or float16 caches, got ", k_cache.scalar_type());
}

}  // namespace deltaserve

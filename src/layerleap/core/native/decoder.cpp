// layerleap's decoder layers in C++: the same ATen calls, in the same order, as model.py's Python
// path (Block -> Attention -> attend, RMSNorm, Linear with its weight format), so the results are
// equal bit for bit; what this saves is the Python interpreter between the ~40 small calls of a
// layer.  A few steps are done here without ATen, rounding where ATen rounds (bf16 conversions around
// the block products, rope and the cache writes, RMSNorm: the same bits), and calls of a few rows on block
// weights run on a team of threads (see Team).  Built on first request by layerleap/native/__init__.py; model.py falls back to Python
// when it is not built, and for the cases this file does not take (see run_layers' checks there).
#include <torch/extension.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <string>
#include <limits>
#include <vector>
#include <array>
#include <map>
#include <mutex>
#include <atomic>
#include <exception>
#include <thread>
#include <utility>
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

using at::Tensor;
using c10::optional;

namespace {

// kernels.py's formats; BLOCKS_FINE: a block weight whose activations are rounded to 15 bits, BLOCKS: to 8;
// STACK: block weights over consecutive output rows (kernels.StackWeight), its parts the entries after it
enum Kind : int64_t { DENSE = 0, ONEDNN = 1, INT4 = 2, BLOCKS = 3, BLOCKS_FINE = 4, STACK = 5 };

Tensor block_matmul_to(const Tensor& x, const Tensor& codes, const Tensor& dm, int64_t N, bool fine,
                       const std::string& path, at::ScalarType out);
constexpr int64_t FUSED_ROWS = 64;  // the most rows whose bf16 conversions block_matmul_to makes itself

struct Proj {  // one projection: the weight format's tensors (see kernels.py)
  int64_t kind;
  Tensor a;              // DENSE: weight [N, K]; ONEDNN: packed weight; INT4: packed codes [N', K/2]; BLOCKS: codes
  Tensor b;              // INT4: scale_zero [K/32, N', 2]; BLOCKS: scales and minimums; ONEDNN: rows table (int64)
  optional<Tensor> bias;
  int64_t out;           // output features (INT4 cuts its padding)
  int64_t in;            // input features
  std::vector<Proj> parts;  // STACK: the block weights of its rows, in order
};

Tensor onednn_linear(const Tensor& x2, const Tensor& w, const optional<Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const optional<Tensor>&, c10::string_view,
                                     c10::List<optional<c10::Scalar>>, optional<c10::string_view>)>();
  return op.call(x2, w, bias, "none", c10::List<optional<c10::Scalar>>(), c10::string_view(""));
}

// model.linear / Linear.forward / OneDNNWeight.matmul / Int4Weight.matmul
Tensor project(const Proj& p, const Tensor& x, bool detour) {
  auto sizes = x.sizes().vec();
  int64_t rows = x.numel() / x.size(-1);
  if (p.kind == DENSE) {
    if (rows >= 16 && detour) {
      optional<Tensor> b = p.bias.has_value() ? optional<Tensor>(p.bias->to(at::kFloat)) : c10::nullopt;
      return at::linear(x.to(at::kFloat), p.a.to(at::kFloat), b).to(x.scalar_type());
    }
    return at::linear(x, p.a, p.bias);
  }
  sizes.back() = p.out;
  if (p.kind == ONEDNN) {  // padded with zero rows to p.b[rows] rows where that is more (OneDNNWeight.pad_to)
    auto x2 = x.reshape({-1, p.in});
    if (x2.scalar_type() != p.a.scalar_type()) x2 = x2.to(p.a.scalar_type());
    int64_t to = rows < p.b.numel() ? p.b.data_ptr<int64_t>()[rows] : rows;
    if (to <= rows) return onednn_linear(x2, p.a, p.bias).view(sizes);
    x2 = at::cat({x2, x2.new_zeros({to - rows, p.in})});
    return onednn_linear(x2, p.a, p.bias).narrow(0, 0, rows).view(sizes);
  }
  if (p.kind == BLOCKS || p.kind == BLOCKS_FINE) {  // BlockWeight.matmul
    const bool fuse = x.scalar_type() == at::kBFloat16 && !p.bias.has_value() && rows <= FUSED_ROWS;
    auto y = block_matmul_to(x.reshape({-1, p.in}), p.a, p.b, p.out, p.kind == BLOCKS_FINE, "",
                             fuse ? at::kBFloat16 : at::kFloat);
    if (fuse) return y.view(sizes);  // the same bits as y.to(bf16) below
    if (p.bias.has_value()) y = y + p.bias->to(y.scalar_type());
    return y.view(sizes).to(x.scalar_type());
  }
  if (p.kind == STACK) {  // StackWeight.matmul
    auto x2 = x.reshape({-1, p.in});
    std::vector<Tensor> ys;
    for (const auto& q : p.parts)
      ys.push_back(block_matmul_to(x2, q.a, q.b, q.out, q.kind == BLOCKS_FINE, "", at::kFloat));
    auto y = at::cat(ys, 1);
    if (p.bias.has_value()) y = y + p.bias->to(y.scalar_type());
    return y.view(sizes).to(x.scalar_type());
  }
  auto x2 = x.reshape({-1, p.in}).to(at::kBFloat16);
  Tensor y;
  if (x2.size(0) <= 16) {
    y = at::_weight_int4pack_mm_for_cpu(x2, p.a, 32, p.b);
  } else {
    std::vector<Tensor> parts;
    for (const auto& c : x2.split(16)) parts.push_back(at::_weight_int4pack_mm_for_cpu(c, p.a, 32, p.b));
    y = at::cat(parts);
  }
  if (y.size(1) != p.out) y = y.narrow(1, 0, p.out);
  if (p.bias.has_value()) y = y + p.bias->to(y.scalar_type());
  return y.view(sizes).to(x.scalar_type());
}

// fp32 -> bf16 as ATen's vectorized conversion: rounded to the nearest, ties to even; NaN -> 0xFFFF
static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return std::isnan(f) ? 0xFFFF : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// RMSNorm.forward for bf16 x and weight without ATen calls: ATen's operations on this build, value for
// value (x*x in fp32; their sum in the order of ATen's vectorized inner sum: 8-lane vectors, 4 rows of
// them interleaved, a cascade of 4 levels, then the tail and the lanes; / D; + eps; 1 / sqrt; x * that,
// rounded to bf16; times the weight, rounded).  Whether ATen sums so here is checked once per size
// against ATen itself (rms_norm_exact); where it does not, the ATen calls run.
typedef float v8f __attribute__((vector_size(32)));

__attribute__((optimize("fp-contract=off"))) static float aten_sum_of_squares(const float* x, int64_t n,
                                                                              float* sq) {
  for (int64_t i = 0; i < n; i++) sq[i] = x[i] * x[i];
  constexpr int64_t W = 8, ILP = 4, LEVELS = 4;
  const int64_t vecs = n / W, rows = vecs / ILP;
  auto load = [&](int64_t v) {
    v8f a;
    std::memcpy(&a, sq + v * W, sizeof(a));
    return a;
  };
  int64_t log2 = 0;
  while ((int64_t{1} << log2) < rows) log2++;
  const int64_t power = std::max<int64_t>(4, log2 / LEVELS), step = int64_t{1} << power, mask = step - 1;
  v8f acc[ILP][LEVELS] = {};
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; j++, i++)
      for (int64_t k = 0; k < ILP; k++) acc[k][0] += load(i * ILP + k);
    for (int64_t j = 1; j < LEVELS; j++) {
      for (int64_t k = 0; k < ILP; k++) {
        acc[k][j] += acc[k][j - 1];
        acc[k][j - 1] = v8f{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; i++)
    for (int64_t k = 0; k < ILP; k++) acc[k][0] += load(i * ILP + k);
  for (int64_t j = 1; j < LEVELS; j++)
    for (int64_t k = 0; k < ILP; k++) acc[k][0] += acc[k][j];
  v8f p = acc[0][0];
  for (int64_t v = rows * ILP; v < vecs; v++) p += load(v);
  for (int64_t k = 1; k < ILP; k++) p += acc[k][0];
  float s = 0.0f;
  for (int64_t k = vecs * W; k < n; k++) s += sq[k];
  for (int l = 0; l < W; l++) s += p[l];
  return s;
}

static Tensor rms_norm_bf16(const Tensor& x, const Tensor& w, double eps) {
  const int64_t D = x.size(-1), rows = x.numel() / D;
  auto out = at::empty(x.sizes(), x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  thread_local std::vector<float> buf;
  buf.resize(2 * D);
  float *xf = buf.data(), *sq = xf + D;
  auto f = [](uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float y;
    std::memcpy(&y, &u, 4);
    return y;
  };
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t d = 0; d < D; d++) xf[d] = f(xp[r * D + d]);
    const float mean = aten_sum_of_squares(xf, D, sq) / static_cast<float>(D);
    const float inv = 1.0f / std::sqrt(mean + static_cast<float>(eps));
    for (int64_t d = 0; d < D; d++) op[r * D + d] = bf16_bits(f(wp[d]) * f(bf16_bits(xf[d] * inv)));
  }
  return out;
}

// whether rms_norm_bf16 gives ATen's bits for rows of D (checked once per D and eps on random rows)
static bool rms_norm_exact(int64_t D, double eps) {
  static std::mutex lock;
  static std::map<std::pair<int64_t, double>, bool> known;
  std::lock_guard<std::mutex> hold(lock);
  auto it = known.find({D, eps});
  if (it != known.end()) return it->second;
  uint64_t state = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(D);  // a fixed pseudo-random sequence
  auto next = [&]() {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return static_cast<float>(state >> 40) / static_cast<float>(1 << 24) - 0.5f;  // in [-0.5, 0.5)
  };
  std::vector<float> xs(64 * D), ws(D);
  for (auto& v : xs) v = 6.0f * (next() + next() + next());
  for (auto& v : ws) v = 1.0f + next();
  auto x = at::from_blob(xs.data(), {64, D}, at::kFloat).to(at::kBFloat16);
  auto w = at::from_blob(ws.data(), {D}, at::kFloat).to(at::kBFloat16);
  auto want = w * at::rms_norm(x.to(at::kFloat), {D}, c10::nullopt, eps).to(at::kBFloat16);
  return known[{D, eps}] = at::equal(rms_norm_bf16(x, w, eps), want);
}

// RMSNorm.forward
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  if (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat) return at::rms_norm(x, {x.size(-1)}, w, eps);
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
      w.is_contiguous() && w.numel() == x.size(-1) && x.numel() <= 64 * x.size(-1) && rms_norm_exact(x.size(-1), eps))
    return rms_norm_bf16(x, w, eps);
  return w * at::rms_norm(x.to(at::kFloat), {x.size(-1)}, c10::nullopt, eps).to(x.scalar_type());
}

typedef float v16 __attribute__((vector_size(64)));  // 16 lanes (split by the compiler where narrower)

// x as it is, rounded: a product passed through here is never fused into the addition after it (the
// compiler sees no product in what the empty asm hands back)
template <typename V>
static inline V rounded(V x) {
#if defined(__AVX512F__)
  asm("" : "+v"(x));
#else
  asm("" : "+m"(x));
#endif
  return x;
}

// The dot product of a and b over n elements in a fixed order: 16 lanes of partial sums over the
// 16-element chunks in order, then the lanes added pairwise (8+8, 4+4, 2+2, 1+1), then the tail in
// order: where 8 or more elements are left, 8 products, each rounded, added one by one; then the rest
// as multiply-adds, fused where the build has FMA.  (That is what GCC made of a plain loop over the tail
// on AVX-512; on AVX2 it made 4 more products apart, so hd % 8 of 4 to 7 gave other bits there; spelled out
// here, every build gives the same.)  The same inputs give the same bits wherever the call sits.
// Attention takes it 16 keys at a time (dot16, dot16_tail).
[[maybe_unused]] static inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = {0};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    v16 x, y;
    std::memcpy(&x, a + d, sizeof(v16));
    std::memcpy(&y, b + d, sizeof(v16));
    acc += x * y;
  }
  float l[16];
  std::memcpy(l, &acc, sizeof(v16));
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; i++) l[i] += l[i + w];
  float s = l[0];
  if (n - d >= 8)
    for (const int64_t e = d + 8; d < e; d++) s += rounded(a[d] * b[d]);
#if defined(__FMA__)
  for (; d < n; d++) s = std::fma(a[d], b[d], s);
#else
  for (; d < n; d++) s += a[d] * b[d];
#endif
  return s;
}

// dot's tail for 16 keys at once: s (their sums over the chunks, as dot16 gives them) plus the products of
// elements hd16 .. hd-1 of q and of the keys (kt: element d of key j at kt[(d - hd16) * 16 + j]), in dot's
// order with its roundings (the multiply-adds fused where dot's are: the compiler fuses both where the build
// has FMA)
static inline v16 dot16_tail(v16 s, const float* q, const float* kt, int64_t hd16, int64_t hd) {
  int64_t d = hd16;
  if (hd - d >= 8)
    for (const int64_t e = d + 8; d < e; d++) {
      v16 k;
      std::memcpy(&k, kt + (d - hd16) * 16, sizeof(v16));
      s += rounded(q[d] * k);
    }
  for (; d < hd; d++) {
    v16 k;
    std::memcpy(&k, kt + (d - hd16) * 16, sizeof(v16));
    s += q[d] * k;
  }
  return s;
}

typedef int32_t i16v __attribute__((vector_size(64)));

// One level of the 16-key lane reduction: x and y each hold 16/(2w) keys in groups of 2w lanes; the
// result holds twice as many keys in groups of w lanes, lane i of a key's group being the sum of its
// lanes i and i+w (masks: key group g of the result takes x's group g, then y's).
static const i16v LO8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const i16v HI8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
static const i16v LO4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
static const i16v HI4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
static const i16v LO2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
static const i16v HI2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
static const i16v LO1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const i16v HI1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
template <int W>
static inline v16 fold(v16 x, v16 y) {
  const i16v lo = W == 8 ? LO8 : W == 4 ? LO4 : W == 2 ? LO2 : LO1;
  const i16v hi = W == 8 ? HI8 : W == 4 ? HI4 : W == 2 ? HI2 : HI1;
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define LL_DOT16_AVX2 1
// dot16's last three levels with AVX2: keys k[0..7], each its 8 lanes (lane i: lanes i + i+8 of dot16's
// partial sums) -> one lane each, in key order: lanes i + i+4, then + i+2, then + i+1, with 8-lane shuffles.
static inline __m256 reduce8_avx2(const __m256* k) {
  __m256 f4[4], f2[2];
  for (int i = 0; i < 4; i++)  // [key 2i: lanes i + i+4 | key 2i+1: the same]
    f4[i] = _mm256_add_ps(_mm256_permute2f128_ps(k[2 * i], k[2 * i + 1], 0x20),
                          _mm256_permute2f128_ps(k[2 * i], k[2 * i + 1], 0x31));
  for (int i = 0; i < 2; i++)  // lanes i + i+2: [4i: 2, 4i+2: 2 | 4i+1: 2, 4i+3: 2]
    f2[i] = _mm256_add_ps(_mm256_shuffle_ps(f4[2 * i], f4[2 * i + 1], 0x44),
                          _mm256_shuffle_ps(f4[2 * i], f4[2 * i + 1], 0xEE));
  // lanes 0 + 1: [keys 0, 2, 4, 6 | 1, 3, 5, 7], then in order
  const __m256 f1 = _mm256_add_ps(_mm256_shuffle_ps(f2[0], f2[1], 0x88), _mm256_shuffle_ps(f2[0], f2[1], 0xDD));
  return _mm256_permutevar8x32_ps(f1, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 8 values at p as fp32 (exact: a bf16 is the top half of its fp32; an fp16 converted by F16C, as
// static_cast<float> converts it here)
template <typename T>
static inline __m256 load8f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  } else {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    float x[8];
    for (int i = 0; i < 8; i++) x[i] = static_cast<float>(p[i]);
    return _mm256_loadu_ps(x);
#endif
  }
}

// dot16_tail with AVX2 (two halves of 8 lanes; the products apart, then the multiply-adds fused, as dot's)
static inline v16 dot16_tail_avx2(v16 s, const float* q, const float* kt, int64_t hd16, int64_t hd) {
  __m256 h[2];
  std::memcpy(h, &s, sizeof(h));
  int64_t d = hd16;
  if (hd - d >= 8)
    for (const int64_t e = d + 8; d < e; d++)
      for (int i = 0; i < 2; i++) {
        __m256 p = _mm256_mul_ps(_mm256_set1_ps(q[d]), _mm256_loadu_ps(kt + (d - hd16) * 16 + 8 * i));
        asm("" : "+x"(p));  // rounded: not fused into the addition
        h[i] = _mm256_add_ps(h[i], p);
      }
  for (; d < hd; d++)
    for (int i = 0; i < 2; i++)
      h[i] = _mm256_fmadd_ps(_mm256_set1_ps(q[d]), _mm256_loadu_ps(kt + (d - hd16) * 16 + 8 * i), h[i]);
  std::memcpy(&s, h, sizeof(h));
  return s;
}

// dot16_rows with AVX2: NQ query rows (row n at q + n * qs) against the same 16 keys (key j's elements at
// key[j], in the cache's dtype: widened in registers as they are read, each key chunk once for the NQ rows),
// KG keys at a time, their NQ * KG * 2 accumulators in registers (the queries read by the multiply-adds from
// memory).  Each key's 16 lanes of partial sums as two halves of 8, the same multiply-adds lane by lane,
// then the same tree (lanes i + i+8, then reduce8_avx2): the bits of dot16.
template <int NQ, typename T>
static inline void dot16_rows_avx2(const float* q, int64_t qs, const T* const* key, int64_t hd, v16* out) {
  constexpr int KG = NQ == 1 ? 4 : 2;
  __m256 s8[NQ][16];
  for (int j0 = 0; j0 < 16; j0 += KG) {
    __m256 a[NQ][KG][2];
    for (int n = 0; n < NQ; n++)
      for (int j = 0; j < KG; j++) a[n][j][0] = a[n][j][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16) {
      for (int j = 0; j < KG; j++) {
        const T* k = key[j0 + j] + d;
        for (int h = 0; h < 2; h++) {
          const __m256 kv = load8f(k + 8 * h);
          for (int n = 0; n < NQ; n++)
            a[n][j][h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + n * qs + d + 8 * h), kv, a[n][j][h]);
        }
      }
    }
    for (int n = 0; n < NQ; n++)
      for (int j = 0; j < KG; j++) s8[n][j0 + j] = _mm256_add_ps(a[n][j][0], a[n][j][1]);  // lane i + i+8
  }
  for (int n = 0; n < NQ; n++) {
    const __m256 r0 = reduce8_avx2(s8[n]), r1 = reduce8_avx2(s8[n] + 8);
    std::memcpy(&out[n], &r0, sizeof(r0));
    std::memcpy(reinterpret_cast<char*>(&out[n]) + sizeof(r0), &r1, sizeof(r1));
  }
}
#endif

// Scores of 16 consecutive keys (rows k, k + ks, …; zero rows past the end) against q, hd a multiple
// of 16: the same arithmetic as ``dot`` for each key (lane-wise partial sums over the chunks in order,
// then lanes added as i+8, i+4, i+2, i+1), done for 16 keys at once with shuffles.
static inline v16 dot16(const float* q, const float* const* keys, int64_t hd) {
  v16 p[16];
  for (int j = 0; j < 16; j++) p[j] = v16{0};
  for (int64_t d = 0; d < hd; d += 16) {
    v16 x;
    std::memcpy(&x, q + d, sizeof(v16));
    for (int j = 0; j < 16; j++) {
      v16 y;
      std::memcpy(&y, keys[j] + d, sizeof(v16));
      p[j] += x * y;
    }
  }
  for (int j = 0; j < 8; j++) p[j] = fold<8>(p[2 * j], p[2 * j + 1]);
  for (int j = 0; j < 4; j++) p[j] = fold<4>(p[2 * j], p[2 * j + 1]);
  for (int j = 0; j < 2; j++) p[j] = fold<2>(p[2 * j], p[2 * j + 1]);
  return fold<1>(p[0], p[1]);
}

// dot16 over 16 keys stored chunk by chunk: kc[(c * 16 + j) * 16 + i] is element 16 c + i of key j (the
// same arithmetic, in the same order; the keys' addresses are fixed offsets from kc, none kept apart)
static inline v16 dot16_packed(const float* q, const float* kc, int64_t hd) {
  v16 p[16];
  for (int j = 0; j < 16; j++) p[j] = v16{0};
  for (int64_t d = 0; d < hd; d += 16) {
    v16 x;
    std::memcpy(&x, q + d, sizeof(v16));
    const float* chunk = kc + d * 16;
    for (int j = 0; j < 16; j++) {
      v16 y;
      std::memcpy(&y, chunk + 16 * j, sizeof(v16));
      p[j] += x * y;
    }
  }
  for (int j = 0; j < 8; j++) p[j] = fold<8>(p[2 * j], p[2 * j + 1]);
  for (int j = 0; j < 4; j++) p[j] = fold<4>(p[2 * j], p[2 * j + 1]);
  for (int j = 0; j < 2; j++) p[j] = fold<2>(p[2 * j], p[2 * j + 1]);
  return fold<1>(p[0], p[1]);
}

// dot16 of NQ query rows (row n at q + n * qs) against the same 16 keys, the rows' multiply-adds side by
// side (independent chains, and a key chunk's address computed once for them): the keys in two halves of
// 8, since the first three levels of dot16's tree reduce keys 0-7 and 8-15 apart (so 8 accumulators a row,
// in registers), then the last level; each row's multiply-adds and additions those of dot16, in its
// order, so its bits.  key(j, d): key j's elements d .. d+15 (where they are, or as a v16).
template <int NQ, typename Key>
static inline void dot16_rows(const float* q, int64_t qs, Key key, int64_t hd, v16* out) {
  v16 half[NQ][2];
  for (int h = 0; h < 2; h++) {
    v16 p[NQ][8];
    for (int n = 0; n < NQ; n++)
      for (int j = 0; j < 8; j++) p[n][j] = v16{0};
    for (int64_t d = 0; d < hd; d += 16) {
      v16 x[NQ];
      for (int n = 0; n < NQ; n++) std::memcpy(&x[n], q + n * qs + d, sizeof(v16));
      for (int j = 0; j < 8; j++) {
        v16 y;
        if constexpr (std::is_pointer_v<decltype(key(0, 0))>)
          std::memcpy(&y, key(8 * h + j, d), sizeof(v16));
        else
          y = key(8 * h + j, d);
        for (int n = 0; n < NQ; n++) p[n][j] += x[n] * y;
      }
    }
    for (int n = 0; n < NQ; n++) {
      for (int j = 0; j < 4; j++) p[n][j] = fold<8>(p[n][2 * j], p[n][2 * j + 1]);
      for (int j = 0; j < 2; j++) p[n][j] = fold<4>(p[n][2 * j], p[n][2 * j + 1]);
      half[n][h] = fold<2>(p[n][0], p[n][1]);
    }
  }
  for (int n = 0; n < NQ; n++) out[n] = fold<1>(half[n][0], half[n][1]);
}

// Helpers of exp_neg16 below.
static inline v16 splat(float f) { return v16{} + f; }
static inline v16 floor16(v16 x) {
#if defined(__AVX512F__)
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
  for (int i = 0; i < 16; i++) x[i] = std::floor(x[i]);
  return x;
#endif
}
// exp(x) for x <= 0 in fp32 on 16 lanes (Cephes' expf: a degree-6 polynomial after range reduction,
// within 2 ulp); the same result for an element wherever it sits.
static inline v16 exp_neg16(v16 x) {
  const v16 lo = splat(-87.3f);
  x = x < lo ? lo : x;  // std::max(x, -87.3f)
  const v16 n = floor16(x * 1.44269504088896341f + 0.5f);
  const v16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  i16v bits = reinterpret_cast<i16v&>(p);
  bits += __builtin_convertvector(n, i16v) << 23;
  return reinterpret_cast<v16&>(bits);
}

#ifdef LL_DOT16_AVX2
// exp_neg16 on 8 lanes with AVX2: its operations in its order, each the one instruction the AVX-512 build
// makes of it (the clamp a max that keeps a NaN, the products fused into the additions where GCC fuses
// them there, p * r * r + r as (p * r) * r + r), so the same bits lane for lane.
static inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);  // x < lo ? lo : x
  const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvttps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
#endif

// The first ``n`` (<= 16) elements at p as fp32 (zeros after them).
template <typename T>
static inline v16 load16f(const T* p, int64_t n) {
  v16 x = {0};
  if constexpr (std::is_same_v<T, float>) {
    if (n == 16) {
      std::memcpy(&x, p, sizeof(v16));
      return x;
    }
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // a bf16 is the top half of its fp32: exact
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __mmask16 live = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16);
    std::memcpy(&x, &w, sizeof(v16));
    return x;
#elif defined(__AVX2__)
    if (n == 16) {  // the same, 8 lanes at a time
      __m256i w[2];
      for (int h = 0; h < 2; h++) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h));
        w[h] = _mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16);
      }
      std::memcpy(&x, w, sizeof(v16));
      return x;
    }
#else
    if (n == 16) {
      uint16_t b[16];
      i16v w;
      std::memcpy(b, p, sizeof(b));
      for (int i = 0; i < 16; i++) w[i] = static_cast<int32_t>(static_cast<uint32_t>(b[i]) << 16);
      std::memcpy(&x, &w, sizeof(v16));
      return x;
    }
#endif
  }
#if defined(__F16C__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::Half>) {  // F16C's conversion, as static_cast<float> makes it here
    if (n == 16) {
      const __m512 h = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      std::memcpy(&x, &h, sizeof(v16));
      return x;
    }
  }
#elif defined(__F16C__)
  if constexpr (std::is_same_v<T, c10::Half>) {  // the same, 8 lanes at a time
    if (n == 16) {
      __m256 h[2];
      for (int i = 0; i < 2; i++)
        h[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * i)));
      std::memcpy(&x, h, sizeof(v16));
      return x;
    }
  }
#endif
  for (int64_t i = 0; i < n; i++) x[i] = static_cast<float>(p[i]);
  return x;
}

// Runs f(NR, NS) with both fixed at compile time (1..4 each), so that a tile's accumulators stay in registers.
template <typename F>
static inline void with_tile(int64_t nr, int64_t ns, F&& f) {
  auto rows = [&](auto NS) {
    switch (nr) {
      case 1: return f(std::integral_constant<int, 1>{}, NS);
      case 2: return f(std::integral_constant<int, 2>{}, NS);
      case 3: return f(std::integral_constant<int, 3>{}, NS);
      default: return f(std::integral_constant<int, 4>{}, NS);
    }
  };
  switch (ns) {
    case 1: return rows(std::integral_constant<int, 1>{});
    case 2: return rows(std::integral_constant<int, 2>{});
    case 3: return rows(std::integral_constant<int, 3>{});
    default: return rows(std::integral_constant<int, 4>{});
  }
}

#ifdef LL_DOT16_AVX2
// n (<= 8; 8: all, <= 0: none) values at p as fp32, zeros after them (FULL: 8), as load16f makes them
template <typename T, bool FULL>
static inline __m256 load8_part(const T* p, int64_t n) {
  if constexpr (!FULL) {
    if (n < 8) {
      if (n <= 0) return _mm256_setzero_ps();
      if constexpr (std::is_same_v<T, float>) {
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        return _mm256_maskload_ps(p, live);
      } else {
        T x[8] = {};
        for (int64_t i = 0; i < n; i++) x[i] = p[i];
        return load8f(x);
      }
    }
  }
  return load8f(p);
}

// value_tile's loop over the keys for its NR rows and NC of its slices with AVX2 (NR * NC <= 4: the 2 NR NC
// accumulators in registers; a slice of 16 as two halves of 8 lanes), each lane the fused multiply-adds of
// the AVX-512 path in its order, so its bits.  A weight of 0 leaves the accumulators as they are: AVX2 has
// no masked multiply-add, so the keys go in blocks of 8, and a block whose weights for these rows are all
// nonzero (the usual case) adds with no test at all; a block with a 0 (a masked key, an underflow) keeps
// each multiply-add's result only where the weight is not 0 (a blend).  No branch per weight: with one,
// GCC's loop took 4 taken jumps a key, and with the rows' weight sums in 4 registers of their own it kept
// the accumulators in memory (so the sums share one, row j in lane j, each still added in key order).
// FULL: every slice 16 wide; v: the first slice's values of key 0; w: the slices' widths; acc: row j's
// slice i at acc[j * STRIDE + i]; SUMS: the rows' weight sums into sums[0 .. NR).
template <typename T, int NR, int NC, int STRIDE, bool FULL, bool SUMS>
__attribute__((noinline)) static void value_keys_avx2(
    const T* v, int64_t vs, int64_t Tk, const int64_t* w, const float* p, int64_t pstride, float* sums, v16* acc) {
  static_assert(NR <= 4, "the rows' weight sums in one register");
  __m256 a[NR][NC][2];
  __m128 s = _mm_setzero_ps();  // row j's weight sum in lane j
  for (int j = 0; j < NR; j++)
    for (int i = 0; i < NC; i++) a[j][i][0] = a[j][i][1] = _mm256_setzero_ps();
  const __m256 zero = _mm256_setzero_ps();
  // key t's products for the NR rows and NC slices (TEST: each kept only where its weight is not 0, NaN
  // included), and its weights added to the rows' sums
#define LL_VALUE_KEY(TEST)                                                                                 \
  {                                                                                                        \
    __m256 vt[NC][2];                                                                                      \
    for (int i = 0; i < NC; i++)                                                                           \
      for (int h = 0; h < 2; h++) vt[i][h] = load8_part<T, FULL>(v + t * vs + 16 * i + 8 * h, w[i] - 8 * h); \
    for (int j = 0; j < NR; j++) {                                                                         \
      const __m256 pv = _mm256_set1_ps(p[j * pstride + t]);                                                \
      const __m256 keep = _mm256_cmp_ps(pv, zero, _CMP_NEQ_UQ);                                            \
      for (int i = 0; i < NC; i++)                                                                         \
        for (int h = 0; h < 2; h++) {                                                                      \
          const __m256 f = _mm256_fmadd_ps(pv, vt[i][h], a[j][i][h]);                                      \
          a[j][i][h] = TEST ? _mm256_blendv_ps(a[j][i][h], f, keep) : f;                                   \
        }                                                                                                  \
    }                                                                                                      \
    if (SUMS)                                                                                              \
      s = _mm_add_ps(s, _mm_setr_ps(p[t], NR > 1 ? p[pstride + t] : 0.0f, NR > 2 ? p[2 * pstride + t] : 0.0f, \
                                    NR > 3 ? p[3 * pstride + t] : 0.0f));                                  \
  }
  int64_t t = 0;
  while (t + 8 <= Tk) {
    __m256 zeros = _mm256_cmp_ps(_mm256_loadu_ps(p + t), zero, _CMP_EQ_OQ);
    for (int j = 1; j < NR; j++)
      zeros = _mm256_or_ps(zeros, _mm256_cmp_ps(_mm256_loadu_ps(p + j * pstride + t), zero, _CMP_EQ_OQ));
    const int64_t t1 = t + 8;
    if (_mm256_movemask_ps(zeros) == 0) {
      for (; t < t1; t++) LL_VALUE_KEY(false)
    } else {
      for (; t < t1; t++) LL_VALUE_KEY(true)
    }
  }
  for (; t < Tk; t++) LL_VALUE_KEY(true)
#undef LL_VALUE_KEY
  if (SUMS) {
    float lanes[4];
    _mm_storeu_ps(lanes, s);
    for (int j = 0; j < NR; j++) sums[j] = lanes[j];
  }
  for (int j = 0; j < NR; j++)
    for (int i = 0; i < NC; i++) {
      _mm256_storeu_ps(reinterpret_cast<float*>(acc + j * STRIDE + i), a[j][i][0]);
      _mm256_storeu_ps(reinterpret_cast<float*>(acc + j * STRIDE + i) + 8, a[j][i][1]);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 values at p as fp32 (FULL: all 16; else the first n, zeros after them; live: their lanes), as load16f
template <typename T, bool FULL>
static inline __m512 load16_avx512(const T* p, __mmask16 live, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return FULL ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(live, p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // a bf16 is the top half of its fp32: exact
    const __m256i b =
        FULL ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(live, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  } else {
    return (__m512)load16f(p, FULL ? 16 : n);
  }
}

// value_tile's loop over the keys with intrinsics: the same operations (a weight's product added as one
// fused multiply-add, as the compiler makes of it there; a weight of 0, a masked multiply-add that leaves
// the accumulators as they are).  Written so that GCC keeps the NR * NS accumulators in registers: no
// branch per weight, the values' lanes masked once (FULL: every slice 16 wide), and a function of its own
// without SLP vectorization (GCC packed the rows' weight sums into a vector, and inlined, with a branch per
// weight, it kept every accumulator in memory and stored them all every key).
// v: the first slice's values of key 0; w: the slices' widths; acc: row j's slice i at acc[j * NS + i].
template <typename T, int NR, int NS, bool FULL>
__attribute__((noinline, optimize("no-tree-slp-vectorize"))) static void value_keys_avx512(
    const T* v, int64_t vs, int64_t Tk, const int64_t* w, const float* p, int64_t pstride, float* sums, v16* acc) {
  __m512 a[NR][NS];
  float s[NR];
  __mmask16 live[NS];
  for (int i = 0; i < NS; i++) live[i] = w[i] >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << w[i]) - 1);
  for (int j = 0; j < NR; j++) {
    s[j] = 0.0f;
    for (int i = 0; i < NS; i++) a[j][i] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < Tk; t++) {
    __m512 vt[NS];
    for (int i = 0; i < NS; i++) vt[i] = load16_avx512<T, FULL>(v + t * vs + 16 * i, live[i], w[i]);
    for (int j = 0; j < NR; j++) {
      const float pj = p[j * pstride + t];
      s[j] += pj;
      const __m512 pv = _mm512_set1_ps(pj);
      const __mmask16 add = _mm512_cmp_ps_mask(pv, _mm512_setzero_ps(), _CMP_NEQ_UQ);  // pj != 0 (NaN too)
      for (int i = 0; i < NS; i++) a[j][i] = _mm512_mask3_fmadd_ps(pv, vt[i], a[j][i], add);
    }
  }
  for (int j = 0; j < NR; j++) {
    sums[j] = s[j];
    for (int i = 0; i < NS; i++) _mm512_storeu_ps(reinterpret_cast<float*>(acc + j * NS + i), a[j][i]);
  }
}
#endif

// Pass 3 of attend_rows for query rows r0 .. r0+NR-1 of one key/value head and head-dim slices
// [d0, d0 + 16 NS) (clipped to hd): out row = sum_t p_t v_t / sum_t p_t over the keys in order, skipping
// weights of 0.  p: the rows' weights (row stride pstride); out: the head group's first output row
// (row r at (r / S) * S * hd + (r % S) * hd).
template <typename T, int NR, int NS>
static void value_tile(const T* v, int64_t vs, int64_t Tk, int64_t hd, int64_t d0, const float* p, int64_t pstride,
                       T* out, int64_t S, int64_t r0, int64_t hd_out) {
  v16 acc[NR][NS];
  float sums[NR];
  int64_t w[NS];
  for (int j = 0; j < NR; j++) {
    sums[j] = 0.0f;
    for (int i = 0; i < NS; i++) acc[j][i] = v16{0};
  }
  for (int i = 0; i < NS; i++) w[i] = std::max<int64_t>(0, std::min<int64_t>(16, hd - d0 - 16 * i));
  const bool full = w[NS - 1] == 16;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // the loop below with intrinsics, the same operations (value_keys_avx512)
  if (true) {
    if (full)
      value_keys_avx512<T, NR, NS, true>(v + d0, vs, Tk, w, p, pstride, sums, &acc[0][0]);
    else
      value_keys_avx512<T, NR, NS, false>(v + d0, vs, Tk, w, p, pstride, sums, &acc[0][0]);
  } else
#elif defined(LL_DOT16_AVX2)
  // the same with AVX2 (value_keys_avx2): runs of NC of the NS slices, so that a run's accumulators fit in
  // AVX2's 16 registers, each over every key; the rows' weight sums made in the first run
  if (true) {
    constexpr int NC = NR * NS <= 4 ? NS : NR == 2 && NS % 2 == 0 ? 2 : 1;
    for (int i = 0; i < NS; i += NC) {
      const auto run = [&](auto FULL, auto SUMS) {
        value_keys_avx2<T, NR, NC, NS, FULL, SUMS>(v + d0 + 16 * i, vs, Tk, w + i, p, pstride, sums, &acc[0][i]);
      };
      if (full)
        i == 0 ? run(std::true_type{}, std::true_type{}) : run(std::true_type{}, std::false_type{});
      else
        i == 0 ? run(std::false_type{}, std::true_type{}) : run(std::false_type{}, std::false_type{});
    }
  } else
#endif
  for (int64_t t = 0; t < Tk; t++) {  // each value slice read once for these rows, in key order
    v16 vt[NS];
    if constexpr (std::is_same_v<T, float>) {
      if (full) {
        for (int i = 0; i < NS; i++) std::memcpy(&vt[i], v + t * vs + d0 + 16 * i, sizeof(v16));
      } else {
        for (int i = 0; i < NS; i++) vt[i] = load16f(v + t * vs + d0 + 16 * i, w[i]);
      }
    } else {
      for (int i = 0; i < NS; i++) vt[i] = load16f(v + t * vs + d0 + 16 * i, w[i]);
    }
    for (int j = 0; j < NR; j++) {
      // a weight of 0 (a masked key; an underflowed one adds nothing either) leaves the sums as they
      // are: sums[j] + 0 is sums[j] (never -0), and the accumulators are kept, not added to
      const float pj = p[j * pstride + t];
      const v16 pv = splat(pj);
      const auto add = pv != 0.0f;
      sums[j] += pj;
      for (int i = 0; i < NS; i++) acc[j][i] = add ? acc[j][i] + pv * vt[i] : acc[j][i];
    }
  }
  for (int j = 0; j < NR; j++) {
    const int64_t r = r0 + j;
    const float inv = sums[j] > 0 ? 1.0f / sums[j] : 0.0f;
    T* orow = out + (r / S) * S * hd_out + (r % S) * hd_out + d0;
    for (int i = 0; i < NS; i++) {
      float lanes[16];  // a copy: read by lane here, so that the loop above keeps acc in registers
      const v16 a = acc[j][i] * inv;
      std::memcpy(lanes, &a, sizeof(a));
      for (int64_t d = 0; d < w[i]; d++) orow[16 * i + d] = static_cast<T>(lanes[d]);
    }
  }
}

// -- a team for the layers of a call with a few rows ----------------------------------------------------
// A call with a few new tokens reads every weight once and does little arithmetic per byte: on 1 thread
// its block products already stream at about the memory's speed, and the ~40 small ATen calls of a layer
// (norms, rope, cache writes, residual adds) run on one thread whatever the thread count.  So a second
// thread gains little by splitting each product alone.  With a team, the call's layers run inside one
// OpenMP region: thread 0 runs them as on 1 thread; the other threads take their shares of its parallel
// loops (the block products, attention: ``par_for``, split as at::parallel_for splits them) and, while
// they wait, stream the weights a few products ahead into the caches (``Team::stream``), so that the
// products read them from the last-level cache, at twice the speed of memory for two threads.  The
// shares are those of at::parallel_for, and every loop's result does not depend on its split: the same bits.
constexpr int TEAM_MAX = 64;
constexpr int64_t TEAM_ROWS = 16;  // the most rows (batch x new tokens) a call runs on a team
// bytes of weights streamed ahead of thread 0's product; teams_on: calls may run on a team (both settable
// by ``team_settings``, for timing one against the other in one process)
std::atomic<int64_t> stream_window{4 << 20};
std::atomic<bool> teams_on{true};
// whether a team splits the rounding of a product's activations between its threads (settable too; the
// same bits).  Where the build rounds with vector code (AVX-512, AVX2), not: on a 2-core Zen 5 the split
// made an 8-token q4 call no faster (the extra join, and thread 0 then reads half the rounded rows from
// the other core's cache); where it rounds with scalar code (portable), yes: an x86-64-v3 build rounding
// with the scalar code ran the same call about 1 ms (5%) faster split, on the same machine
// (benchmarks/q4_team_rounding.py, both settings timed in turn)
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) || \
    (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
std::atomic<bool> team_rounds{false};
#else
std::atomic<bool> team_rounds{true};
#endif
std::atomic<int64_t> team_calls{0};  // calls run on a team so far (tests check that teams run)
constexpr int64_t STREAM_STEP = 4096;       // bytes streamed between looks for a share of a loop
constexpr int64_t AFTER_BYTES = 12 << 20;   // of the call after's weight's codes (run_layers' `after`)

struct alignas(64) Mark {
  std::atomic<int64_t> v{0};
};

struct Team {
  int n = 1;                          // threads, thread 0 included
  std::atomic<int64_t> seq{0};        // loops posted so far (each helper takes its share of the last)
  std::atomic<bool> quit{false};
  Mark done[TEAM_MAX];                // per helper: the last loop whose share it finished
  void (*call)(const void*, int64_t, int64_t) = nullptr;
  const void* fn = nullptr;           // the posted loop's body
  int64_t begin = 0, end = 0, chunk = 0, shares = 0;
  std::exception_ptr failed[TEAM_MAX];
  // the weights in the order the products read them: (first byte, bytes), and where thread 0 reads
  std::vector<std::pair<const char*, int64_t>> ranges;
  size_t tail = SIZE_MAX;             // ranges from here on: the weights of the call after (a head), streamed
  int64_t tail_from = 0;              // once thread 0 is at this range (the last layer), past the window
  std::atomic<int64_t> cursor{0};     // index into ranges of the product thread 0 is at
  size_t next = 0;                    // helper 1: the range it streams, and how far in
  int64_t offset = 0, ahead = 0;      // ahead: bytes streamed beyond the start of range `cursor`
  int64_t seen_cursor = -1;
  int32_t touched = 0;                // the loaded bytes' sum (kept, so that the loads stay)

  // the body f over [b, e) in shares of at::parallel_for's sizes: thread 0 takes the first
  template <typename F>
  void parallel(int64_t b, int64_t e, int64_t grain, const F& f) {
    const int64_t range = e - b;
    const int64_t parts = std::min<int64_t>(n, grain > 0 ? (range + grain - 1) / grain : range);
    if (range <= 0) return;
    if (parts <= 1) return f(b, e);
    call = [](const void* p, int64_t x, int64_t y) { (*static_cast<const F*>(p))(x, y); };
    fn = &f;
    begin = b, end = e, shares = parts, chunk = (range + parts - 1) / parts;
    const int64_t s = seq.load(std::memory_order_relaxed) + 1;
    seq.store(s, std::memory_order_release);
    std::exception_ptr mine;
    try {
      f(b, std::min(e, b + chunk));
    } catch (...) {
      mine = std::current_exception();
    }
    for (int t = 1; t < n; t++) wait_for([&] { return done[t].v.load(std::memory_order_acquire) >= s; });
    if (mine) std::rethrow_exception(mine);
    for (int t = 1; t < n; t++)
      if (failed[t]) std::rethrow_exception(std::exchange(failed[t], nullptr));
  }

  static inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }

  template <typename P>
  static void wait_for(P ready) {
    for (int64_t spins = 0; !ready(); spins++) {
      relax();
      if (spins > (1 << 16)) std::this_thread::yield();  // a busy machine: let the other thread run
    }
  }

  // helper t (1 .. n-1): takes its share of each posted loop until thread 0 says stop; between loops,
  // helper 1 streams weights ahead
  void serve(int t) {
    int64_t taken = 0, idle = 0;
    while (true) {
      const int64_t s = seq.load(std::memory_order_acquire);
      if (s != taken) {
        taken = s;
        if (quit.load(std::memory_order_acquire)) return;
        const int64_t b0 = begin + t * chunk;
        if (t < shares && b0 < end) {
          try {
            call(fn, b0, std::min(end, b0 + chunk));
          } catch (...) {
            failed[t] = std::current_exception();
          }
        }
        done[t].v.store(s, std::memory_order_release);
        idle = 0;
      } else if (t != 1 || !stream()) {
        relax();
        if (++idle > (1 << 16)) std::this_thread::yield();
      }
    }
  }

  // thread 0: the product reading range i starts (the stream runs up to stream_window bytes past its start)
  void at_range(int64_t i) { cursor.store(i, std::memory_order_relaxed); }

  // up to STREAM_STEP bytes of the weights ahead loaded into the caches; false when the window is full
  bool stream() {
    const int64_t c = cursor.load(std::memory_order_relaxed);
    if (c != seen_cursor) {  // thread 0 moved on: the bytes between count no more
      if (next < static_cast<size_t>(c)) next = c, offset = 0;
      ahead = 0;
      for (size_t i = c; i < next; i++) ahead += ranges[i].second;
      ahead += offset;
      seen_cursor = c;
    }
    if (next >= ranges.size()) return false;
    if (next < tail ? ahead >= stream_window.load(std::memory_order_relaxed) : c < tail_from) return false;
    const char* p = ranges[next].first;
    const int64_t stop = std::min(ranges[next].second, offset + STREAM_STEP);
    int32_t sum = 0;  // a byte of each line loaded (on a Zen 4, prefetch instructions brought fewer lines)
    for (int64_t o = offset; o < stop; o += 64) sum += *reinterpret_cast<const volatile char*>(p + o);
    touched += sum;
    ahead += stop - offset;
    offset = stop;
    if (offset >= ranges[next].second) next++, offset = 0;
    return true;
  }
};

thread_local Team* team_of_thread = nullptr;  // set on thread 0 of a team while it runs the layers

// at::parallel_for, or, on thread 0 of a team, the team's split of the loop
template <typename F>
static inline void par_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (Team* team = team_of_thread) return team->parallel(begin, end, grain, f);
  at::parallel_for(begin, end, grain, f);
}

// Attention for a few new tokens (model.attend's native branch), in fp32.  Each query row's score for
// a key is ``dot`` of the scaled query and the key, the softmax visits the keys its mask row allows in
// key order (skipping the others) and accumulates the values in that order: a row's result depends
// only on its query and the keys it sees, so a token verified in one call with others (a chain, or a
// tree whose other branches are masked) gets exactly what a call over that token alone gives, in
// every dtype.  q [B, H, S, hd]; k, v [B, Hkv, T, hd] (any strides, hd contiguous); mask [B|1, 1, S, T]
// bool or none.  Three passes, each split between threads so that every thread reads its own share of
// the cache (at long contexts the keys and values are most of a step's bytes):
//   1. scores, by runs of up to KEY_RUN keys: keys read 16 at a time (``dot16``, as fp32) and shared by the g*S
//      query rows of their key/value head (a masked key's score is -inf);
//   2. per query row: the maximum, then exp(score - max) (``exp_neg16``; 0 for a masked key);
//   3. by 16 of the head dim at a time: each row's weighted sum of the values and the sum of its weights,
//      both in key order (the same sums, element by element, whichever thread and slice computes them).
// Small calls run on the calling thread (a fork and join costs more than the work).
constexpr int64_t KEY_RUN = 256;
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool WIDEN_IN_REGISTERS = true;
#else
constexpr bool WIDEN_IN_REGISTERS = false;
#endif
constexpr int64_t PARALLEL_MIN = 8192;  // query rows x keys below which the passes run on the calling thread

template <typename T>
void attend_rows_impl(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask, Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), hd = q.size(3), Hkv = k.size(1), Tk = k.size(2);
  const int64_t g = H / Hkv, R = g * S, BK = B * Hkv, Tp = (Tk + 15) / 16 * 16, hd16 = hd / 16 * 16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), qs3 = q.stride(3);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attend_rows: keys and values contiguous in the head dim");
  const bool* mp = nullptr;
  int64_t m0 = 0, m2 = 0, m3 = 0;
  if (mask.has_value()) {
    mp = mask->data_ptr<bool>();
    m0 = mask->size(0) == 1 ? 0 : mask->stride(0);
    m2 = mask->stride(2);
    m3 = mask->stride(3);
  }
  const float NEG = -std::numeric_limits<float>::infinity();
  // the calling thread's buffers, kept between calls up to 16 MB: scaled queries [BK, R, hd], then
  // scores / weights [BK, R, Tp]
  thread_local std::vector<float> held;
  held.resize(BK * R * (hd + Tp));
  float* qf = held.data();
  float* scores = qf + BK * R * hd;
  const bool serial = BK * R * Tk < PARALLEL_MIN;
  const auto grain = [&](int64_t n) { return serial ? n : 1; };
  // runs of at most KEY_RUN keys, of equal length (a multiple of 16): 264 keys as 144 + 120, not 256 + 8, so
  // that the threads' shares of the tasks are alike (a key's score does not depend on its run)
  const int64_t runs = (Tk + KEY_RUN - 1) / KEY_RUN;
  const int64_t run_len = runs > 0 ? ((Tk + runs - 1) / runs + 15) / 16 * 16 : KEY_RUN;
  for (int64_t bk = 0; bk < BK; bk++) {
    const int64_t b = bk / Hkv, kvh = bk % Hkv;
    for (int64_t r = 0; r < R; r++) {  // row r: query head kvh*g + r/S, token r%S
      const T* qrow = qp + b * qs0 + (kvh * g + r / S) * qs1 + (r % S) * qs2;
      float* qrf = qf + (bk * R + r) * hd;
      int64_t d = 0;
      if (qs3 == 1)
        for (; d + 16 <= hd; d += 16) {  // 16 at a time: the same products
          const v16 x = load16f(qrow + d, 16) * scale;
          std::memcpy(qrf + d, &x, sizeof(v16));
        }
      for (; d < hd; d++) qrf[d] = static_cast<float>(qrow[d * qs3]) * scale;
    }
  }
  par_for(0, BK * runs, grain(BK * runs), [&](int64_t begin, int64_t end) {  // 1. scores
    // ktail: hd not a multiple of 16, the keys' last hd % 16 elements as fp32, element by element (16 keys each)
    std::vector<float> kf(16 * hd), zeros(hd, 0.0f), ktail(16 * 16);
    for (int64_t task = begin; task < end; task++) {
      const int64_t bk = task / runs, b = bk / Hkv, kvh = bk % Hkv;
      const int64_t t1 = std::min(Tk, (task % runs + 1) * run_len);
      const T* kbase = kp + b * ks0 + kvh * ks1;
      for (int64_t t0 = task % runs * run_len; t0 < t1; t0 += 16) {
        const int64_t nb = std::min<int64_t>(16, Tk - t0);
        const float* kt[16];
#ifdef LL_DOT16_AVX2
        // AVX2: keys of every dtype read where they are, widened in registers as dot16_rows_avx2 reads them
        // (the same values), the rows past the end zeros
        const bool rows_avx2 = true;
#else
        const bool rows_avx2 = false;
#endif
        // half-precision keys with hd a multiple of 16: widened into kf chunk by chunk (dot16_packed)
        const bool packed = !std::is_same_v<T, float> && hd % 16 == 0 && !rows_avx2;
        // bf16 and fp16 keys, a full block (AVX-512): widened in registers as dot16_rows reads them (the same
        // values; a widening is 1 or 2 instructions), not stored into kf and read back (which took 1.3-1.8x the
        // time in bf16)
        const bool direct = !std::is_same_v<T, float> && WIDEN_IN_REGISTERS && packed && nb == 16;
        for (int64_t j = 0; j < 16 && !direct && !rows_avx2; j++) {
          if (packed) {
            const T* krow = kbase + (t0 + j) * ks2;
            for (int64_t d = 0; d < hd; d += 16) {
              const v16 x = j < nb ? load16f(krow + d, 16) : v16{0};
              std::memcpy(&kf[(d + j) * 16], &x, sizeof(v16));  // chunk d / 16, key j
            }
          } else if (j >= nb) {
            kt[j] = zeros.data();
          } else if constexpr (std::is_same_v<T, float>) {
            kt[j] = kbase + (t0 + j) * ks2;
          } else {
            const T* krow = kbase + (t0 + j) * ks2;
            int64_t d = 0;
            for (; d + 16 <= hd; d += 16) {
              const v16 x = load16f(krow + d, 16);
              std::memcpy(&kf[j * hd + d], &x, sizeof(v16));
            }
            for (; d < hd; d++) kf[j * hd + d] = static_cast<float>(krow[d]);
            kt[j] = &kf[j * hd];
          }
        }
        if (hd16 < hd && !rows_avx2)
          for (int64_t d = hd16; d < hd; d++)
            for (int j = 0; j < 16; j++) ktail[(d - hd16) * 16 + j] = kt[j][d];
        // a row's 16 scores into its scores row, masked (row r: token r % S, kept as tok)
        const auto put = [&](int64_t r, int64_t tok, const float* sc) {
          const bool* mrow = mp ? mp + b * m0 + tok * m2 : nullptr;
          float* sr = scores + (bk * R + r) * Tp + t0;
          if (!mrow && nb == 16) {
            std::memcpy(sr, sc, 16 * sizeof(float));
          } else if (nb == 16 && m3 == 1) {  // 16 mask entries side by side: compared at once
#ifdef LL_DOT16_AVX2
            const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mrow + t0));  // a bool a byte
            const __m256i seen[2] = {_mm256_cvtepu8_epi32(bytes), _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))};
            for (int h = 0; h < 2; h++) {
              const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(seen[h], _mm256_setzero_si256()));
              _mm256_storeu_ps(sr + 8 * h, _mm256_blendv_ps(_mm256_loadu_ps(sc + 8 * h), _mm256_set1_ps(NEG), hidden));
            }
#else
            v16 x;
            i16v seen;
            std::memcpy(&x, sc, sizeof(v16));
            uint8_t bytes[16];  // a bool is a byte: the 16 entries read at once
            std::memcpy(bytes, mrow + t0, sizeof(bytes));
            for (int j = 0; j < 16; j++) seen[j] = bytes[j];
            x = seen != 0 ? x : splat(NEG);
            std::memcpy(sr, &x, sizeof(v16));
#endif
          } else {
            for (int64_t j = 0; j < 16; j++) sr[j] = j >= nb || (mrow && !mrow[(t0 + j) * m3]) ? NEG : sc[j];
          }
        };
        int64_t r = 0, tok = 0;
#ifdef LL_DOT16_AVX2
        if (rows_avx2) {  // three rows at a time, as below
          const T* kr[16];
          for (int j = 0; j < 16; j++)
            kr[j] = j < nb ? kbase + (t0 + j) * ks2 : reinterpret_cast<const T*>(zeros.data());  // hd zeros
          for (int64_t d = hd16; d < hd; d++)
            for (int j = 0; j < 16; j++) ktail[(d - hd16) * 16 + j] = static_cast<float>(kr[j][d]);
          for (; r < R; r += 3) {
            v16 s16[3];
            const float* qr = qf + (bk * R + r) * hd;
            const int64_t nq = std::min<int64_t>(3, R - r);
            if (nq == 3)
              dot16_rows_avx2<3>(qr, hd, kr, hd16, s16);
            else if (nq == 2)
              dot16_rows_avx2<2>(qr, hd, kr, hd16, s16);
            else
              dot16_rows_avx2<1>(qr, hd, kr, hd16, s16);
            for (int n = 0; n < nq; n++) {
              if (hd16 < hd) s16[n] = dot16_tail_avx2(s16[n], qr + n * hd, ktail.data(), hd16, hd);
              put(r + n, tok, reinterpret_cast<const float*>(&s16[n]));
              if (++tok == S) tok = 0;
            }
          }
        }
#else
        if (direct) {
          const T* k0 = kbase + t0 * ks2;
          const auto key = [&](int j, int64_t d) { return load16f(k0 + j * ks2 + d, 16); };
          for (; r < R; r += 3) {
            v16 s16[3];
            const float* qr = qf + (bk * R + r) * hd;
            const int64_t nq = std::min<int64_t>(3, R - r);
            if (nq == 3)
              dot16_rows<3>(qr, hd, key, hd, s16);
            else if (nq == 2)
              dot16_rows<2>(qr, hd, key, hd, s16);
            else
              dot16_rows<1>(qr, hd, key, hd, s16);
            for (int n = 0; n < nq; n++) {
              put(r + n, tok, reinterpret_cast<const float*>(&s16[n]));
              if (++tok == S) tok = 0;
            }
          }
        }
        {  // NQ rows at a time (dot16_rows; about 7% faster in bf16 than row by row), then dot's tail
          constexpr int NQ = 3;
          for (; r + NQ <= R; r += NQ) {
            v16 s16[NQ];
            const float* qr = qf + (bk * R + r) * hd;
            if (packed)
              dot16_rows<NQ>(qr, hd, [&](int j, int64_t d) { return kf.data() + d * 16 + 16 * j; }, hd, s16);
            else
              dot16_rows<NQ>(qr, hd, [&](int j, int64_t d) { return kt[j] + d; }, hd16, s16);
            for (int n = 0; n < NQ; n++) {
              if (hd16 < hd) s16[n] = dot16_tail(s16[n], qr + n * hd, ktail.data(), hd16, hd);
              put(r + n, tok, reinterpret_cast<const float*>(&s16[n]));
              if (++tok == S) tok = 0;
            }
          }
        }
#endif
        for (; r < R; r++) {
          const float* qr = qf + (bk * R + r) * hd;
          float sc[16];
          if (packed) {
            const v16 s16 = dot16_packed(qr, kf.data(), hd);
            std::memcpy(sc, &s16, sizeof(v16));
          } else if (hd % 16 == 0) {
            const v16 s16 = dot16(qr, kt, hd);
            std::memcpy(sc, &s16, sizeof(v16));
          } else {  // dot for 16 keys at once: its chunks as dot16's, then its tail
            const v16 s16 = dot16_tail(dot16(qr, kt, hd16), qr, ktail.data(), hd16, hd);
            std::memcpy(sc, &s16, sizeof(v16));
          }
          put(r, tok, sc);
          if (++tok == S) tok = 0;
        }
      }
    }
  });
  par_for(0, BK * R, grain(BK * R), [&](int64_t begin, int64_t end) {  // 2. weights
    for (int64_t row = begin; row < end; row++) {
      float* sr = scores + row * Tp;
#ifdef LL_DOT16_AVX2
      {  // the loops below with AVX2, 16 lanes as two halves of 8: the same operations lane for lane (the
         // maximum a max of x and the running one, as the AVX-512 build makes it), so the same bits
        const __m256 neg = _mm256_set1_ps(NEG);
        __m256 m8[2] = {neg, neg};
        for (int64_t t = 0; t < Tp; t += 16)
          for (int h = 0; h < 2; h++) m8[h] = _mm256_max_ps(_mm256_loadu_ps(sr + t + 8 * h), m8[h]);
        float lanes[16];
        std::memcpy(lanes, m8, sizeof(lanes));
        float mx = NEG;
        for (int i = 0; i < 16; i++) mx = std::max(mx, lanes[i]);
        const __m256 m = _mm256_set1_ps(mx);
        for (int64_t t = 0; t < Tp; t += 8) {
          const __m256 x = _mm256_loadu_ps(sr + t);
          const __m256 e = exp_neg8(_mm256_sub_ps(x, m));
          _mm256_storeu_ps(sr + t, _mm256_andnot_ps(_mm256_cmp_ps(x, neg, _CMP_EQ_OQ), e));  // x == NEG: 0
        }
        continue;
      }
#endif
      v16 m16 = splat(NEG);
      for (int64_t t = 0; t < Tp; t += 16) {
        v16 x;
        std::memcpy(&x, sr + t, sizeof(v16));
        m16 = m16 < x ? x : m16;
      }
      float mx = NEG;
      for (int i = 0; i < 16; i++) mx = std::max(mx, m16[i]);
      for (int64_t t = 0; t < Tp; t += 16) {
        v16 x;
        std::memcpy(&x, sr + t, sizeof(v16));
        const v16 e = exp_neg16(x - mx);
        x = x == NEG ? v16{0} : e;
        std::memcpy(sr + t, &x, sizeof(v16));
      }
    }
  });
  const int64_t slices = (hd + 15) / 16;
  // a task: NS (<= 4) slices of 16 of the head dim for every row, NR (<= 4) rows at a time, their
  // NR * NS accumulators in registers (independent sums, so the additions overlap)
  int64_t per = 4;  // slices a task: the most that still gives every thread a share (whole rows alone)
  while (!serial && per > 1 && BK * ((slices + per - 1) / per) < 2 * at::get_num_threads()) per /= 2;
  const int64_t groups = (slices + per - 1) / per;
  par_for(0, BK * groups, grain(BK * groups), [&](int64_t begin, int64_t end) {  // 3. values
    for (int64_t task = begin; task < end; task++) {
      const int64_t bk = task / groups, b = bk / Hkv, kvh = bk % Hkv;
      const int64_t s0 = task % groups * per, ns = std::min(per, slices - s0);
      const T* vbase = vp + b * vs0 + kvh * vs1;
      for (int64_t r0 = 0; r0 < R; r0 += 4) {
        const int64_t nr = std::min<int64_t>(4, R - r0);
        with_tile(nr, ns, [&](auto NR, auto NS) {
          value_tile<T, NR, NS>(vbase, vs2, Tk, hd, s0 * 16, scores + (bk * R + r0) * Tp, Tp,
                                op + (b * H + kvh * g) * S * hd, S, r0, hd);
        });
      }
    }
  });
  if (held.capacity() > (1 << 22)) std::vector<float>().swap(held);  // a big batch's buffers: handed back
}

Tensor attend_rows(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend_rows: 4-D q, k, v");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "attend_rows: one dtype");
  TORCH_CHECK(!mask.has_value() || (mask->scalar_type() == at::kBool && mask->dim() == 4), "attend_rows: bool mask");
  auto out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attend_rows", [&] {
    attend_rows_impl<scalar_t>(q, k, v, mask, out);
  });
  return out;
}

// model._attend_folded
Tensor attend_folded(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask, int64_t g,
                     optional<Tensor> folded) {
  if (g == 1) return at::scaled_dot_product_attention(q, k, v, mask);
  auto B = q.size(0), H = q.size(1), S = q.size(2), hd = q.size(3);
  if (mask.has_value() && !folded.has_value()) folded = mask->repeat({1, 1, g, 1});
  auto y = at::scaled_dot_product_attention(q.reshape({B, k.size(1), g * S, hd}), k, v, folded);
  return y.view({B, H, S, hd});
}


// -- 4-bit and 8-bit block products ---------------------------------------------------------------------
// A weight in blocks (kernels.BlockWeight): codes of 16 output rows x 32 inputs (one group) lie together,
// lane-major in 4-byte runs, so that one 64-byte vector holds 4 consecutive inputs of 16 rows:
//   4-bit: codes [N/16, G, 4, 16, 4] bytes, vector i's low nibbles are inputs 8i..8i+3 of each row and
//          its high nibbles inputs 8i+4..8i+7 (w = code * d + m, codes 0..15);
//   8-bit: codes [N/16, G, 8, 16, 4] bytes, vector j holds inputs 4j..4j+3 (w = code * d + m, codes
//          0..255; GGUF's Q8_0 as code = q + 128, m = -128 d).
// dm [N/16, G, 2, 16] (fp16 or fp32): each group's scale d for 16 rows, then its minimum m; or, for a
// weight whose scales and minimums are 8-bit multiples of one fp16 per super-block of 8 groups (GGUF's
// Q4_K: d = D * sc, m = M * mn with 6-bit sc, mn), dm [N/16, G/8, 320] bytes: the super-block's D for
// 16 rows and its M (fp16, 64 bytes), then each of its 8 groups' sc for 16 rows and mn (uint8, 32
// bytes).  D * sc and M * mn are exact in fp32, so both forms give the same d and m, and the same bits;
// the second reads 0.625 bits a weight for them instead of 2 (fp32).
// Activations are rounded per group of 32 inputs: xq = round(x / dx), dx = amax / QMAX, sx = dx * sum(xq)
// for the minimum's term.  Coarse: QMAX = 127 (8 bits, llama.cpp's Q8_1); fine: QMAX = 127 * 128
// (15 bits), kept as two int8 halves xq = 128 hi + lo (hi in -127..127, lo in -64..63) for the 8-bit
// integer dot products, twice the multiplications of coarse.  Then
// y[s, n] = sum_g (d_g dx_g * sum_i code_i xq_i + m_g sx_g), the groups in order, each group's integer
// sum exact (at most 32 * 255 * QMAX < 2^31): a row's result depends only on that row of x (never on
// how many rows a call has or how they are split between threads), and every path gives the same bits.
// The weights are read once per 8 activation rows (AVX-512; 4 with AVX2).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LL_AVX512 1
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LL_AVX2 1
#include <immintrin.h>
#endif

// Activations rounded per group of 32, group-major so that a tile's rows of one group lie together:
// record g * M + s holds row s's group g: q[64 * record] 32 values (fine: hi) then 32 more (fine: lo),
// d, s, n the scale, the scaled sum and the integer sum.
struct QX {
  int64_t M;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> n, n16;  // n16: the integer sums of inputs 0..15 and 16..31 (2 per record)
};

// An activation as fp32: X is float, or uint16_t holding a bf16's bits (the top half of its fp32: exact).
template <typename X>
static inline float act(const X* p, int i) {
  if constexpr (std::is_same_v<X, float>) {
    return p[i];
  } else {
    const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
}

#ifdef LL_AVX512
template <typename X>
static inline __m512 act16(const X* p) {
  if constexpr (std::is_same_v<X, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// quantize_rows' rounding of one group (record r) with AVX-512: the same operations on each value (the
// product with qmax / amax rounded to the nearest, ties to even, as nearbyint does), so the same bits
template <typename X>
static inline void quantize_group512(const X* xr, int32_t qmax, bool fine, int8_t* q, QX& out, int64_t r) {
  const __m512 x0 = act16(xr), x1 = act16(xr + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  // a NaN input makes the group's scale NaN (the max above skips it): the products it enters are NaN
  const bool nan = (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) != 0;
  const float d = nan ? NAN : amax / static_cast<float>(qmax), id = amax > 0.0f ? static_cast<float>(qmax) / amax : 0.0f;
  const __m512i hi = _mm512_set1_epi32(qmax), lo = _mm512_set1_epi32(-qmax);
  auto round = [&](__m512 v) {
    return _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvt_roundps_epi32(
                                                         _mm512_mul_ps(v, _mm512_set1_ps(id)),
                                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  };
  const __m512i v0 = round(x0), v1 = round(x1);
  if (fine) {
    const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(v0, _mm512_set1_epi32(64)), 7);
    const __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(v1, _mm512_set1_epi32(64)), 7);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(h0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(h1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32), _mm512_cvtepi32_epi8(_mm512_sub_epi32(v0, _mm512_slli_epi32(h0, 7))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 48), _mm512_cvtepi32_epi8(_mm512_sub_epi32(v1, _mm512_slli_epi32(h1, 7))));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(v0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(v1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32), _mm512_cvtepi32_epi8(_mm512_setzero_si512()));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 48), _mm512_cvtepi32_epi8(_mm512_setzero_si512()));
  }
  const int32_t n0 = _mm512_reduce_add_epi32(v0), n1 = _mm512_reduce_add_epi32(v1);
  out.n16[2 * r] = n0;
  out.n16[2 * r + 1] = n1;
  out.d[r] = d;
  out.s[r] = d * static_cast<float>(n0 + n1);
  out.n[r] = n0 + n1;
}
#endif

#if defined(LL_AVX2) && !defined(LL_AVX512)
template <typename X>
static inline __m256 act8(const X* p) {
  if constexpr (std::is_same_v<X, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// 32 int32 values (each in -127..127) as 32 bytes in their order: packs saturate, which leaves them as
// they are, then the 4-byte pieces the two packs interleave by lane put back in order
static inline void store_bytes32(int8_t* q, __m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, order));
}

static inline int32_t sum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// quantize_rows' rounding of one group (record r) with AVX2: the same operations on each value as the
// scalar and AVX-512 roundings (amax the largest |x|, exact in any order; the product with qmax / amax,
// converted rounding to the nearest, ties to even, as nearbyint does in the default rounding mode; then
// clamped), so the same bits.  Not inlined: inlined into quantize_rows it changed how GCC compiled the
// products around it (on a 2-core Zen 5, x86-64-v3 build, an 8-token q4 call ran about 5 ms slower)
template <typename X>
__attribute__((noinline)) static void quantize_group256(const X* xr, int32_t qmax, bool fine, int8_t* q, QX& out, int64_t r) {
  const __m256 x0 = act8(xr), x1 = act8(xr + 8), x2 = act8(xr + 16), x3 = act8(xr + 24);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  // a NaN input makes the group's scale NaN (the max above skips it): the products it enters are NaN
  const __m256 un = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q), _mm256_cmp_ps(x1, x1, _CMP_UNORD_Q)),
                                 _mm256_or_ps(_mm256_cmp_ps(x2, x2, _CMP_UNORD_Q), _mm256_cmp_ps(x3, x3, _CMP_UNORD_Q)));
  const bool nan = _mm256_movemask_ps(un) != 0;
  const float d = nan ? NAN : amax / static_cast<float>(qmax), id = amax > 0.0f ? static_cast<float>(qmax) / amax : 0.0f;
  const __m256i hi = _mm256_set1_epi32(qmax), lo = _mm256_set1_epi32(-qmax);
  const __m256 vid = _mm256_set1_ps(id);
  auto round = [&](__m256 v) {
    // _mm256_cvtps_epi32 rounds as MXCSR says: to the nearest, ties to even, as nearbyint
    return _mm256_max_epi32(lo, _mm256_min_epi32(hi, _mm256_cvtps_epi32(_mm256_mul_ps(v, vid))));
  };
  const __m256i v0 = round(x0), v1 = round(x1), v2 = round(x2), v3 = round(x3);
  if (fine) {
    const __m256i half = _mm256_set1_epi32(64);
    const __m256i h0 = _mm256_srai_epi32(_mm256_add_epi32(v0, half), 7);
    const __m256i h1 = _mm256_srai_epi32(_mm256_add_epi32(v1, half), 7);
    const __m256i h2 = _mm256_srai_epi32(_mm256_add_epi32(v2, half), 7);
    const __m256i h3 = _mm256_srai_epi32(_mm256_add_epi32(v3, half), 7);
    store_bytes32(q, h0, h1, h2, h3);
    store_bytes32(q + 32, _mm256_sub_epi32(v0, _mm256_slli_epi32(h0, 7)), _mm256_sub_epi32(v1, _mm256_slli_epi32(h1, 7)),
                  _mm256_sub_epi32(v2, _mm256_slli_epi32(h2, 7)), _mm256_sub_epi32(v3, _mm256_slli_epi32(h3, 7)));
  } else {
    store_bytes32(q, v0, v1, v2, v3);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32), _mm256_setzero_si256());
  }
  const int32_t n0 = sum8_epi32(_mm256_add_epi32(v0, v1)), n1 = sum8_epi32(_mm256_add_epi32(v2, v3));
  out.n16[2 * r] = n0;
  out.n16[2 * r + 1] = n1;
  out.d[r] = d;
  out.s[r] = d * static_cast<float>(n0 + n1);
  out.n[r] = n0 + n1;
}
#endif

// The rounding of x [M, K] (fp32, or bf16 bits) into out, record by record (each on its own: the same bits
// however the records are split): on the calling thread, or, on a team where team_rounds says so, split
// between its threads (a call of 8 rows rounds 8 * K / 32 groups before its products).
// vec: the vector rounding where the build has it (the same bits; the portable path keeps the scalar one,
// so that tests comparing the paths compare the two)
constexpr int64_t ROUND_GRAIN = 64;  // records (groups of 32) a thread's share holds at least
template <typename X>
static void quantize_rows(const X* x, int64_t M, int64_t K, bool fine, QX& out, bool vec = true) {
  const int64_t G = K / 32;
  const int32_t qmax = fine ? 127 * 128 : 127;
  out.M = M;
  out.q.resize(M * G * 64);  // every record's 64 bytes are written below
  out.d.resize(M * G);
  out.s.resize(M * G);
  out.n.resize(M * G);
  out.n16.resize(2 * M * G);
  // records in their order (r = g * M + row): a thread's share of d, s and n lies together, no cache line
  // of them written by two threads (but at the ends of the shares)
  auto records = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const int64_t g = r / M, row = r % M;
      const X* xr = x + row * K + g * 32;
#ifdef LL_AVX512
      if (vec) {
        quantize_group512(xr, qmax, fine, &out.q[r * 64], out, r);
        continue;
      }
#elif defined(LL_AVX2)
      if (vec) {
        quantize_group256(xr, qmax, fine, &out.q[r * 64], out, r);
        continue;
      }
#endif
      float amax = 0.0f;
      bool nan = false;  // a NaN input makes the group's scale NaN (std::max skips it): its products are NaN
      for (int j = 0; j < 32; j++) {
        const float v = act(xr, j);
        amax = std::max(amax, std::fabs(v));
        nan |= std::isnan(v);
      }
      const float d = nan ? NAN : amax / static_cast<float>(qmax), id = amax > 0.0f ? static_cast<float>(qmax) / amax : 0.0f;
      int8_t* q = &out.q[r * 64];
      int32_t sum = 0;
      for (int j = 0; j < 32; j++) {
        const int32_t v = std::max(-qmax, std::min(qmax, static_cast<int32_t>(std::nearbyint(act(xr, j) * id))));
        const int32_t h = fine ? (v + 64) >> 7 : v;  // arithmetic shift: round to nearest
        q[j] = static_cast<int8_t>(h);
        q[32 + j] = static_cast<int8_t>(v - 128 * h * fine);
        sum += v;
        if (j == 15) out.n16[2 * r] = sum;
      }
      out.n16[2 * r + 1] = sum - out.n16[2 * r];
      out.d[r] = d;
      out.s[r] = d * static_cast<float>(sum);
      out.n[r] = sum;
    }
  };
  if (team_of_thread && team_rounds.load(std::memory_order_relaxed)) par_for(0, M * G, ROUND_GRAIN, records);
  else records(0, M * G);
}

static inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

constexpr int64_t SUPER = 8;                      // groups per super-block of 8-bit multipliers
constexpr int64_t SUPER_BYTES = 64 + SUPER * 32;  // its fp16 D, M for 16 rows, then sc, mn per group

// a group's scales and minimums for the 16 rows of block nb: SC float or uint16_t (fp16 bits) holds
// them, uint8_t a super-block's fp16 pair and the group's multipliers
template <typename SC>
static inline const uint8_t* super_of(const SC* dm, int64_t nb, int64_t G, int64_t g) {
  return reinterpret_cast<const uint8_t*>(dm) + (nb * (G / SUPER) + g / SUPER) * SUPER_BYTES;
}

template <typename SC>
static inline void group_dm(const SC* dm, int64_t nb, int64_t G, int64_t g, float* d, float* m) {
  if constexpr (std::is_same_v<SC, uint8_t>) {
    const uint8_t* base = super_of(dm, nb, G, g);
    uint16_t h[32];
    std::memcpy(h, base, 64);
    const uint8_t* mult = base + 64 + (g % SUPER) * 32;
    for (int l = 0; l < 16; l++) {
      d[l] = half_to_float(h[l]) * static_cast<float>(mult[l]);
      m[l] = half_to_float(h[16 + l]) * static_cast<float>(mult[16 + l]);
    }
  } else {
    const SC* sc = dm + (nb * G + g) * 32;
    for (int l = 0; l < 16; l++) {
      if constexpr (std::is_same_v<SC, float>) {
        d[l] = sc[l];
        m[l] = sc[16 + l];
      } else {
        d[l] = half_to_float(sc[l]);
        m[l] = half_to_float(sc[16 + l]);
      }
    }
  }
}

// -- 6-bit blocks (GGUF's Q6_K): w = D * sc * (code - 32), codes 0..63, an int8 sc per 16 inputs and an fp16 D
// per 256.  codes [N/16, G, 6, 16, 4] bytes: vectors 0..3 the low 4 bits as the 4-bit layout, vectors 4 and 5
// the high 2 bits, vector 4 + j/4 holding those of inputs 4j..4j+3 at bits 2(j%4)..2(j%4)+1;
// dm [N/16, G/8, 288] bytes: per super-block of 8 groups D for 16 rows (fp16, 32 bytes), then sc for each
// of its 16 sub-blocks of 16 inputs for 16 rows (int8, 256 bytes).  Each half group's integer sum
// sum_i (code_i - 32) xq_i is exact (at most 16 * 63 * 127 * 128 < 2^31), scaled by (D sc) dx (D sc is exact
// in fp32); the two halves are added in order.
constexpr int64_t Q6_SUPER_BYTES = 32 + 16 * 16;

static inline const uint8_t* q6_super(const uint8_t* dm, int64_t nb, int64_t G, int64_t g) {
  return dm + (nb * (G / SUPER) + g / SUPER) * Q6_SUPER_BYTES;
}

// the scales D * sc of both halves of group g for the 16 rows of block nb
static inline void q6_scales(const uint8_t* dm, int64_t nb, int64_t G, int64_t g, float* d0, float* d1) {
  const uint8_t* base = q6_super(dm, nb, G, g);
  uint16_t h[16];
  std::memcpy(h, base, 32);
  const int8_t* sc = reinterpret_cast<const int8_t*>(base + 32 + (g % SUPER) * 32);
  for (int l = 0; l < 16; l++) {
    d0[l] = half_to_float(h[l]) * static_cast<float>(sc[l]);
    d1[l] = half_to_float(h[l]) * static_cast<float>(sc[16 + l]);
  }
}

template <bool FINE>
static void blocks6_portable(const uint8_t* codes, const uint8_t* dm, const QX& xq, int64_t M, int64_t G,
                             int64_t nb0, int64_t nb1, float* y, int64_t N) {
  for (int64_t nb = nb0; nb < nb1; nb++)
    for (int64_t s = 0; s < M; s++) {
      float acc[16] = {0};
      for (int64_t g = 0; g < G; g++) {
        const uint8_t* c = codes + (nb * G + g) * 6 * 64;
        float d0[16], d1[16];
        q6_scales(dm, nb, G, g, d0, d1);
        const int64_t r = g * M + s;
        const int8_t* hi = &xq.q[r * 64];
        const float dx = xq.d[r];
        for (int l = 0; l < 16; l++) {
          int32_t half[2] = {0, 0};
          for (int j = 0; j < 8; j++)
            for (int t = 0; t < 4; t++) {
              const uint8_t b = c[((j / 2) * 16 + l) * 4 + t];
              const int32_t low = j % 2 ? b >> 4 : b & 0x0F;
              const int32_t high = (c[256 + ((j / 4) * 16 + l) * 4 + t] >> (2 * (j % 4))) & 3;
              half[j / 4] += (low | (high << 4)) * (FINE ? 128 * hi[4 * j + t] + hi[32 + 4 * j + t] : hi[4 * j + t]);
            }
          const int32_t i0 = half[0] - 32 * xq.n16[2 * r], i1 = half[1] - 32 * xq.n16[2 * r + 1];
          acc[l] = std::fma(static_cast<float>(i0), d0[l] * dx, acc[l]);
          acc[l] = std::fma(static_cast<float>(i1), d1[l] * dx, acc[l]);
        }
      }
      for (int l = 0; l < 16 && nb * 16 + l < N; l++) y[s * N + nb * 16 + l] = acc[l];
    }
}

// the portable path: the same integer sums and the same fused multiply-adds, one row of 16 lanes at a time
template <int BITS, bool FINE, typename SC>
static void blocks_portable(const uint8_t* codes, const SC* dm, const QX& xq, int64_t M, int64_t G, int64_t nb0,
                            int64_t nb1, float* y, int64_t N) {
  constexpr int J = BITS == 4 ? 4 : 8;
  for (int64_t nb = nb0; nb < nb1; nb++)
    for (int64_t s = 0; s < M; s++) {
      float acc[16] = {0};
      for (int64_t g = 0; g < G; g++) {
        const uint8_t* c = codes + (nb * G + g) * J * 64;
        float sd[16], sm[16];
        group_dm(dm, nb, G, g, sd, sm);
        const int64_t r = g * M + s;
        const int8_t* hi = &xq.q[r * 64];
        const float dx = xq.d[r], sx = xq.s[r];
        for (int l = 0; l < 16; l++) {
          int32_t isum = 0;
          for (int j = 0; j < 8; j++)
            for (int t = 0; t < 4; t++) {
              int32_t code;
              if constexpr (BITS == 4) {
                const uint8_t b = c[((j / 2) * 16 + l) * 4 + t];
                code = j % 2 ? b >> 4 : b & 0x0F;
              } else {
                code = c[(j * 16 + l) * 4 + t];
              }
              isum += code * (FINE ? 128 * hi[4 * j + t] + hi[32 + 4 * j + t] : hi[4 * j + t]);
            }
          acc[l] = std::fma(static_cast<float>(isum), sd[l] * dx, acc[l]);
          acc[l] = std::fma(sm[l], sx, acc[l]);
        }
      }
      for (int l = 0; l < 16 && nb * 16 + l < N; l++) y[s * N + nb * 16 + l] = acc[l];
    }
}

#if defined(LL_AVX512) || defined(LL_AVX2)
// The codes of a group PREFETCH bytes on (a later group of the block, or the next blocks: a weight is one
// run of bytes, read in order) asked into the cache: one core's hardware prefetchers alone keep too few
// lines in flight to stream at the memory's speed.  Into L1 where the activations' records are small
// (4- and 8-bit codes, K <= L1_PREFETCH_K), else into L2, so that the lines on their way do not push the
// activations out of L1.  On a 2-core Zen 4, 1 row, 1.5B-model shapes: 4-bit products 12-20% faster, 6-bit 25-40%.
constexpr int64_t PREFETCH = 8192;
constexpr int64_t L1_PREFETCH_K = 4096;
template <int LINES>
static inline void prefetch_ahead(const uint8_t* c, bool l1) {
  const char* p = reinterpret_cast<const char*>(c + PREFETCH);
#pragma GCC unroll 8
  for (int i = 0; i < LINES; i++) {
    if (l1) _mm_prefetch(p + i * 64, _MM_HINT_T0);
    else _mm_prefetch(p + i * 64, _MM_HINT_T1);
  }
}

// The scales of the group as many groups on (flat index i = nb * G + g, CODE_BYTES of codes a group), into
// L2: a second, slower run of bytes beside the codes (super-blocks: SUPER_SIZE bytes per SUPER groups)
template <int CODE_BYTES, int64_t SUPER_SIZE, typename SC>
static inline void prefetch_scales(const SC* dm, int64_t i) {
  const int64_t j = i + PREFETCH / CODE_BYTES;
  const char* p = std::is_same_v<SC, uint8_t> ? reinterpret_cast<const char*>(dm) + j * SUPER_SIZE / SUPER
                                              : reinterpret_cast<const char*>(dm + j * 32);
  _mm_prefetch(p, _MM_HINT_T1);
  if constexpr (sizeof(SC) == 4) _mm_prefetch(p + 64, _MM_HINT_T1);  // fp32: 128 bytes a group
}
#endif

// Runs f(std::integral_constant<int, T>) for T = min(rows, MAX) (1..MAX): a tile's row count fixed at
// compile time, so that its accumulators stay in registers.
template <int MAX, typename F>
static inline void with_rows(int64_t rows, F&& f) {
  if constexpr (MAX > 1) {
    if (rows < MAX) return with_rows<MAX - 1>(rows, f);
  }
  f(std::integral_constant<int, MAX>());
}

#ifdef LL_AVX512
template <typename SC>
static inline __m512 load16(const SC* p) {
  if constexpr (std::is_same_v<SC, float>) return _mm512_loadu_ps(p);
  else return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// a group's scales d and minimums m for the 16 rows of block nb (group_dm's values)
template <typename SC>
static inline void dm512(const SC* dm, int64_t nb, int64_t G, int64_t g, __m512& d, __m512& m) {
  if constexpr (std::is_same_v<SC, uint8_t>) {
    const uint8_t* base = super_of(dm, nb, G, g);
    const uint8_t* mult = base + 64 + (g % SUPER) * 32;
    auto widen = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    d = _mm512_mul_ps(load16(reinterpret_cast<const uint16_t*>(base)), widen(mult));
    m = _mm512_mul_ps(load16(reinterpret_cast<const uint16_t*>(base + 32)), widen(mult + 16));
  } else {
    d = load16(dm + (nb * G + g) * 32);
    m = load16(dm + (nb * G + g) * 32 + 16);
  }
}

// T rows of activations against one block of 16 output rows (all groups); each group's codes are
// loaded (and split into nibbles) once for the T rows
template <int BITS, bool FINE, typename SC, int T>
static inline void tile512(const uint8_t* codes, const SC* dm, const QX& xq, int64_t s0, int64_t G, int64_t nb,
                           float* y, int64_t N) {
  constexpr int J = BITS == 4 ? 4 : 8;
  const int64_t M = xq.M;
  __m512 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* c = codes + (nb * G + g) * J * 64;
    prefetch_ahead<J>(c, G * 32 <= L1_PREFETCH_K);
    prefetch_scales<J * 64, SUPER_BYTES>(dm, nb * G + g);
    __m512i w[8];
    if constexpr (BITS == 4) {
#pragma GCC unroll 4
      for (int i = 0; i < 4; i++) {
        const __m512i p = _mm512_loadu_si512(c + i * 64);
        w[2 * i] = _mm512_and_si512(p, low);
        w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512(c + j * 64);
    }
    __m512 d, m;
    dm512(dm, nb, G, g, d, m);
    const int32_t* x = reinterpret_cast<const int32_t*>(&xq.q[(g * M + s0) * 64]);  // row t at x + 16 t
    const float* dx = &xq.d[g * M + s0];
    const float* sx = &xq.s[g * M + s0];
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
      const int32_t* h = x + 16 * t;
      __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; j += 2) {
        a = _mm512_dpbusd_epi32(a, w[j], _mm512_set1_epi32(h[j]));
        b = _mm512_dpbusd_epi32(b, w[j + 1], _mm512_set1_epi32(h[j + 1]));
      }
      __m512i isum = _mm512_add_epi32(a, b);
      if constexpr (FINE) {
        __m512i e = _mm512_setzero_si512(), f = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j += 2) {
          e = _mm512_dpbusd_epi32(e, w[j], _mm512_set1_epi32(h[8 + j]));
          f = _mm512_dpbusd_epi32(f, w[j + 1], _mm512_set1_epi32(h[8 + j + 1]));
        }
        isum = _mm512_add_epi32(_mm512_slli_epi32(isum, 7), _mm512_add_epi32(e, f));
      }
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dx[t])), acc[t]);
      acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[t]), acc[t]);
    }
  }
  const int64_t n0 = nb * 16, live = std::min<int64_t>(16, N - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1);
#pragma GCC unroll 8
  for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(y + (s0 + t) * N + n0, keep, acc[t]);
}

// 6-bit: T rows against one block of 16 output rows (see blocks6_portable)
template <bool FINE, int T>
static inline void tile512_6(const uint8_t* codes, const uint8_t* dm, const QX& xq, int64_t s0, int64_t G,
                             int64_t nb, float* y, int64_t N) {
  const int64_t M = xq.M;
  __m512 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* c = codes + (nb * G + g) * 6 * 64;
    prefetch_ahead<6>(c, false);
    prefetch_scales<6 * 64, Q6_SUPER_BYTES>(dm, nb * G + g);
    __m512i w[8];
    const __m512i h0 = _mm512_loadu_si512(c + 256), h1 = _mm512_loadu_si512(c + 320);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
      const __m512i p = _mm512_loadu_si512(c + i * 64);
      w[2 * i] = _mm512_and_si512(p, low);
      w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
    }
    // the high bits of vector j sit at bits 2(j%4) of h[j/4]: moved to bits 4 and 5
    w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(h0, 4), two));
    w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(h0, 2), two));
    w[2] = _mm512_or_si512(w[2], _mm512_and_si512(h0, two));
    w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_srli_epi16(h0, 2), two));
    w[4] = _mm512_or_si512(w[4], _mm512_and_si512(_mm512_slli_epi16(h1, 4), two));
    w[5] = _mm512_or_si512(w[5], _mm512_and_si512(_mm512_slli_epi16(h1, 2), two));
    w[6] = _mm512_or_si512(w[6], _mm512_and_si512(h1, two));
    w[7] = _mm512_or_si512(w[7], _mm512_and_si512(_mm512_srli_epi16(h1, 2), two));
    const uint8_t* base = q6_super(dm, nb, G, g);
    const __m512 D = load16(reinterpret_cast<const uint16_t*>(base));
    const int8_t* sc = reinterpret_cast<const int8_t*>(base + 32 + (g % SUPER) * 32);
    auto widen = [](const int8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    const __m512 d0 = _mm512_mul_ps(D, widen(sc)), d1 = _mm512_mul_ps(D, widen(sc + 16));
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
      const int64_t r = g * M + s0 + t;
      const int32_t* h = reinterpret_cast<const int32_t*>(&xq.q[r * 64]);
      __m512i a[2], e[2];
#pragma GCC unroll 2
      for (int k = 0; k < 2; k++) {  // half k: vectors 4k..4k+3
        __m512i u = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4 * k], _mm512_set1_epi32(h[4 * k]));
        __m512i v = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4 * k + 1], _mm512_set1_epi32(h[4 * k + 1]));
        u = _mm512_dpbusd_epi32(u, w[4 * k + 2], _mm512_set1_epi32(h[4 * k + 2]));
        v = _mm512_dpbusd_epi32(v, w[4 * k + 3], _mm512_set1_epi32(h[4 * k + 3]));
        a[k] = _mm512_add_epi32(u, v);
        if constexpr (FINE) {
          __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4 * k], _mm512_set1_epi32(h[8 + 4 * k]));
          __m512i q = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4 * k + 1], _mm512_set1_epi32(h[9 + 4 * k]));
          p = _mm512_dpbusd_epi32(p, w[4 * k + 2], _mm512_set1_epi32(h[10 + 4 * k]));
          q = _mm512_dpbusd_epi32(q, w[4 * k + 3], _mm512_set1_epi32(h[11 + 4 * k]));
          e[k] = _mm512_add_epi32(p, q);
          a[k] = _mm512_add_epi32(_mm512_slli_epi32(a[k], 7), e[k]);
        }
        a[k] = _mm512_sub_epi32(a[k], _mm512_set1_epi32(32 * xq.n16[2 * r + k]));
      }
      const __m512 dx = _mm512_set1_ps(xq.d[r]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[0]), _mm512_mul_ps(d0, dx), acc[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[1]), _mm512_mul_ps(d1, dx), acc[t]);
    }
  }
  const int64_t n0 = nb * 16, live = std::min<int64_t>(16, N - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1);
#pragma GCC unroll 8
  for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(y + (s0 + t) * N + n0, keep, acc[t]);
}

template <bool FINE>
static void blocks6_avx512(const uint8_t* codes, const uint8_t* dm, const QX& xq, int64_t M, int64_t G, int64_t nb0,
                           int64_t nb1, float* y, int64_t N) {
  for (int64_t nb = nb0; nb < nb1; nb++)
    for (int64_t s0 = 0; s0 < M; s0 += 8)
      with_rows<8>(M - s0, [&](auto T) { tile512_6<FINE, decltype(T)::value>(codes, dm, xq, s0, G, nb, y, N); });
}

template <int BITS, bool FINE, typename SC>
static void blocks_avx512(const uint8_t* codes, const SC* dm, const QX& xq, int64_t M, int64_t G, int64_t nb0,
                          int64_t nb1, float* y, int64_t N) {
  for (int64_t nb = nb0; nb < nb1; nb++)
    for (int64_t s0 = 0; s0 < M; s0 += 8)
      with_rows<8>(M - s0, [&](auto T) { tile512<BITS, FINE, SC, decltype(T)::value>(codes, dm, xq, s0, G, nb, y, N); });
}
#endif

#ifdef LL_AVX2
template <typename SC>
static inline __m256 load8(const SC* p) {
  if constexpr (std::is_same_v<SC, float>) return _mm256_loadu_ps(p);
  else return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// rows 8h..8h+7 of a group's scales d and minimums m (group_dm's values)
template <typename SC>
static inline void dm256(const SC* dm, int64_t nb, int64_t G, int64_t g, int half, __m256& d, __m256& m) {
  if constexpr (std::is_same_v<SC, uint8_t>) {
    const uint8_t* base = super_of(dm, nb, G, g);
    const uint8_t* mult = base + 64 + (g % SUPER) * 32 + half * 8;
    auto widen = [](const uint8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
    d = _mm256_mul_ps(load8(reinterpret_cast<const uint16_t*>(base) + half * 8), widen(mult));
    m = _mm256_mul_ps(load8(reinterpret_cast<const uint16_t*>(base) + 16 + half * 8), widen(mult + 16));
  } else {
    d = load8(dm + (nb * G + g) * 32 + half * 8);
    m = load8(dm + (nb * G + g) * 32 + 16 + half * 8);
  }
}

// acc + the 4-products sums of u (unsigned, at most 128 when `wide`, else at most 15) and s (signed)
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// T rows against 8 of a block's 16 output rows (half h).  8-bit codes c are taken as c - 128 (signed)
// in the products (unsigned |c - 128| times the activation with c - 128's sign, as llama.cpp does, so
// that maddubs' 16-bit pair sums cannot saturate), and 128 * sum(xq) added back: the same integer sum.
template <int BITS, bool FINE, typename SC, int T>
static inline void tile256(const uint8_t* codes, const SC* dm, const QX& xq, int64_t s0, int64_t G, int64_t nb,
                           int half, float* y, int64_t N) {
  constexpr int J = BITS == 4 ? 4 : 8;
  const int64_t M = xq.M;
  __m256 acc[T];
#pragma GCC unroll 4
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* c = codes + (nb * G + g) * J * 64 + half * 32;
    if (half == 0) {  // half 1 reads the same lines again
      prefetch_ahead<J>(c, G * 32 <= L1_PREFETCH_K);
      prefetch_scales<J * 64, SUPER_BYTES>(dm, nb * G + g);
    }
    __m256i w[8], sg[8];
    if constexpr (BITS == 4) {
#pragma GCC unroll 4
      for (int i = 0; i < 4; i++) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i * 64));
        w[2 * i] = _mm256_and_si256(p, low);
        w[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++) {
        sg[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * 64)), flip);
        w[j] = _mm256_abs_epi8(sg[j]);  // -128 stays 0x80: 128 as unsigned
      }
    }
    __m256 d, m;
    dm256(dm, nb, G, g, half, d, m);
    const int64_t r0 = g * M + s0;
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
      const int32_t* h = reinterpret_cast<const int32_t*>(&xq.q[(r0 + t) * 64]);
      __m256i a = _mm256_setzero_si256(), e = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++) {
        __m256i xh = _mm256_set1_epi32(h[j]);
        if constexpr (BITS == 8) xh = _mm256_sign_epi8(xh, sg[j]);
        a = dot_u8s8(a, w[j], xh);
        if constexpr (FINE) {
          __m256i xl = _mm256_set1_epi32(h[8 + j]);
          if constexpr (BITS == 8) xl = _mm256_sign_epi8(xl, sg[j]);
          e = dot_u8s8(e, w[j], xl);
        }
      }
      __m256i isum = FINE ? _mm256_add_epi32(_mm256_slli_epi32(a, 7), e) : a;
      if constexpr (BITS == 8) isum = _mm256_add_epi32(isum, _mm256_set1_epi32(128 * xq.n[r0 + t]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(xq.d[r0 + t])), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.s[r0 + t]), acc[t]);
    }
  }
  const int64_t n0 = nb * 16 + half * 8;
#pragma GCC unroll 4
  for (int t = 0; t < T; t++) {
    float out[8];
    _mm256_storeu_ps(out, acc[t]);
    for (int l = 0; l < 8 && n0 + l < N; l++) y[(s0 + t) * N + n0 + l] = out[l];
  }
}

#if defined(__AVXVNNI__)
constexpr bool AVX2_VNNI = true;
#else
constexpr bool AVX2_VNNI = false;
#endif

// tile256 for 4-bit codes without AVX-VNNI: the same integer sums in fewer instructions and registers.  A code
// vector is split into its nibbles once and used for the T rows at once; maddubs' 16-bit pair sums are added
// in 16 bits (each at most 2 * 15 * 127 in size, the 8 of a group less than 2^15: exact) and widened once a
// group, so a group's integer sums, and all that follows from them, are tile256's.  The 16-bit additions
// saturate (never here), which keeps GCC from reassociating them: with plain ones it moved every product
// ahead of the sums and out of the registers (1.5x slower).
template <bool FINE, typename SC, int T>
static inline void tile256_q4(const uint8_t* codes, const SC* dm, const QX& xq, int64_t s0, int64_t G, int64_t nb,
                              int half, float* y, int64_t N) {
  const int64_t M = xq.M;
  __m256 acc[T];
#pragma GCC unroll 4
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* c = codes + (nb * G + g) * 4 * 64 + half * 32;
    if (half == 0) {  // half 1 reads the same lines again
      prefetch_ahead<4>(c, G * 32 <= L1_PREFETCH_K);
      prefetch_scales<4 * 64, SUPER_BYTES>(dm, nb * G + g);
    }
    const int64_t r0 = g * M + s0;
    const int32_t* h = reinterpret_cast<const int32_t*>(&xq.q[r0 * 64]);  // row t's at h + 16 t
    __m256i ph[T], pl[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) ph[t] = pl[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i * 64));
      const __m256i w0 = _mm256_and_si256(p, low), w1 = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
#pragma GCC unroll 4
      for (int t = 0; t < T; t++) {
        const int32_t* ht = h + 16 * t;
        ph[t] = _mm256_adds_epi16(ph[t], _mm256_maddubs_epi16(w0, _mm256_set1_epi32(ht[2 * i])));
        ph[t] = _mm256_adds_epi16(ph[t], _mm256_maddubs_epi16(w1, _mm256_set1_epi32(ht[2 * i + 1])));
        if constexpr (FINE) {
          pl[t] = _mm256_adds_epi16(pl[t], _mm256_maddubs_epi16(w0, _mm256_set1_epi32(ht[8 + 2 * i])));
          pl[t] = _mm256_adds_epi16(pl[t], _mm256_maddubs_epi16(w1, _mm256_set1_epi32(ht[8 + 2 * i + 1])));
        }
      }
    }
    __m256 d, m;
    dm256(dm, nb, G, g, half, d, m);
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
      const __m256i a = _mm256_madd_epi16(ph[t], _mm256_set1_epi16(1));
      const __m256i e = FINE ? _mm256_madd_epi16(pl[t], _mm256_set1_epi16(1)) : _mm256_setzero_si256();
      const __m256i isum = FINE ? _mm256_add_epi32(_mm256_slli_epi32(a, 7), e) : a;
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(xq.d[r0 + t])), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.s[r0 + t]), acc[t]);
    }
  }
  const int64_t n0 = nb * 16 + half * 8;
#pragma GCC unroll 4
  for (int t = 0; t < T; t++) {
    float out[8];
    _mm256_storeu_ps(out, acc[t]);
    for (int l = 0; l < 8 && n0 + l < N; l++) y[(s0 + t) * N + n0 + l] = out[l];
  }
}

// tile256 for 8-bit codes without AVX-VNNI: the same integer sums, each code vector loaded (and its sign and
// size taken) once for the T rows at once.  maddubs' pair sums are widened at once here (two of them may
// not fit 16 bits); the empty asm after each addition keeps GCC from reassociating the sums (it moved
// every product ahead of them and out of the registers).
template <bool FINE, typename SC, int T>
static inline void tile256_q8(const uint8_t* codes, const SC* dm, const QX& xq, int64_t s0, int64_t G, int64_t nb,
                              int half, float* y, int64_t N) {
  const int64_t M = xq.M;
  __m256 acc[T];
#pragma GCC unroll 4
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), one = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* c = codes + (nb * G + g) * 8 * 64 + half * 32;
    if (half == 0) {  // half 1 reads the same lines again
      prefetch_ahead<8>(c, G * 32 <= L1_PREFETCH_K);
      prefetch_scales<8 * 64, SUPER_BYTES>(dm, nb * G + g);
    }
    const int64_t r0 = g * M + s0;
    const int32_t* h = reinterpret_cast<const int32_t*>(&xq.q[r0 * 64]);  // row t's at h + 16 t
    __m256i a[T], e[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) a[t] = e[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
      const __m256i sg = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * 64)), flip);
      const __m256i w = _mm256_abs_epi8(sg);  // -128 stays 0x80: 128 as unsigned
#pragma GCC unroll 4
      for (int t = 0; t < T; t++) {
        const int32_t* ht = h + 16 * t;
        const __m256i xh = _mm256_sign_epi8(_mm256_set1_epi32(ht[j]), sg);
        a[t] = _mm256_add_epi32(a[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xh), one));
        asm("" : "+x"(a[t]));
        if constexpr (FINE) {
          const __m256i xl = _mm256_sign_epi8(_mm256_set1_epi32(ht[8 + j]), sg);
          e[t] = _mm256_add_epi32(e[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xl), one));
          asm("" : "+x"(e[t]));
        }
      }
    }
    __m256 d, m;
    dm256(dm, nb, G, g, half, d, m);
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
      __m256i isum = FINE ? _mm256_add_epi32(_mm256_slli_epi32(a[t], 7), e[t]) : a[t];
      isum = _mm256_add_epi32(isum, _mm256_set1_epi32(128 * xq.n[r0 + t]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(xq.d[r0 + t])), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.s[r0 + t]), acc[t]);
    }
  }
  const int64_t n0 = nb * 16 + half * 8;
#pragma GCC unroll 4
  for (int t = 0; t < T; t++) {
    float out[8];
    _mm256_storeu_ps(out, acc[t]);
    for (int l = 0; l < 8 && n0 + l < N; l++) y[(s0 + t) * N + n0 + l] = out[l];
  }
}

// 6-bit: T rows against 8 of a block's 16 output rows (half hf; see blocks6_portable).  Codes are at most 63,
// so maddubs' 16-bit pair sums cannot saturate.
template <bool FINE, int T>
static inline void tile256_6(const uint8_t* codes, const uint8_t* dm, const QX& xq, int64_t s0, int64_t G,
                             int64_t nb, int hf, float* y, int64_t N) {
  const int64_t M = xq.M;
  __m256 acc[T];
#pragma GCC unroll 4
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* c = codes + (nb * G + g) * 6 * 64 + hf * 32;
    if (hf == 0) {
      prefetch_ahead<6>(c, false);
      prefetch_scales<6 * 64, Q6_SUPER_BYTES>(dm, nb * G + g);
    }
    __m256i w[8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i * 64));
      w[2 * i] = _mm256_and_si256(p, low);
      w[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
    }
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 256 + k * 64));
      w[4 * k] = _mm256_or_si256(w[4 * k], _mm256_and_si256(_mm256_slli_epi16(hb, 4), two));
      w[4 * k + 1] = _mm256_or_si256(w[4 * k + 1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), two));
      w[4 * k + 2] = _mm256_or_si256(w[4 * k + 2], _mm256_and_si256(hb, two));
      w[4 * k + 3] = _mm256_or_si256(w[4 * k + 3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), two));
    }
    const uint8_t* base = q6_super(dm, nb, G, g);
    const __m256 D = load8(reinterpret_cast<const uint16_t*>(base) + hf * 8);
    const int8_t* sc = reinterpret_cast<const int8_t*>(base + 32 + (g % SUPER) * 32 + hf * 8);
    auto widen = [](const int8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
    const __m256 d0 = _mm256_mul_ps(D, widen(sc)), d1 = _mm256_mul_ps(D, widen(sc + 16));
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
      const int64_t r = g * M + s0 + t;
      const int32_t* h = reinterpret_cast<const int32_t*>(&xq.q[r * 64]);
      __m256i a[2];
#pragma GCC unroll 2
      for (int k = 0; k < 2; k++) {
        __m256i u = _mm256_setzero_si256(), e = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 4 * k; j < 4 * k + 4; j++) {
          u = dot_u8s8(u, w[j], _mm256_set1_epi32(h[j]));
          if constexpr (FINE) e = dot_u8s8(e, w[j], _mm256_set1_epi32(h[8 + j]));
        }
        a[k] = FINE ? _mm256_add_epi32(_mm256_slli_epi32(u, 7), e) : u;
        a[k] = _mm256_sub_epi32(a[k], _mm256_set1_epi32(32 * xq.n16[2 * r + k]));
      }
      const __m256 dx = _mm256_set1_ps(xq.d[r]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[0]), _mm256_mul_ps(d0, dx), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[1]), _mm256_mul_ps(d1, dx), acc[t]);
    }
  }
  const int64_t n0 = nb * 16 + hf * 8;
#pragma GCC unroll 4
  for (int t = 0; t < T; t++) {
    float out[8];
    _mm256_storeu_ps(out, acc[t]);
    for (int l = 0; l < 8 && n0 + l < N; l++) y[(s0 + t) * N + n0 + l] = out[l];
  }
}

template <bool FINE>
static void blocks6_avx2(const uint8_t* codes, const uint8_t* dm, const QX& xq, int64_t M, int64_t G, int64_t nb0,
                         int64_t nb1, float* y, int64_t N) {
  for (int64_t nb = nb0; nb < nb1; nb++)
    for (int hf = 0; hf < 2; hf++)
      for (int64_t s0 = 0; s0 < M; s0 += 4)
        with_rows<4>(M - s0, [&](auto T) { tile256_6<FINE, decltype(T)::value>(codes, dm, xq, s0, G, nb, hf, y, N); });
}

template <int BITS, bool FINE, typename SC>
static void blocks_avx2(const uint8_t* codes, const SC* dm, const QX& xq, int64_t M, int64_t G, int64_t nb0,
                        int64_t nb1, float* y, int64_t N) {
  for (int64_t nb = nb0; nb < nb1; nb++)
    for (int half = 0; half < 2; half++)
      for (int64_t s0 = 0; s0 < M; s0 += 4)
        with_rows<4>(M - s0, [&](auto T) {
          constexpr int R = decltype(T)::value;
          if constexpr (BITS == 4 && !AVX2_VNNI) tile256_q4<FINE, SC, R>(codes, dm, xq, s0, G, nb, half, y, N);
          else if constexpr (BITS == 8 && !AVX2_VNNI) tile256_q8<FINE, SC, R>(codes, dm, xq, s0, G, nb, half, y, N);
          else tile256<BITS, FINE, SC, R>(codes, dm, xq, s0, G, nb, half, y, N);
        });
}
#endif

// The vector paths this build holds, best first; "portable" is always there.
std::vector<std::string> blocks_paths() {
  std::vector<std::string> out;
#ifdef LL_AVX512
  out.push_back("avx512-vnni");
#endif
#ifdef LL_AVX2
  out.push_back(
#if defined(__AVXVNNI__)
      "avx2-vnni"
#else
      "avx2"
#endif
  );
#endif
  out.push_back("portable");
  return out;
}

// x [M, K] (fp32 or bf16) times a block weight (see above) -> [M, N] fp32.  fine: 15-bit activations
// (else 8-bit).  path: one of blocks_paths() (tests compare them), "" for the best.
// out: the result's dtype, fp32 or (up to FUSED_ROWS rows) bf16, the same bits as y.to(bf16) on ATen's
// vectorized path, each share of the columns rounded by the thread that computed it; a bf16 x is widened
// as it is rounded (exact), without ATen calls
Tensor block_matmul_to(const Tensor& x, const Tensor& codes, const Tensor& dm, int64_t N, bool fine,
                       const std::string& path, at::ScalarType out) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "block_matmul: x [M, K] with K a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && dm.is_contiguous(),
              "block_matmul: contiguous uint8 codes and scales");
  TORCH_CHECK(dm.scalar_type() == at::kFloat || dm.scalar_type() == at::kHalf || dm.scalar_type() == at::kByte,
              "block_matmul: fp32, fp16 or super-block (uint8) scales");
  const auto paths = blocks_paths();
  const std::string use = path.empty() ? paths[0] : path;
  TORCH_CHECK(std::find(paths.begin(), paths.end(), use) != paths.end(), "block_matmul: no path ", use, " here");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, NB = (N + 15) / 16;
  const int64_t per = codes.numel() / (NB * G * 64);
  TORCH_CHECK((per == 4 || per == 6 || per == 8) && codes.numel() == NB * G * 64 * per,
              "block_matmul: codes do not fit the shape");
  const bool super = dm.scalar_type() == at::kByte;
  const int64_t super_bytes = per == 6 ? Q6_SUPER_BYTES : SUPER_BYTES;
  TORCH_CHECK(super ? G % SUPER == 0 && dm.numel() == NB * (G / SUPER) * super_bytes
                    : per != 6 && dm.numel() == NB * G * 32,
              "block_matmul: scales do not fit the shape");
  TORCH_CHECK(out == at::kFloat || (out == at::kBFloat16 && M <= FUSED_ROWS), "block_matmul: fp32 out, or bf16 for few rows");
  // a few rows' buffers kept from call to call (a decoding step makes ~100 calls); a reference, so that the
  // worker threads below read the caller's own
  thread_local QX held;
  thread_local std::vector<float> ybuf;
  QX& xq = held;
  if (x.scalar_type() == at::kBFloat16 && x.is_contiguous() && M <= FUSED_ROWS) {  // widened as it is read
    quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, fine, xq, use != "portable");
  } else {
    const Tensor xf = x.to(at::kFloat).contiguous();
    quantize_rows(xf.data_ptr<float>(), M, K, fine, xq, use != "portable");
  }
  Tensor y = at::empty({M, N}, x.options().dtype(out));
  float* yp;
  uint16_t* yb = nullptr;  // bf16 out: each share's columns rounded by the thread that computed them
  if (out == at::kBFloat16) {
    ybuf.resize(M * N);
    yp = ybuf.data();
    yb = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  } else {
    yp = y.data_ptr<float>();
  }
  auto rounded = [&](int64_t b0, int64_t b1) {
    if (!yb) return;
    const int64_t n0 = b0 * 16, n1 = std::min(N, b1 * 16);
    for (int64_t s = 0; s < M; s++) {
      const float* from = yp + s * N;
      uint16_t* to = yb + s * N;
      for (int64_t n = n0; n < n1; n++) to[n] = bf16_bits(from[n]);
    }
  };
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const int64_t grain = std::max<int64_t>(1, NB / (4 * std::max(1, at::get_num_threads())));
  auto run = [&](auto* sc, auto bits, auto fine_) {
    using SC = std::remove_const_t<std::remove_pointer_t<decltype(sc)>>;
    constexpr int B = decltype(bits)::value;
    constexpr bool F = decltype(fine_)::value;
    par_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
      [&] {
#ifdef LL_AVX512
        if (use == "avx512-vnni") return blocks_avx512<B, F, SC>(c, sc, xq, M, G, b0, b1, yp, N);
#endif
#ifdef LL_AVX2
        if (use != "portable") return blocks_avx2<B, F, SC>(c, sc, xq, M, G, b0, b1, yp, N);
#endif
        blocks_portable<B, F, SC>(c, sc, xq, M, G, b0, b1, yp, N);
      }();
      rounded(b0, b1);
    });
  };
  auto with_scales = [&](auto bits, auto fine_) {
    if (dm.scalar_type() == at::kFloat) run(dm.data_ptr<float>(), bits, fine_);
    else if (super) run(dm.data_ptr<uint8_t>(), bits, fine_);
    else run(reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>()), bits, fine_);
  };
  auto six = [&](auto fine_) {
    constexpr bool F = decltype(fine_)::value;
    const uint8_t* sc = dm.data_ptr<uint8_t>();
    par_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
      [&] {
#ifdef LL_AVX512
        if (use == "avx512-vnni") return blocks6_avx512<F>(c, sc, xq, M, G, b0, b1, yp, N);
#endif
#ifdef LL_AVX2
        if (use != "portable") return blocks6_avx2<F>(c, sc, xq, M, G, b0, b1, yp, N);
#endif
        blocks6_portable<F>(c, sc, xq, M, G, b0, b1, yp, N);
      }();
      rounded(b0, b1);
    });
  };
  auto with_bits = [&](auto fine_) {
    if (per == 4) with_scales(std::integral_constant<int, 4>(), fine_);
    else if (per == 6) six(fine_);
    else with_scales(std::integral_constant<int, 8>(), fine_);
  };
  if (fine) with_bits(std::true_type());
  else with_bits(std::false_type());
  if (xq.q.capacity() > (1 << 20)) held = QX();  // a prompt's rows: handed back, not kept per thread
  return y;
}

Tensor block_matmul(const Tensor& x, const Tensor& codes, const Tensor& dm, int64_t N, bool fine,
                    const std::string& path) {
  return block_matmul_to(x, codes, dm, N, fine, path, at::kFloat);
}

std::string blocks_isa() { return blocks_paths()[0]; }

// One EAGLE draft step for R rows (drafters/eagle.py: EagleChains.draft, EagleHead.step, the model's final
// norm and the draft vocabulary's 8-bit product), in one call and the same ATen and block kernels as the
// Python path, so the same bits: z [R, D] the rows' normalised states (bf16), e [R, D] the embeddings of the
// tokens after them (bf16); w holds the codes and scales of the head's fc, gate_up and down and of the draft
// vocabulary's rows, outs their output sizes; norm the head's own norm (fp32), final_w the model's final
// norm (bf16).  Gives the next normalised states [R, D] (bf16) and the draft logits [R, K] (fp32).
std::vector<Tensor> eagle_step(const Tensor& z, const Tensor& e, const std::vector<Tensor>& w,
                               const std::vector<int64_t>& outs, const Tensor& norm, const Tensor& final_w,
                               double final_eps, bool fine) {
  TORCH_CHECK(w.size() == 8 && outs.size() == 4, "eagle_step: four block weights (codes, scales) and sizes");
  TORCH_CHECK(z.dim() == 2 && e.sizes() == z.sizes() && z.scalar_type() == at::kBFloat16,
              "eagle_step: bf16 states and embeddings [R, D]");
  const int64_t D = z.size(1), H = outs[1] / 2;
  auto e32 = at::rms_norm(e.to(at::kFloat), {D}, c10::nullopt, 1e-6);
  auto u = block_matmul_to(at::cat({z.to(at::kFloat), e32}, -1), w[0], w[1], outs[0], fine, "", at::kFloat);
  auto v = at::rms_norm(u, {D}, norm, 1e-6);
  auto g = block_matmul_to(v, w[2], w[3], outs[1], fine, "", at::kFloat);
  auto a = at::silu(g.narrow(1, 0, H)) * g.narrow(1, H, H);
  auto s = (u + block_matmul_to(a, w[4], w[5], outs[2], fine, "", at::kFloat)).to(at::kBFloat16);
  auto zn = rms_norm(s, final_w, final_eps);
  return {zn, block_matmul_to(zn, w[6], w[7], outs[3], fine, "", at::kFloat)};
}

// Transformer.logits for a few bf16 rows and a block LM head without bias: the final norm (RMSNorm.forward)
// and the head's product rounded to bf16 (BlockWeight.matmul's .to(bf16), fused), then widened to fp32
// (Transformer.unembed), in one call: the same bits.  h [rows, D] contiguous bf16, at most FUSED_ROWS rows.
Tensor final_logits(const Tensor& h, const Tensor& norm, double eps, const Tensor& codes, const Tensor& dm, int64_t N,
                    bool fine) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kBFloat16 && h.size(0) <= FUSED_ROWS,
              "final_logits: bf16 rows [M, D], at most ", FUSED_ROWS);
  return block_matmul_to(rms_norm(h, norm, eps), codes, dm, N, fine, "", at::kBFloat16).to(at::kFloat);
}
}  // namespace

// Attention.project's rope and Keys.store for bf16 heads, cos, sin and cache, in one pass and no ATen
// calls: each value rounded to bf16 where ATen's bf16 operations round it (part * cos, roll(part) * sin,
// their sum; a bf16 operation computes in fp32 and rounds once), so the same bits.  heads [B, S, H + 2 Hkv,
// hd] contiguous; cos, sin [B, S, 1, hd]; kl, vl [B, Hkv, T, hd] (hd contiguous): rows start .. start+S-1
// get the rotated keys and the values.  Gives q [B, H, S, hd] (rotated; a transposed view).
bool rope_fusable(const Tensor& heads, const Tensor& cos, const Tensor& sin, const Tensor& kl, const Tensor& vl) {
  const auto bf = at::kBFloat16;
  return heads.scalar_type() == bf && cos.scalar_type() == bf && sin.scalar_type() == bf && kl.scalar_type() == bf &&
         vl.scalar_type() == bf && heads.is_contiguous() && heads.size(-1) % 2 == 0 && cos.dim() == 4 &&
         cos.sizes() == sin.sizes() && cos.size(0) == heads.size(0) && cos.size(1) == heads.size(1) &&
         cos.size(2) == 1 && cos.size(3) == heads.size(3) && cos.strides() == sin.strides() && kl.stride(3) == 1 &&
         vl.stride(3) == 1;
}

Tensor rope_store(const Tensor& heads, const Tensor& cos, const Tensor& sin, const Tensor& kl, const Tensor& vl,
                  int64_t start, int64_t H, int64_t Hkv) {
  const int64_t B = heads.size(0), S = heads.size(1), R = heads.size(2), hd = heads.size(3), half = hd / 2;
  auto qh = at::empty({B, S, H, hd}, heads.options());
  auto bits = [](const Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  auto f = [](uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
  };
  auto r = [&](float x) { return f(bf16_bits(x)); };  // rounded to bf16, as a float
  const uint16_t *x = bits(heads), *cp = bits(cos), *sp = bits(sin);
  uint16_t *qp = bits(qh), *kp = bits(kl), *vp = bits(vl);
  const int64_t c0 = cos.stride(0), c1 = cos.stride(1), c3 = cos.stride(3);
  for (int64_t b = 0; b < B; b++)
    for (int64_t s = 0; s < S; s++) {
      const uint16_t *c = cp + b * c0 + s * c1, *sn = sp + b * c0 + s * c1;
      const uint16_t* row0 = x + (b * S + s) * R * hd;
      for (int64_t j = 0; j < H + Hkv; j++) {
        const uint16_t* row = row0 + j * hd;
        uint16_t* out = j < H ? qp + ((b * S + s) * H + j) * hd
                              : kp + b * kl.stride(0) + (j - H) * kl.stride(1) + (start + s) * kl.stride(2);
        // the partner of d is d + half in the first half, d - half in the second: two loops without a
        // modulo, which the compiler vectorizes
        for (int64_t d = 0; d < half; d++) {
          const float a = r(f(row[d]) * f(c[d * c3])), e = r(f(row[d + half]) * f(sn[d * c3]));
          out[d] = bf16_bits(a + e);
        }
        for (int64_t d = half; d < hd; d++) {
          const float a = r(f(row[d]) * f(c[d * c3])), e = r(f(row[d - half]) * f(sn[d * c3]));
          out[d] = bf16_bits(a + e);
        }
      }
      for (int64_t j = 0; j < Hkv; j++) {
        uint16_t* out = vp + b * vl.stride(0) + j * vl.stride(1) + (start + s) * vl.stride(2);
        std::memcpy(out, row0 + (H + Hkv + j) * hd, hd * sizeof(uint16_t));
      }
    }
  return qh.transpose(1, 2);
}

// Model.run_layers over layers [0, L') of the given stacks, cache rows all starting at `start` (the
// caller checked): h [B, S, D]; cos/sin [B, S, 1, hd]; K/V [L', B, Hkv, total, hd] views of the cache;
// mask/folded: Keys.mask / Keys.folded; projections 4 per layer (qkv, o, gate_up,
// down; a STACK entry is followed by its parts' entries, whose outputs add up to its own), norms 2 per layer;
// after: the codes and scales of the block weight the caller multiplies next (the LM head), or none: a team
// streams part of it during the last layer.
Tensor run_layers(Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& K, const Tensor& V, int64_t start,
                  const optional<Tensor>& mask, const optional<Tensor>& folded, int64_t H, int64_t Hkv,
                  int64_t hd, int64_t inter, double eps, bool detour, int64_t row_by_row_max,
                  const std::vector<Tensor>& norms, const std::vector<int64_t>& kinds, const std::vector<Tensor>& a,
                  const std::vector<Tensor>& b, const std::vector<optional<Tensor>>& bias,
                  const std::vector<int64_t>& outs, const std::vector<int64_t>& ins, const std::vector<Tensor>& after) {
  const int64_t L = K.size(0), B = h.size(0), S = h.size(1), g = H / Hkv;
  size_t next = 0;  // the entry read next
  auto entry = [&]() {
    TORCH_CHECK(next < kinds.size(), "run_layers: fewer projections than the layers take");
    auto i = next++;
    TORCH_CHECK(kinds[i] != ONEDNN || (b[i].scalar_type() == at::kLong && b[i].is_contiguous()),
                "run_layers: a oneDNN projection's rows table must be contiguous int64");
    return Proj{kinds[i], a[i], b[i], bias[i], outs[i], ins[i], {}};
  };
  std::vector<std::array<Proj, 4>> projs(L);
  std::vector<std::array<int64_t, 4>> first(L);  // each product's first range in a team's stream
  std::vector<std::pair<const char*, int64_t>> ranges;
  bool blocks_only = true;
  auto bytes = [](const Tensor& t) { return std::make_pair(static_cast<const char*>(t.data_ptr()), t.nbytes()); };
  for (int64_t l = 0; l < L; l++) {
    auto& p = projs[l];
    for (int j = 0; j < 4; j++) {
      p[j] = entry();
      for (int64_t rows = 0; p[j].kind == STACK && rows < p[j].out; rows += p[j].parts.back().out) {
        p[j].parts.push_back(entry());
      }
      first[l][j] = static_cast<int64_t>(ranges.size());
      blocks_only = blocks_only && (p[j].kind == BLOCKS || p[j].kind == BLOCKS_FINE || p[j].kind == STACK);
      for (const Proj& q : p[j].kind == STACK ? p[j].parts : std::vector<Proj>{p[j]}) {
        if (q.kind != BLOCKS && q.kind != BLOCKS_FINE) continue;
        ranges.push_back(bytes(q.a));
        ranges.push_back(bytes(q.b));
      }
    }
  }
  Team* team = nullptr;
  auto layers = [&]() {
    for (int64_t l = 0; l < L; l++) {
      const auto& p = projs[l];
      auto mark = [&](int j) {
        if (team) team->at_range(first[l][j]);
      };
      // Attention.project
      auto x = rms_norm(h, norms[2 * l], eps);
      mark(0);
      auto heads = project(p[0], x, detour).view({B, S, H + 2 * Hkv, hd});
      auto kl = K.select(0, l), vl = V.select(0, l);
      Tensor q;
      if (rope_fusable(heads, cos, sin, kl, vl)) {
        q = rope_store(heads, cos, sin, kl, vl, start, H, Hkv);
      } else {
        auto part = heads.narrow(2, 0, H + Hkv);
        auto qk = part * cos + at::roll(part, {hd / 2}, {-1}) * sin;
        q = qk.narrow(2, 0, H).transpose(1, 2);
        auto k = qk.narrow(2, H, Hkv).transpose(1, 2);
        auto v = heads.narrow(2, H + Hkv, Hkv).transpose(1, 2);
        // Keys.store (rows agree)
        kl.narrow(2, start, S).copy_(k);
        vl.narrow(2, start, S).copy_(v);
        if (q.scalar_type() != kl.scalar_type()) q = q.to(kl.scalar_type());
      }
      // attend
      Tensor y;
      if (!mask.has_value() && S > 1) {
        y = at::scaled_dot_product_attention(q, kl, vl, c10::nullopt, 0.0, true, c10::nullopt, g > 1);
      } else if (S <= row_by_row_max) {
        y = attend_rows(q, kl, vl, mask);
      } else {
        y = attend_folded(q, kl, vl, mask, g, folded);
      }
      y = y.transpose(1, 2).reshape({B, S, H * hd});
      if (y.scalar_type() != h.scalar_type()) y = y.to(h.scalar_type());
      mark(1);
      h = h + project(p[1], y, detour);
      // MLP
      mark(2);
      auto gu = project(p[2], rms_norm(h, norms[2 * l + 1], eps), detour);
      auto act = at::silu(gu.narrow(-1, 0, inter)) * gu.narrow(-1, inter, inter);
      mark(3);
      h = h + project(p[3], act, detour);
    }
  };
  // a team where the attention takes attend_rows (on the team) and every product is a block weight
  const int threads = at::get_num_threads();
  const bool rows_attend = (mask.has_value() || S == 1) && S <= row_by_row_max;
  if (!teams_on || threads < 2 || at::in_parallel_region() || !blocks_only || !rows_attend || B * S > TEAM_ROWS) {
    layers();
    return h;
  }
  Team crew;
  crew.tail = ranges.size();
  crew.tail_from = L > 0 ? first[L - 1][0] : 0;
  // the next call's block weight (the LM head: codes, then scales), as its products will read it, split
  // between the threads as par_for splits its blocks: the first AFTER_BYTES / threads of each thread's share
  if (after.size() == 2) {
    const int n = std::min(threads, TEAM_MAX);
    for (const Tensor& t : after) {
      auto [base, size] = bytes(t);
      const int64_t each = std::min<int64_t>(size / n, AFTER_BYTES * size / (n * bytes(after[0]).second));
      for (int i = 0; i < n; i++) ranges.emplace_back(base + size * i / n, each);
    }
  }
  crew.ranges = std::move(ranges);
  team_calls.fetch_add(1, std::memory_order_relaxed);
  std::exception_ptr failed;
#pragma omp parallel num_threads(std::min(threads, TEAM_MAX))
  {
    const int t = omp_get_thread_num();
    if (t == 0) {
      crew.n = omp_get_num_threads();
      team = &crew;
      team_of_thread = team;
      try {
        layers();
      } catch (...) {
        failed = std::current_exception();
      }
      team_of_thread = nullptr;
      crew.quit.store(true, std::memory_order_release);
      crew.seq.fetch_add(1, std::memory_order_release);
    } else {
      crew.serve(t);
    }
  }
  if (failed) std::rethrow_exception(failed);
  return h;
}

// Whether calls of a few rows run their layers on a team, how many bytes of weights its helper streams
// ahead (0: none) and whether its threads share the rounding of a product's activations (rounds; else
// thread 0 rounds them: the same bits); -1 leaves a setting as it is.  Gives the settings before the
// call: on, window, the number of calls run on a team so far, rounds.
std::vector<int64_t> team_settings(int64_t on, int64_t window, int64_t rounds) {
  std::vector<int64_t> was = {teams_on.load() ? 1 : 0, stream_window.load(), team_calls.load(),
                              team_rounds.load() ? 1 : 0};
  if (on >= 0) teams_on.store(on != 0);
  if (window >= 0) stream_window.store(window);
  if (rounds >= 0) team_rounds.store(rounds != 0);
  return was;
}

// The instruction sets this build was compiled for (the compiler's feature macros): which vector paths it
// holds, and whether its fp32 sums are fused multiply-adds ("fma"; without them they round twice, so a
// build for a target without FMA gives other bits in attention than one with it; the block products'
// fused steps are std::fma on every path, the same bits everywhere).
static std::vector<std::string> build_features() {
  std::vector<std::string> out;
#if defined(__AVX512F__)
  out.push_back("avx512f");
#endif
#if defined(__AVX512BW__)
  out.push_back("avx512bw");
#endif
#if defined(__AVX512VNNI__)
  out.push_back("avx512vnni");
#endif
#if defined(__AVX2__)
  out.push_back("avx2");
#endif
#if defined(__AVXVNNI__)
  out.push_back("avxvnni");
#endif
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  out.push_back("fma");
#endif
#if defined(__F16C__)
  out.push_back("f16c");
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the calls let go of the GIL: a server's event loop (or any other Python thread) runs meanwhile
  m.def("run_layers", &run_layers, "layerleap decoder layers (see decoder.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("attend_rows", &attend_rows, "attention for a few new tokens, row by row (see decoder.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_matmul", &block_matmul, "x times a 4- or 8-bit block weight (see decoder.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("team_settings", &team_settings,
        "teams on (1/0), the stream window in bytes, the team rounding activations (1/0); -1 keeps one",
        py::arg("on") = -1, py::arg("window") = -1, py::arg("rounds") = -1);
  m.def("eagle_step", &eagle_step, "one EAGLE draft step with 8-bit block weights (see decoder.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("final_logits", &final_logits, "the final norm and a block LM head for a few bf16 rows (see decoder.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm.forward in one call, the same bits (see decoder.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("blocks_isa", &blocks_isa, "the vector path block_matmul takes by default");
  m.def("blocks_paths", &blocks_paths, "the paths block_matmul was built with, best first");
  m.def("build_features", &build_features, "the instruction sets this build was compiled for");
}

// layerleap's decoder layers in C++: the same ATen calls, in the same order, as model.py's Python
// path (Block -> Attention -> attend, RMSNorm, Linear with its weight format), so the results are
// equal bit for bit; what this saves is the Python interpreter between the ~40 small calls of a
// layer.  Built on first request by layerleap/native/__init__.py; model.py falls back to Python
// when it is not built, and for the cases this file does not take (see run_layers' checks there).
#include <torch/extension.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

using at::Tensor;
using c10::optional;

namespace {

enum Kind : int64_t { DENSE = 0, ONEDNN = 1, INT4 = 2 };

struct Proj {  // one projection: the weight format's tensors (see kernels.py)
  int64_t kind;
  Tensor a;              // DENSE: weight [N, K]; ONEDNN: packed weight; INT4: packed codes [N', K/2]
  Tensor b;              // INT4: scale_zero [K/32, N', 2]; else undefined
  optional<Tensor> bias;
  int64_t out;           // output features (INT4 cuts its padding)
  int64_t in;            // input features
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
  if (p.kind == ONEDNN) {
    auto x2 = x.reshape({-1, p.in});
    if (x2.scalar_type() != p.a.scalar_type()) x2 = x2.to(p.a.scalar_type());
    return onednn_linear(x2, p.a, p.bias).view(sizes);
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

// RMSNorm.forward
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  if (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat) return at::rms_norm(x, {x.size(-1)}, w, eps);
  return w * at::rms_norm(x.to(at::kFloat), {x.size(-1)}, c10::nullopt, eps).to(x.scalar_type());
}

// exp(x) for x <= 0 in fp32 (Cephes' expf: a degree-6 polynomial after range reduction, within 2 ulp),
// written so the compiler vectorizes it; the same result for an element wherever it sits.
typedef float v16 __attribute__((vector_size(64)));  // 16 lanes (split by the compiler where narrower)

static inline float exp_neg(float x) {
  x = std::max(x, -87.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

// The dot product of a and b over n elements in a fixed order: 16 lanes of partial sums over the
// 16-element chunks in order, then the lanes added pairwise (8+8, 4+4, 2+2, 1+1), then the tail in
// order.  The same inputs give the same bits wherever the call sits.
static inline float dot(const float* a, const float* b, int64_t n) {
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
  for (; d < n; d++) s += a[d] * b[d];
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

// Attention for a few new tokens (model.attend's native branch), in fp32.  Each query row's score for
// a key is ``dot`` of the scaled query and the key, the softmax visits the keys its mask row allows in
// key order (skipping the others) and accumulates the values in that order: a row's result depends
// only on its query and the keys it sees, so a token verified in one call with others (a chain, or a
// tree whose other branches are masked) gets exactly what a call over that token alone gives, in
// every dtype.  Keys are read 16 at a time (``dot16``; converted to fp32 once per task) and shared by the
// g*S query rows of their key/value head.  q [B, H, S, hd]; k, v [B, Hkv, T, hd] (any strides, hd contiguous);
// mask [B|1, 1, S, T] bool or none.
template <typename T>
void attend_rows_impl(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask, Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), hd = q.size(3), Hkv = k.size(1), Tk = k.size(2);
  const int64_t g = H / Hkv, R = g * S;
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
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(R, at::get_num_threads()));  // row slices per head
  at::parallel_for(0, B * Hkv * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(R * hd), kf(16 * hd), zeros(hd, 0.0f), vf(hd), scores(R * Tk), acc(R * hd), sums(R);
    for (int64_t task = begin; task < end; task++) {
      const int64_t bk = task / parts, part = task % parts;
      const int64_t b = bk / Hkv, kvh = bk % Hkv;
      const int64_t r0 = R * part / parts, r1 = R * (part + 1) / parts;
      for (int64_t r = r0; r < r1; r++) {  // row r: query head kvh*g + r/S, token r%S
        const T* qrow = qp + b * qs0 + (kvh * g + r / S) * qs1 + (r % S) * qs2;
        for (int64_t d = 0; d < hd; d++) qf[r * hd + d] = static_cast<float>(qrow[d * qs3]) * scale;
      }
      const T* kbase = kp + b * ks0 + kvh * ks1;
      for (int64_t t0 = 0; t0 < Tk; t0 += 16) {  // 16 keys at a time, each as fp32
        const int64_t nb = std::min<int64_t>(16, Tk - t0);
        const float* kt[16];
        for (int64_t j = 0; j < 16; j++) {
          if (j >= nb) {
            kt[j] = zeros.data();
          } else if constexpr (std::is_same_v<T, float>) {
            kt[j] = kbase + (t0 + j) * ks2;
          } else {
            for (int64_t d = 0; d < hd; d++) kf[j * hd + d] = static_cast<float>(kbase[(t0 + j) * ks2 + d]);
            kt[j] = &kf[j * hd];
          }
        }
        for (int64_t r = r0; r < r1; r++) {
          const bool* mrow = mp ? mp + b * m0 + (r % S) * m2 : nullptr;
          float sc[16];
          if (hd % 16 == 0) {
            const v16 s16 = dot16(&qf[r * hd], kt, hd);
            std::memcpy(sc, &s16, sizeof(v16));
          } else {
            for (int64_t j = 0; j < nb; j++) sc[j] = dot(&qf[r * hd], kt[j], hd);
          }
          for (int64_t j = 0; j < nb; j++)
            scores[r * Tk + t0 + j] = (mrow && !mrow[(t0 + j) * m3]) ? NEG : sc[j];
        }
      }
      for (int64_t r = r0; r < r1; r++) {
        float* sr = &scores[r * Tk];
        float mx = NEG;
        for (int64_t t = 0; t < Tk; t++) mx = std::max(mx, sr[t]);
        for (int64_t t = 0; t < Tk; t++) sr[t] = sr[t] == NEG ? 0.0f : exp_neg(sr[t] - mx);
        std::fill(acc.begin() + r * hd, acc.begin() + (r + 1) * hd, 0.0f);
        sums[r] = 0.0f;
      }
      const T* vbase = vp + b * vs0 + kvh * vs1;
      for (int64_t t = 0; t < Tk; t++) {  // each value row read once for all rows, accumulated in key order
        const float* vt;
        if constexpr (std::is_same_v<T, float>) {
          vt = vbase + t * vs2;
        } else {
          for (int64_t d = 0; d < hd; d++) vf[d] = static_cast<float>(vbase[t * vs2 + d]);
          vt = vf.data();
        }
        for (int64_t r = r0; r < r1; r++) {
          const float p = scores[r * Tk + t];
          if (p == 0.0f) continue;  // a masked key (an underflowed weight adds nothing either)
          sums[r] += p;
          float* ar = &acc[r * hd];
          for (int64_t d = 0; d < hd; d++) ar[d] += p * vt[d];
        }
      }
      for (int64_t r = r0; r < r1; r++) {
        const float inv = sums[r] > 0 ? 1.0f / sums[r] : 0.0f;
        T* orow = op + ((b * H + kvh * g + r / S) * S + r % S) * hd;
        for (int64_t d = 0; d < hd; d++) orow[d] = static_cast<T>(acc[r * hd + d] * inv);
      }
    }
  });
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

}  // namespace

// Model.run_layers over layers [0, L') of the given stacks, cache rows all starting at `start` (the
// caller checked): h [B, S, D]; cos/sin [B, S, 1, hd]; K/V [L', B, Hkv, total, hd] views of the cache;
// mask/folded: Keys.mask / Keys.folded; projections 4 per layer (qkv, o, gate_up,
// down), norms 2 per layer.
Tensor run_layers(Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& K, const Tensor& V, int64_t start,
                  const optional<Tensor>& mask, const optional<Tensor>& folded, int64_t H, int64_t Hkv,
                  int64_t hd, int64_t inter, double eps, bool detour, int64_t row_by_row_max,
                  const std::vector<Tensor>& norms, const std::vector<int64_t>& kinds, const std::vector<Tensor>& a,
                  const std::vector<Tensor>& b, const std::vector<optional<Tensor>>& bias,
                  const std::vector<int64_t>& outs, const std::vector<int64_t>& ins) {
  const int64_t L = K.size(0), B = h.size(0), S = h.size(1), g = H / Hkv;
  for (int64_t l = 0; l < L; l++) {
    Proj p[4];
    for (int j = 0; j < 4; j++) {
      auto i = l * 4 + j;
      p[j] = Proj{kinds[i], a[i], b[i], bias[i], outs[i], ins[i]};
    }
    // Attention.project
    auto x = rms_norm(h, norms[2 * l], eps);
    auto heads = project(p[0], x, detour).view({B, S, H + 2 * Hkv, hd});
    auto part = heads.narrow(2, 0, H + Hkv);
    auto qk = part * cos + at::roll(part, {hd / 2}, {-1}) * sin;
    auto q = qk.narrow(2, 0, H).transpose(1, 2);
    auto k = qk.narrow(2, H, Hkv).transpose(1, 2);
    auto v = heads.narrow(2, H + Hkv, Hkv).transpose(1, 2);
    // Keys.store (rows agree)
    auto kl = K.select(0, l), vl = V.select(0, l);
    kl.narrow(2, start, S).copy_(k);
    vl.narrow(2, start, S).copy_(v);
    if (q.scalar_type() != kl.scalar_type()) q = q.to(kl.scalar_type());
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
    h = h + project(p[1], y, detour);
    // MLP
    auto gu = project(p[2], rms_norm(h, norms[2 * l + 1], eps), detour);
    auto act = at::silu(gu.narrow(-1, 0, inter)) * gu.narrow(-1, inter, inter);
    h = h + project(p[3], act, detour);
  }
  return h;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the calls let go of the GIL: a server's event loop (or any other Python thread) runs meanwhile
  m.def("run_layers", &run_layers, "layerleap decoder layers (see decoder.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("attend_rows", &attend_rows, "attention for a few new tokens, row by row (see decoder.cpp)",
        py::call_guard<py::gil_scoped_release>());
}

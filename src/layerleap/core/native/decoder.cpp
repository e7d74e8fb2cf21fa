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

// Attention for a few new tokens (model.attend's native branch), in fp32.  Each query row's score for
// a key is its dot product summed over the head dimension in order, the softmax visits the keys its
// mask row allows in key order (skipping the others) and accumulates the values in that order: a
// row's result depends only on its query and the keys it sees, so a token verified in one call with
// others (a chain, or a tree whose other branches are masked) gets exactly what a call over that token
// alone gives, in every dtype.  Keys are read in blocks of 16, turned and shared by the g*S query rows
// of their key/value head.  q [B, H, S, hd]; k, v [B, Hkv, T, hd] (any strides, hd contiguous);
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
  constexpr int64_t KB = 16;
  const float NEG = -std::numeric_limits<float>::infinity();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(R, at::get_num_threads()));  // row slices per head
  at::parallel_for(0, B * Hkv * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(R * hd), kt(hd * KB), scores(R * Tk), acc(hd);
    for (int64_t task = begin; task < end; task++) {
      const int64_t bk = task / parts, part = task % parts;
      const int64_t b = bk / Hkv, kvh = bk % Hkv;
      const int64_t r0 = R * part / parts, r1 = R * (part + 1) / parts;
      for (int64_t r = r0; r < r1; r++) {  // row r: query head kvh*g + r/S, token r%S
        const T* qrow = qp + b * qs0 + (kvh * g + r / S) * qs1 + (r % S) * qs2;
        for (int64_t d = 0; d < hd; d++) qf[r * hd + d] = static_cast<float>(qrow[d * qs3]) * scale;
      }
      const T* kbase = kp + b * ks0 + kvh * ks1;
      for (int64_t t0 = 0; t0 < Tk; t0 += KB) {
        const int64_t nb = std::min(KB, Tk - t0);
        for (int64_t j = 0; j < KB; j++)
          for (int64_t d = 0; d < hd; d++)
            kt[d * KB + j] = j < nb ? static_cast<float>(kbase[(t0 + j) * ks2 + d]) : 0.0f;
        for (int64_t r = r0; r < r1; r++) {
          v16 sc = {0};  // 16 keys' scores, each summed over d in order
          const float* qr = &qf[r * hd];
          for (int64_t d = 0; d < hd; d++) {
            v16 kd;
            std::memcpy(&kd, &kt[d * KB], sizeof(v16));
            sc += qr[d] * kd;
          }
          float tmp[KB];
          std::memcpy(tmp, &sc, sizeof(v16));
          const bool* mrow = mp ? mp + b * m0 + (r % S) * m2 : nullptr;
          for (int64_t j = 0; j < nb; j++)
            scores[r * Tk + t0 + j] = (mrow && !mrow[(t0 + j) * m3]) ? NEG : tmp[j];
        }
      }
      const T* vbase = vp + b * vs0 + kvh * vs1;
      for (int64_t r = r0; r < r1; r++) {
        float* sr = &scores[r * Tk];
        float mx = NEG;
        for (int64_t t = 0; t < Tk; t++) mx = std::max(mx, sr[t]);
        for (int64_t t = 0; t < Tk; t++) sr[t] = sr[t] == NEG ? 0.0f : exp_neg(sr[t] - mx);
        std::fill(acc.begin(), acc.end(), 0.0f);
        float sum = 0.0f;
        for (int64_t t = 0; t < Tk; t++) {
          if (sr[t] == 0.0f) continue;  // a masked key (an underflowed weight adds nothing either)
          const float p = sr[t];
          sum += p;
          const T* vrow = vbase + t * vs2;
          for (int64_t d = 0; d < hd; d++) acc[d] += p * static_cast<float>(vrow[d]);
        }
        const float inv = sum > 0 ? 1.0f / sum : 0.0f;
        T* orow = op + ((b * H + kvh * g + r / S) * S + r % S) * hd;
        for (int64_t d = 0; d < hd; d++) orow[d] = static_cast<T>(acc[d] * inv);
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
  m.def("run_layers", &run_layers, "layerleap decoder layers (see decoder.cpp)");
  m.def("attend_rows", &attend_rows, "attention for a few new tokens, row by row (see decoder.cpp)");
}

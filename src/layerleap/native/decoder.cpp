// layerleap's decoder layers in C++: the same ATen calls, in the same order, as model.py's Python
// path (Block -> Attention -> attend, RMSNorm, Linear with its weight format), so the results are
// equal bit for bit; what this saves is the Python interpreter between the ~40 small calls of a
// layer.  Built on first request by layerleap/native/__init__.py; model.py falls back to Python
// when it is not built, and for the cases this file does not take (see run_layers' checks there).
#include <torch/extension.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

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
// mask/folded: Keys.mask / Keys.folded; chain: Keys.chain; projections 4 per layer (qkv, o, gate_up,
// down), norms 2 per layer.
Tensor run_layers(Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& K, const Tensor& V, int64_t start,
                  const optional<Tensor>& mask, const optional<Tensor>& folded, bool chain, int64_t H, int64_t Hkv,
                  int64_t hd, int64_t inter, double eps, bool detour, int64_t row_by_row_max,
                  const std::vector<Tensor>& norms, const std::vector<int64_t>& kinds, const std::vector<Tensor>& a,
                  const std::vector<Tensor>& b, const std::vector<optional<Tensor>>& bias,
                  const std::vector<int64_t>& outs, const std::vector<int64_t>& ins) {
  const int64_t L = K.size(0), B = h.size(0), S = h.size(1), total = K.size(3), g = H / Hkv;
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
    } else if (S > 1 && S <= row_by_row_max && q.scalar_type() != at::kFloat) {
      const int64_t first = total - S + 1;
      std::vector<Tensor> rows;
      for (int64_t i = 0; i < S; i++) {
        optional<Tensor> m = chain ? optional<Tensor>() : optional<Tensor>(mask->narrow(2, i, 1).narrow(3, 0, first + i));
        rows.push_back(attend_folded(q.narrow(2, i, 1), kl.narrow(2, 0, first + i), vl.narrow(2, 0, first + i), m, g,
                                     c10::nullopt));
      }
      y = at::cat(rows, 2);
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
}

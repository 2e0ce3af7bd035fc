// XLA FFI handlers for jaxckpt attention (forward and backward), float32.
//
// Exported symbols (wrap them with jax.ffi.pycapsule and register them with
// jax.ffi.register_ffi_target; npu_backend/_ffi.py does this):
//   JaxckptNpuAttentionFwd     CPU: q, k, v -> out, lse
//   JaxckptNpuAttentionBwd     CPU: q, k, v, out, lse, dout -> dq, dk, dv
//   JaxckptNpuAttentionFwdAscend / JaxckptNpuAttentionBwdAscend (only with
//   -DJAXCKPT_WITH_ASCEND): the same on an NPU stream, for a PJRT plugin that
//   would hand the handler an aclrtStream. None is public today.
//
// Layouts: q, out, dout, dq [..., T, N, H]; k, v, dk, dv [..., S, K, H];
// lse [..., N, T]. Every leading axis ("...", at least one) is folded into the
// batch B, so a vmapped call (vmap_method="broadcast_all") needs no extra code.
// Attributes: scale (f32 or f64), is_causal (bool), window_left and
// window_right (i64, -1 = no bound).
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxckpt_npu {
namespace {

using F32 = ffi::Buffer<ffi::F32>;
using F32Out = ffi::ResultBuffer<ffi::F32>;
using Scale = std::variant<float, double>;
using ForwardFn = Status (*)(const AttentionShape&, const float*, const float*, const float*,
                             float*, float*, void*);
using BackwardFn = Status (*)(const AttentionShape&, const float*, const float*, const float*,
                              const float*, const float*, const float*, float*, float*, float*,
                              void*);

std::string show(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// The shape from q [..., T, N, H] and k, v [..., S, K, H]; folds the leading axes into B.
ffi::Error shape_from(ffi::Span<const int64_t> q, ffi::Span<const int64_t> k,
                      ffi::Span<const int64_t> v, AttentionShape* s) {
  const size_t r = q.size();
  if (r < 4 || k.size() != r || v.size() != r) {
    return ffi::Error::InvalidArgument("query, key and value must have one rank >= 4 "
                                       "([..., T, N, H], [..., S, K, H]); got query " +
                                       show(q) + ", key " + show(k) + ", value " + show(v));
  }
  if (!(k == v)) {
    return ffi::Error::InvalidArgument("key and value shapes differ: " + show(k) + " vs " + show(v));
  }
  s->batch = 1;
  for (size_t i = 0; i + 3 < r; ++i) {
    if (q[i] != k[i]) {
      return ffi::Error::InvalidArgument("query and key leading (batch) axes differ: " + show(q) +
                                         " vs " + show(k));
    }
    s->batch *= q[i];
  }
  if (q[r - 1] != k[r - 1]) {
    return ffi::Error::InvalidArgument("query and key head dims H differ: " + show(q) + " vs " +
                                       show(k));
  }
  s->q_len = q[r - 3];
  s->q_heads = q[r - 2];
  s->head_dim = q[r - 1];
  s->kv_len = k[r - 3];
  s->kv_heads = k[r - 2];
  return ffi::Error::Success();
}

// Checks that `dims` is `like` with its last three axes replaced by `tail` (size 2 or 3).
ffi::Error expect(const char* name, ffi::Span<const int64_t> dims, ffi::Span<const int64_t> like,
                  std::vector<int64_t> tail) {
  std::vector<int64_t> want(like.begin(), like.end() - 3);
  want.insert(want.end(), tail.begin(), tail.end());
  if (std::vector<int64_t>(dims.begin(), dims.end()) != want) {
    return ffi::Error::InvalidArgument(std::string(name) + " must have shape " +
                                       show(ffi::Span<const int64_t>(want)) + "; got " + show(dims));
  }
  return ffi::Error::Success();
}

ffi::Error from_status(const Status& st) {
  return st.ok ? ffi::Error::Success() : ffi::Error::Internal(st.message);
}

ffi::Error set_attrs(Scale scale, bool is_causal, int64_t left, int64_t right, AttentionShape* s) {
  s->scale = std::visit([](auto x) { return static_cast<double>(x); }, scale);
  s->is_causal = is_causal;
  s->window_left = left;
  s->window_right = right;
  return from_status(validate(*s));
}

template <ForwardFn kernel>
ffi::Error forward(void* stream, F32 q, F32 k, F32 v, F32Out out, F32Out lse, Scale scale,
                   bool is_causal, int64_t left, int64_t right) {
  AttentionShape s;
  if (auto e = shape_from(q.dimensions(), k.dimensions(), v.dimensions(), &s); e.failure()) return e;
  if (auto e = set_attrs(scale, is_causal, left, right, &s); e.failure()) return e;
  const auto qd = q.dimensions();
  if (auto e = expect("out", out->dimensions(), qd, {s.q_len, s.q_heads, s.head_dim}); e.failure()) {
    return e;
  }
  if (auto e = expect("lse", lse->dimensions(), qd, {s.q_heads, s.q_len}); e.failure()) return e;
  return from_status(kernel(s, q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(),
                            lse->typed_data(), stream));
}

template <BackwardFn kernel>
ffi::Error backward(void* stream, F32 q, F32 k, F32 v, F32 out, F32 lse, F32 dout, F32Out dq,
                    F32Out dk, F32Out dv, Scale scale, bool is_causal, int64_t left,
                    int64_t right) {
  AttentionShape s;
  if (auto e = shape_from(q.dimensions(), k.dimensions(), v.dimensions(), &s); e.failure()) return e;
  if (auto e = set_attrs(scale, is_causal, left, right, &s); e.failure()) return e;
  const auto qd = q.dimensions(), kd = k.dimensions();
  const std::vector<int64_t> q_tail{s.q_len, s.q_heads, s.head_dim};
  const std::vector<int64_t> k_tail{s.kv_len, s.kv_heads, s.head_dim};
  for (auto [name, dims] : {std::pair{"out", out.dimensions()}, {"dout", dout.dimensions()},
                            {"dq", dq->dimensions()}}) {
    if (auto e = expect(name, dims, qd, q_tail); e.failure()) return e;
  }
  if (auto e = expect("lse", lse.dimensions(), qd, {s.q_heads, s.q_len}); e.failure()) return e;
  if (auto e = expect("dk", dk->dimensions(), kd, k_tail); e.failure()) return e;
  if (auto e = expect("dv", dv->dimensions(), kd, k_tail); e.failure()) return e;
  return from_status(kernel(s, q.typed_data(), k.typed_data(), v.typed_data(), out.typed_data(),
                            lse.typed_data(), dout.typed_data(), dq->typed_data(),
                            dk->typed_data(), dv->typed_data(), stream));
}

ffi::Error ForwardCpu(F32 q, F32 k, F32 v, F32Out out, F32Out lse, Scale scale, bool is_causal,
                      int64_t left, int64_t right) {
  return forward<cpu::attention_forward>(nullptr, q, k, v, out, lse, scale, is_causal, left, right);
}

ffi::Error BackwardCpu(F32 q, F32 k, F32 v, F32 out, F32 lse, F32 dout, F32Out dq, F32Out dk,
                       F32Out dv, Scale scale, bool is_causal, int64_t left, int64_t right) {
  return backward<cpu::attention_backward>(nullptr, q, k, v, out, lse, dout, dq, dk, dv, scale,
                                           is_causal, left, right);
}

}  // namespace
}  // namespace jaxckpt_npu

#define JAXCKPT_ATTRS                          \
  .Attr<jaxckpt_npu::Scale>("scale")           \
      .Attr<bool>("is_causal")                 \
      .Attr<int64_t>("window_left")            \
      .Attr<int64_t>("window_right")

#define JAXCKPT_FWD_BUFFERS                                                                  \
  .Arg<jaxckpt_npu::F32>() /* q */.Arg<jaxckpt_npu::F32>() /* k */.Arg<jaxckpt_npu::F32>() \
      /* v */.Ret<jaxckpt_npu::F32>() /* out */.Ret<jaxckpt_npu::F32>() /* lse */

#define JAXCKPT_BWD_BUFFERS                                                                 \
  .Arg<jaxckpt_npu::F32>() /* q */.Arg<jaxckpt_npu::F32>() /* k */                         \
      .Arg<jaxckpt_npu::F32>() /* v */.Arg<jaxckpt_npu::F32>() /* out */                   \
      .Arg<jaxckpt_npu::F32>() /* lse */.Arg<jaxckpt_npu::F32>() /* dout */                \
      .Ret<jaxckpt_npu::F32>() /* dq */.Ret<jaxckpt_npu::F32>() /* dk */                   \
      .Ret<jaxckpt_npu::F32>() /* dv */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxckptNpuAttentionFwd, jaxckpt_npu::ForwardCpu,
                              ffi::Ffi::Bind() JAXCKPT_FWD_BUFFERS JAXCKPT_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxckptNpuAttentionBwd, jaxckpt_npu::BackwardCpu,
                              ffi::Ffi::Bind() JAXCKPT_BWD_BUFFERS JAXCKPT_ATTRS);

#ifdef JAXCKPT_WITH_ASCEND
// Not compiled or run on hardware by this project: there is no public PJRT
// plugin for Ascend, so nothing can call these handlers from JAX today.
namespace jaxckpt_npu {
namespace {

ffi::Error ForwardAscend(void* stream, F32 q, F32 k, F32 v, F32Out out, F32Out lse, Scale scale,
                         bool is_causal, int64_t left, int64_t right) {
  return forward<ascend::attention_forward>(stream, q, k, v, out, lse, scale, is_causal, left,
                                            right);
}

ffi::Error BackwardAscend(void* stream, F32 q, F32 k, F32 v, F32 out, F32 lse, F32 dout,
                          F32Out dq, F32Out dk, F32Out dv, Scale scale, bool is_causal,
                          int64_t left, int64_t right) {
  return backward<ascend::attention_backward>(stream, q, k, v, out, lse, dout, dq, dk, dv, scale,
                                              is_causal, left, right);
}

}  // namespace
}  // namespace jaxckpt_npu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxckptNpuAttentionFwdAscend, jaxckpt_npu::ForwardAscend,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>()
                                  JAXCKPT_FWD_BUFFERS JAXCKPT_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxckptNpuAttentionBwdAscend, jaxckpt_npu::BackwardAscend,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>()
                                  JAXCKPT_BWD_BUFFERS JAXCKPT_ATTRS);
#endif  // JAXCKPT_WITH_ASCEND

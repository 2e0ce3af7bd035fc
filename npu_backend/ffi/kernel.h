// The kernel interface behind the XLA FFI handlers of attention.cc.
//
// One shape vocabulary, the same as jax.nn and jaxckpt: B batch, T query length,
// S key length, N query heads, K key/value heads (K divides N: GQA), H head dim.
// Layouts are row-major:
//   q, out, dout, dq   [B, T, N, H]
//   k, v, dk, dv       [B, S, K, H]
//   lse                [B, N, T]   (natural-log sum of exp of the scaled logits)
//
// Mask (top-left aligned, the jaxckpt predicate): query row t sees key s when
//   (!is_causal || s <= t) && (window_left < 0 || s >= t - window_left)
//                          && (window_right < 0 || s <= t + window_right).
// A row that sees no key has out = 0, lse = -inf, and gets zero gradients.
//
// Two implementations share these signatures:
//   cpu::     kernel_cpu.cc, plain loops over host memory (always built);
//   ascend::  kernel_ascend.cc, aclnnFlashAttentionScore[Grad] on an Ascend NPU,
//             device pointers and an aclrtStream (built only when CANN is found).
#ifndef JAXCKPT_NPU_FFI_KERNEL_H_
#define JAXCKPT_NPU_FFI_KERNEL_H_

#include <cstdint>
#include <string>
#include <utility>

namespace jaxckpt_npu {

// Sizes and attributes of one attention call. Leading batch-like axes (for
// example a vmapped axis) are folded into `batch` by the caller.
struct AttentionShape {
  int64_t batch = 0;     // B
  int64_t q_len = 0;     // T
  int64_t kv_len = 0;    // S
  int64_t q_heads = 0;   // N
  int64_t kv_heads = 0;  // K
  int64_t head_dim = 0;  // H
  double scale = 1.0;
  bool is_causal = false;
  int64_t window_left = -1;   // -1: unbounded
  int64_t window_right = -1;  // -1: unbounded
};

// The result of a kernel call: ok, or a message saying what went wrong.
struct Status {
  bool ok = true;
  std::string message;

  static Status Ok() { return Status(); }
  static Status Error(std::string msg) { return Status{false, std::move(msg)}; }
};

// Checks the sizes and attributes of `shape` (positive sizes, K divides N,
// window bounds >= -1). Shared by both implementations; defined in kernel_cpu.cc.
Status validate(const AttentionShape& shape);

namespace cpu {

// out [B,T,N,H] and lse [B,N,T] from q, k, v (host memory, float32).
Status attention_forward(const AttentionShape& shape, const float* q, const float* k,
                         const float* v, float* out, float* lse, void* stream);

// dq, dk, dv from the forward's inputs and outputs and dout (host memory, float32).
// The probabilities are recomputed from lse; nothing of size T x S is stored.
Status attention_backward(const AttentionShape& shape, const float* q, const float* k,
                          const float* v, const float* out, const float* lse,
                          const float* dout, float* dq, float* dk, float* dv,
                          void* stream);

}  // namespace cpu

#ifdef JAXCKPT_WITH_ASCEND
namespace ascend {

// Same contract, on an Ascend NPU: every pointer is device memory, `stream` is an
// aclrtStream. Not compiled or run on hardware by this project's tests.
Status attention_forward(const AttentionShape& shape, const float* q, const float* k,
                         const float* v, float* out, float* lse, void* stream);

Status attention_backward(const AttentionShape& shape, const float* q, const float* k,
                          const float* v, const float* out, const float* lse,
                          const float* dout, float* dq, float* dk, float* dv,
                          void* stream);

}  // namespace ascend
#endif  // JAXCKPT_WITH_ASCEND

}  // namespace jaxckpt_npu

#endif  // JAXCKPT_NPU_FFI_KERNEL_H_

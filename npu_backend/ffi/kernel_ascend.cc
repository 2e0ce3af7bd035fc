// Ascend implementation of kernel.h over aclnnFlashAttentionScore / aclnnFlashAttentionScoreGrad.
//
// NOT COMPILED OR RUN ON HARDWARE: this project has no Ascend NPU and no CANN
// toolkit. build.py compiles this file only when ASCEND_TOOLKIT_HOME is set and
// holds include/. It was written against the documented aclnn signatures (CANN
// 8.x, Atlas A2 training series) and syntax-checked against stub headers with
// those signatures only. Expect to debug it on a real device.
//
// Every pointer is device memory; `stream` is an aclrtStream. The calls:
//   forward:  FlashAttentionScore, layout "BSND" (= our BTNH), headNum N (GQA
//             allowed when K divides N), sparseMode 1 ("allMask") with an
//             explicit uint8 [T, S] mask (1 = masked) built on the host from the
//             same predicate as kernel_cpu.cc, so T != S keeps top-left alignment.
//             The op returns softmaxMax and softmaxSum, [B, N, T, 8] (8 equal
//             copies); lse = max[..., 0] + log(sum[..., 0]) (aclnnLog, aclnnInplaceAdd
//             on strided views).
//   backward: FlashAttentionScoreGrad with softmaxMax = lse and softmaxSum = 1
//             broadcast to [B, N, T, 8], so that the op's exp(s - max) / sum is
//             exp(s - lse), the probabilities of the forward.
// Rows that see no key: with a top-left mask these are exactly the rows
// t >= S + window_left (a tail of the query axis). Their out is zeroed and
// their lse set to -inf after the forward; in the backward their softmaxMax is
// 0 (not -inf, which would give exp(+inf)) so the op sees p = 0, and their dq
// is zeroed after the op.
// Temporary device buffers and workspaces are freed after the stream is
// synchronized at the end of each call (simple, not asynchronous).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <string>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_add.h"
#include "aclnnop/aclnn_fill_scalar.h"
#include "aclnnop/aclnn_flash_attention_score.h"
#include "aclnnop/aclnn_flash_attention_score_grad.h"
#include "aclnnop/aclnn_log.h"
#include "kernel.h"

namespace jaxckpt_npu {
namespace ascend {
namespace {

constexpr int64_t kNoBound = 2147483647;  // preTokens/nextTokens: ignored with sparseMode 1
constexpr int64_t kAllMask = 1;           // sparseMode: a full [T, S] mask is given

using RunFn = aclnnStatus (*)(void*, uint64_t, aclOpExecutor*, aclrtStream);

// Owns the tensors, scalars and device buffers of one kernel call. The
// destructor synchronizes the stream, then frees everything.
class Scope {
 public:
  explicit Scope(aclrtStream stream) : stream_(stream) {}
  ~Scope() {
    aclrtSynchronizeStream(stream_);
    for (aclTensor* t : tensors_) aclDestroyTensor(t);
    for (aclScalar* s : scalars_) aclDestroyScalar(s);
    for (void* p : buffers_) aclrtFree(p);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

  aclrtStream stream() const { return stream_; }

  // A float32 (or `dtype`) ND tensor viewing `data`: `dims`/`strides` in
  // elements, `offset` elements from the start of storage `storage_elems` long.
  aclTensor* tensor(const void* data, std::vector<int64_t> dims, std::vector<int64_t> strides,
                    int64_t offset, int64_t storage_elems, aclDataType dtype = ACL_FLOAT) {
    const int64_t storage[1] = {storage_elems};
    aclTensor* t = aclCreateTensor(dims.data(), dims.size(), dtype, strides.data(), offset,
                                   ACL_FORMAT_ND, storage, 1, const_cast<void*>(data));
    tensors_.push_back(t);
    return t;
  }

  // A contiguous tensor over the whole of `data`.
  aclTensor* dense(const void* data, std::vector<int64_t> dims, aclDataType dtype = ACL_FLOAT) {
    std::vector<int64_t> strides(dims.size(), 1);
    for (int64_t i = static_cast<int64_t>(dims.size()) - 2; i >= 0; --i) {
      strides[i] = strides[i + 1] * dims[i + 1];
    }
    const int64_t n = dims.empty() ? 1 : strides[0] * dims[0];
    return tensor(data, std::move(dims), std::move(strides), 0, n, dtype);
  }

  aclScalar* scalar(float value) {
    values_.push_back(value);  // a deque: earlier addresses stay valid
    aclScalar* s = aclCreateScalar(&values_.back(), ACL_FLOAT);
    scalars_.push_back(s);
    return s;
  }

  // Device memory of `bytes` bytes (nullptr for 0), freed by the destructor.
  void* alloc(uint64_t bytes, Status* st) {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    if (aclrtMalloc(&p, bytes, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) {
      *st = Status::Error("aclrtMalloc of " + std::to_string(bytes) + " bytes failed");
      return nullptr;
    }
    buffers_.push_back(p);
    return p;
  }

  // Second phase of a two-phase aclnn call, after its GetWorkspaceSize returned `got`.
  Status run(const char* name, aclnnStatus got, uint64_t ws_size, aclOpExecutor* exec, RunFn fn) {
    if (got != ACL_SUCCESS) {
      return Status::Error(std::string(name) + "GetWorkspaceSize failed: " + std::to_string(got));
    }
    Status st;
    void* ws = alloc(ws_size, &st);
    if (!st.ok) return st;
    const aclnnStatus ran = fn(ws, ws_size, exec, stream_);
    if (ran != ACL_SUCCESS) return Status::Error(std::string(name) + " failed: " + std::to_string(ran));
    return Status::Ok();
  }

 private:
  aclrtStream stream_;
  std::vector<aclTensor*> tensors_;
  std::vector<aclScalar*> scalars_;
  std::vector<void*> buffers_;
  std::deque<float> values_;
};

// First query row that sees no key (rows t0..T-1 see none; t0 == T when every row sees one).
int64_t first_empty_row(const AttentionShape& s) {
  if (s.kv_len == 0) return 0;
  if (s.window_left < 0) return s.q_len;
  return std::clamp<int64_t>(s.kv_len + s.window_left, 0, s.q_len);
}

bool needs_mask(const AttentionShape& s) {
  return s.is_causal || s.window_left >= 0 || s.window_right >= 0;
}

// The uint8 [T, S] mask on the device (1 = masked), or nullptr when nothing is masked.
aclTensor* device_mask(const AttentionShape& s, Scope& scope, Status* st) {
  if (!needs_mask(s)) return nullptr;
  std::vector<uint8_t> host(static_cast<size_t>(s.q_len * s.kv_len));
  for (int64_t t = 0; t < s.q_len; ++t) {
    for (int64_t j = 0; j < s.kv_len; ++j) {
      bool ok = !s.is_causal || j <= t;
      ok = ok && (s.window_left < 0 || j >= t - s.window_left);
      ok = ok && (s.window_right < 0 || j <= t + s.window_right);
      host[t * s.kv_len + j] = ok ? 0 : 1;
    }
  }
  void* dev = scope.alloc(host.size(), st);
  if (!st->ok) return nullptr;
  if (aclrtMemcpy(dev, host.size(), host.data(), host.size(), ACL_MEMCPY_HOST_TO_DEVICE) !=
      ACL_SUCCESS) {
    *st = Status::Error("aclrtMemcpy of the attention mask failed");
    return nullptr;
  }
  return scope.dense(dev, {s.q_len, s.kv_len}, ACL_UINT8);
}

// Fills `t` (any view) with `value`.
Status fill(Scope& scope, aclTensor* t, float value) {
  uint64_t ws = 0;
  aclOpExecutor* exec = nullptr;
  const aclnnStatus got = aclnnInplaceFillScalarGetWorkspaceSize(t, scope.scalar(value), &ws, &exec);
  return scope.run("aclnnInplaceFillScalar", got, ws, exec, aclnnInplaceFillScalar);
}

// The [B, rows, ...] tail view t0..T-1 of a [B, T, N, H] array (rows on axis 1).
aclTensor* tail_btnh(Scope& scope, const AttentionShape& s, const float* data, int64_t t0) {
  const int64_t n = s.q_heads, h = s.head_dim, t = s.q_len;
  return scope.tensor(data, {s.batch, t - t0, n, h}, {t * n * h, n * h, h, 1}, t0 * n * h,
                      s.batch * t * n * h);
}

// The [B, N, rows(, 8)] tail view t0..T-1 of a [B, N, T(, 8)] array.
aclTensor* tail_bnt(Scope& scope, const AttentionShape& s, const float* data, int64_t t0,
                    int64_t last) {
  const int64_t n = s.q_heads, t = s.q_len;
  return scope.tensor(data, {s.batch, n, t - t0, last}, {n * t * last, t * last, last, 1},
                      t0 * last, s.batch * n * t * last);
}

// lse [B, N, T] = max[..., 0] + log(sum[..., 0]) from the op's [B, N, T, 8] statistics.
Status lse_from_stats(Scope& scope, const AttentionShape& s, const float* max8, const float* sum8,
                      float* lse) {
  const int64_t n = s.q_heads, t = s.q_len, rows = s.batch * n * t;
  const std::vector<int64_t> dims{s.batch, n, t}, strides{n * t * 8, t * 8, 8};
  aclTensor* sum_view = scope.tensor(sum8, dims, strides, 0, rows * 8);
  aclTensor* max_view = scope.tensor(max8, dims, strides, 0, rows * 8);
  aclTensor* out = scope.dense(lse, dims);
  uint64_t ws = 0;
  aclOpExecutor* exec = nullptr;
  Status st = scope.run("aclnnLog", aclnnLogGetWorkspaceSize(sum_view, out, &ws, &exec), ws, exec,
                        aclnnLog);
  if (!st.ok) return st;
  const aclnnStatus got = aclnnInplaceAddGetWorkspaceSize(out, max_view, scope.scalar(1.0f), &ws, &exec);
  return scope.run("aclnnInplaceAdd", got, ws, exec, aclnnInplaceAdd);
}

}  // namespace

Status attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                         float* out, float* lse, void* stream) {
  if (Status st = validate(s); !st.ok) return st;
  if (s.batch == 0 || s.q_len == 0) return Status::Ok();
  if (s.kv_len == 0) return Status::Error("the Ascend kernel needs S >= 1 keys");
  Scope scope(static_cast<aclrtStream>(stream));
  Status st;
  aclTensor* mask = device_mask(s, scope, &st);
  const uint64_t stat_bytes = static_cast<uint64_t>(s.batch * s.q_heads * s.q_len * 8) * sizeof(float);
  float* max8 = static_cast<float*>(scope.alloc(stat_bytes, &st));
  float* sum8 = static_cast<float*>(scope.alloc(stat_bytes, &st));
  if (!st.ok) return st;
  const int64_t t0 = first_empty_row(s);
  char layout[] = "BSND";
  uint64_t ws = 0;
  aclOpExecutor* exec = nullptr;
  const aclnnStatus got = aclnnFlashAttentionScoreGetWorkspaceSize(
      scope.dense(q, {s.batch, s.q_len, s.q_heads, s.head_dim}),
      scope.dense(k, {s.batch, s.kv_len, s.kv_heads, s.head_dim}),
      scope.dense(v, {s.batch, s.kv_len, s.kv_heads, s.head_dim}), nullptr, nullptr, nullptr, mask,
      nullptr, s.scale, /*keepProb=*/1.0, kNoBound, kNoBound, s.q_heads, layout,
      /*innerPrecise=*/t0 < s.q_len ? 2 : 0, mask ? kAllMask : 0,
      scope.dense(max8, {s.batch, s.q_heads, s.q_len, 8}),
      scope.dense(sum8, {s.batch, s.q_heads, s.q_len, 8}), nullptr,
      scope.dense(out, {s.batch, s.q_len, s.q_heads, s.head_dim}), &ws, &exec);
  st = scope.run("aclnnFlashAttentionScore", got, ws, exec, aclnnFlashAttentionScore);
  if (!st.ok) return st;
  st = lse_from_stats(scope, s, max8, sum8, lse);
  if (!st.ok || t0 == s.q_len) return st;
  st = fill(scope, tail_btnh(scope, s, out, t0), 0.0f);
  if (!st.ok) return st;
  return fill(scope, tail_bnt(scope, s, lse, t0, 1), -std::numeric_limits<float>::infinity());
}

Status attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                          const float* out, const float* lse, const float* dout, float* dq,
                          float* dk, float* dv, void* stream) {
  if (Status st = validate(s); !st.ok) return st;
  if (s.batch == 0 || s.q_len == 0) return Status::Ok();
  if (s.kv_len == 0) return Status::Error("the Ascend kernel needs S >= 1 keys");
  Scope scope(static_cast<aclrtStream>(stream));
  Status st;
  aclTensor* mask = device_mask(s, scope, &st);
  const std::vector<int64_t> stat_dims{s.batch, s.q_heads, s.q_len, 8};
  const uint64_t stat_bytes = static_cast<uint64_t>(s.batch * s.q_heads * s.q_len * 8) * sizeof(float);
  float* max8 = static_cast<float*>(scope.alloc(stat_bytes, &st));
  float* sum8 = static_cast<float*>(scope.alloc(stat_bytes, &st));
  if (!st.ok) return st;
  const int64_t t0 = first_empty_row(s);
  // softmaxMax = lse broadcast over the last axis (0 + lse), 0 on rows that see no key.
  aclTensor* max_t = scope.dense(max8, stat_dims);
  if (!(st = fill(scope, max_t, 0.0f)).ok) return st;
  uint64_t ws = 0;
  aclOpExecutor* exec = nullptr;
  aclTensor* lse_col = scope.dense(lse, {s.batch, s.q_heads, s.q_len, 1});
  st = scope.run("aclnnInplaceAdd",
                 aclnnInplaceAddGetWorkspaceSize(max_t, lse_col, scope.scalar(1.0f), &ws, &exec),
                 ws, exec, aclnnInplaceAdd);
  if (!st.ok) return st;
  if (t0 < s.q_len && !(st = fill(scope, tail_bnt(scope, s, max8, t0, 8), 0.0f)).ok) return st;
  aclTensor* sum_t = scope.dense(sum8, stat_dims);
  if (!(st = fill(scope, sum_t, 1.0f)).ok) return st;
  char layout[] = "BSND";
  const std::vector<int64_t> q_dims{s.batch, s.q_len, s.q_heads, s.head_dim};
  const std::vector<int64_t> kv_dims{s.batch, s.kv_len, s.kv_heads, s.head_dim};
  const aclnnStatus got = aclnnFlashAttentionScoreGradGetWorkspaceSize(
      scope.dense(q, q_dims), scope.dense(k, kv_dims), scope.dense(v, kv_dims),
      scope.dense(dout, q_dims), nullptr, nullptr, nullptr, mask, max_t, sum_t, nullptr,
      scope.dense(out, q_dims), nullptr, s.scale, /*keepProb=*/1.0, kNoBound, kNoBound, s.q_heads,
      layout, /*innerPrecise=*/t0 < s.q_len ? 2 : 0, mask ? kAllMask : 0, scope.dense(dq, q_dims),
      scope.dense(dk, kv_dims), scope.dense(dv, kv_dims), nullptr, &ws, &exec);
  st = scope.run("aclnnFlashAttentionScoreGrad", got, ws, exec, aclnnFlashAttentionScoreGrad);
  if (!st.ok || t0 == s.q_len) return st;
  return fill(scope, tail_btnh(scope, s, dq, t0), 0.0f);
}

}  // namespace ascend
}  // namespace jaxckpt_npu

// CPU implementation of kernel.h: FlashAttention-2 in plain loops, float32.
//
// Forward: for each query row, an ONLINE softmax over blocks of kBlockK keys:
// a running max m and running sum l; each new block rescales the accumulator by
// exp(m_old - m_new), so no T x S matrix is ever formed. lse = m + log(l).
// Backward: the outer loop runs over key blocks and the inner loop over query
// rows (FlashAttention-2 order); probabilities are recomputed from lse as
// p = exp(scale * q.k - lse), with delta = rowsum(dout * out):
//   dv += p dout,  ds = p (dout.v - delta),  dq += scale ds k,  dk += scale ds q.
// Single-threaded: this is the reference route of the FFI, not a fast kernel.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kernel.h"

namespace jaxckpt_npu {

Status validate(const AttentionShape& s) {
  if (s.batch < 0 || s.q_len < 0 || s.kv_len < 0) {
    return Status::Error("batch, q_len and kv_len must be >= 0");
  }
  if (s.q_heads <= 0 || s.kv_heads <= 0 || s.head_dim <= 0) {
    return Status::Error("q_heads, kv_heads and head_dim must be positive");
  }
  if (s.q_heads % s.kv_heads != 0) {
    return Status::Error("q_heads N=" + std::to_string(s.q_heads) +
                         " must be a multiple of kv_heads K=" + std::to_string(s.kv_heads));
  }
  if (s.window_left < -1 || s.window_right < -1) {
    return Status::Error("window_left and window_right must be >= 0, or -1 for none");
  }
  if (!std::isfinite(s.scale)) return Status::Error("scale must be finite");
  return Status::Ok();
}

namespace cpu {
namespace {

constexpr int64_t kBlockK = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Offsets of row (b, t, n) of a [B, T, N, H] array and (b, s, kh) of [B, S, K, H].
int64_t q_offset(const AttentionShape& s, int64_t b, int64_t t, int64_t n) {
  return ((b * s.q_len + t) * s.q_heads + n) * s.head_dim;
}
int64_t kv_offset(const AttentionShape& s, int64_t b, int64_t j, int64_t kh) {
  return ((b * s.kv_len + j) * s.kv_heads + kh) * s.head_dim;
}
int64_t lse_offset(const AttentionShape& s, int64_t b, int64_t n, int64_t t) {
  return (b * s.q_heads + n) * s.q_len + t;
}

// The keys [lo, hi) that query row t sees (empty when lo == hi).
std::pair<int64_t, int64_t> key_range(const AttentionShape& s, int64_t t) {
  int64_t lo = 0, hi = s.kv_len;
  if (s.is_causal) hi = std::min(hi, t + 1);
  if (s.window_left >= 0) lo = std::max(lo, t - s.window_left);
  if (s.window_right >= 0) hi = std::min(hi, t + s.window_right + 1);
  return {lo, std::max(lo, hi)};
}

float dot(const float* a, const float* b, int64_t h) {
  float acc = 0.0f;
  for (int64_t i = 0; i < h; ++i) acc += a[i] * b[i];
  return acc;
}

// One query row: online softmax over key blocks. `acc` (H) and `logits`
// (kBlockK) are scratch buffers.
void forward_row(const AttentionShape& s, const float* q_row, const float* k, const float* v,
                 int64_t b, int64_t kh, int64_t t, float* out_row, float* lse,
                 std::vector<float>& acc, std::vector<float>& logits) {
  const int64_t h = s.head_dim;
  const auto [lo, hi] = key_range(s, t);
  std::fill(acc.begin(), acc.end(), 0.0f);
  float m = kNegInf, l = 0.0f;
  for (int64_t j0 = lo; j0 < hi; j0 += kBlockK) {
    const int64_t j1 = std::min(hi, j0 + kBlockK);
    float block_max = kNegInf;
    for (int64_t j = j0; j < j1; ++j) {
      logits[j - j0] = static_cast<float>(s.scale) * dot(q_row, k + kv_offset(s, b, j, kh), h);
      block_max = std::max(block_max, logits[j - j0]);
    }
    const float m_new = std::max(m, block_max);
    const float alpha = std::exp(m - m_new);  // exp(-inf) = 0 on the first block
    l *= alpha;
    for (int64_t i = 0; i < h; ++i) acc[i] *= alpha;
    for (int64_t j = j0; j < j1; ++j) {
      const float p = std::exp(logits[j - j0] - m_new);
      const float* v_row = v + kv_offset(s, b, j, kh);
      l += p;
      for (int64_t i = 0; i < h; ++i) acc[i] += p * v_row[i];
    }
    m = m_new;
  }
  if (l > 0.0f) {
    for (int64_t i = 0; i < h; ++i) out_row[i] = acc[i] / l;
    *lse = m + std::log(l);
  } else {  // no visible key
    std::fill(out_row, out_row + h, 0.0f);
    *lse = kNegInf;
  }
}

// The contribution of key block [j0, j1) to the gradients of query row t.
void backward_row_block(const AttentionShape& s, const float* q_row, const float* do_row,
                        float lse, float delta, const float* k, const float* v, int64_t b,
                        int64_t kh, int64_t j0, int64_t j1, float* dq_row, float* dk,
                        float* dv) {
  const int64_t h = s.head_dim;
  const float scale = static_cast<float>(s.scale);
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t off = kv_offset(s, b, j, kh);
    const float p = std::exp(scale * dot(q_row, k + off, h) - lse);
    const float ds = p * (dot(do_row, v + off, h) - delta);
    for (int64_t i = 0; i < h; ++i) {
      dv[off + i] += p * do_row[i];
      dq_row[i] += scale * ds * k[off + i];
      dk[off + i] += scale * ds * q_row[i];
    }
  }
}

// Gradients of one (batch, query head) pair; dk and dv accumulate over the
// query heads of a GQA group.
void backward_head(const AttentionShape& s, const float* q, const float* k, const float* v,
                   const float* out, const float* lse, const float* dout, int64_t b, int64_t n,
                   float* dq, float* dk, float* dv, std::vector<float>& delta) {
  const int64_t kh = n / (s.q_heads / s.kv_heads);
  for (int64_t t = 0; t < s.q_len; ++t) {
    const int64_t off = q_offset(s, b, t, n);
    delta[t] = dot(dout + off, out + off, s.head_dim);
  }
  for (int64_t j0 = 0; j0 < s.kv_len; j0 += kBlockK) {
    const int64_t j1 = std::min(s.kv_len, j0 + kBlockK);
    for (int64_t t = 0; t < s.q_len; ++t) {
      const float row_lse = lse[lse_offset(s, b, n, t)];
      const auto [lo, hi] = key_range(s, t);
      const int64_t a = std::max(lo, j0), e = std::min(hi, j1);
      if (a >= e || !std::isfinite(row_lse)) continue;  // masked rows: zero gradient
      const int64_t off = q_offset(s, b, t, n);
      backward_row_block(s, q + off, dout + off, row_lse, delta[t], k, v, b, kh, a, e,
                         dq + off, dk, dv);
    }
  }
}

}  // namespace

Status attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                         float* out, float* lse, void* /*stream*/) {
  if (Status st = validate(s); !st.ok) return st;
  std::vector<float> acc(s.head_dim), logits(kBlockK);
  const int64_t group = s.q_heads / s.kv_heads;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t n = 0; n < s.q_heads; ++n) {
      for (int64_t t = 0; t < s.q_len; ++t) {
        const int64_t off = q_offset(s, b, t, n);
        forward_row(s, q + off, k, v, b, n / group, t, out + off, lse + lse_offset(s, b, n, t),
                    acc, logits);
      }
    }
  }
  return Status::Ok();
}

Status attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                          const float* out, const float* lse, const float* dout, float* dq,
                          float* dk, float* dv, void* /*stream*/) {
  if (Status st = validate(s); !st.ok) return st;
  std::fill(dq, dq + s.batch * s.q_len * s.q_heads * s.head_dim, 0.0f);
  std::fill(dk, dk + s.batch * s.kv_len * s.kv_heads * s.head_dim, 0.0f);
  std::fill(dv, dv + s.batch * s.kv_len * s.kv_heads * s.head_dim, 0.0f);
  std::vector<float> delta(s.q_len);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t n = 0; n < s.q_heads; ++n) {
      backward_head(s, q, k, v, out, lse, dout, b, n, dq, dk, dv, delta);
    }
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace jaxckpt_npu

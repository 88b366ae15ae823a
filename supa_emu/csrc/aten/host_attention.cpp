// Blockwise attention on the host (see host_attention.h). Computes in float32, as PyTorch's math
// path does for half and bfloat16, and holds one block of rows of the scores at a time.
#include "host_attention.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

namespace supa::host_attention {
namespace blocks {

// Rows per block: about 16 MiB of float32 scores. A function of the shapes only, so that backward
// cuts the same blocks and draws the same dropout masks as forward.
int64_t rows_per_block(int64_t batch_heads, int64_t keys) {
  constexpr int64_t kBudget = int64_t{4} << 20;  // elements
  return std::max<int64_t>(1, kBudget / std::max<int64_t>(1, batch_heads * keys));
}

at::Tensor heads_like_query(const at::Tensor& t, int64_t heads) {
  const int64_t group = heads / t.size(1);
  return group == 1 ? t : t.repeat_interleave(group, 1);
}

// The scaled scores of rows [begin, end) with the mask applied (float32, (B, H, rows, S)).
at::Tensor scores(const Call& call, const at::Tensor& q, const at::Tensor& k, int64_t begin, int64_t end) {
  at::Tensor s = at::matmul(q.narrow(2, begin, end - begin), k.transpose(-2, -1)).mul_(call.scale);
  if (call.bias.defined()) {
    at::Tensor bias = call.bias.dim() >= 2 ? call.bias.narrow(-2, call.bias.size(-2) == 1 ? 0 : begin,
                                                              call.bias.size(-2) == 1 ? 1 : end - begin)
                                           : call.bias;
    s.add_(bias.to(at::kFloat));
  }
  if (call.is_causal) {
    const int64_t keys = k.size(2);
    at::Tensor rows = at::arange(begin, end, at::kLong).unsqueeze(1);
    at::Tensor cols = at::arange(keys, at::kLong).unsqueeze(0);
    s.masked_fill_(cols > rows, -std::numeric_limits<float>::infinity());
  }
  return s;
}

// Probabilities from scores and the rows' log-sum-exp; rows that mask every key get zeros.
at::Tensor probabilities(const at::Tensor& s, const at::Tensor& lse_rows) {
  at::Tensor p = (s - lse_rows.unsqueeze(-1)).exp_();
  return p.masked_fill_(at::isneginf(lse_rows).unsqueeze(-1), 0.0);
}

// The kept entries of the block's dropout mask, scaled by 1 / (1 - p); undefined without dropout.
at::Tensor dropout_scale(const Call& call, c10::IntArrayRef block_shape, int64_t begin) {
  if (call.dropout_p <= 0.0) {
    return at::Tensor();
  }
  const uint64_t stream = call.seed ^ (call.offset * 0x9E3779B97F4A7C15ULL) ^
                          (static_cast<uint64_t>(begin) * 0xBF58476D1CE4E5B9ULL);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(stream);
  at::Tensor keep = at::rand(block_shape, generator, at::TensorOptions().dtype(at::kFloat)).ge_(call.dropout_p);
  return keep.to(at::kFloat).div_(1.0 - call.dropout_p);
}

// The operands in float32, key and value with the query's heads, and the block size.
struct Operands {
  int64_t batch, heads, rows, step;
  at::Tensor q, k, v;
};

Operands float_operands(const Call& call) {
  const int64_t heads = call.query.size(1);
  const at::Tensor k = heads_like_query(call.key, heads).to(at::kFloat);
  return {call.query.size(0), heads, call.query.size(2), rows_per_block(call.query.size(0) * heads, k.size(2)),
          call.query.to(at::kFloat), k, heads_like_query(call.value, heads).to(at::kFloat)};
}

}  // namespace blocks

std::tuple<at::Tensor, at::Tensor> forward(const Call& call) {
  const auto [batch, heads, rows, step, q, k, v] = blocks::float_operands(call);
  at::Tensor out = at::empty({batch, heads, rows, v.size(3)}, q.options());
  at::Tensor lse = at::empty({batch, heads, rows}, q.options());
  for (int64_t begin = 0; begin < rows; begin += step) {
    const int64_t end = std::min(rows, begin + step);
    at::Tensor s = blocks::scores(call, q, k, begin, end);
    at::Tensor lse_rows = at::logsumexp(s, -1);
    at::Tensor p = blocks::probabilities(s, lse_rows);
    at::Tensor drop = blocks::dropout_scale(call, p.sizes(), begin);
    if (drop.defined()) {
      p.mul_(drop);
    }
    out.narrow(2, begin, end - begin).copy_(at::matmul(p, v));
    lse.narrow(2, begin, end - begin).copy_(lse_rows);
  }
  return {out.to(call.query.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(const Call& call, const at::Tensor& grad_out,
                                                                    const at::Tensor& out, const at::Tensor& lse,
                                                                    bool bias_grad) {
  const auto [batch, heads, rows, step, q, k, v] = blocks::float_operands(call);
  const at::Tensor d_out = grad_out.to(at::kFloat);
  const at::Tensor lse_f = lse.to(at::kFloat);
  // Row sums of dO * O: the softmax's backward term, dropout included.
  const at::Tensor delta = (d_out * out.to(at::kFloat)).sum(-1);
  at::Tensor dq = at::empty_like(q);
  at::Tensor dk = at::zeros_like(k);
  at::Tensor dv = at::zeros_like(v);
  at::Tensor dbias = bias_grad ? at::empty({batch, heads, rows, k.size(2)}, q.options()) : at::Tensor();
  for (int64_t begin = 0; begin < rows; begin += step) {
    const int64_t end = std::min(rows, begin + step);
    const int64_t n = end - begin;
    at::Tensor p = blocks::probabilities(blocks::scores(call, q, k, begin, end), lse_f.narrow(2, begin, n));
    at::Tensor drop = blocks::dropout_scale(call, p.sizes(), begin);
    at::Tensor d_out_rows = d_out.narrow(2, begin, n);
    at::Tensor dp = at::matmul(d_out_rows, v.transpose(-2, -1));
    if (drop.defined()) {
      dv.add_(at::matmul((p * drop).transpose(-2, -1), d_out_rows));
      dp.mul_(drop);
    } else {
      dv.add_(at::matmul(p.transpose(-2, -1), d_out_rows));
    }
    at::Tensor ds = p.mul_(dp.sub_(delta.narrow(2, begin, n).unsqueeze(-1)));
    if (bias_grad) {
      dbias.narrow(2, begin, n).copy_(ds);
    }
    dq.narrow(2, begin, n).copy_(at::matmul(ds, k).mul_(call.scale));
    dk.add_(at::matmul(ds.transpose(-2, -1), q.narrow(2, begin, n)).mul_(call.scale));
  }
  const int64_t query_heads = heads;  // a plain variable: lambdas capture no structured bindings before C++20
  const auto to_key_heads = [query_heads](const at::Tensor& g, const at::Tensor& like) {
    const int64_t key_heads = like.size(1);
    at::Tensor summed = key_heads == query_heads ? g : g.unflatten(1, {key_heads, query_heads / key_heads}).sum(2);
    return summed.to(like.scalar_type());
  };
  return {dq.to(call.query.scalar_type()), to_key_heads(dk, call.key), to_key_heads(dv, call.value), dbias};
}

}  // namespace supa::host_attention

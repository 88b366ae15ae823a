// Operators whose CPU path PyTorch chooses by looking at the device type, which the generic
// fallback never sees because the choice is made before any kernel runs:
//
// - Convolutions: at::convolution / convolution_backward pick a backend (mkldnn, slow_conv,
//   ...) from the device; for a non-CPU, non-CUDA device they pick convolution_overrideable.
//   Making the fallback their supa kernel runs their CPU implementation on host views, so
//   the CPU backend selection happens and autograd stays with the generated kernels. Half and
//   bfloat16 convolutions run in float32, rounded once (half_precision_products.h).
// - Recurrent cells: RNN.cpp gives CUDA, XPU and PrivateUse1 inputs to the fused cell ops
//   (_thnn_fused_lstm_cell, _thnn_fused_gru_cell and their backward ops), which have GPU
//   kernels only. They get host kernels here, run through the fallback machinery, that
//   compute the cell with the operations and in the order of the CPU cell in RNN.cpp.
// - LSTM layers: for float32 the CPU runs whole layers with oneDNN (mkldnn_rnn_layer), chosen
//   by the input's backend. supa's at::lstm makes the same choice and the same calls, one
//   mkldnn_rnn_layer per layer and direction (a CPU kernel with its own autograd formula), so
//   results are the CPU's bit for bit and a layer is one call instead of one per time step.
#include "fallback.h"
#include "half_precision_products.h"

#include <ATen/ATen.h>
#include <ATen/ops/lstm_native.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace supa {
namespace {

using at::Tensor;


// The arguments both fused cells take: (input_gates, hidden_gates, state, input_bias?, hidden_bias?).
struct CellInputs {
  Tensor input_gates;
  Tensor hidden_gates;
  Tensor state;  // cx for the LSTM cell, hx for the GRU cell
  Tensor input_bias;
  Tensor hidden_bias;
};

CellInputs cell_inputs(const torch::jit::Stack& stack, int64_t gates, const char* op) {
  auto args = torch::jit::last(stack, 5);
  CellInputs in{args[0].toTensor(), args[1].toTensor(), args[2].toTensor(), optional_tensor(args[3]),
                optional_tensor(args[4])};
  TORCH_CHECK(in.input_gates.dim() == 2 && in.input_gates.sizes() == in.hidden_gates.sizes(), op,
              ": input_gates and hidden_gates must be 2-D and of the same shape, got ", in.input_gates.sizes(),
              " and ", in.hidden_gates.sizes());
  TORCH_CHECK(in.state.dim() == 2 && in.state.size(0) == in.input_gates.size(0) &&
                  in.state.size(1) * gates == in.input_gates.size(1),
              op, ": the state must be (batch, hidden) with ", gates, " * hidden gate columns, got state ",
              in.state.sizes(), " and gates ", in.input_gates.sizes());
  TORCH_CHECK(in.input_bias.defined() == in.hidden_bias.defined(), op, ": give both biases or neither");
  return in;
}

// Gate pre-activations as the CPU cell forms them, (h W_hh^T + b_hh) + (x W_ih^T + b_ih):
// the hidden side is a fresh tensor the cell then updates in place, the input side is read.
Tensor hidden_side(const Tensor& gates, const Tensor& bias) {
  return bias.defined() ? gates + bias : gates.clone();
}
Tensor input_side(const Tensor& gates, const Tensor& bias) {
  return bias.defined() ? gates + bias : gates;
}

// _thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias, hidden_bias)
//   -> (hy, cy, workspace); the workspace holds the activated gates (i, f, g, o) for backward.
void fused_lstm_cell(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  const CellInputs in = cell_inputs(*stack, 4, "_thnn_fused_lstm_cell");
  const Tensor& cx = in.state;
  Tensor workspace = hidden_side(in.hidden_gates, in.hidden_bias).add_(input_side(in.input_gates, in.input_bias));
  auto chunks = workspace.unsafe_chunk(4, 1);
  const Tensor ingate = chunks[0].sigmoid_();
  const Tensor forgetgate = chunks[1].sigmoid_();
  const Tensor cellgate = chunks[2].tanh_();
  const Tensor outgate = chunks[3].sigmoid_();
  Tensor cy = (forgetgate * cx).add_(ingate * cellgate);
  Tensor hy = outgate * cy.tanh();
  push_results(stack, 5, {hy, cy, workspace});
}

// _thnn_fused_lstm_cell_backward_impl(grad_hy?, grad_cy?, cx, cy, workspace, has_bias)
//   -> (grad_gates, grad_cx, grad_bias)
void fused_lstm_cell_backward(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 6);
  const Tensor grad_hy = optional_tensor(args[0]);
  const Tensor grad_cy = optional_tensor(args[1]);
  const Tensor cx = args[2].toTensor();
  const Tensor cy = args[3].toTensor();
  const Tensor workspace = args[4].toTensor();
  const bool has_bias = args[5].toBool();
  if (!grad_hy.defined() && !grad_cy.defined()) {
    push_results(stack, 6, {Tensor(), Tensor(), Tensor()});
    return;
  }
  auto gates = workspace.chunk(4, 1);
  const Tensor& i = gates[0];
  const Tensor& f = gates[1];
  const Tensor& g = gates[2];
  const Tensor& o = gates[3];
  const Tensor tanh_cy = cy.tanh();
  // Gradient reaching c_t: through h_t = o * tanh(c_t), plus the one given for c_t.
  Tensor grad_c = at::zeros_like(cy);
  if (grad_hy.defined()) {
    grad_c.add_(grad_hy * o * (1 - tanh_cy * tanh_cy));
  }
  if (grad_cy.defined()) {
    grad_c.add_(grad_cy);
  }
  const Tensor grad_o = grad_hy.defined() ? grad_hy * tanh_cy * o * (1 - o) : at::zeros_like(o);
  const Tensor grad_i = grad_c * g * i * (1 - i);
  const Tensor grad_f = grad_c * cx * f * (1 - f);
  const Tensor grad_g = grad_c * i * (1 - g * g);
  Tensor grad_gates = at::cat({grad_i, grad_f, grad_g, grad_o}, 1);
  Tensor grad_cx = grad_c * f;
  Tensor grad_bias = has_bias ? grad_gates.sum(0) : Tensor();
  push_results(stack, 6, {grad_gates, grad_cx, grad_bias});
}

// _thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias, hidden_bias) -> (hy, workspace);
// the workspace holds (r, z, n, hx, hidden part of n) for backward.
void fused_gru_cell(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  const CellInputs in = cell_inputs(*stack, 3, "_thnn_fused_gru_cell");
  const Tensor& hx = in.state;
  auto igates = input_side(in.input_gates, in.input_bias).unsafe_chunk(3, 1);
  auto hgates = hidden_side(in.hidden_gates, in.hidden_bias).unsafe_chunk(3, 1);
  const Tensor hidden_new = hgates[2].clone();
  const Tensor reset_gate = hgates[0].add_(igates[0]).sigmoid_();
  const Tensor input_gate = hgates[1].add_(igates[1]).sigmoid_();
  const Tensor new_gate = igates[2].add(hgates[2].mul_(reset_gate)).tanh_();
  Tensor hy = (hx - new_gate).mul_(input_gate).add_(new_gate);
  Tensor workspace = at::cat({reset_gate, input_gate, new_gate, hx, hidden_new}, 1);
  push_results(stack, 5, {hy, workspace});
}

// _thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias)
//   -> (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)
void fused_gru_cell_backward(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 3);
  const Tensor grad_hy = args[0].toTensor();
  const Tensor workspace = args[1].toTensor();
  const bool has_bias = args[2].toBool();
  TORCH_CHECK(workspace.dim() == 2 && workspace.size(1) == 5 * grad_hy.size(-1),
              "_thnn_fused_gru_cell_backward: expected a (batch, 5 * hidden) workspace, got ", workspace.sizes());
  auto parts = workspace.chunk(5, 1);
  const Tensor& r = parts[0];
  const Tensor& z = parts[1];
  const Tensor& n = parts[2];
  const Tensor& hx = parts[3];
  const Tensor& hidden_new = parts[4];
  // h' = n + z * (hx - n), n = tanh(in + r * hn), r and z sigmoids.
  const Tensor grad_z = grad_hy * (hx - n) * (1 - z) * z;
  const Tensor grad_n = grad_hy * (1 - z) * (1 - n * n);
  const Tensor grad_r = grad_n * hidden_new * (1 - r) * r;
  Tensor grad_input_gates = at::cat({grad_r, grad_z, grad_n}, 1);
  Tensor grad_hidden_gates = at::cat({grad_r, grad_z, grad_n * r}, 1);
  Tensor grad_hx = grad_hy * z;
  Tensor grad_input_bias = has_bias ? grad_input_gates.sum(0) : Tensor();
  Tensor grad_hidden_bias = has_bias ? grad_hidden_gates.sum(0) : Tensor();
  push_results(stack, 3, {grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias});
}

// What at::lstm on CPU checks before taking oneDNN (use_mkldnn in RNN.cpp), for float32.
bool cpu_would_use_onednn(const Tensor& input, at::TensorList hx, at::TensorList params) {
  auto all_float = [](at::TensorList tensors) {
    return std::all_of(tensors.begin(), tensors.end(),
                       [](const Tensor& t) { return t.scalar_type() == at::kFloat; });
  };
  const bool projections = hx.size() == 2 && hx[0].dim() == 3 && hx[1].dim() == 3 && hx[0].size(2) != hx[1].size(2);
  return at::globalContext().userEnabledMkldnn() && input.scalar_type() == at::kFloat && all_float(params) &&
         all_float(hx) && input.numel() != 0 && !projections;
}

constexpr int64_t kOneDnnLstmMode = 2;  // ideep::rnn_kind::LSTM

std::tuple<Tensor, Tensor, Tensor> lstm(const Tensor& input, at::TensorList hx, at::TensorList params,
                                        bool has_biases, int64_t num_layers, double dropout, bool train,
                                        bool bidirectional, bool batch_first) {
  if (!cpu_would_use_onednn(input, hx, params)) {
    return at::native::lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
  }
  const int64_t directions = bidirectional ? 2 : 1;
  const int64_t per_layer = has_biases ? 4 : 2;
  TORCH_CHECK(hx.size() == 2, "lstm expects two hidden states (h_0, c_0), got ", hx.size());
  TORCH_CHECK(hx[0].dim() == 3 && hx[1].dim() == 3 && hx[0].size(0) == num_layers * directions &&
                  hx[1].size(0) == num_layers * directions,
              "Expected h_0 and c_0 of size (num_layers * num_directions = ", num_layers * directions,
              ", batch, hidden_size), got ", hx[0].sizes(), " and ", hx[1].sizes());
  TORCH_CHECK(static_cast<int64_t>(params.size()) == num_layers * directions * per_layer,
              "lstm: expected ", num_layers * directions * per_layer, " parameter tensors, got ", params.size());
  const int64_t hidden_size = hx[0].size(2);
  const Tensor h0 = hx[0].contiguous();
  const Tensor c0 = hx[1].contiguous();
  Tensor layer_input = (batch_first ? input.transpose(0, 1) : input).contiguous();
  std::vector<Tensor> hy(num_layers * directions);
  std::vector<Tensor> cy(num_layers * directions);
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    std::vector<Tensor> outputs(directions);
    for (int64_t direction = 0; direction < directions; ++direction) {
      const int64_t index = layer * directions + direction;
      const Tensor& w_ih = params[index * per_layer];
      const Tensor& w_hh = params[index * per_layer + 1];
      const Tensor b_ih = has_biases ? params[index * per_layer + 2] : at::zeros({w_ih.size(0)}, w_ih.options());
      const Tensor b_hh = has_biases ? params[index * per_layer + 3] : at::zeros({w_hh.size(0)}, w_hh.options());
      auto result = at::mkldnn_rnn_layer(layer_input, w_ih, w_hh, b_ih, b_hh, h0[index], c0[index], direction > 0,
                                         /*batch_sizes=*/{}, kOneDnnLstmMode, hidden_size, num_layers, has_biases,
                                         bidirectional, batch_first, train);
      outputs[direction] = std::get<0>(result);
      hy[index] = std::get<1>(result);
      cy[index] = std::get<2>(result);
    }
    layer_input = directions == 1 ? outputs[0] : at::cat(outputs, -1);
    if (dropout != 0 && train && layer < num_layers - 1) {
      layer_input = at::dropout(layer_input, dropout, /*train=*/true);
    }
  }
  Tensor output = batch_first ? layer_input.transpose(0, 1) : layer_input;
  return {output, at::stack(hy, 0), at::stack(cy, 0)};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"convolution", "convolution_backward", "_convolution", "_convolution.deprecated"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&run_product_kernel>());
  }
  m.impl("lstm.input", lstm);
  m.impl("_thnn_fused_lstm_cell", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&fused_lstm_cell>>());
  m.impl("_thnn_fused_lstm_cell_backward_impl",
         torch::CppFunction::makeFromBoxedFunction<&on_host_views<&fused_lstm_cell_backward>>());
  m.impl("_thnn_fused_gru_cell", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&fused_gru_cell>>());
  m.impl("_thnn_fused_gru_cell_backward",
         torch::CppFunction::makeFromBoxedFunction<&on_host_views<&fused_gru_cell_backward>>());
}

// lstm.input is composite: a kernel at the autograd key keeps it above autograd, so the layer
// calls it makes record their own gradients as they do on CPU.
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("lstm.input", lstm);
}

}  // namespace supa

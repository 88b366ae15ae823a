"""Operators whose implementation PyTorch picks by device type: convolutions and recurrent
layers run on supa with the results (forward and gradients) of the same modules on CPU."""

import copy

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

DEV = torch.device("supa", 0)


def _first_tensor(output):
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output.data if isinstance(output, torch.nn.utils.rnn.PackedSequence) else output


def _assert_module_matches_cpu(module, *inputs, memory_format=None, atol=None, rtol=None):
    """Forward and backward of `module` on supa equal those of the same module on CPU."""
    torch.manual_seed(0)
    on_device = copy.deepcopy(module).to(DEV)
    cpu_inputs = [x.clone().requires_grad_() for x in inputs]
    dev_inputs = [x.detach().to(DEV).requires_grad_() for x in inputs]
    if memory_format is not None:
        on_device = on_device.to(memory_format=memory_format)
        module = module.to(memory_format=memory_format)
    expected = _first_tensor(module(*cpu_inputs))
    got = _first_tensor(on_device(*dev_inputs))
    assert got.device == DEV
    torch.testing.assert_close(got.cpu(), expected, atol=atol, rtol=rtol)
    if memory_format is not None:
        assert got.is_contiguous(memory_format=memory_format) == expected.is_contiguous(memory_format=memory_format)
    weights = torch.randn_like(expected)
    (expected * weights).sum().backward()
    (got * weights.to(DEV)).sum().backward()
    for cpu_x, dev_x in zip(cpu_inputs, dev_inputs):
        assert dev_x.grad.device == DEV
        torch.testing.assert_close(dev_x.grad.cpu(), cpu_x.grad, atol=atol, rtol=rtol)
    for (name, cpu_p), dev_p in zip(module.named_parameters(), on_device.parameters()):
        assert dev_p.grad is not None and dev_p.grad.device == DEV, name
        torch.testing.assert_close(dev_p.grad.cpu(), cpu_p.grad, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


CONVOLUTIONS = {
    "conv1d": (lambda: torch.nn.Conv1d(4, 6, 3), (2, 4, 16)),
    "conv1d grouped dilated no bias": (lambda: torch.nn.Conv1d(4, 6, 3, groups=2, dilation=2, bias=False), (2, 4, 16)),
    "conv2d": (lambda: torch.nn.Conv2d(3, 8, 3, padding=1), (2, 3, 9, 9)),
    "conv2d strided padding same": (lambda: torch.nn.Conv2d(3, 4, 5, padding="same", padding_mode="reflect"),
                                    (1, 3, 8, 8)),
    "conv2d depthwise": (lambda: torch.nn.Conv2d(4, 8, 3, groups=4, stride=2), (2, 4, 9, 9)),
    "conv3d": (lambda: torch.nn.Conv3d(2, 4, 3, padding=1), (1, 2, 5, 6, 5)),
    "conv_transpose1d": (lambda: torch.nn.ConvTranspose1d(4, 3, 3, stride=2, output_padding=1), (2, 4, 7)),
    "conv_transpose2d grouped dilated": (lambda: torch.nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, dilation=2),
                                         (2, 4, 5, 5)),
    "conv_transpose3d no bias": (lambda: torch.nn.ConvTranspose3d(2, 3, 2, stride=2, bias=False), (1, 2, 3, 3, 3)),
}


@pytest.mark.parametrize("name", CONVOLUTIONS)
def test_convolution_matches_cpu(name):
    make, shape = CONVOLUTIONS[name]
    torch.manual_seed(1)
    _assert_module_matches_cpu(make(), torch.randn(shape))


@pytest.mark.parametrize("transposed", [False, True])
def test_channels_last_convolution_keeps_the_layout(transposed):
    torch.manual_seed(2)
    module = torch.nn.ConvTranspose2d(3, 8, 3) if transposed else torch.nn.Conv2d(3, 8, 3)
    x = torch.randn(2, 3, 10, 10).contiguous(memory_format=torch.channels_last)
    _assert_module_matches_cpu(module, x, memory_format=torch.channels_last)


def test_functional_convolution_and_double_backward():
    torch.manual_seed(3)
    x, w = torch.randn(2, 3, 7, 7, dtype=torch.float32), torch.randn(5, 3, 3, 3)
    results = []
    for device in ("cpu", DEV):
        xd = x.to(device).requires_grad_()
        wd = w.to(device).requires_grad_()
        out = torch.nn.functional.conv2d(xd, wd, stride=2, padding=1)
        (gx,) = torch.autograd.grad(out.square().sum(), xd, create_graph=True)
        (gw,) = torch.autograd.grad(gx.sum(), wd)
        results.append((out, gx, gw))
    for cpu, dev in zip(*results):
        assert dev.device == DEV
        torch.testing.assert_close(dev.cpu(), cpu)


def test_bfloat16_convolution_is_the_float32_one_rounded_once():
    # A card's convolutions accumulate in float32 and round once, and supa's do (docs/device_model.md#operators);
    # the CPU's bfloat16 kernel rounds partial sums of the input's gradient. The reference: the module in float32.
    torch.manual_seed(4)
    module = torch.nn.Conv2d(3, 4, 3).to(torch.bfloat16)
    on_device, reference = copy.deepcopy(module).to(DEV), copy.deepcopy(module).float()
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    x_on_device, x_reference = x.to(DEV).requires_grad_(), x.float().requires_grad_()
    got, expected = on_device(x_on_device), reference(x_reference)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu(), expected.to(torch.bfloat16), rtol=0, atol=0)
    weights = torch.randn(expected.shape, dtype=torch.bfloat16)
    (got * weights.to(DEV)).sum().backward()
    (expected * weights.float()).sum().backward()
    torch.testing.assert_close(x_on_device.grad.cpu(), x_reference.grad.to(torch.bfloat16), rtol=0, atol=0)
    for (name, p), q in zip(reference.named_parameters(), on_device.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad.to(torch.bfloat16), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


RECURRENT = {
    "lstm": (lambda: torch.nn.LSTM(5, 7), (4, 3, 5)),
    "lstm 2 layers bidirectional": (lambda: torch.nn.LSTM(5, 7, num_layers=2, bidirectional=True), (4, 3, 5)),
    "lstm batch_first no bias": (lambda: torch.nn.LSTM(5, 7, batch_first=True, bias=False), (3, 4, 5)),
    "lstm with projection": (lambda: torch.nn.LSTM(5, 7, proj_size=3, num_layers=2), (4, 3, 5)),
    "gru": (lambda: torch.nn.GRU(5, 7), (4, 3, 5)),
    "gru 2 layers bidirectional batch_first": (
        lambda: torch.nn.GRU(5, 7, num_layers=2, bidirectional=True, batch_first=True), (3, 4, 5)),
    "gru no bias": (lambda: torch.nn.GRU(5, 7, bias=False), (4, 3, 5)),
    "rnn tanh bidirectional": (lambda: torch.nn.RNN(5, 7, bidirectional=True), (4, 3, 5)),
    "rnn relu 2 layers": (lambda: torch.nn.RNN(5, 7, num_layers=2, nonlinearity="relu"), (4, 3, 5)),
    "lstm unbatched": (lambda: torch.nn.LSTM(5, 7), (4, 5)),
}


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_layer_matches_cpu(name):
    make, shape = RECURRENT[name]
    torch.manual_seed(5)
    _assert_module_matches_cpu(make(), torch.randn(shape))


@pytest.mark.parametrize("name", ["lstm_cell", "lstm_cell no bias", "gru_cell", "gru_cell no bias", "rnn_cell"])
def test_recurrent_cells_match_cpu(name):
    torch.manual_seed(6)
    bias = "no bias" not in name
    cell = {"lstm": torch.nn.LSTMCell, "gru_": torch.nn.GRUCell, "rnn_": torch.nn.RNNCell}[name[:4]](5, 7, bias=bias)
    hidden = torch.randn(3, 7)
    state = (hidden, torch.randn(3, 7)) if name.startswith("lstm") else hidden
    x = torch.randn(3, 5)
    cpu_args = [x.clone().requires_grad_()]
    dev_args = [x.to(DEV).requires_grad_()]
    on_device = copy.deepcopy(cell).to(DEV)
    expected = cell(cpu_args[0], state)
    dev_state = tuple(s.to(DEV) for s in state) if isinstance(state, tuple) else state.to(DEV)
    got = on_device(dev_args[0], dev_state)
    expected, got = (expected, got) if isinstance(expected, tuple) else ((expected,), (got,))
    for e, g in zip(expected, got):
        assert g.device == DEV
        torch.testing.assert_close(g.cpu(), e)
    sum(e.sin().sum() for e in expected).backward()
    sum(g.sin().sum() for g in got).backward()
    torch.testing.assert_close(dev_args[0].grad.cpu(), cpu_args[0].grad)
    for p, q in zip(cell.parameters(), on_device.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad)


@pytest.mark.parametrize("kind", [torch.nn.LSTM, torch.nn.GRU])
def test_packed_sequences_match_cpu(kind):
    torch.manual_seed(7)
    layer = kind(4, 6, num_layers=2, bidirectional=True)
    x = torch.randn(5, 3, 4)
    lengths = torch.tensor([5, 3, 2])
    results = []
    for device, module in (("cpu", layer), (DEV, copy.deepcopy(layer).to(DEV))):
        xd = x.to(device, copy=True).requires_grad_()
        packed_out, _ = module(pack_padded_sequence(xd, lengths))
        out, out_lengths = pad_packed_sequence(packed_out)
        out.sum().backward()
        results.append((out, xd.grad, next(module.parameters()).grad))
        assert out_lengths.tolist() == [5, 3, 2]
    for cpu, dev in zip(*results):
        assert dev.device == DEV
        torch.testing.assert_close(dev.cpu(), cpu)


def test_recurrent_double_backward_matches_cpu():
    # With create_graph the fused cells take their differentiable backward formulas.
    torch.manual_seed(8)
    lstm = torch.nn.LSTM(3, 4)
    x = torch.randn(2, 2, 3)
    results = []
    for device, module in (("cpu", lstm), (DEV, copy.deepcopy(lstm).to(DEV))):
        xd = x.to(device, copy=True).requires_grad_()
        (gx,) = torch.autograd.grad(module(xd)[0].pow(2).sum(), xd, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.sum(), xd)
        results.append((gx, ggx))
    for cpu, dev in zip(*results):
        torch.testing.assert_close(dev.cpu(), cpu)


def test_fused_cell_shape_errors_are_clear():
    gates = torch.randn(3, 28, device=DEV)
    with pytest.raises(RuntimeError, match="_thnn_fused_lstm_cell"):
        torch.ops.aten._thnn_fused_lstm_cell(gates, gates, torch.randn(3, 5, device=DEV))


@pytest.mark.parametrize("batch_first", [False, True])
def test_float32_lstm_runs_the_cpu_onednn_layers_bit_for_bit(batch_first):
    # The CPU runs float32 LSTMs through oneDNN; supa takes the same path, so nothing differs.
    torch.manual_seed(9)
    lstm = torch.nn.LSTM(6, 8, num_layers=2, bidirectional=True, batch_first=batch_first)
    x = torch.randn(3, 5, 6)
    results = []
    for device, module in (("cpu", lstm), (DEV, copy.deepcopy(lstm).to(DEV))):
        xd = x.to(device, copy=True).requires_grad_()
        out, (hy, cy) = module(xd)
        (out.sin().sum() + hy.sum() + cy.cos().sum()).backward()
        results.append([out, hy, cy, xd.grad, *(p.grad for p in module.parameters())])
    for cpu, dev in zip(*results):
        assert dev.device == DEV
        torch.testing.assert_close(dev.cpu(), cpu, rtol=0, atol=0)


def test_lstm_dropout_between_layers_draws_from_the_device_generator():
    lstm = torch.nn.LSTM(4, 4, num_layers=3, dropout=0.5).to(DEV)
    x = torch.randn(5, 2, 4, device=DEV)
    torch.supa.manual_seed(3)
    first = lstm(x)[0]
    torch.supa.manual_seed(3)
    again = lstm(x)[0]
    assert torch.equal(first.cpu(), again.cpu())
    assert not torch.equal(first.cpu(), lstm.eval()(x)[0].cpu())

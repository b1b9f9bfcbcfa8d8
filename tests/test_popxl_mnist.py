"""The PopXL user guide's MNIST model, written as that guide builds it (a ``popxl.Module``
per linear layer called with ``call_with_info``, ``softmax`` then
``nll_loss_with_softmax_grad``, grad graphs from ``transforms.autodiff`` called with
``inputs_dict``, ``scaled_add_`` SGD), trained on the package's 8x8 digits upscaled to 28x28,
must reach PyTorch's accuracy for the same model, initial weights and data order.

The model: 784 -> 32 -> 10, each layer ``gelu(x @ W + b)`` (tanh GELU, the last layer's too),
weights and biases N(0, 0.02); plain SGD at lr 0.005 on batches of 8, Mean reduction; inputs
normalised by (0.1307, 0.3081) as the guide's torchvision transform does."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import popxl
from popxl import ops, transforms

from helpers.popxl_case import Linear

BATCH, LR, EPOCHS, HIDDEN = 8, 0.005, 4, 32
MEAN, STD = 0.1307, 0.3081


def _digits() -> dict[str, np.ndarray]:
    path = Path(__file__).parents[1] / "examples" / "mnist_saturated.py"
    spec = importlib.util.spec_from_file_location("_mnist_saturated", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    d = mod.load_data()   # x [N, 1, 28, 28] in [0, 1], y int32
    return {k: ((v[:, 0] - MEAN) / STD).astype(np.float32) if k.startswith("x") else v
            for k, v in d.items()}


def _init() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = lambda *s: rng.normal(0, 0.02, s).astype(np.float32)
    return {"W0": n(784, HIDDEN), "b0": n(HIDDEN), "W1": n(HIDDEN, 10), "b1": n(10)}


def _order(n: int) -> list[np.ndarray]:
    """Each epoch's batches of sample indices (a seeded permutation, whole batches)."""
    rng = np.random.default_rng(1)
    return [rng.permutation(n)[: n // BATCH * BATCH].reshape(-1, BATCH) for _ in range(EPOCHS)]


def _train_popxl(data: dict, init: dict, order: list) -> dict[str, np.ndarray]:
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x_stream = popxl.h2d_stream([BATCH, 28, 28], popxl.float32, name="x_stream")
        y_stream = popxl.h2d_stream([BATCH], popxl.int32, name="y_stream")
        x = ops.host_load(x_stream, "x").reshape((-1, 28 * 28))
        labels = ops.host_load(y_stream, "labels")
        params = {k: popxl.variable(v, name=k) for k, v in init.items()}
        infos, layers, h = [], [], x
        for i, width in enumerate((HIDDEN, 10)):
            layer = Linear(ops.gelu)
            graph = ir.create_graph(layer, h, out_features=width)
            infos.append(ops.call_with_info(graph, h, inputs_dict={
                layer.W: params[f"W{i}"], layer.b: params[f"b{i}"]}))
            layers.append(layer)
            h = infos[-1].outputs[0]
        probs = ops.softmax(h, axis=-1)
        loss, dy = ops.nll_loss_with_softmax_grad(probs, labels)

        bwd1 = transforms.autodiff(infos[1].called_graph)
        call1 = ops.call_with_info(bwd1.graph, dy, inputs_dict=bwd1.inputs_dict(infos[1]))
        g1 = bwd1.fwd_parent_ins_to_grad_parent_outs(infos[1], call1)
        bwd0 = transforms.autodiff(infos[0].called_graph,
                                   grads_required=[layers[0].W, layers[0].b])
        gw0, gb0 = ops.call(bwd0.graph, g1[infos[0].outputs[0]], inputs_dict=bwd0.inputs_dict(infos[0]))
        grads = {"W0": gw0, "b0": gb0, "W1": g1[params["W1"]], "b1": g1[params["b1"]]}
        for k, v in params.items():
            ops.scaled_add_(v, grads[k], b=-LR)
        loss_stream = popxl.d2h_stream(loss.shape, loss.dtype, name="loss_stream")
        ops.host_store(loss_stream, loss)
    with popxl.Session(ir, "ipu_model") as sess:
        for batches in order:
            for idx in batches:
                sess.run({x_stream: data["x_train"][idx], y_stream: data["y_train"][idx]})
        trained = sess.get_tensors_data(list(params.values()))
    return {k: np.asarray(trained[v]) for k, v in params.items()}


def _train_torch(data: dict, init: dict, order: list) -> dict[str, np.ndarray]:
    import torch
    torch.manual_seed(0)
    p = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    opt = torch.optim.SGD(list(p.values()), lr=LR)
    gelu = lambda t: torch.nn.functional.gelu(t, approximate="tanh")
    for batches in order:
        for idx in batches:
            x = torch.tensor(data["x_train"][idx]).reshape(BATCH, -1)
            y = gelu(gelu(x @ p["W0"] + p["b0"]) @ p["W1"] + p["b1"])
            loss = torch.nn.functional.cross_entropy(y, torch.tensor(data["y_train"][idx]).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach().numpy() for k, v in p.items()}


def _accuracy(w: dict, x: np.ndarray, y: np.ndarray) -> float:
    """Test accuracy (%) of the model with weights ``w``, in NumPy (float64)."""
    gelu = lambda t: 0.5 * t * (1 + np.tanh(np.sqrt(2 / np.pi) * (t + 0.044715 * t ** 3)))
    h = gelu(gelu(x.reshape(len(x), -1) @ w["W0"] + w["b0"]) @ w["W1"] + w["b1"])
    return 100.0 * float(np.mean(np.argmax(h, -1) == y))


@pytest.fixture(scope="module")
def trained():
    data, init = _digits(), _init()
    order = _order(len(data["y_train"]))
    return data, _train_popxl(data, init, order), _train_torch(data, init, order)


def test_user_guide_mnist_model_learns_as_pytorch_does(trained):
    data, ours, ref = trained
    acc_ours = _accuracy(ours, data["x_test"], data["y_test"])
    acc_ref = _accuracy(ref, data["x_test"], data["y_test"])
    print(f"popxl {acc_ours:.2f}%  pytorch {acc_ref:.2f}%")
    assert acc_ref > 80, acc_ref      # the model does learn the digits in this budget
    assert abs(acc_ours - acc_ref) <= 2, (acc_ours, acc_ref)
    # the same gradients step for step: the weights agree closely, not just the accuracy
    for k in ours:
        np.testing.assert_allclose(ours[k], ref[k], rtol=0, atol=2e-3, err_msg=k)

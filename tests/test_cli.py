"""The ``popart`` command: run, demo, devices and its one-line errors."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

import popart
from popart.cli import main, sanitize

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """A PyTorch-exported MLP (input x [5, 4] -> y [5, 3]) and a Builder Add model."""
    d = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    mlp = str(d / "mlp.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, torch.randn(5, 4), mlp, input_names=["x"], output_names=["y"],
                          opset_version=11, dynamo=False)
    b = popart.Builder()
    i1 = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "a")
    i2 = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "b")
    out = b.aiOnnx.add([i1, i2])
    b.addOutputTensor(out)
    add = str(d / "add.onnx")
    b.saveModelProto(add)
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    np.save(d / "x.npy", x)
    np.save(d / "x_bad.npy", np.zeros((4, 4), np.float32))
    return {"dir": d, "mlp": mlp, "add": add, "add_out": out, "x": x, "a": i1}


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("popart: error: "), err
    return err[0]


def test_run_exported_model_with_input_and_output(models, capsys, tmp_path):
    rc = main(["run", models["mlp"], "--batches-per-step", "3", "--input",
               f"x={models['dir'] / 'x.npy'}", "--output", str(tmp_path), "--runs", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "output y: float32 [3, 5, 3]" in out and "samples/s" in out and "compile time" in out
    y = np.load(tmp_path / "y.npy")
    expected = ort.InferenceSession(models["mlp"]).run(None, {"x": models["x"]})[0]
    assert y.shape == (3, 5, 3)
    for b in range(3):  # the [5, 4] input is repeated for each of the 3 batches
        np.testing.assert_allclose(y[b], expected, rtol=1e-5, atol=1e-5)


def test_run_builder_model_random_inputs(models, capsys, tmp_path):
    rc = main(["run", models["add"], "--output", str(tmp_path / "o"), "--device", "ipumodel:1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"output {models['add_out']}: float32 [2, 3]" in out
    assert re.search(r"[\d.]+ samples/s \(batch size 2", out)
    saved = np.load(tmp_path / "o" / (sanitize(models["add_out"]) + ".npy"))
    assert saved.shape == (2, 3) and np.all(np.isfinite(saved)) and np.any(saved != 0)


def test_run_without_output_writes_nothing(models, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", models["mlp"], "-b", "2"]) == 0
    assert "output y: float32 [2, 5, 3]" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["bad_model", "missing_file", "wrong_shape", "unknown_input",
                                  "bad_device"])
def test_run_errors_are_one_line(models, capsys, case):
    d = models["dir"]
    argv = {
        "bad_model": ["run", str(d / "nope.onnx")],
        "missing_file": ["run", models["mlp"], "--input", f"x={d / 'missing.npy'}"],
        "wrong_shape": ["run", models["mlp"], "--input", f"x={d / 'x_bad.npy'}"],
        "unknown_input": ["run", models["mlp"], "--input", f"z={d / 'x.npy'}"],
        "bad_device": ["run", models["mlp"], "--device", "tpu9"],
    }[case]
    assert main(argv) == 1
    line = _error_line(capsys)
    expect = {"bad_model": "nope.onnx", "missing_file": "missing.npy", "wrong_shape": "Tensor x.",
              "unknown_input": "'z'", "bad_device": "tpu9"}[case]
    assert expect in line


def test_verbose_error_shows_traceback(models, capsys):
    assert main(["run", str(models["dir"] / "nope.onnx"), "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("popart: error: ")


def test_usage_error_returns_2(capsys):
    assert main(["run"]) == 2
    assert "usage: popart run" in capsys.readouterr().err


def test_devices_console_entry():
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-m", "popart.cli", "devices"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "enumerateDevices" in proc.stdout and "jax device 0" in proc.stdout
    assert re.search(r"id +0: 1 IPU\(s\) -> \w+:0", proc.stdout)


def test_demo_one_epoch(capsys, tmp_path):
    assert main(["demo", "--epochs", "1", "--output", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "epoch 1/1: train loss" in captured.out
    assert "train [" in captured.err  # the progress bar
    m = re.search(r"test accuracy: ([\d.]+)% .* reloaded into an InferenceSession", captured.out)
    assert m and float(m.group(1)) > 60.0, captured.out
    assert (tmp_path / "digits.onnx").stat().st_size > 1000

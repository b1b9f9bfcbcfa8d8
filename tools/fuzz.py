"""Fuzz the ONNX importer, the sessions and the CLI with mutated models.

    python tools/fuzz.py --count 1000 [--seed 0] [--jobs 2] [--timeout 120] [--json FILE]

Mutants of the bench models (bench/bench_models.py at the sizes of tests/models.py) and of
small hand-written models (gather / scatter, control flow, shapes) -- attributes, dtypes,
shapes, dangling names, cycles, truncated bytes, wrong opsets, deleted inputs, duplicated
outputs, ... -- are deterministic by seed. Each runs through ``popart.Builder``, an
``InferenceSession`` and ``popart run`` (in-process, ``popart.cli.main``) in a worker process
with a time limit, so hangs and crashes are counted, and through onnxruntime. Outcomes:

    ran       popart ran it (and, where onnxruntime ran it too, the outputs agree)
    clean     popart raised popart_exception (the CLI printed ``popart: error:``)
    raw       an exception other than popart_exception left the package (a bug)
    mismatch  popart and onnxruntime both ran it and the outputs differ (a bug)
    crash     the worker process died
    hang      the mutant took longer than --timeout seconds

The exit status is 1 when any mutant is raw, mismatch, crash or hang.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = ("raw", "mismatch", "crash", "hang")
RTOL = 1e-3


# --------------------------------------------------------------------------- base models
def _graph_model(nodes, inputs, outputs, inits=(), opset=13) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def _vi(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def small_models() -> dict[str, bytes]:
    """Hand-written models: every gather / scatter op, control flow, shape ops."""
    F, I = TensorProto.FLOAT, TensorProto.INT64
    x = _vi("x", F, [4, 5])
    y = _vi("y", F, None)
    c = lambda name, v: numpy_helper.from_array(np.asarray(v), name)
    m = {}
    m["gather"] = _graph_model(
        [helper.make_node("Gather", ["x", "i"], ["g"], axis=1),
         helper.make_node("Gather", ["x", "k"], ["h"], axis=0),
         helper.make_node("ReduceSum", ["h"], ["s"], keepdims=1),
         helper.make_node("Add", ["g", "s"], ["y"])],
        [x, _vi("i", I, [2])], [y], [c("k", np.array([3, -1], np.int64))])
    m["gather_elements"] = _graph_model(
        [helper.make_node("GatherElements", ["x", "i"], ["y"], axis=1)],
        [x, _vi("i", I, [4, 2])], [y])
    m["gather_nd"] = _graph_model(
        [helper.make_node("GatherND", ["x", "i"], ["y"])], [x, _vi("i", I, [3, 2])], [y])
    m["scatter_elements"] = _graph_model(
        [helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=0, reduction="add")],
        [x, _vi("i", I, [2, 5]), _vi("u", F, [2, 5])], [y], opset=16)
    m["scatter_nd"] = _graph_model(
        [helper.make_node("ScatterND", ["x", "i", "u"], ["y"])],
        [x, _vi("i", I, [2, 1]), _vi("u", F, [2, 5])], [y])
    m["shapes"] = _graph_model(
        [helper.make_node("Shape", ["x"], ["sh"]),
         helper.make_node("Gather", ["sh", "zero"], ["n"], axis=0),
         helper.make_node("Concat", ["n", "m1"], ["newshape"], axis=0),
         helper.make_node("Reshape", ["x", "newshape"], ["r"]),
         helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
         helper.make_node("Slice", ["t", "st", "en", "ax"], ["sl"]),
         helper.make_node("Unsqueeze", ["sl", "ax"], ["u"]),
         helper.make_node("Softmax", ["u"], ["y"], axis=-1)],
        [x], [y], [c("zero", np.array([0], np.int64)), c("m1", np.array([-1], np.int64)),
                   c("st", np.array([1], np.int64)), c("en", np.array([4], np.int64)),
                   c("ax", np.array([0], np.int64))])
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["a"])], "then", [], [_vi("a", F, [4, 5])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["b"])], "else", [], [_vi("b", F, [4, 5])])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Add", ["acc", "x"], ["acc_out"]),
         helper.make_node("Gather", ["acc_out", "ii"], ["row"], axis=0)],
        "body", [_vi("ii", I, []), _vi("cond", TensorProto.BOOL, []), _vi("acc", F, [4, 5])],
        [_vi("cond_out", TensorProto.BOOL, []), _vi("acc_out", F, [4, 5]), _vi("row", F, [5])])
    m["control"] = _graph_model(
        [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
         helper.make_node("Greater", ["s", "zf"], ["p"]),
         helper.make_node("If", ["p"], ["z"], then_branch=then, else_branch=other),
         helper.make_node("Loop", ["trips", "", "z"], ["acc", "rows"], body=body),
         helper.make_node("ReduceMean", ["rows"], ["rm"], axes=[0], keepdims=0),
         helper.make_node("Add", ["acc", "rm"], ["y"])],
        [x], [y], [c("zf", np.float32(0)), c("trips", np.int64(3))])
    m["conv"] = _graph_model(
        [helper.make_node("Conv", ["img", "w", "b"], ["cv"], pads=[1, 1, 1, 1]),
         helper.make_node("MaxPool", ["cv"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
         helper.make_node("Flatten", ["mp"], ["fl"]),
         helper.make_node("MatMul", ["fl", "w2"], ["mm"]),
         helper.make_node("TopK", ["mm", "k"], ["y", "idx"], axis=-1)],
        [_vi("img", F, [2, 3, 6, 6])], [y, _vi("idx", I, None)],
        [c("w", np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)),
         c("b", np.zeros(4, np.float32)),
         c("w2", np.random.default_rng(1).standard_normal((36, 6)).astype(np.float32)),
         c("k", np.array([3], np.int64))])
    return m


def bench_models(cache: str) -> dict[str, bytes]:
    """The bench models at test sizes (tests/models.py), exported once into ``cache``."""
    out = {}
    for name in ("mlp", "cnn", "transformer"):
        path = os.path.join(cache, f"{name}.onnx")
        if not os.path.exists(path):
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            import models  # tests/models.py (needs torch)
            data = models.make(name, 2)[1]
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
        with open(path, "rb") as f:
            out[name] = f.read()
    return out


def base_models(cache: Optional[str] = None, bench: bool = True) -> dict[str, bytes]:
    cache = cache or os.path.join(tempfile.gettempdir(), "popart-fuzz-corpus")
    os.makedirs(cache, exist_ok=True)
    models = small_models()
    if bench:
        models.update(bench_models(cache))
    return models


# --------------------------------------------------------------------------- mutations
INT_VALUES = [-(2 ** 40), -100, -7, -3, -2, -1, 0, 1, 2, 3, 5, 9, 100, 2 ** 40]
ELEM_TYPES = [TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16,
              TensorProto.INT8, TensorProto.UINT8, TensorProto.INT32, TensorProto.INT64,
              TensorProto.BOOL, TensorProto.STRING, TensorProto.COMPLEX64, 0, 99]
OPS = ["Relu", "Add", "MatMul", "Gather", "Reshape", "Concat", "Foo", "Conv", "Softmax",
       "Transpose", "ScatterND", "Identity", "Cast", "Slice", "If", "Split", "Where"]


def _all_graphs(g: onnx.GraphProto) -> list:
    out = [g]
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                out += _all_graphs(a.g)
    return out


def _nodes(m: onnx.ModelProto) -> list:
    return [n for g in _all_graphs(m.graph) for n in g.node]


def _names(m: onnx.ModelProto) -> list[str]:
    g = m.graph
    return ([v.name for v in g.input] + [t.name for t in g.initializer]
            + [o for n in g.node for o in n.output if o])


def mut_attr_value(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    cands = [(n, a) for n in _nodes(m) for a in n.attribute
             if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS,
                           onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING)]
    if not cands:
        return None
    n, a = r.choice(cands)
    if a.type == onnx.AttributeProto.INT:
        a.i = r.choice(INT_VALUES)
    elif a.type == onnx.AttributeProto.INTS:
        vals = list(a.ints)
        op = r.choice(["set", "drop", "append"]) if vals else "append"
        if op == "set":
            vals[r.randrange(len(vals))] = r.choice(INT_VALUES)
        elif op == "drop":
            vals.pop(r.randrange(len(vals)))
        else:
            vals.append(r.choice(INT_VALUES))
        del a.ints[:]
        a.ints.extend(vals)
    elif a.type == onnx.AttributeProto.FLOAT:
        a.f = r.choice([0.0, -1.0, 1e30, float("nan"), float("inf"), 0.5])
    else:
        a.s = r.choice([b"", b"bogus", b"NOTSET", b"add", b"max", b"linear"])
    return f"{n.op_type}.{a.name}"


def mut_attr_type(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    cands = [(n, a) for n in _nodes(m) for a in n.attribute if a.type != onnx.AttributeProto.GRAPH]
    if not cands:
        return None
    n, a = r.choice(cands)
    new = r.choice([helper.make_attribute(a.name, 1.5), helper.make_attribute(a.name, "x"),
                    helper.make_attribute(a.name, [1, 2]), helper.make_attribute(a.name, 3)])
    a.CopyFrom(new)
    return f"{n.op_type}.{a.name}"


def mut_attr_delete_add(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    n = r.choice(_nodes(m))
    if n.attribute and r.random() < 0.5:
        a = n.attribute[r.randrange(len(n.attribute))]
        n.attribute.remove(a)
        return f"{n.op_type} -{a.name}"
    name = r.choice(["axis", "bogus", "keepdims", "perm", "to", "mode"])
    n.attribute.append(helper.make_attribute(name, r.choice([0, 1, -1, 7])))
    return f"{n.op_type} +{name}"


def mut_dtype(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    g = m.graph
    if g.initializer and r.random() < 0.4:
        t = r.choice(list(g.initializer))
        t.data_type = r.choice(ELEM_TYPES)
        return f"initializer {t.name}"
    vs = list(g.input) + list(g.output)
    v = r.choice(vs)
    v.type.tensor_type.elem_type = r.choice(ELEM_TYPES)
    return f"value {v.name}"


def mut_shape(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    g = m.graph
    if g.initializer and r.random() < 0.4:
        t = r.choice(list(g.initializer))
        dims = list(t.dims)
        if dims and r.random() < 0.7:
            dims[r.randrange(len(dims))] = r.choice([0, 1, 3, 1000, -1])
        else:
            dims.append(2)
        del t.dims[:]
        t.dims.extend(dims)
        return f"initializer {t.name}"
    v = r.choice(list(g.input))
    shape = v.type.tensor_type.shape
    op = r.choice(["dim", "drop", "add", "param", "none"])
    if op == "dim" and shape.dim:
        shape.dim[r.randrange(len(shape.dim))].dim_value = r.choice([0, 1, 3, 7, 10 ** 9])
    elif op == "drop" and shape.dim:
        del shape.dim[r.randrange(len(shape.dim))]
    elif op == "param" and shape.dim:
        shape.dim[r.randrange(len(shape.dim))].dim_param = "N"
    elif op == "none":
        v.type.tensor_type.ClearField("shape")
    else:
        shape.dim.add().dim_value = 2
    return f"input {v.name} {op}"


def mut_dangling(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    if r.random() < 0.3:
        o = r.choice(list(m.graph.output))
        o.name = "missing_" + o.name
        return "graph output"
    n = r.choice([n for n in _nodes(m) if n.input] or [None])
    if n is None:
        return None
    k = r.randrange(len(n.input))
    n.input[k] = "dangling_" + str(k)
    return f"{n.op_type} input {k}"


def mut_cycle(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    nodes = list(m.graph.node)
    if len(nodes) < 2:
        return None
    i = r.randrange(len(nodes) - 1)
    later = r.choice(nodes[i:])
    src = nodes[i]
    if not src.input or not later.output:
        return None
    src.input[r.randrange(len(src.input))] = later.output[0]
    return f"{src.op_type} <- {later.op_type}"


def mut_reorder(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    nodes = list(m.graph.node)
    r.shuffle(nodes)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return "shuffled nodes"


def mut_opset(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    op = r.choice(["version", "version", "remove", "domain", "ir"])
    if op == "version":
        v = r.choice([1, 5, 7, 9, 10, 12, 14, 17, 21, 100])
        for o in m.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = v
        return f"opset {v}"
    if op == "remove":
        del m.opset_import[:]
        return "no opset_import"
    if op == "domain":
        n = r.choice(_nodes(m))
        n.domain = r.choice(["ai.graphcore", "com.bogus", "ai.onnx.ml"])
        return f"{n.op_type} domain {n.domain}"
    m.ir_version = r.choice([0, 1, 3, 100])
    return f"ir_version {m.ir_version}"


def mut_delete_input(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    if r.random() < 0.3 and m.graph.input:
        v = m.graph.input[r.randrange(len(m.graph.input))]
        m.graph.input.remove(v)
        return f"graph input {v.name}"
    n = r.choice([n for n in _nodes(m) if n.input] or [None])
    if n is None:
        return None
    k = r.randrange(len(n.input))
    del n.input[k]
    return f"{n.op_type} input {k}"


def mut_extra_input(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    n = r.choice(_nodes(m))
    names = _names(m)
    if r.random() < 0.5 and len(n.input) >= 2:
        i, j = r.sample(range(len(n.input)), 2)
        n.input[i], n.input[j] = n.input[j], n.input[i]
        return f"{n.op_type} swapped inputs"
    n.input.append(r.choice(names))
    return f"{n.op_type} extra input"


def mut_dup_output(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    nodes = list(m.graph.node)
    if r.random() < 0.3 or len(nodes) < 2:
        m.graph.output.append(m.graph.output[0])
        return "graph output twice"
    a, b = r.sample(nodes, 2)
    if not a.output or not b.output:
        return None
    b.output[0] = a.output[0]
    return f"{b.op_type} writes {a.op_type}'s output"


def mut_delete_node(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    n = m.graph.node[r.randrange(len(m.graph.node))]
    m.graph.node.remove(n)
    return n.op_type


def mut_op_type(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    n = r.choice(_nodes(m))
    old, n.op_type = n.op_type, r.choice(OPS)
    return f"{old} -> {n.op_type}"


def mut_indices(r: random.Random, m: onnx.ModelProto) -> Optional[str]:
    """Out-of-range constant indices or index feeds (see ``make_feeds``' ``index_range``)."""
    ints = [t for t in m.graph.initializer if t.data_type == TensorProto.INT64 and 0 < np.prod(t.dims) <= 8]
    if ints and r.random() < 0.5:
        t = r.choice(ints)
        a = numpy_helper.to_array(t).copy()
        a.reshape(-1)[r.randrange(a.size)] = r.choice([-100, -9, 9, 100, 2 ** 40])
        t.CopyFrom(numpy_helper.from_array(a, t.name))
        return f"constant {t.name}"
    return "index feeds"


MUTATORS: dict[str, Callable] = {
    "attr_value": mut_attr_value, "attr_type": mut_attr_type, "attr_delete_add": mut_attr_delete_add,
    "dtype": mut_dtype, "shape": mut_shape, "dangling": mut_dangling, "cycle": mut_cycle,
    "reorder": mut_reorder, "opset": mut_opset, "delete_input": mut_delete_input,
    "extra_input": mut_extra_input, "dup_output": mut_dup_output, "delete_node": mut_delete_node,
    "op_type": mut_op_type, "indices": mut_indices, "truncate": None, "bitflip": None,
    "two": None,   # two of the model mutations above
}


def mutant(seed: int, index: int, models: dict[str, bytes]) -> tuple[str, str, str, bytes, int]:
    """(base model, kind, description, bytes, feed seed) of mutant ``index``."""
    r = random.Random(seed * 1_000_003 + index)
    base = r.choice(sorted(models))
    data = models[base]
    for _ in range(20):
        kind = r.choice(sorted(MUTATORS))
        if kind == "truncate":
            cut = r.randrange(1, len(data))
            return base, kind, f"{cut}/{len(data)} bytes", data[:cut], r.randrange(2 ** 31)
        if kind == "bitflip":
            b = bytearray(data)
            for _ in range(r.randint(1, 8)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
            return base, kind, "bytes flipped", bytes(b), r.randrange(2 ** 31)
        m = onnx.ModelProto.FromString(data)
        picks = r.sample([k for k, f in sorted(MUTATORS.items()) if f], 2) if kind == "two" else [kind]
        try:
            descs = [MUTATORS[k](r, m) for k in picks]
        except (IndexError, ValueError):   # e.g. nothing left to mutate
            continue
        desc = None if None in descs else "; ".join(
            f"{k}: {d}" if kind == "two" else d for k, d in zip(picks, descs))
        if desc is not None:
            return base, kind, desc, m.SerializeToString(), r.randrange(2 ** 31)
    return base, "none", "", data, 0


def make_feeds(data: bytes, seed: int, index_range: bool) -> dict[str, np.ndarray]:
    """Random data for the declared graph inputs (unknown dimensions: 2); integer inputs are
    small indices, or with ``index_range`` sometimes out of range."""
    r = np.random.default_rng(seed)
    try:
        m = onnx.ModelProto.FromString(data)
    except Exception:
        return {}
    inits = {t.name for t in m.graph.initializer}
    feeds = {}
    for v in m.graph.input:
        if v.name in inits or not v.name:
            continue
        tt = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") and 0 <= d.dim_value < 1000 else 2
                 for d in tt.shape.dim]
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        except Exception:
            dtype = np.dtype(np.float32)
        if dtype.kind == "f":
            a = r.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            hi = 12 if index_range and r.random() < 0.5 else 2
            a = r.integers(-hi if dtype.kind == "i" and index_range else 0, hi + 1, shape).astype(dtype)
        elif dtype.kind == "b":
            a = r.random(shape) < 0.5
        else:
            a = np.zeros(shape, np.float32)
        feeds[v.name] = a
    return feeds


# --------------------------------------------------------------------------- evaluation
def _attempt(fn: Callable[[], Any]) -> tuple[str, Any]:
    import popart
    try:
        return "ok", fn()
    except popart.popart_exception as e:
        return "clean", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)
                      if "popart" in f.filename or "popxl" in f.filename), "?")
        return "raw", f"{type(e).__name__} at {where}: {' '.join(str(e).split())[:300]}"


def _session_outputs(data: bytes, feeds: dict) -> dict[str, np.ndarray]:
    import popart
    builder = popart.Builder(modelProtoOrFilename=data)   # the Builder reads it too
    outs = builder.getOutputTensorIds()
    info = popart.InputShapeInfo()   # for inputs with unknown dimensions, as the CLI does
    for v in onnx.ModelProto.FromString(data).graph.input:
        dims = v.type.tensor_type.shape.dim
        if v.name in feeds and (not v.type.tensor_type.HasField("shape")
                                or any(not d.HasField("dim_value") for d in dims)):
            info.add(v.name, popart.TensorInfo(feeds[v.name]))
    flow = popart.DataFlow(1, {o: popart.AnchorReturnType("ALL") for o in outs})
    s = popart.InferenceSession(data, flow, popart.DeviceManager().createCpuDevice(),
                                inputShapeInfo=info)
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO(dict(feeds), anchors))
    return {o: np.asarray(anchors[o]) for o in outs}


def _ort_outputs(data: bytes, feeds: dict) -> Optional[list]:
    import onnxruntime as ort
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        sess = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        return dict(zip(names, sess.run(None, feeds)))
    except Exception:
        return None


def _reference_outputs(data: bytes, feeds: dict) -> Optional[dict]:
    try:
        from onnx.reference import ReferenceEvaluator
        ref = ReferenceEvaluator(onnx.ModelProto.FromString(data))
        return dict(zip(ref.output_names, ref.run(None, feeds)))
    except Exception:
        return None


def _cli(data: bytes, feeds: dict) -> tuple[str, str]:
    from popart import cli
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.onnx")
        with open(path, "wb") as f:
            f.write(data)
        args = ["run", path, "--runs", "1"]
        for k, (name, v) in enumerate(feeds.items()):
            np.save(os.path.join(d, f"{k}.npy"), v)
            args += ["--input", f"{name}={os.path.join(d, f'{k}.npy')}"]
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                code = cli.main(args)
            except BaseException as e:   # cli.main must not raise
                return "raw", f"cli.main raised {type(e).__name__}: {e}"
    text = " ".join(err.getvalue().split())[:300]
    if code == 0:
        return "ok", ""
    if code == 1 and text.startswith("popart: error:"):
        return "clean", text
    return "raw", f"exit {code}: {text}"


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "fc":
        a64, b64 = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64), b.astype(
            np.complex128 if b.dtype.kind == "c" else np.float64)
        finite = np.isfinite(b64)
        scale = max(1.0, float(np.max(np.abs(b64[finite]), initial=0)))
        return bool(np.array_equal(np.isnan(a64), np.isnan(b64)) and np.allclose(
            a64[finite], b64[finite], rtol=RTOL, atol=1e-4 * scale)) and bool(
            np.array_equal(a64[~finite & ~np.isnan(b64)], b64[~finite & ~np.isnan(b64)]))
    return bool(np.array_equal(a, b))


def evaluate(data: bytes, feeds: dict, cli: bool = True) -> dict:
    """Run one mutant every way; returns its outcome and details."""
    res: dict[str, Any] = {}
    status, val = _attempt(lambda: _session_outputs(data, feeds))
    ort = _ort_outputs(data, feeds)
    res["ort"] = ort is not None
    res["popart"] = status if status != "ok" else "ok"
    res["detail"] = val if status != "ok" else ""
    if cli:
        res["cli"], cli_detail = _cli(data, feeds)
        if res["cli"] == "raw":
            res["detail"] = "CLI: " + cli_detail
    if status == "raw" or res.get("cli") == "raw":
        res["outcome"] = "raw"
    elif status == "ok":
        diff = [k for k in val if ort is not None and (k not in ort or not _same(val[k], ort[k]))]
        res["outcome"] = "mismatch" if diff else "ran"
        if diff:   # the ONNX reference implementation decides (onnxruntime deviates at times)
            ref = _reference_outputs(data, feeds)
            if ref is not None and all(k in ref and _same(val[k], ref[k]) for k in diff):
                res["outcome"], res["ort_deviates"] = "ran", True
                res["detail"] = f"outputs {diff}: onnxruntime's differ from the ONNX reference's, ours agree"
            elif any(np.asarray(v).dtype.kind == "f" and not np.isfinite(v).all() for v in ort.values()):
                res["outcome"], res["overflow"] = "ran", True   # inf - inf: order-dependent
                res["detail"] = f"outputs {diff} differ where onnxruntime computes inf / NaN"
            else:
                res["detail"] = f"outputs {diff} differ from onnxruntime's"
    else:
        res["outcome"] = "clean"
    return res


# --------------------------------------------------------------------------- workers
def _worker(conn: Any, log: str, memory: int) -> None:
    """Evaluate mutants sent over ``conn``; stderr goes to ``log`` (its tail explains a
    crash), memory is limited to ``memory`` bytes (a mutant that needs more fails inside)."""
    import resource
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import popart  # noqa: F401  (imported once, before the first mutant's clock starts)
    import onnxruntime  # noqa: F401
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        data, feeds, cli = job
        conn.send(evaluate(data, feeds, cli))


class Pool:
    """Worker processes evaluating one mutant at a time each, restarted after a crash or a
    hang."""

    def __init__(self, jobs: int, timeout: float, memory: int):
        self.ctx = mp.get_context("spawn")
        self.timeout, self.memory = timeout, memory
        self.workers: list = [None] * jobs
        self.logs = tempfile.mkdtemp(prefix="popart-fuzz-")

    def _log_tail(self, k: int) -> str:
        with open(os.path.join(self.logs, f"worker{k}.log"), errors="replace") as f:
            return " ".join(f.read()[-400:].split())

    def _start(self, k: int) -> Any:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, daemon=True, args=(
            child, os.path.join(self.logs, f"worker{k}.log"), self.memory))
        p.start()
        if not parent.poll(300) or parent.recv() != "ready":
            raise RuntimeError("fuzz worker did not start")
        self.workers[k] = (p, parent)
        return self.workers[k]

    def _stop(self, k: int) -> None:
        p, conn = self.workers[k]
        p.kill()
        p.join()
        self.workers[k] = None

    def run(self, items: list, on_result: Callable[[int, dict], None]) -> None:
        todo = list(enumerate(items))
        busy: dict[int, tuple] = {}   # worker -> (item index, started)
        while todo or busy:
            for k in range(len(self.workers)):
                if k not in busy and todo:
                    p, conn = self.workers[k] or self._start(k)
                    i, (data, feeds, cli) = todo.pop(0)
                    conn.send((data, feeds, cli))
                    busy[k] = (i, time.monotonic())
            for k, (i, t0) in list(busy.items()):
                p, conn = self.workers[k]
                try:
                    ready = conn.poll(0.05)
                    res = conn.recv() if ready else None
                except (EOFError, OSError):
                    res = {"outcome": "crash"}
                if res is None and not p.is_alive():
                    res = {"outcome": "crash"}
                if res is None and time.monotonic() - t0 > self.timeout:
                    res = {"outcome": "hang"}
                if res is None:
                    continue
                if res["outcome"] in ("crash", "hang"):
                    self._stop(k)
                    res["detail"] = (f"worker exit code {p.exitcode}: {self._log_tail(k)}"
                                     if res["outcome"] == "crash" else f"over {self.timeout:.0f} s")
                res["seconds"] = round(time.monotonic() - t0, 2)
                del busy[k]
                on_result(i, res)

    def close(self) -> None:
        for k, w in enumerate(self.workers):
            if w is not None:
                try:
                    w[1].send(None)
                except OSError:
                    pass
                w[0].join(5)
                if w[0].is_alive():
                    self._stop(k)


def fuzz(count: int, seed: int = 0, jobs: int = 2, timeout: float = 120.0, cli: bool = True,
         bench: bool = True, memory_gb: float = 6.0,
         log: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Generate and evaluate ``count`` mutants; returns one record per mutant."""
    models = base_models(bench=bench)
    records, items = [], []
    for i in range(count):
        base, kind, desc, data, fseed = mutant(seed, i, models)
        feeds = make_feeds(data, fseed, index_range="indices" in kind + desc)
        records.append({"index": i, "base": base, "kind": kind, "mutation": desc})
        items.append((data, feeds, cli))

    def done(i: int, res: dict) -> None:
        records[i].update(res)
        if log and (res["outcome"] in BAD or os.environ.get("FUZZ_VERBOSE")):
            r = records[i]
            log(f"[{i}] {r['outcome']}: {r['base']} {r['kind']} ({r['mutation']}): {r.get('detail', '')}")

    pool = Pool(jobs, timeout, int(memory_gb * (1 << 30)))
    try:
        pool.run(items, done)
    finally:
        pool.close()
    return records


def summary(records: list[dict]) -> str:
    by_outcome = collections.Counter(r["outcome"] for r in records)
    lines = [f"{len(records)} mutants: " + ", ".join(
        f"{k} {by_outcome.get(k, 0)}" for k in ("ran", "clean", "raw", "mismatch", "crash", "hang"))]
    ran = [r for r in records if r["outcome"] == "ran"]
    clean = [r for r in records if r["outcome"] == "clean"]
    deviates = sum(bool(r.get("ort_deviates")) for r in ran)
    overflow = sum(bool(r.get("overflow")) for r in ran)
    lines.append(f"  ran: {sum(r['ort'] for r in ran) - deviates - overflow} also run by "
                 f"onnxruntime (same outputs), {deviates} where onnxruntime's outputs differ from "
                 f"the ONNX reference's and ours agree with it, {overflow} where both overflow "
                 f"to inf / NaN and differ there, {sum(not r['ort'] for r in ran)} rejected by "
                 f"onnxruntime")
    lines.append(f"  clean: {sum(not r['ort'] for r in clean)} rejected by onnxruntime too, "
                 f"{sum(r['ort'] for r in clean)} run by onnxruntime")
    lines.append("  by mutation kind (ran / clean / bad):")
    kinds = collections.defaultdict(collections.Counter)
    for r in records:
        kinds[r["kind"]][r["outcome"] if r["outcome"] in ("ran", "clean") else "bad"] += 1
    for k in sorted(kinds):
        c = kinds[k]
        lines.append(f"    {k:16s} {c['ran']:4d} {c['clean']:5d} {c['bad']:4d}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant")
    p.add_argument("--memory", type=float, default=6.0, help="GiB of address space per worker")
    p.add_argument("--no-cli", action="store_true", help="skip `popart run`")
    p.add_argument("--no-bench", action="store_true", help="only the small hand-written models")
    p.add_argument("--json", help="write every mutant's record to this file")
    args = p.parse_args(argv)
    t0 = time.time()
    records = fuzz(args.count, args.seed, args.jobs, args.timeout, not args.no_cli,
                   not args.no_bench, args.memory, log=lambda s: print(s, flush=True))
    print(summary(records))
    print(f"({time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return int(any(r["outcome"] in BAD for r in records))


if __name__ == "__main__":
    sys.exit(main())

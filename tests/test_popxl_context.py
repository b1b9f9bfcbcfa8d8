"""popxl.context and popxl.tensor as PopXL defines them (python/popxl/python_files/context.py,
tensor.py, utils.py): name scopes in tensor / op names, per-op debug info, the Context
object, variables from np.memmap, TensorSpec as a mapping, Tensor's reflected operators."""
import json
import logging
import os
import re
import sys

import numpy as np
import pytest

import popart
import popxl
import popxl.context as pctx
import popxl.tensor as ptensor
from popxl import ops

HERE = os.path.realpath(__file__)


def _line(offset: int = 0) -> int:
    """The caller's line number plus ``offset``."""
    return sys._getframe(1).f_lineno + offset


# ---------------------------------------------------------------------- names
def test_name_scopes_in_tensor_and_op_names():
    ir = popxl.Ir()
    with ir.main_graph:
        with popxl.name_scope("foo") as scopes:
            assert scopes == ["foo"]
            v = popxl.variable(np.ones(2, np.float32), name="bar")
            with popxl.name_scope("inner"):
                assert pctx.get_current_context().name_scopes == ["foo", "inner"]
                w = v + 1.0
            v2 = popxl.variable(np.ones(2, np.float32), name="bar")
        c = popxl.constant(1.0)
    # PopXL: the id of a main-graph tensor is its name, name scopes included
    assert (v.id, v.name) == ("foo/bar", "foo/bar")
    assert w.id == w.name and w.id.startswith("foo/inner/")
    assert re.fullmatch(r"foo/bar__t\d+", v2.id)          # PopART's createIntermediateTensorId
    assert c.id == "t"                                     # the default name
    node = ir.main_graph._g.nodes[-1]
    assert node.op_type == "Add" and node.name == "foo/inner/add"

    def body(x):
        with popxl.name_scope("s"):
            return x * 2.0

    g = ir.create_graph(body, v)
    x, y = g.inputs[0], g.outputs[0]
    # a subgraph's tensors carry the graph's scope in the id, not in the name
    assert (x.id, x.name, x.scope) == (f"{g.id}/x", "x", g.id)
    assert y.id == f"{g.id}/{y.name}" and y.name.startswith("s/")
    assert g._g.nodes[0].name == "s/mul"
    with g:
        assert g._create_tensor_id("z") == f"{g.id}/z"
        assert g._create_tensor_id() == f"{g.id}/t"
        assert re.fullmatch(rf"{g.id}/x__t\d+", g._create_tensor_id("x"))
    with ir.main_graph, popxl.name_scope("a"):
        assert ir.main_graph._create_tensor_id("q") == "a/q"


def test_per_op_debug_info_and_op_debug_context(tmp_path):
    path = str(tmp_path / "debug.json")
    popart.initializePoplarDebugInfo(path, "json")
    ir = popxl.Ir()

    @popxl.context.op_debug_context("layer")
    def layer(t):
        return ops.relu(t)

    @popxl.context.debug_context_frame_offset(1)
    def helper(t):
        return t * 3.0          # recorded at the caller's line, as PopXL does

    try:
        with ir.main_graph, popxl.name_scope("foo"):
            v = popxl.variable(np.ones(2, np.float32), name="v")
            s, add_line = v + 2.0, _line()
            r, layer_line = layer(s), _line()
            m, helper_line = helper(r), _line()
    finally:
        popart.closePoplarDebugInfo()
    doc = json.load(open(path))
    st = doc["stringTable"]
    recs = [{**c, "name": st[c["name"]], "file": st[c["location"]["fileName"]],
             "line": c["location"]["lineNumber"]} for c in doc["contexts"] if c["layer"] == "popxl"]
    by_name = {r["name"]: r for r in recs}
    add = by_name["foo/add"]
    const_id = ir.main_graph._g.nodes[0].inputs[1]
    assert (add["category"], add["api"]) == ("op", "add")
    assert add["inputs"] == [v.id, const_id] and add["outputs"] == [s.id]
    assert (add["file"], add["line"]) == (HERE, add_line)
    lay = by_name["foo/layer"]                              # the decorated function's record
    assert lay["api"] == "layer" and lay["inputs"] == [s.id] and lay["outputs"] == [r.id]
    assert (lay["file"], lay["line"]) == (HERE, layer_line)
    assert by_name["foo/relu"]["outputs"] == [r.id]
    assert by_name["foo/mul"]["line"] == helper_line
    assert ir.main_graph._g.nodes[-2].annotations["__debug_context"] == "foo/layer"


def test_get_source_location():
    loc, line = pctx.get_source_location(0), _line()
    assert (loc.getFunctionName(), loc.getFileName(), loc.getLineNumber()) == \
        ("test_get_source_location", HERE, line)
    with pytest.raises(IndexError, match="Incorrect source location offset"):
        pctx.get_source_location(10 ** 6)


# ---------------------------------------------------------------------- Context
def test_context_members():
    ctx = pctx.get_current_context()
    assert isinstance(ctx, pctx.Context) and ctx is pctx.get_current_context()
    for what, get in (("a graph", lambda: ctx.graph), ("the main_graph", lambda: ctx.main_graph),
                      ("the ir", lambda: ctx.ir)):
        with pytest.raises(RuntimeError, match=f"Trying to access {what}, but no graph has been "
                                               f"selected"):
            get()
    ir = popxl.Ir()
    sub = ir.create_empty_graph("sub")
    with ir.main_graph, sub:
        assert (ctx.graph, ctx.main_graph, ctx.ir) == (sub, ir.main_graph, ir)
        assert ctx.ipu_id == 0 and not ctx.io_tile_set and ctx.in_sequence is None
        with popxl.ipu(2), popxl.io_tiles():
            assert ctx.ipu_id == 2 and ctx.io_tile_set
        with popxl.in_sequence(False):
            assert ctx.in_sequence is False
            with popxl.in_sequence("pass"):
                assert ctx.in_sequence is None
        assert ctx.ipu_id == 0 and ctx.in_sequence is None
        with pytest.raises(AttributeError, match="Cannot delete in_sequence"):
            del ctx.in_sequence
        ctx.push_name_scope("n")
        assert ctx.name_scopes == ["n"] and ctx.pop_name_scope() == "n"
        # a graph of another Ir cannot be entered inside this Ir's
        other = popxl.Ir()
        with pytest.raises(RuntimeError, match="Trying to a create a context manager nested in "
                                               "another context, when the previous context's "
                                               "Ir is different"):
            with other.main_graph:
                pass
        assert ctx.graph is sub
        popped = ctx.pop_graph()
        assert popped is sub and ctx.graph is ir.main_graph
        ctx.push_graph(sub)
    # hooks of the context see ops of every graph; a graph's only its own
    seen, main_only = [], []
    h = ctx.register_op_created_hook(lambda n: seen.append(n.op_type))
    hg = ir.main_graph.register_op_created_hook(lambda n: main_only.append(n.op_type))
    with ir.main_graph:
        a = popxl.constant(np.ones(2, np.float32))
        ops.relu(a)
    with sub:
        ops.negate(popxl.graph_input((2,), popxl.float32))
    ctx.remove_op_created_hook(h)
    ir.main_graph.remove_op_created_hook(hg)
    with pytest.raises(ValueError, match=f"Unknown op created hook {h}"):
        ctx.remove_op_created_hook(h)
    assert seen == ["Relu", "Neg"] and main_only == ["Relu"]
    assert pctx.InSequenceKey is not None and pctx.Fn is not None


def test_create_graph_output_must_be_tensors():
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(ValueError, match=re.escape(
                "Output of subgraph must be None, a Tensor or an iterable of Tensors. Output "
                "type: <class 'int'>. Value 3")):
            ir.create_graph(lambda x: 3, popxl.TensorSpec((2,), popxl.float32))
        with pytest.raises(ValueError, match="Output type: <class 'list'>"):
            ir.create_graph(lambda x: [x, 1], popxl.TensorSpec((2,), popxl.float32))


# ---------------------------------------------------------------------- popxl.tensor names
def test_tensor_module_names_and_tensorspec_mapping():
    import torch
    assert isinstance(np.zeros(2), ptensor.host_tensor_types)
    assert isinstance([1, 2], ptensor.host_tensor_types)
    assert torch.Tensor in ptensor.host_tensor_types
    assert ptensor.TILE_SET_MAP[popxl.TileSet.IO] == "io"
    assert set(ptensor.TILE_SET_MAP.values()) == {"compute", "io", "undefined"}
    assert ptensor.ScalarType and ptensor.HostTensor and ptensor.HostScalarTensor
    spec = popxl.TensorSpec((2, 3), popxl.float16, (6,))
    assert spec.to_dict() == {"shape": (2, 3), "dtype": popxl.float16, "meta_shape": (6,)}
    assert list(spec) == ["shape", "dtype", "meta_shape"] and len(spec) == 3
    assert spec["dtype"] == popxl.float16 and dict(**spec)["shape"] == (2, 3)
    ir = popxl.Ir()
    with ir.create_empty_graph("g"):
        t = popxl.graph_input(**spec)
        assert (t.shape, t.dtype, t.meta_shape) == ((2, 3), popxl.float16, (6,))


def test_tensor_reflected_operators_and_protocols():
    ir = popxl.Ir()
    main = ir.main_graph
    with main:
        x = popxl.variable(np.array([5.0, -7.0], np.float32), name="x")
        b = popxl.variable(np.array([True, False]), name="b")
        for expr, op_type in ((lambda: 3.0 % x, "Fmod"), (lambda: True & b, "And"),
                              (lambda: False | b, "Or")):
            out = expr()
            node = main._g.nodes[-1]
            # the literal is the first operand (PopXL: ops.fmod(other, self), ...)
            assert node.op_type == op_type and node.inputs[1] == (x if op_type == "Fmod" else b).id
            assert node.inputs[0] != node.inputs[1] and out.shape == (2,)
        # NumPy defers to the Tensor's reflected operators
        out = np.ones(2, np.float32) + x
        assert isinstance(out, popxl.Tensor) and main._g.nodes[-1].op_type == "Add"
        assert main._g.nodes[-1].inputs[1] == x.id
        with pytest.raises(TypeError):
            iter(x)
        with pytest.raises(TypeError):
            1.0 in x  # noqa: B015
        with pytest.raises(ValueError, match="Tensor is a scalar and doesn't have a length."):
            len(popxl.constant(1.0))
        assert len(x) == 2
        with pytest.raises(ValueError, match="The value has 0 elements"):
            x + []


# ---------------------------------------------------------------------- np.memmap
def _memmap(tmp_path, data, mode="w+", name="w.bin"):
    mm = np.memmap(str(tmp_path / name), dtype=data.dtype, mode="w+", shape=data.shape)
    mm[...] = data
    mm.flush()
    return mm if mode == "w+" else np.memmap(str(tmp_path / name), dtype=data.dtype, mode=mode,
                                              shape=data.shape)


def test_variable_from_memmap_errors(tmp_path):
    f32 = _memmap(tmp_path, np.arange(6, dtype=np.float32).reshape(2, 3))
    f64 = _memmap(tmp_path, np.zeros(3, np.float64), name="d.bin")
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(ValueError, match="the `dtype` parameter must be None or the same as "
                                             "the array's dtype"):
            popxl.variable(f32, popxl.float16)
        with pytest.raises(ValueError, match="it must already be in C-ordered and aligned form"):
            popxl.variable(f32.T)
        for downcast in (True, False):
            with pytest.raises(ValueError, match="requires downcasting the array"):
                popxl.variable(f64, downcast=downcast)
        with pytest.raises(ValueError, match="requires downcasting"):
            popxl.constant(f64)
        v = popxl.variable(f32, popxl.float32)             # the same dtype is accepted
        assert ir._variable_data[v] is f32 and v._memmap_arr is f32


def test_variable_from_memmap_non_const_grouping_warns(tmp_path):
    mm = _memmap(tmp_path, np.arange(6, dtype=np.float32).reshape(2, 3))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("popart")
    log.addHandler(handler)
    level = popart.getLogger().getLevel()
    popart.getLogger().setLevel("WARN")
    try:
        ir = popxl.Ir(replication=4)
        grouping = ir.replica_grouping_from_assignments([0, 1, 1, 0])
        assert not grouping.is_const
        with ir.main_graph:
            v = popxl.variable(mm, replica_grouping=grouping, name="g")
            w = popxl.variable(mm, replica_grouping=ir.replica_grouping(1, 2), name="h")
    finally:
        log.removeHandler(handler)
        popart.getLogger().setLevel(level)
    msgs = [r.getMessage() for r in records]
    assert any("In creation of variable g, you have passed np.memmap data and a non-const "
               "replica grouping" in m and "NOT an np.memmap" in m for m in msgs), msgs
    assert v._memmap_arr is None and not np.shares_memory(ir._variable_data[v], mm)
    assert w._memmap_arr is mm                               # a const grouping keeps the memmap


def test_memmap_variable_is_written_back_in_place(tmp_path):
    init = np.array([1.0, 2.0, 3.0], np.float32)
    mm = _memmap(tmp_path, init)
    ro = _memmap(tmp_path, init, mode="r", name="ro.bin")
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(mm, name="v")
        ops.var_updates.accumulate_(v, popxl.constant(np.full(3, 10.0, np.float32)))
    sess = popxl.Session(ir, "cpu")
    with sess:
        sess.run()
    # weights_to_host on exit wrote into the memmap and flushed it to its file
    np.testing.assert_array_equal(mm, init + 10.0)
    np.testing.assert_array_equal(np.fromfile(str(tmp_path / "w.bin"), np.float32), init + 10.0)

    ir2 = popxl.Ir()
    with ir2.main_graph:
        r = popxl.variable(ro, name="r")
        ops.var_updates.accumulate_(r, popxl.constant(np.ones(3, np.float32)))
    assert ir2._variable_data[r] is ro
    sess2 = popxl.Session(ir2, "cpu")
    assert sess2.weights_to_host_on_exit is False
    with sess2:
        sess2.run()
        with pytest.raises(Exception, match="Writing data from device to host is not possible "
                                            "as the `ir` contains a read-only memmap."):
            sess2.weights_to_host()
    np.testing.assert_array_equal(ro, init)


# ---------------------------------------------------------------------- grouped setters, devices
def test_all_replicas_grouped_variable_setter_not_implemented():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        v = popxl.variable(np.zeros(2, np.float32), name="a", retrieval_mode="all_replicas")
        w = popxl.variable(np.zeros(2, np.float32), name="o")
        ops.var_updates.accumulate_(w, v)
    assert ir.replica_grouping()._to_variable_settings("all_replicas").getRetrievalMode() == \
        popart.VariableRetrievalMode.AllReplicas
    with pytest.raises(NotImplementedError, match="non-constant stride"):
        popxl.Ir(replication=4).replica_grouping_from_assignments([0, 1, 1, 0])._to_variable_settings()
    with pytest.raises(ValueError, match="Invalid retrieval_mode: bad"):
        ir.replica_grouping()._to_variable_settings("bad")
    # an attached device: the session is attached from the start and stays attached
    dev = popart.DeviceManager().createIpuModelDevice({"numIPUs": 2})
    assert dev.attach()
    sess = popxl.Session(ir, dev)
    try:
        assert sess.is_attached
        with pytest.raises(NotImplementedError, match='Copying to tensor a with "all_replicas" '
                                                      'retreval mode is not yet supported.'):
            sess.write_variable_data(v, np.ones(2, np.float32))
        sess.write_variable_data(w, np.full(2, 4.0, np.float32))   # one_per_group is fine
        with sess:
            sess.run()
        assert sess.is_attached
        np.testing.assert_array_equal(sess.get_tensor_data(w), np.full(2, 4.0, np.float32))
    finally:
        dev.detach()

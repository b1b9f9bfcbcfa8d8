"""``popart._internal.ir``: PopART's C++ IR binding as live handles on popxl's IR (issue 34).

Handles read popxl's graphs as they are now, and what a binding method changes (a custom op
added, an op erased or cloned into another graph, an output removed, a constraint added) is
what the session then compiles: the numbers are checked against NumPy. Binding methods that
mean nothing on XLA raise ``popart_exception`` naming the method. The last test imports
popxl-addons (tests/helpers/addons.py) where it is present."""
from __future__ import annotations

import importlib
import pkgutil
import types

import numpy as np
import pytest

import popart
import popart._internal.ir as _ir
import popxl
import popxl.ops as ops
from popart.errors import popart_exception
from popart.ops import registry
from helpers.addons import addons_or_skip
from popxl.transforms.autodiff import ExpectedConnection, ExpectedConnectionType, GradGraphInfo


def _run(ir: popxl.Ir) -> tuple[dict, dict]:
    """(stream outputs, variable values) of one run of ``ir``."""
    with popxl.Session(ir, "ipu_model") as s:
        out = s.run()
        return out, s.get_tensors_data(ir.main_graph.variables)


# ---------------------------------------------------------------------------------- reading
@pytest.fixture(scope="module")
def built():
    """A main graph with a transpose, matmul, add, in-place add, sub, and a called subgraph."""
    ir = popxl.Ir()
    with ir.main_graph as g:
        a = popxl.variable(np.ones((2, 3), np.float32), name="a")
        b = popxl.variable(np.full((2, 3), 2, np.float32), name="b")
        c = ops.matmul(a, ops.transpose(b))
        d = a + b
        a += 1.0
        e = d - a
        sg = ir.create_graph(lambda x, y: (x * y, x + y), c, c)
        info = ops.call_with_info(sg, c, c)
        rep = ops.repeat_with_info(ir.create_graph(lambda x: x + 1.0, d), 3, d)
    return types.SimpleNamespace(**locals())


def test_schedule_classes_and_ids(built):
    ops_ = built.g._pb_graph.getOpSchedule()
    names = [type(op).__name__ for op in ops_]
    assert names == ["TransposeOp", "MatMulOp", "AddOp", "AddOp", "SubtractOp", "CallOp", "LoopOp"]
    assert isinstance(ops_[1], _ir.op.MatMulOp) and isinstance(ops_[1], _ir.Op)
    assert isinstance(ops_[4], _ir.op.SubtractOp) and not isinstance(ops_[4], _ir.op.AddOp)
    assert isinstance(ops_[5], _ir.op.CallOp) and isinstance(ops_[6], _ir.op.LoopOp)
    assert _ir.op.HostLoadOp is _ir.op.exchange.HostLoadOp   # one class per name
    assert [op.id for op in ops_] == sorted(op.id for op in ops_) and ops_[0].id >= 100
    assert built.g._pb_graph.getOpSchedule() == ops_   # handles compare by op
    assert ops_[1].opType() == "MatMul" and ops_[1].opid.type == "MatMul"


def test_tensors_producers_consumers(built):
    g, c, d, a = built.g, built.c, built.d, built.a
    matmul = g._pb_graph.getOps()[1]
    assert c._pb_tensor.getProducer() == matmul and c._pb_tensor.hasProducer()
    assert [type(o).__name__ for o in d._pb_tensor.consumers.getOps()] == ["SubtractOp", "LoopOp"]
    assert matmul.inTensor(0).id == built.a.id and matmul.outTensor(0) == c._pb_tensor
    assert list(matmul.getInputIndexMap()) == [0, 1] and matmul.outTensor(0).info.shape() == [2, 2]
    assert popxl.Tensor._from_pb_tensor(c._pb_tensor) is c
    assert popxl.Graph._from_pb(g._pb_graph) is g and g._pb_graph.getIr() == built.ir._pb_ir
    b_pb = built.b._pb_tensor
    assert not b_pb.hasProducer()
    with pytest.raises(popart_exception, match="No producer for tensor b"):
        b_pb.getProducer()
    # ``a += 1`` made a new value: the popxl tensor a names it, and its producer is the add
    add_ = a._pb_tensor.getProducer()
    assert a._pb_tensor.id != a.id and popxl.Tensor._from_pb_tensor(a._pb_tensor) is a
    regions = a._pb_tensor.modifiedRegionsByOps([add_])
    assert regions == [_ir.view.Region.getFull((2, 3))] and not regions[0].isEmpty()
    assert a._pb_tensor.modifiedRegionsByOps([matmul])[0].isEmpty()


def test_tensor_info_sets_the_meta_shape():
    """``Tensor.info`` is read-write, as PopART's field is: an op's setup sets an output's meta
    shape through it (popxl-addons' strided reduce-scatter, configured for replicated tensor
    sharding), which the popxl tensor then has; the type and shape stay the traced ones."""
    ir = popxl.Ir()
    with ir.main_graph:
        y = ops.flatten(popxl.variable(np.ones((2, 3), np.float32), name="x"))
    pb = y._pb_tensor
    assert pb.info.metaShape() == [] and y.meta_shape == ()
    info = pb.info
    info.set(info.dataType(), info.shape(), [2, 3])
    pb.info = info
    assert y.meta_shape == (2, 3) and pb.info.metaShape() == [2, 3] and pb.info.shape() == [6]
    info.set(info.dataType(), [3, 2])
    with pytest.raises(popart_exception, match=r"info FLOAT \[3, 2\] differs from the traced "
                                               r"FLOAT \[6\]; only the meta shape can be set"):
        pb.info = info


def test_subgraph_ops_and_io(built):
    sg, info, rep = built.sg, built.info, built.rep
    pg = sg._pb_graph
    assert pg.getInputIds() == [t.id for t in sg.inputs] and pg.getInputIndex(sg.inputs[1].id) == 1
    assert popxl.Tensor._from_pb_tensor(pg.getOutputTensor(1)) is sg.outputs[1]
    assert pg.getOutputIndex(sg.outputs[0].id) == 0 and pg.id == _ir.GraphId(sg.id) == sg.id
    call, loop = built.g._pb_graph.getOps()[5:]
    assert call.getCalledGraph() == pg and call.getCalledGraphIds() == [pg.id]
    assert call.subgraphInToOpInIndex(1) == 1
    body = rep.called_graph._pb_graph
    (middle,) = loop.getCalledGraphs()   # PopXL's middle graph: it calls the repeated graph
    assert str(middle.id).startswith(f"{body.id}__loop_wrapper") and loop.getTripCountValue() == 3
    (inner,) = middle.getOps()
    assert isinstance(inner, _ir.op.CallOp) and inner.getCalledGraph() == body
    assert loop.opInToSubgraphInIndex(2) == 2 and loop.subgraphInToOpInIndex(2) == 2
    assert loop.opOutToSubgraphOutIndex(0) == 1 and loop.subgraphOutToOpOutIndex(1) == 0
    assert len(middle.getInputIds()) == 3 and len(middle.getOutputIds()) == 2
    assert loop.inTensor(2) == built.d._pb_tensor and inner.inTensor(0).id == middle.getInputId(2)
    assert middle.getOutputId(1) == inner.outId(0)   # carried into the next iteration
    assert rep.parent_to_graph_input_index(2) == 0 and rep.graph_to_parent_input_index(0) == 2
    assert {g.id for g in built.ir._pb_ir.getAllGraphs()} == {"main", sg.id, body.id, middle.id}
    assert built.ir._pb_ir.getGraph(sg.id) == pg and built.g._pb_graph.getCalledGraphs() == [pg, middle]
    with pytest.raises(popart_exception, match="Could not find input index"):
        pg.getInputIndex("nope")


def test_settings_and_hooks():
    """``ctx._get_op_settings`` carries the context's placement and name scope; hooks get op
    handles, also from ``ctx._op_created(op)`` (popxl-addons' one-argument call)."""
    ir = popxl.Ir()
    seen = []
    ctx = popxl.context.get_current_context()
    with ir.main_graph as g, popxl.ipu(1), popxl.name_scope("blk"), popxl.io_tiles():
        g.register_op_created_hook(seen.append)
        s = ctx._get_op_settings("MyOp")
        x = popxl.variable(np.zeros(2, np.float32)) * 2.0
    assert (s.name, s.vgraphId, s.tileSet) == ("blk/MyOp", 1, _ir.TileSet.IO)
    assert s.executionContext == _ir.ExecutionContext.Normal
    op = x._pb_tensor.getProducer()
    assert seen == [op] and seen[0].op_type == "Mul" and op.getVirtualGraphId() == 1
    ctx._op_created(op)
    assert seen == [op, op]
    op.setVirtualGraphId(0)
    assert op.annotations[popart.engine.graph_api.VIRTUAL_GRAPH] == 0 and op.settings.vgraphId == 0


# ---------------------------------------------------------------------------------- custom ops
@pytest.fixture
def toy_op():
    """Registry op test.h1::ToyAffine (x * scale + y, x - y), removed afterwards."""
    registry.add("ToyAffine", lambda ctx, x, y, scale=1.0: [x * scale + y, x - y],
                 domain="test.h1", since=1)
    yield
    registry._REGISTRY.pop(("test.h1", "ToyAffine"))


def test_create_custom_op(toy_op):
    ir = popxl.Ir()
    seen = []
    ctx = popxl.context.get_current_context()
    X, Y = np.arange(6, dtype=np.float32).reshape(2, 3), np.full((2, 3), 0.5, np.float32)
    with ir.main_graph as g:
        g.register_op_created_hook(seen.append)
        x, y = popxl.variable(X, name="x"), popxl.variable(Y, name="y")
        with popxl.ipu(0):
            settings = ctx._get_op_settings("ToyAffine")
        out_ids = {0: g._create_tensor_id("toy_out"), 1: g._create_tensor_id("toy_diff")}
        op = g._pb_graph.createCustomOp("ToyAffine", "test.h1", 1, {0: x.id, 1: y.id}, out_ids,
                                        {"scale": 3.0}, settings)
        t0, t1 = (popxl.Tensor._from_pb_tensor(op.outTensor(i)) for i in (0, 1))
        s0, s1 = popxl.d2h_stream((2, 3), popxl.float32), popxl.d2h_stream((2, 3), popxl.float32)
        ops.host_store(s0, t0)
        ops.host_store(s1, t1)
        with pytest.raises(popart_exception, match="already exists"):
            g._pb_graph.createCustomOp("ToyAffine", "test.h1", 1, {0: x.id, 1: y.id},
                                       {0: out_ids[0]}, {}, None)
    assert (t0.id, t1.id) == (out_ids[0], out_ids[1]) and t0.shape == (2, 3)
    assert type(op).__name__ == "ToyAffineOp" and seen[0] == op and op.getVirtualGraphId() == 0
    out, _ = _run(ir)
    np.testing.assert_allclose(out[s0], X * 3.0 + Y)
    np.testing.assert_allclose(out[s1], X - Y)


# ---------------------------------------------------------------------------------- changes
def _inplace_ir(erase: bool) -> tuple[popxl.Ir, popxl.DeviceToHostStream]:
    ir = popxl.Ir()
    with ir.main_graph as g:
        v = popxl.variable(np.array([1.0, 2.0], np.float32), name="v")
        v += 2.0
        s = popxl.d2h_stream((2,), popxl.float32)
        ops.host_store(s, v * 3.0)
        if erase:
            op = [o for o in g._pb_graph.getOps() if isinstance(o, _ir.op.AddOp)][0]
            g._pb_graph.eraseOp(op.id)
    return ir, s


@pytest.mark.parametrize("erase", [False, True])
def test_erase_op_changes_the_program(erase):
    """Erasing the in-place add: the variable keeps its value and later ops read it."""
    ir, s = _inplace_ir(erase)
    out, vs = _run(ir)
    want = np.array([1.0, 2.0]) + (0.0 if erase else 2.0)
    np.testing.assert_allclose(out[s], want * 3.0)
    np.testing.assert_allclose(list(vs.values())[0], want)


def _move_into_repeat(graph: popxl.Graph, n: int) -> popxl.Graph:
    """Clone every op of ``graph`` into a new graph (its inputs by reference), repeat that
    ``n`` times in ``graph`` and erase the originals."""
    sg = graph.ir.create_empty_graph("moved")
    new_of: dict = {}
    outer: dict = {}
    old = graph._pb_graph.getOpSchedule()
    with sg:
        for op in old:
            clone = op.cloneIntoGraph(sg._pb_graph)
            for i, t in op.getInputIndexMap().items():
                if t not in new_of:
                    pt = popxl.Tensor._from_pb_tensor(t)
                    inp = popxl.graph_input(pt.shape, pt.dtype, pt.name, by_ref=True)
                    new_of[t], outer[inp] = inp._pb_tensor, pt
                clone.connectInTensor(i, new_of[t].id)
            for i, t in op.getOutputIndexMap().items():
                name = popxl.Tensor._from_pb_tensor(t).name
                clone.createAndConnectOutTensor(i, sg._create_tensor_id(name))
                new_of[t] = clone.outTensor(i)
            clone.setup()
    with graph:
        ops.repeat(sg, n, inputs_dict=outer)
    for op in old:
        op.disconnectAllInputs()
        op.disconnectAllOutputs()
        graph._pb_graph.eraseOp(op.id)
    return sg


def test_clone_into_graph_and_erase():
    """Ops cloned into a repeated graph: the in-place update runs n times."""
    ir = popxl.Ir()
    with ir.main_graph as g:
        v = popxl.variable(np.array([1.0, -1.0], np.float32), name="v")
        w = popxl.variable(np.array([0.5, 0.5], np.float32), name="w")
        v += w * 2.0
    sg = _move_into_repeat(g, 3)
    assert [type(o).__name__ for o in g._pb_graph.getOps()] == ["LoopOp"]
    assert [type(o).__name__ for o in sg._pb_graph.getOps()] == ["MulOp", "AddOp"]
    _, vs = _run(ir)
    np.testing.assert_allclose(vs[v], np.array([1.0, -1.0]) + 3 * 2 * 0.5)
    np.testing.assert_allclose(vs[w], [0.5, 0.5])


def test_remove_output():
    ir = popxl.Ir()
    X = np.array([1.0, 2.0], np.float32)
    with ir.main_graph:
        x = popxl.variable(X, name="x")
        sg = ir.create_graph(lambda t: (t * 2.0, t + 1.0), x)
        sg._pb_graph.removeOutput(0)
        (y,) = ops.call(sg, x)
        s = popxl.d2h_stream((2,), popxl.float32)
        ops.host_store(s, y)
        read = ir.create_graph(lambda t: (t * 2.0, t + 1.0), x)
        kept = ops.call(read, x)[0] + 0.0
        with pytest.raises(popart_exception, match="is read"):
            read._pb_graph.removeOutput(0)
        unread = ir.create_graph(lambda t: (t * 2.0, t + 1.0, t - 1.0), x)
        ops.call(unread, x)
        unread._pb_graph.removeOutput(1)
        unread._pb_graph.removeOutput(2)   # past the end: the last one (PopART's erase)
    assert len(sg.outputs) == 1 and len(unread.outputs) == 1
    assert len(unread._pb_graph.getOutputIds()) == 1 and kept.shape == (2,)
    out, _ = _run(ir)
    np.testing.assert_allclose(out[s], X + 1.0)


def test_topo_cons_reorder():
    ir = popxl.Ir()
    with ir.main_graph as g:
        a = popxl.variable(1.0) + 1.0
        b = popxl.variable(2.0) * 2.0
        c = a + b
    add, mul, add2 = g._pb_graph.getOps()
    g._pb_graph.topoCons().insert(mul, add)
    assert g._pb_graph.getOpSchedule() == [mul, add, add2]
    with pytest.raises(popart_exception, match="cycle"):
        g._pb_graph.topoCons().insert(add2, mul)
    assert c._pb_tensor.getProducer() == add2


def test_route_into_an_existing_call():
    """A graph input added after the call: connected at the call site, marked modified (the
    caller's variable moves to the call's result), and a graph output added afterwards."""
    ir = popxl.Ir()
    sg = ir.create_empty_graph("sg")
    with ir.main_graph as g:
        v = popxl.variable(np.array([1.0, 2.0], np.float32), name="v")
        info = ops.call_with_info(sg)
    call = g._pb_graph.getOps()[0]
    with sg:
        v_sg = popxl.graph_input((2,), popxl.float32, "v")
        assert not call.hasInput(0) and call.getNumExplicitInputs() == 1
        call.connectInTensor(0, v.id)
        call.addModified(0, [_ir.view.Region.getFull((2,))])
        v_sg += 10.0
        doubled = v_sg * 2.0
    sg._pb_graph.markAsOutput(doubled.id)
    out = g._create_tensor_id("doubled")
    call.createAndConnectOutTensor(0, out)
    assert call.hasInputTensor(v._pb_tensor) and call.inIndex(v._pb_tensor) == 0
    with g:
        s = popxl.d2h_stream((2,), popxl.float32)
        ops.host_store(s, popxl.Tensor._from_pb_tensor(call.outTensor(0)))
    assert info.outputs[0].id == out
    outs, vs = _run(ir)
    np.testing.assert_allclose(vs[v], [11.0, 12.0])
    np.testing.assert_allclose(outs[s], [22.0, 24.0])


def test_ipu_copy_class():
    ir = popxl.Ir()
    with ir.main_graph as g:
        with popxl.ipu(0):
            x = popxl.variable(np.zeros(2, np.float32)) + 1.0
        y = x.copy_to_ipu(1)
        z = ops.identity(y)
    copy, ident = y._pb_tensor.getProducer(), z._pb_tensor.getProducer()
    assert isinstance(copy, _ir.op.IpuCopyOp) and copy.isIpuCopyOp()
    assert (copy.getSourceIpu(x.id), copy.getDestIpu()) == (0, 1)
    assert not isinstance(ident, _ir.op.IpuCopyOp) and type(ident).__name__ == "IdentityOp"


# ---------------------------------------------------------------------------------- autodiff
def _fwd_and_hand_grad(ir: popxl.Ir, factor: float):
    """f(x, w) = x @ w and a hand-built gradient graph (dy, x, w) -> (factor * dx, dw)."""
    X = np.arange(6, dtype=np.float32).reshape(2, 3)
    W = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    fwd = ir.create_graph(lambda x, w: x @ w, popxl.TensorSpec((2, 3), popxl.float32),
                          popxl.TensorSpec((3, 4), popxl.float32))
    grad = ir.create_graph(lambda dy, x, w: ((dy @ w.T) * factor, x.T @ dy),
                           popxl.TensorSpec((2, 4), popxl.float32),
                           popxl.TensorSpec((2, 3), popxl.float32),
                           popxl.TensorSpec((3, 4), popxl.float32))
    x_f, w_f = fwd.inputs
    (y_f,) = fwd.outputs
    T = _ir.ExpectedConnectionType
    bwd = _ir.BwdGraphInfo(grad._pb_graph.id,
                           [_ir.ExpectedConnection(y_f.id, T.FwdGrad), _ir.ExpectedConnection(x_f.id, T.Fwd),
                            _ir.ExpectedConnection(w_f.id, T.Fwd)],
                           [_ir.ExpectedConnection(x_f.id, T.FwdGrad), _ir.ExpectedConnection(w_f.id, T.FwdGrad)])
    info = GradGraphInfo._from_pb(ir._pb_ir, fwd._pb_graph, bwd)
    return X, W, fwd, grad, info


def test_grad_graph_info_from_pb():
    ir = popxl.Ir()
    with ir.main_graph:
        X, W, fwd, grad, info = _fwd_and_hand_grad(ir, 1.0)
        x, w = popxl.variable(X, name="x"), popxl.variable(W, name="w")
        site = ops.call_with_info(fwd, x, w)
        dy = popxl.constant(np.ones((2, 4), np.float32))
        dx, dw = ops.call(info.graph, dy, inputs_dict=info.inputs_dict(site))
        s_dx, s_dw = popxl.d2h_stream((2, 3), popxl.float32), popxl.d2h_stream((3, 4), popxl.float32)
        ops.host_store(s_dx, dx)
        ops.host_store(s_dw, dw)
    assert info.graph is grad and info.forward_graph is fwd
    assert [e.connection_type for e in info.expected_inputs] == [ExpectedConnectionType.FwdGrad,
                                                                ExpectedConnectionType.Fwd,
                                                                ExpectedConnectionType.Fwd]
    assert info.inputs == (fwd.outputs[0], *fwd.inputs) and info.outputs == fwd.inputs
    ec = info.expected_inputs[1]
    assert ExpectedConnection._from_pb(fwd._pb_graph, ec._pb_ec)._pb_ec == ec._pb_ec
    out, _ = _run(ir)
    np.testing.assert_allclose(out[s_dx], np.ones((2, 4)) @ W.T, rtol=1e-6)
    np.testing.assert_allclose(out[s_dw], X.T @ np.ones((2, 4)), rtol=1e-6)


def test_autodiff_uses_a_hand_built_grad_graph():
    """autodiff of a graph that calls ``fwd`` takes ``fwd``'s gradient from the given info
    (its dx is scaled by 10: the hand-built graph ran)."""
    ir = popxl.Ir()
    with ir.main_graph:
        X, W, fwd, _, info = _fwd_and_hand_grad(ir, 10.0)
        outer = ir.create_graph(lambda x, w: ops.call(fwd, x, w)[0] * 1.0,
                                popxl.TensorSpec((2, 3), popxl.float32),
                                popxl.TensorSpec((3, 4), popxl.float32))
        ginfo = popxl.transforms.autodiff(outer, called_graphs_grad_info={fwd: info})
        x, w = popxl.variable(X, name="x"), popxl.variable(W, name="w")
        site = ops.call_with_info(outer, x, w)
        dy = popxl.constant(np.ones((2, 4), np.float32))
        grads = ops.call(ginfo.graph, dy, inputs_dict=ginfo.inputs_dict(site))
        got = dict(zip(ginfo.outputs, grads))
        s_dx = popxl.d2h_stream((2, 3), popxl.float32)
        ops.host_store(s_dx, got[outer.inputs[0]])
    out, _ = _run(ir)
    np.testing.assert_allclose(out[s_dx], 10.0 * np.ones((2, 4)) @ W.T, rtol=1e-6)


# ---------------------------------------------------------------------------------- the rest
def test_session_replica_grouping_and_patterns():
    ir = popxl.Ir(replication=1)
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32), name="v")
        s = popxl.d2h_stream((3,), popxl.float32)
        ops.host_store(s, v + 1.0)
    pb = ir._pb_ir
    pb.setPatterns(_ir.patterns.Patterns(_ir.patterns.PatternsLevel.Default))
    pb.applyPreAliasPatterns(ir.main_graph._pb_graph)
    pb.applyInplacePattern(ir.main_graph._pb_graph)
    assert pb.getPatterns().isPatternEnabled("PreUniRepl") and pb.getSessionOptions() is ir._options
    rg = ir.replica_grouping()._pb_replica_grouping
    assert (rg.getNumReplicas(), rg.getStride(), rg.getGroupSize()) == (1, 1, 1)
    with popxl.Session(ir, "ipu_model") as sess:
        sess._pb_session.writeWeights(popart.PyWeightsIO({"v": np.array([1, 2, 3], np.float32)}))
        sess._pb_session.weightsFromHost()
        np.testing.assert_allclose(sess.run()[s], [2, 3, 4])
        np.testing.assert_allclose(sess.get_tensor_data(v), [1, 2, 3])


def test_unsupported_methods_raise():
    ir = popxl.Ir()
    with ir.main_graph as g:
        x = popxl.variable(1.0) + 1.0
    op = x._pb_tensor.getProducer()
    cases = [(g._pb_graph, "addInput", "Graph"), (op, "getGradOps", "AddOp"),
             (x._pb_tensor, "isAliased", "Tensor"), (ir._pb_ir, "removeIsolatedGraphs", "Ir"),
             (op, "addModified", "AddOp")]
    for obj, name, cls in cases:
        with pytest.raises(popart_exception, match=rf"popart._internal.ir.{cls}.{name} is not supported on XLA"):
            getattr(obj, name)
    assert not hasattr(op, "setAvailableMemoryProportion")   # not a name of the Op binding
    with pytest.raises(AttributeError):
        _ir.op.notAClass
    with pytest.raises(popart_exception, match="No Ir::Tensor with TensorId 'nope'"):
        g._pb_graph.getTensor("nope")


def test_popxl_addons_imports():
    """popxl-addons 3.4, installed unchanged, imports module by module on the facade (its C++
    custom ops through their registered equivalents), and its repeat_graph transform, which
    clones ops through the binding, runs."""
    addons = addons_or_skip()
    names = [m.name for m in pkgutil.walk_packages(addons.__path__, "popxl_addons.")]
    assert len(names) > 60
    for name in names:
        importlib.import_module(name)
    from popxl_addons.transforms.repeat_graph import repeat_graph
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.array([0.0, 1.0], np.float32), name="v")
        v += 1.0
    repeat_graph(ir.main_graph, 4)
    _, vs = _run(ir)
    np.testing.assert_allclose(vs[v], [4.0, 5.0])

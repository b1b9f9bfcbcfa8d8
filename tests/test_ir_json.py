"""``_serializeIr``'s JSON against PopART's transforms, each rule transcribed from PopART's
source: OpToIdentity / PostNRepl on IdentityLoss (patterns/optoidentitypattern.cpp,
op/identity.cpp ``IdentityLossOp::canBeReplacedByIdentity``, patterns/postnrepl.cpp,
ir.cpp ``applyPreAliasPattern``), ExplicitRecompute (transforms/explicitrecompute.cpp,
tensornames.cpp ``createRecomputedTensorId``) and a pipeline's InterIpuCopy
(transforms/interipucopy.cpp, op/ipucopy.cpp) with the stash / restore ops."""
from __future__ import annotations

import json

import numpy as np
import pytest

import popart

GRAD = "Gradient___"


def ir_ops(session) -> list:
    return json.loads(session._serializeIr(popart.IrSerializationFormat.JSON))["maingraph"]


def names(ops, key):
    return [[t["name"] for t in op[key]] for op in ops]


def cpu():
    return popart.DeviceManager().createCpuDevice()


# ------------------------------------------------------------------ IdentityLoss
def replaced_by_identity(reduction: str, rank: int) -> bool:
    """IdentityLossOp::canBeReplacedByIdentity (op/identity.cpp:94-105)."""
    return reduction == "None" or rank == 0


@pytest.mark.parametrize("reduction,shape,anchor_it,pattern_on", [
    ("None", [3], False, True),     # OpToIdentity, then PostNRepl removes the Identity
    ("None", [3], True, True),      # anchored output: PostNRepl touches an anchor, Identity kept
    ("Mean", [], False, True),      # a scalar's loss: replaced too
    ("Mean", [3], False, True),     # a real reduction: stays an IdentityLoss
    ("None", [3], False, False),    # OpToIdentity off
])
def test_inference_identity_loss(reduction, shape, anchor_it, pattern_on):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", shape), "x")
    r = b.aiOnnx.relu([x])
    loss = b.aiGraphcore.identityloss([r], reduction=getattr(popart.ReductionType, {
        "None": "NoReduction", "Mean": "Mean"}[reduction]))
    y = b.aiOnnx.neg([loss])
    patterns = popart.Patterns().enablePattern("OpToIdentity", pattern_on)
    s = popart.InferenceSession(b.getModelProto(),
                                popart.DataFlow(1, [y] + ([loss] if anchor_it else [])), cpu(),
                                patterns=patterns)
    ops = ir_ops(s)
    replaced = pattern_on and replaced_by_identity(reduction, len(shape))
    removed = replaced and not anchor_it
    # a kept Identity is then inplaced too (op/identity.cpp:46 IdentityInplace, a view)
    assert [op["type"] for op in ops] == ["ReluInplace"] + (
        [] if removed else ["IdentityInplace" if replaced else "IdentityLoss"]) + ["Neg"]
    assert names(ops, "inputs")[-1] == [r if removed else loss]   # Neg reads Relu's output
    if replaced and not removed:
        ident = ops[1]
        assert ident["name"] == "IdentityLoss:OpToIdentity"   # getReplacementOpName
        assert "reduction" not in ident["attributes"]         # makeReplacementOp: debug id only
        assert "__debug_info_id" in ident["attributes"]


def test_training_identity_loss_becomes_identity_and_stays():
    """In training the scalar IdentityLoss becomes an Identity (OpToIdentity touches no
    tensor) that PostNRepl may not remove (it touches the loss before setFinalLoss); its
    grad op is the Identity's."""
    ops = ir_ops(recompute_session(explicit=False))
    ident = [op for op in ops if op["outputs"][0]["name"] == "IdentityLoss:0"]
    # then inplaced (a view: an anchored output does not stop it, inplace.cpp / ir.cpp:3786)
    assert [(op["type"], op["name"]) for op in ident] == [("IdentityInplace",
                                                          "IdentityLoss:OpToIdentity")]
    assert [op["type"] for op in ops if op["name"] == "IdentityLoss_Grad"] == ["IdentityGrad"]
    assert not any(op["type"].startswith("IdentityLoss") for op in ops)


# ------------------------------------------------------------------ explicit recomputation
def mlp(builder):
    x = builder.addInputTensor(popart.TensorInfo("FLOAT", [2, 4]), "x")
    w1 = builder.addInitializedInputTensor(np.full((4, 4), 0.1, np.float32), "w1")
    w2 = builder.addInitializedInputTensor(np.full((4, 3), -0.2, np.float32), "w2")
    return x, w1, w2


_SESSIONS: dict = {}


def recompute_session(explicit: bool):
    """x -> MatMul -> Relu (both recomputeOutputInBackwardPass) -> MatMul -> L1 ->
    IdentityLoss; built once per mode (no compile: _serializeIr reads the IR)."""
    if explicit not in _SESSIONS:
        b = popart.Builder()
        x, w1, w2 = mlp(b)
        m = b.aiOnnx.matmul([x, w1])
        h = b.aiOnnx.relu([m])
        b.recomputeOutputInBackwardPass(m)
        b.recomputeOutputInBackwardPass(h)
        y = b.aiOnnx.matmul([h, w2])
        loss = b.aiGraphcore.identityloss(
            [b.aiGraphcore.l1loss([y], 0.5, reduction=popart.ReductionType.Sum)])
        o = popart.SessionOptions()
        o.explicitRecomputation = explicit
        _SESSIONS[explicit] = popart.TrainingSession(
            b.getModelProto(), popart.DataFlow(1, [loss]), loss, popart.ConstSGD(0.1), cpu(),
            userOptions=o)
    return _SESSIONS[explicit]


def test_implicit_recompute_ops_say_yes_and_are_not_cloned():
    ops = ir_ops(recompute_session(explicit=False))
    fwd = {op["outputs"][0]["name"]: op["attributes"]["recompute"] for op in ops
           if not op["type"].endswith(("Grad", "VarUpdate"))}
    assert fwd == {"MatMul:0": "YES", "Relu:0": "YES", "MatMul:0/1": "NO", "L1:0": "NO",
                   "IdentityLoss:0": "NO"}
    assert not any("__re" in t for op in ops for t in sum(names([op], "outputs"), []))


def test_explicit_recompute_clones():
    """ExplicitRecompute: each Recompute op read in the backward pass is cloned (last op
    first: the ids' counter runs in that order) with its name, type and attributes, outputs
    <t>__re__t<n>; the clone reads the other clones' outputs, the grad ops read the
    recomputed tensors; original (Checkpoint) and clone (Recomputed) both say NO."""
    ops = ir_ops(recompute_session(explicit=True))
    assert all(op["attributes"]["recompute"] == "NO" for op in ops)
    by_name = {}
    for op in ops:
        by_name.setdefault((op["type"].removesuffix("Inplace"), op["name"]), []).append(op)
    (mm, mm_re), (relu, relu_re) = by_name[("MatMul", "MatMul")], by_name[("Relu", "Relu")]
    # Inplace: each Relu's input is read by it alone (ReluGrad reads the output,
    # relu.cpp:77-78): both are inplaced
    assert (relu["type"], relu_re["type"]) == ("ReluInplace", "ReluInplace")
    assert names([mm, relu], "outputs") == [["MatMul:0"], ["Relu:0"]]
    # reverse schedule: Relu's clone takes the counter's first id, MatMul's the next
    assert names([relu_re, mm_re], "outputs") == [["Relu:0__re__t0"], ["MatMul:0__re__t1"]]
    assert names([mm_re, relu_re], "inputs") == [["x", "w1"], ["MatMul:0__re__t1"]]
    assert mm_re["attributes"].keys() == mm["attributes"].keys()
    grads = {op["name"]: [t["name"] for t in op["inputs"]] for op in ops
             if op["type"].endswith("Grad")}
    assert "Relu:0__re__t0" in grads["MatMul/1_Grad"]
    assert "Relu:0__re__t0" in grads["Relu_Grad"]
    # the clones come after the forward pass, before the first grad op that reads them
    pos = {id(op): i for i, op in enumerate(ops)}
    first_reader = min(pos[id(op)] for op in ops if op["type"].endswith("Grad") and
                       "Relu:0__re__t0" in [t["name"] for t in op["inputs"]])
    assert pos[id(ops[-1])] > first_reader > pos[id(relu_re)] > pos[id(mm_re)] > \
        pos[id(by_name[("L1", "L1")][0])]


# ------------------------------------------------------------------ pipelines
@pytest.fixture(scope="module")
def pipeline_ops():
    """Stage 0 (IPU 0): MatMul, Relu; stage 1 (IPU 1): MatMul, L1; backward stages 1, 2."""
    b = popart.Builder()
    x, w1, w2 = mlp(b)
    with b.virtualGraph(0), b.pipelineStage(0):
        h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
    with b.virtualGraph(1), b.pipelineStage(1):
        loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([h, w2])], 0.5,
                                    reduction=popart.ReductionType.Sum)
    o = popart.SessionOptions()
    o.enablePipelining, o.virtualGraphMode = True, popart.VirtualGraphMode.Manual
    o.enableGradientAccumulation, o.accumulationFactor = True, 4
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(0.1),
                               popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}),
                               userOptions=o)
    return ir_ops(s), h


def test_pipeline_ipu_copies(pipeline_ops):
    """InterIpuCopy: one IpuCopy per tensor read on another IPU than the one making it,
    unnamed, writing <t>_c<destIpu>, in the stage of the op making it, with __sourceIpus /
    __destIpu and no __ipu_number (IpuCopyOp has none); its readers read the copy. The
    gradient of h, made on IPU 1 (backward stage 1) and read on IPU 0, is copied too."""
    ops, h = pipeline_ops
    copies = [op for op in ops if op["type"] == "IpuCopy"]
    got = [(op["name"], names([op], "inputs")[0], names([op], "outputs")[0],
            {k: v for k, v in op["attributes"].items() if k != "schedulePriority"})
           for op in copies]
    assert got == [
        ("", [h], [h + "_c1"], {"recompute": "NO", "__pipeline_stage": "0",
                                "__sourceIpus": "{0}", "__destIpu": "1"}),
        ("", [GRAD + h], [GRAD + h + "_c0"], {"recompute": "NO", "__pipeline_stage": "1",
                                               "__sourceIpus": "{1}", "__destIpu": "0"})]
    readers = [op for op in ops if h + "_c1" in names([op], "inputs")[0]]
    assert {op["attributes"]["__ipu_number"] for op in readers} == {"1"}
    assert not any(h in names([op], "inputs")[0] for op in ops
                   if op["attributes"].get("__ipu_number") == "1")
    relu_grad = [op for op in ops if op["type"] == "ReluGrad"][0]
    assert GRAD + h + "_c0" in names([relu_grad], "inputs")[0]
    assert ops.index(copies[1]) < ops.index(relu_grad)


def test_pipeline_grad_ops_read_restored_tensors(pipeline_ops):
    """Pipeline::addStashRestoreOps: the grad ops of stage 0's ops (backward stage 2) read
    the restored activations, each Restore before the first of them."""
    ops, _ = pipeline_ops
    restores = {op["outputs"][0]["name"]: i for i, op in enumerate(ops)
                if op["type"].startswith("Restore")}
    stage2 = [(i, op) for i, op in enumerate(ops) if op["type"].endswith("Grad")
              and op["attributes"]["__pipeline_stage"] == "2"]
    read = {t for _, op in stage2 for t in names([op], "inputs")[0]}
    stashed = {op["inputs"][0]["name"] for op in ops if op["type"] == "Stash"}
    assert {"x", "Relu:0"} <= stashed   # MatMulGrad reads x, ReluGrad Relu's output
    for t in stashed:   # no stage-2 grad op reads a stashed activation itself
        assert t not in read
    for i, op in stage2:
        for t in names([op], "inputs")[0]:
            if t.startswith("Restored___"):
                assert restores[t] < i
    assert {"Restored___x", "Restored___Relu:0"} <= read


def test_main_graph_output_is_no_reason_to_keep_the_identity():
    """PostNRepl keeps an Identity whose output is a graph output; PopART's main graph has
    none (the ONNX outputs are not marked), so only anchors keep it there."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    loss = b.aiGraphcore.identityloss([b.aiOnnx.relu([x])],
                                      reduction=popart.ReductionType.NoReduction)
    y = b.aiOnnx.neg([loss])
    b.addOutputTensor(loss)
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), cpu())
    assert [op["type"] for op in ir_ops(s)] == ["ReluInplace", "Neg"]


# ------------------------------------------------------------------ Inplace pattern
@pytest.fixture(scope="module")
def inplace_session():
    """An inference graph whose ops PopART's Inplace pattern would turn into their inplace
    variants, and a few it must leave: a tensor read twice, Tanh (no variant)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    v = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "v")
    u = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "u")
    a = b.aiOnnx.relu([x], "relu")                      # x read once: ReluInplace
    c = b.aiOnnx.add([v, a], "add")                     # lhs [3] != out [2 3]: AddRhsInplace
    d = b.aiOnnx.reshape([c, b.aiOnnx.constant(np.array([3, 2], np.int64))], "reshape")
    e = b.aiOnnx.transpose([d], [1, 0], "transpose")    # TransposeInplace
    f = b.aiOnnx.mul([e, b.aiOnnx.sigmoid([u], "sig")], "mul")   # MulLhsInplace
    g = b.aiOnnx.tanh([f], "tanh")                      # no TanhInplace in PopART
    h = b.aiOnnx.relu([u], "relu_u")                    # u also read by sig (see below)
    y = b.aiOnnx.concat([g, h], 0, "concat")            # a view of g and h
    k = b.aiGraphcore.scale([y], 2.0, "scale")          # modifies y, whose output is anchored
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [k]), cpu())
    return s, (x, v, u, k)


def test_inplace_variants(inplace_session):
    """ir.cpp applyInplacePattern: candidates by decreasing inplacePriorityDefault
    (transpose.cpp:181 100, the others 10), ties by the higher op id first, so relu_u (op 7)
    is taken before sig (op 4): u's other reader sig can run first, so ReluInplace (with that
    order); sig would then modify u before relu_u reads it: it stays Sigmoid. Scale modifies
    y, which is not unmodifiable (only its output k is anchored, ir.cpp:3786-3806 checks the
    input): ScaleInplace; Concat (a view, concat.cpp:130) after it. Binary ops: Lhs when the
    output has the first input's size, else Rhs (elementwise.cpp:221-238)."""
    s, _ = inplace_session
    types = {op["name"]: op["type"] for op in ir_ops(s)}
    want = {"relu": "ReluInplace", "add": "AddRhsInplace", "reshape": "ReshapeInplace",
            "transpose": "TransposeInplace", "mul": "MulLhsInplace", "sig": "Sigmoid",
            "tanh": "Tanh", "relu_u": "ReluInplace", "concat": "ConcatInplace",
            "scale": "ScaleInplace"}
    assert {k: types[k] for k in want} == want


def test_inplace_variants_compute_the_same(inplace_session):
    """The serialized variants change nothing in the numbers (NumPy reference)."""
    s, (x, v, u, k) = inplace_session
    rng = np.random.default_rng(0)
    xs, vs, us = (rng.standard_normal(sh).astype(np.float32) for sh in ((2, 3), (3,), (2, 3)))
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: xs, v: vs, u: us}, anchors))
    f = (vs + np.maximum(xs, 0)).reshape(3, 2).T * (1 / (1 + np.exp(-us)))
    np.testing.assert_allclose(anchors[k], 2 * np.concatenate([np.tanh(f), np.maximum(us, 0)]),
                               rtol=1e-5)


# ------------------------------------------------------------------ sharding: InterIpuCopy
def sharded_ops(training: bool) -> tuple:
    """IPU 0: Relu(x); IPU 1: MatMul(relu, w), Add(x, mm), Mul(relu, add) (+ an L1 loss)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 2]), "x")
    w = b.addInitializedInputTensor(np.eye(2, dtype=np.float32), "w")
    with b.virtualGraph(0):
        r = b.aiOnnx.relu([x], "relu")
    with b.virtualGraph(1):
        m = b.aiOnnx.matmul([r, w], "mm")
        a = b.aiOnnx.add([x, m], "add")
        y = b.aiOnnx.mul([r, a], "mul")
        loss = b.aiGraphcore.l1loss([y], 0.1, reduction=popart.ReductionType.Sum) \
            if training else None
    o = popart.SessionOptions()
    o.virtualGraphMode = popart.VirtualGraphMode.Manual
    device = popart.DeviceManager().createIpuModelDevice({"numIPUs": 2})
    if training:
        s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                                   popart.ConstSGD(0.1), device, userOptions=o)
    else:
        s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), device,
                                    userOptions=o)
    return ir_ops(s), (x, r)


@pytest.mark.parametrize("training", [False, True])
def test_sharded_ipu_copies(training):
    """transforms/interipucopy.cpp without pipelining: one IpuCopy per (tensor, IPU) read on
    another IPU than its producer's (a stream read on several IPUs: from the lowest one),
    named <t>_c<destIpu>, before the op that first needs it, with __sourceIpus / __destIpu
    and no __pipeline_stage; the readers on IPU 1 read the copies."""
    ops, (x, r) = sharded_ops(training)
    copies = [op for op in ops if op["type"] == "IpuCopy"]
    assert names(copies, "inputs") == [[r], [x]]
    assert names(copies, "outputs") == [[f"{r}_c1"], [f"{x}_c1"]]
    for op in copies:
        assert op["attributes"]["__sourceIpus"] == "{0}" and op["attributes"]["__destIpu"] == "1"
        assert "__pipeline_stage" not in op["attributes"]
    order = [op["name"] or op["type"] for op in ops]
    assert order[:5] == ["relu", "IpuCopy", "mm", "IpuCopy", "add"]
    by_name = {op["name"]: op for op in ops}
    assert names([by_name["mm"]], "inputs") == [[f"{r}_c1", "w"]]
    m, a = (by_name[k]["outputs"][0]["name"] for k in ("mm", "add"))
    assert names([by_name["add"], by_name["mul"]], "inputs") == [[f"{x}_c1", m], [f"{r}_c1", a]]


# ------------------------------------------------------------------ Inplace in training
def inplace_training_ops(anchor_m: bool = False, inplace: bool = True) -> list:
    """x -> MatMul(w1) = m -> Relu = h -> Scale = s -> MatMul(w2) = y -> Add(y, b) -> L1;
    r = Relu(w1) -> Add into the loss's input too; b and w1, w2 trained weights."""
    b = popart.Builder()
    x, w1, w2 = mlp(b)
    bias = b.addInitializedInputTensor(np.zeros(3, np.float32), "b")
    m = b.aiOnnx.matmul([x, w1], "mm1")
    h = b.aiOnnx.relu([m], "relu")
    s = b.aiGraphcore.scale([h], 2.0, "scale")
    y = b.aiOnnx.matmul([s, w2], "mm2")
    a = b.aiOnnx.add([y, bias], "add")
    r = b.aiOnnx.relu([w2], "relu_w")
    loss = b.aiGraphcore.l1loss([b.aiOnnx.add([a, b.aiOnnx.reducesum([r], [0], 1, "sum")],
                                              "add2")], 0.5, reduction=popart.ReductionType.Sum)
    patterns = popart.Patterns()
    patterns.InPlace = inplace
    sess = popart.TrainingSession(b.getModelProto(),
                                  popart.DataFlow(1, [loss] + ([m] if anchor_m else [])), loss,
                                  popart.ConstSGD(0.1), cpu(), patterns=patterns)
    return ir_ops(sess)


def test_training_inplace_forward_ops():
    """Ir::applyInplacePattern in a TrainingSession (ir.cpp:3515-3830 with the grad ops'
    gradInputInfo): relu's input m is read by it alone (MatMulGrad reads x and w1), so
    ReluInplace; scale would modify h, which ReluGrad reads later (relu.cpp:77-78), so
    Scale; add modifies y, which no grad op reads (matmul.cpp:342: MatMulGrad reads the
    other operand; add.cpp:76: AddGrad the gradient only), so AddLhsInplace; add2 likewise;
    relu_w would modify the weight w2 (a Variable, Tensor::isUnmodifiable), so Relu."""
    types = {op["name"]: op["type"] for op in inplace_training_ops()
             if not op["type"].endswith(("Grad", "VarUpdate"))}
    assert {k: types[k] for k in ("mm1", "relu", "scale", "mm2", "add", "relu_w", "add2")} == {
        "mm1": "MatMul", "relu": "ReluInplace", "scale": "Scale", "mm2": "MatMul",
        "add": "AddLhsInplace", "relu_w": "Relu", "add2": "AddLhsInplace"}


def test_training_inplace_respects_anchors_and_the_pattern_switch():
    """An anchored tensor is unmodifiable (tensor.cpp:1014): relu may not overwrite m; with
    the InPlace pattern off nothing is inplaced."""
    types = {op["name"]: op["type"] for op in inplace_training_ops(anchor_m=True)}
    assert types["relu"] == "Relu" and types["add"] == "AddLhsInplace"
    assert not any(op["type"].endswith("Inplace")
                   for op in inplace_training_ops(inplace=False))


def test_training_grad_ops_read_what_popart_s_read():
    """gradInputInfo: ReluGrad reads Relu's output, ScaleGrad / AddGrad no forward tensor,
    MatMulGrad the operands, L1Grad its input."""
    reads = {op["name"]: [t["name"] for t in op["inputs"] if not t["name"].startswith(GRAD)]
             for op in inplace_training_ops() if op["type"].endswith("Grad")}
    assert reads["relu_Grad"] == ["relu:0"] and reads["scale_Grad"] == []
    assert reads["add_Grad"] == [] and reads["mm1_Grad"] == ["x", "w1"]


# ------------------------------------------------------------------ sharded training, Auto
def two_ipu_mlp(mode: str):
    """x -> MatMul(w1) -> Relu on IPU 0, MatMul(w2) -> L1 on IPU 1 (Manual: the Builder's
    ids; Auto: none given), trained on 2 IPUs without pipelining."""
    b = popart.Builder()
    x, w1, w2 = mlp(b)
    with b.virtualGraph(0) if mode == "Manual" else _nothing():
        h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1], "mm1")], "relu")
    with b.virtualGraph(1) if mode == "Manual" else _nothing():
        loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([h, w2], "mm2")], 0.5,
                                    popart.ReductionType.Sum, "l1")
    o = popart.SessionOptions()
    o.virtualGraphMode = getattr(popart.VirtualGraphMode, mode)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(0.1),
                               popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}),
                               userOptions=o)
    return s, h


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check_copies(ops) -> list:
    """Every op reading a tensor made on another IPU reads its IpuCopy ``<t>_c<ipu>``,
    made earlier from the producer's IPU (interipucopy.cpp); the copies, in order."""
    made, copies = {}, []
    for op in ops:
        ipu = op["attributes"].get("__ipu_number")
        if op["type"] == "IpuCopy":
            ((src,),), ((dst,),) = names([op], "inputs"), names([op], "outputs")
            assert dst == f"{src}_c{op['attributes']['__destIpu']}"
            assert op["attributes"]["__sourceIpus"] == "{%s}" % made[src]
            copies.append((src, made[src], op["attributes"]["__destIpu"]))
            made[dst] = op["attributes"]["__destIpu"]
            continue
        if ipu is None:     # var updates
            continue
        for t in names([op], "inputs")[0]:
            assert made.get(t, ipu) == ipu, (op["name"], t)
        for t in names([op], "outputs")[0]:
            made.setdefault(t, ipu)
    return copies


@pytest.mark.parametrize("mode", ["Manual", "Auto"])
def test_sharded_training_copies_gradients_back(mode):
    """InterIpuCopy after autodiff (interipucopy.cpp): a grad op runs on its forward op's
    IPU; the gradient of Relu's output, made by mm2's grad op on IPU 1, is copied to IPU 0
    (from the later IPU to the earlier) as Gradient___<h>_c0 before ReluGrad reads it.
    Auto: AutoVirtualGraph's ids are serialized as each op's __ipu_number, the ones the
    engine placed the ops on."""
    s, h = two_ipu_mlp(mode)
    ops = ir_ops(s)
    ipus = {op["name"]: op["attributes"].get("__ipu_number") for op in ops if op["name"]}
    assert [ipus[k] for k in ("mm1", "relu", "mm2", "l1")] == ["0", "0", "1", "1"]
    assert [ipus[k + "_Grad"] for k in ("l1", "mm2", "relu", "mm1")] == ["1", "1", "0", "0"]
    assert check_copies(ops) == [(h, "0", "1"), (GRAD + h, "1", "0")]
    relu_grad = next(op for op in ops if op["name"] == "relu_Grad")
    assert GRAD + h + "_c0" in names([relu_grad], "inputs")[0]
    if mode == "Auto":   # the engine's placement of the same ops
        plan = s._plan().placed.stages
        placed = {n.outputs[0]: plan.stage_ipu[k] for k, nodes in enumerate(plan.nodes)
                  for n in nodes}
        assert {op["name"]: int(op["attributes"]["__ipu_number"]) for op in ops
                if op["name"] in ("mm1", "relu", "mm2", "l1")} == \
            {op["name"]: placed[op["outputs"][0]["name"]] for op in ops
             if op["name"] in ("mm1", "relu", "mm2", "l1")}


def test_inference_auto_virtual_graphs_with_the_session_s_options():
    """An InferenceSession with VirtualGraphMode.Auto: each op of its IR JSON carries
    AutoVirtualGraph's id and the boundary's activation is copied to IPU 1."""
    b = popart.Builder()
    x, w1, w2 = mlp(b)
    y = b.aiOnnx.matmul([b.aiOnnx.relu([b.aiOnnx.matmul([x, w1], "mm1")], "relu"), w2], "mm2")
    o = popart.SessionOptions()
    o.virtualGraphMode = popart.VirtualGraphMode.Auto
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}),
                                userOptions=o)
    ops = json.loads(s._serializeIr(popart.IrSerializationFormat.JSON))["maingraph"]
    copies = check_copies(ops)
    assert len(copies) == 1 and copies[0][1:] == ("0", "1")
    assert {op["attributes"]["__ipu_number"] for op in ops if op["type"] != "IpuCopy"} == {"0", "1"}

"""The popart.ir / popxl user guide's first examples (seeds 002 and 003): an IR whose main
graph loads two host streams, adds them and stores the sum; then a variable plus a constant.
"""
import numpy as np

import popxl
import popxl.ops as ops

ir = popxl.Ir()
main = ir.main_graph()
with main:
    # host load
    input0 = popxl.h2d_stream([1], popxl.float32, name="input0_stream")
    a = ops.host_load(input0, "a")
    input1 = popxl.h2d_stream([1], popxl.float32, name="input1_stream")
    b = ops.host_load(input1, "b")

    # addition
    o = ops.add(a, b)

    # host store
    o_d2h = popxl.d2h_stream(o.shape, o.dtype, name="output_stream")
    ops.host_store(o_d2h, o)

with popxl.Session(ir, "ipu_model") as session:
    outputs = session.run({input0: np.array([1.5], np.float32),
                           input1: np.array([2.25], np.float32)})
print(f"a + b = {outputs[o_d2h]}")
assert np.allclose(outputs[o_d2h], [3.75])

# Variables and constants live in the main graph; `+` with a Python literal works too.
ir = popxl.Ir()
with ir.main_graph():
    v = popxl.variable(3, dtype=popxl.int8, name="variable_a")
    c = popxl.constant(1, dtype=popxl.int8, name="constant_b")
    s = v + c
    d2h = popxl.d2h_stream(s.shape, s.dtype, name="sum")
    ops.host_store(d2h, s)
with popxl.Session(ir, "cpu") as session:
    out = session.run()
print(f"variable_a + constant_b = {out[d2h]} ({out[d2h].dtype})")
assert out[d2h] == 4
print("popxl_example: OK")

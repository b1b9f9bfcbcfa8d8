"""The internal IR: graphs of nodes over named tensors, ONNX import, and the passes that
rewrite them (``popart.ir`` is PopART's public alias of popxl, not this package)."""

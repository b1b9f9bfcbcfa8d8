"""The C++ custom ops that Graphcore's popxl applications (github.com/graphcore/examples) carry
in their own trees, where they differ from popxl-addons' ops of the same module name: each
variant is chosen by its C++ source beside the binding (docs/custom_ops.md lists every
custom op those applications use)."""
from __future__ import annotations

from .bindings import EXAMPLES_DOMAIN, binding_op, register_binding, source_contains

# nlp/dolly/popxl and nlp/llama/popxl: modelling/rotary_pos_embed/, popxl-addons' files except
# rotary_pos_embedx.cpp, whose forward rotates the contiguous halves of the head
register_binding("rotary_pos_embed_binding",
                 when=source_contains("rotary_pos_embedx.cpp", "x.slice({0, h_2}, 3)"),
                 RotaryPosEmbedOp=binding_op("RotaryPosEmbed", ("rotary_dim",),
                                             domain=EXAMPLES_DOMAIN))

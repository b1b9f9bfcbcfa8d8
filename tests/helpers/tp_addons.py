"""The tensor-parallel ops of tests/helpers/tp_layers.py taken from popxl-addons, as Graphcore's
popxl applications use them: ``replicated_all_reduce_identical_inputs`` /
``_identical_grad_inputs`` (its ReplicatedAllReduceTP custom op), ``rotary_pos_embed`` with
``trig_table_constants`` (GPT-J's interleaved rotation) and ``cross_entropy_sharded_loss``;
their C++ ops run as this project's Python equivalents (``popart.custom_ops``). The Adam step
is popxl-addons' ``AdamOptimizerStep`` module (its graph, variable factories and binding)."""
from __future__ import annotations


from typing import Optional

import popxl
from popxl import ReplicaGrouping, Tensor

from . import tp_layers
from .addons import import_addons
from .tp_layers import Adam, Config, TPOps


def addons_ops() -> TPOps:
    """The TPOps of popxl-addons (ImportError when it cannot be imported)."""
    import_addons()
    from popxl_addons.ops.cross_entropy_sharded_loss import cross_entropy_sharded_loss
    from popxl_addons.ops.replicated_all_reduce_TP import (replicated_all_reduce_identical_grad_inputs,
                                                           replicated_all_reduce_identical_inputs)
    from popxl_addons.ops.rotary_pos_embed import rotary_pos_embed, trig_table_constants

    def rope(t: Tensor, cfg: Config) -> Tensor:
        """GPT-J's rotation by popxl-addons' op; LLaMA's half rotation has no addons op."""
        if cfg.family != "gptj":
            return tp_layers.rope(t, cfg)
        sin, cos = trig_table_constants(cfg.seq, cfg.rotary_dim)
        return rotary_pos_embed(t, sin, cos, cfg.rotary_dim)

    def loss(logits: Tensor, labels: Tensor, offset: Tensor, group: ReplicaGrouping, _: TPOps) -> Tensor:
        """cross_entropy_sharded_loss takes labels already shifted to this rank's classes."""
        return cross_entropy_sharded_loss(logits, labels - offset, replica_grouping=group)

    return TPOps(lambda x, g: replicated_all_reduce_identical_inputs(x, "add", g),
                 lambda x, g: replicated_all_reduce_identical_grad_inputs(x, "add", g), rope, loss)


class AddonsAdam(Adam):
    """:class:`tp_layers.Adam`'s step by popxl-addons' ``AdamOptimizerStep``: a graph per weight
    whose optimizer state (first / second order in float32, step) comes from its variable
    factories, with the weight's replica grouping, bound and called on (weight, gradient)."""

    def step(self, var: Tensor, grad: Tensor, grouping: Optional[ReplicaGrouping]) -> None:
        import_addons()
        from popxl_addons.optimizers.adam import AdamOptimizerStep
        facts, graph = AdamOptimizerStep().create_graph(
            var, var.spec, replica_grouping=grouping, lr=self.lr, beta1=self.beta1, beta2=self.beta2,
            eps=self.eps, weight_decay=self.weight_decay, first_order_dtype=popxl.float32)
        graph.bind(facts.init(f"{var.name}/adam")).call(var, grad)

"""popxl.Ir: the main graph, subgraphs, variables, streams and the replication settings."""
from __future__ import annotations

import popart

import inspect
import itertools
import typing
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .graph import Graph
from .replica_grouping import ReplicaGrouping
from .streams import DeviceToHostStream, HostToDeviceStream
from .tensor import Tensor, TensorByRef, TensorSpec, graph_input, graph_output

_IDS = itertools.count()


def _is_by_ref(hint: Any) -> bool:
    if hint is TensorByRef or hint in ("TensorByRef", "popxl.TensorByRef"):
        return True
    if isinstance(hint, str):
        return hint.replace(" ", "") in ("List[TensorByRef]", "Tuple[TensorByRef]",
                                         "list[TensorByRef]", "tuple[TensorByRef]")
    return typing.get_origin(hint) in (list, tuple) and TensorByRef in typing.get_args(hint)


class Ir:
    """PopXL intermediate representation: a main graph and the subgraphs it calls."""

    def __init__(self, replication: Union[int, str] = 1) -> None:
        """``replication``: the number of replicas, or "popdist": this instance's share of the
        replicas of a job started by ``poprun`` (``popdist.popart.configureSessionOptions``:
        ``replication_factor`` is then the job's, ``instance_replication_factor`` this
        instance's)."""
        self._id = next(_IDS)
        self._num_host_transfers = 1
        # The session options PopART keeps on its Ir (replication; engine caching).
        self._options = popart.SessionOptions()
        self._use_popdist = replication == "popdist"
        if self._use_popdist:
            import popdist.popart
            popdist.popart.configureSessionOptions(self._options)
        else:
            self.replication_factor = replication
        self._stream_names: set[str] = set()
        self._graph_names: dict[str, int] = {}
        self._variables: list = []
        self._variable_data: dict = {}       # Variable -> host value (an np.memmap kept as is)
        self._has_read_only_memmap = False   # a variable's data is a read-only np.memmap
        self._remote_buffers: dict = {}      # id -> popxl.RemoteBuffer
        self._remote_entries: dict = {}      # (RemoteBuffer, offset) -> its remote Variable
        self._h2d: list[HostToDeviceStream] = []
        self._d2h: list[DeviceToHostStream] = []
        self._graphs: list[Graph] = []
        self._intermediate_ids = itertools.count()   # PopART's Ir::createIntermediateTensorId
        self._op_ids = itertools.count(100)          # PopART's Ir::opsCounter (op ids)
        self._main = Graph(self, "main")
        self._graphs.append(self._main)

    # ------------------------------------------------------------------ properties
    @property
    def id(self) -> int:
        return self._id

    @property
    def main_graph(self) -> Graph:
        return self._main

    @property
    def replication_factor(self) -> int:
        """The number of replicas: with several instances (``Ir(replication="popdist")``),
        of all of them (the global replication factor)."""
        return self._options.getGlobalReplicationFactor()

    @replication_factor.setter
    def replication_factor(self, value: int) -> None:
        """Set this instance's number of replicas (as popxl: ``replicatedGraphCount``),
        before a session is made for the Ir."""
        if getattr(self, "_session", None) is not None:
            raise RuntimeError(f"The `Ir` {self.id} is already prepared, you probably have created "
                               f"a session associated with this ir and cannot change the "
                               f"replication_factor after this.")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"replication must be an int >= 1 or 'popdist', got {value!r}")
        if value > 1:
            self._options.enableReplicatedGraphs = True
        self._options.replicatedGraphCount = int(value)

    @property
    def instance_replication_factor(self) -> int:
        """The number of replicas of this instance (equal to ``replication_factor`` unless
        the Ir is one of several instances)."""
        return self._options.localReplicationFactor()

    @property
    def num_host_transfers(self) -> int:
        return self._num_host_transfers

    @num_host_transfers.setter
    def num_host_transfers(self, value: int) -> None:
        if int(value) < 1:
            raise ValueError(f"num_host_transfers must be >= 1, got {value}")
        self._num_host_transfers = int(value)

    # ------------------------------------------------------------------ graphs
    def _create_name(self, name: str) -> str:
        name = name.replace(".<locals>", "")
        k = self._graph_names.get(name, 0)
        self._graph_names[name] = k + 1
        return f"{name}_{k}"

    @property
    def _pb_ir(self) -> Any:
        """PopART's binding view of this Ir (``popart._internal.ir.Ir``), live."""
        from . import _pb
        return _pb.Ir(self)

    @property
    def _graph_cache(self) -> dict[str, Graph]:
        """Each graph of the Ir by its id, the main graph's included (PopXL's private map,
        which popxl-addons reads): a new dict per read, made from the Ir's graphs."""
        return {g.id: g for g in self._graphs}

    def create_empty_graph(self, name: Optional[str] = None) -> Graph:
        """A new, empty subgraph."""
        g = Graph(self, self._create_name(name or "graph"), parent=self._main)
        self._graphs.append(g)
        return g

    def create_graph(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
        """A subgraph built by calling ``fn``: Tensor / TensorSpec arguments (also inside
        lists, ``*args`` and ``**kwargs``) become graph inputs, in signature order; the returned
        tensors become its outputs."""
        from .module import Module
        func = fn.build if isinstance(fn, Module) else fn
        if not callable(func):
            raise TypeError("Callable `fn` must be either a function or a class that extends popxl.Module")
        qualname = type(fn).__qualname__ if isinstance(fn, Module) else getattr(fn, "__qualname__", "graph")
        sig = inspect.signature(func, follow_wrapped=True)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise ValueError("The arguments, `args` and `kwargs`, do not match the signature "
                             f"of the function `fn`: {e}") from e
        bound.apply_defaults()
        graph = self.create_empty_graph(qualname)
        with graph:
            arguments = bound.arguments
            for name, arg in list(arguments.items()):
                param = sig.parameters[name]
                by_ref = _is_by_ref(param.annotation)
                if isinstance(arg, (Tensor, TensorSpec)):
                    arguments[name] = graph_input(arg.shape, arg.dtype, name, by_ref=by_ref,
                                                  meta_shape=arg.meta_shape)
                elif isinstance(arg, (tuple, list, dict)) and arg:
                    items = list(arg.items()) if isinstance(arg, dict) else \
                        [(f"{name}_{i}", a) for i, a in enumerate(arg)]
                    is_t = [isinstance(a, (Tensor, TensorSpec)) for _, a in items]
                    if any(is_t) and not all(is_t):
                        raise TypeError(f"A {type(arg).__name__} argument can't contain a mixture "
                                        f"of Tensors and other types. Arg name: {name}. Value: {arg}")
                    if all(is_t):
                        new = [(k, graph_input(a.shape, a.dtype, k, by_ref=by_ref, meta_shape=a.meta_shape))
                               for k, a in items]
                        arguments[name] = dict(new) if isinstance(arg, dict) else \
                            type(arg)(t for _, t in new) if isinstance(arg, tuple) else [t for _, t in new]
            result = func(*bound.args, **bound.kwargs)
            if result is None:
                outputs = []
            elif isinstance(result, Tensor):
                outputs = [result]
            else:
                outputs = list(result) if isinstance(result, typing.Iterable) else [result]
            if not all(isinstance(o, Tensor) for o in outputs):
                raise ValueError("Output of subgraph must be None, a Tensor or an iterable of "
                                 f"Tensors. Output type: {type(result)}. Value {result}")
            for o in outputs:
                graph_output(o)
        graph._finalize()
        return graph

    # ------------------------------------------------------------------ replica groupings
    def replica_grouping(self, stride: Union[int, Sequence[int]] = 1,
                         group_size: Optional[int] = None) -> ReplicaGrouping:
        """Groups of ``group_size`` replicas ``stride`` apart (default: all replicas)."""
        if isinstance(stride, (list, tuple)):
            return self.replica_grouping_from_assignments(stride)
        return ReplicaGrouping(self.replication_factor, stride, group_size)

    def replica_grouping_from_assignments(self, assignment: Sequence[int]) -> ReplicaGrouping:
        """A grouping with an arbitrary group for each replica."""
        return ReplicaGrouping(self.replication_factor, assignment=assignment)

    # ------------------------------------------------------------------ streams
    def get_all_h2d_streams(self) -> set[HostToDeviceStream]:
        """Every host-to-device stream that a host_load op reads."""
        return set(self._h2d)

    def get_all_d2h_streams(self) -> set[DeviceToHostStream]:
        """Every device-to-host stream that a host_store op writes."""
        return set(self._d2h)

    # ------------------------------------------------------------------ debugging
    def dot_checkpoint(self, check: str, save_dir: Optional[Union[Path, str]] = None) -> None:
        """Write the graphs in Graphviz DOT format to ``save_dir`` (default: the current
        directory) as ``<check>.dot``."""
        folder = Path(save_dir) if save_dir is not None else Path(".")
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["digraph popxl {"]
        for g in self._graphs:
            ir = g._finalize()
            lines.append(f'  subgraph "cluster_{ir.name}" {{ label="{ir.name}";')
            for i, n in enumerate(ir.nodes):
                op = f'"{ir.name}/op{i}"'
                lines.append(f'    {op} [shape=box label="{n.domain}::{n.op_type}"];')
                lines += [f'    "{ir.name}/{t}" -> {op};' for t in n.inputs if t]
                lines += [f'    {op} -> "{ir.name}/{t}";' for t in n.outputs if t]
            lines.append("  }")
        lines.append("}")
        from popart.fileio import atomic_write
        atomic_write(folder / f"{check}.dot", ("\n".join(lines) + "\n").encode())

    def __repr__(self) -> str:
        return (f"Ir(id={self._id}, replication={self.replication_factor}, "
                f"graphs={[g.name for g in self._graphs]})")

"""``popart._internal.ir.op.exchange``: the host exchange op classes."""
from popxl._pb import op_class

HostLoadOp = op_class("HostLoadOp")
HostStoreOp = op_class("HostStoreOp")
RemoteLoadOp = op_class("RemoteLoadOp")
RemoteStoreOp = op_class("RemoteStoreOp")

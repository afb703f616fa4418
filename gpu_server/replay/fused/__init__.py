"""Reference implementations (plain torch) of torch_npu fused operators, for replay on the bench device.

``FUSED_REFERENCES`` maps a bare torch_npu operator name to its forward reference; ``get_reference(name)`` returns it
or None. See ``docs/fused_ops.md`` for the supported operators, their signatures and limitations.
"""

from gpu_server.replay.fused import attention as _attention  # noqa: F401  (registers npu_fusion_attention)
from gpu_server.replay.fused import ops as _ops  # noqa: F401  (registers the other operators)
from gpu_server.replay.fused.registry import FUSED_REFERENCES, get_reference, reference

__all__ = ["FUSED_REFERENCES", "get_reference", "reference"]

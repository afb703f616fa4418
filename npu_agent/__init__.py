"""npu_agent: runs inside the training process; captures every API call and streams it to gpu_server."""
from npu_agent.config import ConfigError
from npu_agent.debugger import PrecisionDebugger
from npu_agent.seed import seed_all

__all__ = ["PrecisionDebugger", "seed_all", "ConfigError"]

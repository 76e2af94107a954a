from .config import EngineConfig
from .engine import Engine, GenerationOutput, RequestError
from .request import FinishReason, RequestOutput

__all__ = ["Engine", "EngineConfig", "GenerationOutput", "RequestError", "FinishReason", "RequestOutput"]

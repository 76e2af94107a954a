"""constrained-spec: structured-output LLM serving with speculative decoding."""
from .sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):  # keep `import constrained_spec` light: torch/xgrammar load on first use
    if name in ("Engine", "EngineConfig", "GenerationOutput", "RequestError"):
        from . import engine
        return getattr(engine, name)
    if name in ("GrammarSpec", "GrammarError"):
        from . import grammar
        return getattr(grammar, name)
    raise AttributeError(name)


__all__ = ["Engine", "EngineConfig", "SamplingParams", "GrammarSpec", "GrammarError", "GenerationOutput"]

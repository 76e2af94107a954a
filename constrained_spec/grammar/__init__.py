"""Grammar-constrained decoding on xgrammar or llguidance (see docs/constraints.md)."""
from .backend import GrammarBackend
from .compile_queue import CompiledGrammar
from .errors import GrammarBusy, GrammarError
from .matcher import RequestMatcher, legal_draft_nodes
from .schema import prepare_schema
from .spec import BACKENDS, GrammarSpec

__all__ = ["GrammarSpec", "GrammarError", "GrammarBusy", "GrammarBackend", "RequestMatcher", "CompiledGrammar",
           "legal_draft_nodes", "prepare_schema", "BACKENDS"]

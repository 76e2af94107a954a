"""Grammar-constrained decoding on top of xgrammar (see docs/constraints.md)."""
from .backend import CompiledGrammar, GrammarBackend, RequestMatcher, legal_draft_nodes
from .errors import GrammarBusy
from .errors import GrammarError
from .schema import prepare_schema
from .spec import GrammarSpec

__all__ = ["GrammarSpec", "GrammarError", "GrammarBusy", "GrammarBackend", "RequestMatcher", "CompiledGrammar",
           "legal_draft_nodes", "prepare_schema"]

"""The grammar backend of the tests that compare outputs across runs (lossless speculation, batch
invariance, cache on/off). Under the default, `auto`, a grammar's first uses are llguidance's and
later ones xgrammar's once its background compile is done: both grammars are exact, but their
whitespace and escape rules differ, so the same greedy request may answer differently before and
after the hand-over. Those tests pin one backend; tests parametrized by backend name theirs."""
PINNED = "xgrammar"

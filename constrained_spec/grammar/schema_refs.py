"""Local `$ref`s of a JSON schema: resolving one (`local_target`), whether a nested `$id` could
re-base them (`has_nested_id`), and refusing a reference that leads only to references back to
itself (`check_ref_cycles`): `{"$ref": "#"}`, or `$defs` that refer to one another and say
nothing else. No value satisfies such a subschema; where a grammar reaches one it has no token to
offer (llguidance let a request write `{"a":` and then allowed only a stop token it refused), so
the request is refused up front instead."""
from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from .errors import GrammarError
from .schema_walk import INERT_BESIDE_REF, children


def check_ref_cycles(schema: Any) -> None:
    """GrammarError naming the first subschema in use (reached from the root, through `$ref`s too)
    whose `$ref` chain, through nodes that are only a `$ref`, comes back to a node it passed. An
    unused definition is left alone."""
    if not isinstance(schema, dict) or has_nested_id(schema, top=True):
        return
    for path, node in _ref_only_in_use(schema):
        seen = set()
        while node is not None and _ref_only(node):
            if id(node) in seen:
                raise GrammarError(f"the '$ref' at {path or 'the schema root'} leads only to references back to "
                                   "itself: no value satisfies it", keyword="$ref", path=path)
            seen.add(id(node))
            node = local_target(schema, node["$ref"])


def has_ref_cycle(schema: Any) -> bool:
    """Whether a local `$ref` leads, through the `$ref`s inside its target, back to itself: the only
    way a schema recurses (`GrammarBackend._refuse_if_unproductive` checks only these under
    llguidance). A schema whose nested `$id` could re-base its references counts as one; a `#anchor`
    reference is not followed."""
    if not isinstance(schema, dict):
        return False
    if has_nested_id(schema, top=True):
        return True
    succ: dict = {}  # a $ref -> the $refs inside its target
    todo = list(_refs_in(schema))
    while todo:
        ref = todo.pop()
        if ref not in succ:
            succ[ref] = _refs_in(local_target(schema, ref))
            todo.extend(succ[ref])
    waiting = {ref: 0 for ref in succ}  # Kahn's topological sort: what a cycle holds is never freed
    for targets in succ.values():
        for t in targets:
            waiting[t] += 1
    free = [ref for ref, n in waiting.items() if n == 0]
    while free:
        for t in succ[free.pop()]:
            waiting[t] -= 1
            if waiting[t] == 0:
                free.append(t)
    return any(waiting.values())


def _refs_in(node: Any) -> set:
    """The `$ref` strings in a subschema, not followed. Walked without recursion."""
    found, stack = set(), [node]
    while stack:
        s = stack.pop()
        if isinstance(s, list):
            stack.extend(s)
        elif isinstance(s, dict):
            if isinstance(s.get("$ref"), str):
                found.add(s["$ref"])
            stack.extend(v for _, _, v in children(s))
    return found


def _ref_only(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get("$ref"), str) and set(node) <= INERT_BESIDE_REF


def _ref_only_in_use(root: dict) -> list:
    """(JSON pointer, node) of each reference-only subschema the root reaches, in the order reached:
    `$defs` count only where a `$ref` leads. Walked without recursion."""
    found, visited, stack = [], set(), [("", root)]
    while stack:
        path, s = stack.pop()
        if isinstance(s, list):
            stack.extend((f"{path}/{i}", v) for i, v in reversed(list(enumerate(s))))
            continue
        if not isinstance(s, dict) or id(s) in visited:
            continue
        visited.add(id(s))
        if _ref_only(s):
            found.append((path, s))
        ref = s.get("$ref")
        target = local_target(root, ref) if isinstance(ref, str) else None
        below = [(at, v) for k, at, v in children(s, path) if k not in ("$defs", "definitions")]
        stack.extend(reversed(below + ([(ref[1:], target)] if target is not None else [])))
    return found


def has_nested_id(s: Any, top: bool = False) -> bool:
    """Whether a subschema below the root sets a base URI (`$id`, draft 4's `id`), against which a
    `#/...` reference inside it would resolve."""
    if isinstance(s, list):
        return any(has_nested_id(v) for v in s)
    if not isinstance(s, dict):
        return False
    if not top and (isinstance(s.get("$id"), str) or isinstance(s.get("id"), str)):
        return True
    return any(has_nested_id(v) for _, _, v in children(s))


def local_target(root: dict, ref: Any) -> Any:
    """The subschema a local `$ref` (`#` or `#/json/pointer`) names, or None (an anchor, `#foo`, or
    a remote or unresolvable reference)."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node

"""Schema coverage per grammar backend: which schemas each serves, how exactly, how fast it compiles,
and what a mask costs per token. CPU only (grammar level, no model; SmolLM2's tokenizer).

For xgrammar (through our normalizer), llguidance and `auto`, on
  * the dev split of JSONSchemaBench (schemas/jsonschemabench-dev.jsonl, 400 schemas with labelled
    instances; labels that `jsonschema` disputes are skipped), and
  * JSON-Schema-Test-Suite draft 2020-12 (schemas/conformance/draft2020-12.jsonl, 366 groups),
each schema is compiled (JSON Schema semantics: strict=False; whitespace as the engine allows it, at
most 16 in a run) within a time limit, or refused (counted by keyword); then every instance, as
`json.dumps` writes it, is tokenized and fed with the stop token to a matcher: a valid instance
refused is a "valid rejected", an invalid one accepted an "invalid accepted" (a soundness bug).

Mask cost: along the valid instances of the dev schemas both backends serve, the time of each
`fill_bitmask` (one row per token, the state after each token of the instance), and a draft tree's
rows per node (`traverse_draft_tree`: xgrammar's native walk, llguidance's Python walk), on chains
of the instance's next 7 tokens with a wrong sibling at every depth.

    python benchmarks/bench_schema_coverage.py [--limit N] [--timeout S]
Writes benchmarks/results/schema_coverage.{json,md,png}.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, SCHEMAS, bar_plot, machine, markdown_table, write_results  # noqa: E402

BACKENDS = ("xgrammar", "llguidance", "auto")
VOCAB = 49152
TREE_DEPTH = 7


def load_sets(limit: int | None):
    dev = [json.loads(line) for line in open(SCHEMAS / "jsonschemabench-dev.jsonl")]
    suite = [json.loads(line) for line in open(SCHEMAS / "conformance" / "draft2020-12.jsonl")]
    dev_rows = []
    for row in dev[:limit]:
        v = validator(row["schema"], formats=True)
        valid = [x for x in row["valid"] if v is None or v.is_valid(x)]
        invalid = [x for x in row["invalid"] if v is None or not v.is_valid(x)]
        dev_rows.append({"id": row["id"], "schema": row["schema"], "valid": valid, "invalid": invalid,
                         "disputed": len(row["valid"]) + len(row["invalid"]) - len(valid) - len(invalid)})
    suite_rows = [{"id": f"{g['file']}: {g['description']}", "schema": g["schema"],
                   "valid": [t["data"] for t in g["tests"] if t["valid"]],
                   "invalid": [t["data"] for t in g["tests"] if not t["valid"]], "disputed": 0}
                  for g in suite[:limit]]
    return {"dev": dev_rows, "conformance": suite_rows}


def validator(schema, formats: bool):
    import jsonschema
    if not isinstance(schema, (dict, bool)):
        return None
    s = schema if isinstance(schema, dict) else {}
    V = jsonschema.validators.validator_for(s, default=jsonschema.Draft202012Validator)
    try:
        return V(schema, format_checker=V.FORMAT_CHECKER if formats else None)
    except Exception:  # noqa: BLE001
        return None


def accepts(grammar, compiled, ids: list[int], stop: int) -> bool:
    m = grammar.matcher(compiled)
    return m.accept_tokens(ids) == len(ids) and m.accept_token(stop)


def coverage(grammar, tokenizer, rows: list[dict], backend: str, timeout: float) -> dict:
    from constrained_spec.grammar import GrammarError, GrammarSpec
    stop = min(grammar.stop_token_ids)
    out = collections.Counter()
    refused_by = collections.Counter()
    served_by = collections.Counter()
    compile_s, unsound, served_ids = [], [], []
    compile_by = collections.defaultdict(list)  # backend that served -> compile seconds
    for row in rows:
        spec = GrammarSpec.json_schema(row["schema"], strict=False).with_backend(backend)
        t0 = time.perf_counter()
        try:
            compiled = grammar.compile(spec, timeout_s=timeout)
        except GrammarError as e:
            if "compile exceeded" in str(e):
                out["timed_out"] += 1
            else:
                out["refused"] += 1
                refused_by[e.keyword or "other"] += 1
            continue
        compile_s.append(compiled.compile_seconds if not compiled.from_disk else time.perf_counter() - t0)
        compile_by[compiled.backend].append(compile_s[-1])
        out["served"] += 1
        served_by[compiled.backend] += 1
        served_ids.append(row["id"])
        for label, instances in (("valid", row["valid"]), ("invalid", row["invalid"])):
            for x in instances:
                ids = tokenizer.encode(json.dumps(x, ensure_ascii=False), add_special_tokens=False)
                ok = accepts(grammar, compiled, ids, stop)
                out[f"{label}_total"] += 1
                if label == "valid" and not ok:
                    out["valid_rejected"] += 1
                if label == "invalid" and ok:
                    out["invalid_accepted"] += 1
                    unsound.append({"id": row["id"], "instance": x, "backend": compiled.backend})
    c = np.array(compile_s) if compile_s else np.zeros(1)
    return {"schemas": len(rows), "served": out["served"], "refused": out["refused"], "timed_out": out["timed_out"],
            "refused_by_keyword": dict(refused_by.most_common()), "served_by": dict(served_by),
            "compile_ms_p50": float(np.percentile(c, 50) * 1e3), "compile_ms_p99": float(np.percentile(c, 99) * 1e3),
            "compile_ms_by_backend": {b: {"p50": float(np.percentile(v, 50) * 1e3), "p99": float(np.percentile(v, 99) * 1e3)}
                                      for b, v in sorted(compile_by.items())},
            "valid_rejected": out["valid_rejected"], "valid_total": out["valid_total"],
            "invalid_accepted": out["invalid_accepted"], "invalid_total": out["invalid_total"],
            "invalid_accepted_cases": unsound[:50], "served_ids": served_ids}


def mask_costs(grammars: dict, tokenizer, rows: list[dict], timeout: float, max_schemas: int) -> dict:
    """Per-token fill and per-node tree-walk times, xgrammar against llguidance, on the dev schemas
    both serve."""
    from constrained_spec.grammar import GrammarError, GrammarSpec
    fills = {"xgrammar": [], "llguidance": []}
    nodes = {"xgrammar": [], "llguidance": []}
    wrong = tokenizer.encode("\n", add_special_tokens=False)[0]
    used = 0
    for row in rows:
        if used >= max_schemas or not row["valid"]:
            continue
        compiled = {}
        try:
            for name, g in grammars.items():
                compiled[name] = g.compile(GrammarSpec.json_schema(row["schema"], strict=False).with_backend(name),
                                           timeout_s=timeout)
        except GrammarError:
            continue
        ids = tokenizer.encode(json.dumps(row["valid"][0], ensure_ascii=False), add_special_tokens=False)
        if not all(accepts(grammars[n], compiled[n], ids, min(grammars[n].stop_token_ids)) for n in grammars):
            continue
        used += 1
        for name, g in grammars.items():
            m = g.matcher(compiled[name])
            bm = g.allocate_bitmask(TREE_DEPTH * 2 + 1)
            for i, t in enumerate(ids):
                t0 = time.perf_counter()
                m.fill_bitmask(bm, 0)
                fills[name].append(time.perf_counter() - t0)
                if i % 4 == 0:  # a tree: the next tokens as a chain, a wrong sibling at each depth
                    tokens, nxt, sib = [ids[i - 1] if i else 0], [-1], [-1]  # node 0: accepted already
                    parent = 0
                    for tok in ids[i:i + TREE_DEPTH]:
                        right, bad = len(tokens), len(tokens) + 1
                        tokens += [tok, wrong]
                        nxt += [-1, -1]
                        sib += [bad, -1]
                        nxt[parent] = right
                        parent = right
                    t0 = time.perf_counter()
                    m.traverse_draft_tree(torch.tensor(nxt), torch.tensor(sib), torch.tensor(tokens),
                                          bm[:len(tokens)])
                    nodes[name].append((time.perf_counter() - t0) / len(tokens))
                assert m.accept_token(t)
    summary = {}
    for name in grammars:
        f, n = np.array(fills[name]) * 1e6, np.array(nodes[name]) * 1e6
        summary[name] = {"fills": int(len(f)), "fill_us_p50": float(np.percentile(f, 50)),
                         "fill_us_p99": float(np.percentile(f, 99)), "fill_us_mean": float(f.mean()),
                         "trees": int(len(n)), "tree_us_per_node_p50": float(np.percentile(n, 50)),
                         "tree_us_per_node_p99": float(np.percentile(n, 99))}
    summary["schemas"] = used
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="first N schemas of each set (default: all)")
    ap.add_argument("--timeout", type=float, default=30.0, help="compile time limit per schema, seconds")
    ap.add_argument("--mask-schemas", type=int, default=100, help="dev schemas timed for the mask cost")
    args = ap.parse_args()
    from constrained_spec.grammar import GrammarBackend
    from constrained_spec.models import load_tokenizer
    tokenizer = load_tokenizer()
    sets = load_sets(args.limit)
    grammars = {name: GrammarBackend(tokenizer, VOCAB, max_whitespace_cnt=16, cache_dir=None,
                                     compile_timeout_s=args.timeout, default_backend=name) for name in BACKENDS}
    results = {}
    for set_name, rows in sets.items():
        for name in BACKENDS:
            t0 = time.perf_counter()
            results[f"{set_name}/{name}"] = r = coverage(grammars[name], tokenizer, rows, name, args.timeout)
            print(f"{set_name:12s} {name:10s} served {r['served']}/{r['schemas']} refused {r['refused']} "
                  f"timed out {r['timed_out']} valid rejected {r['valid_rejected']}/{r['valid_total']} "
                  f"invalid accepted {r['invalid_accepted']}/{r['invalid_total']} "
                  f"compile p50 {r['compile_ms_p50']:.1f} ms p99 {r['compile_ms_p99']:.1f} ms "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    llg_served = set(results["dev/llguidance"]["served_ids"])
    costs = mask_costs({n: grammars[n] for n in ("xgrammar", "llguidance")}, tokenizer,
                       [r for r in sets["dev"] if r["id"] in llg_served], args.timeout, args.mask_schemas)
    for g in grammars.values():
        g.close()
    write(results, costs, args, {k: len(v) for k, v in sets.items()})


def acceptance(results: dict) -> list[dict]:
    """Issue 22's acceptance 1, on the dev split."""
    x, lg, auto = (results[f"dev/{b}"] for b in BACKENDS)
    llg_p99 = max(r["compile_ms_by_backend"].get("llguidance", {}).get("p99", 0.0) for r in (lg, auto))
    return [
        {"check": "auto serves at least as many schemas as either backend alone",
         "value": f"{auto['served']} vs {x['served']} (xgrammar), {lg['served']} (llguidance)",
         "ok": auto["served"] >= max(x["served"], lg["served"])},
        {"check": "no invalid instance accepted (auto)", "value": f"{auto['invalid_accepted']} of {auto['invalid_total']}",
         "ok": auto["invalid_accepted"] == 0},
        {"check": "fewer valid instances rejected than the normalizer + xgrammar",
         "value": f"{auto['valid_rejected']} of {auto['valid_total']} vs {x['valid_rejected']} of {x['valid_total']}",
         "ok": auto["valid_rejected"] < x["valid_rejected"]},
        {"check": "compile p99 under 100 ms for the schemas llguidance serves", "value": f"{llg_p99:.1f} ms",
         "ok": llg_p99 < 100.0},
    ]


def write(results: dict, costs: dict, args, sizes: dict) -> None:
    rows = []
    for key, r in results.items():
        refused = ", ".join(f"{k} {v}" for k, v in list(r["refused_by_keyword"].items())[:6])
        rows.append([*key.split("/"), f"{r['served']} / {r['schemas']}", f"{r['refused']} ({refused})" if refused
                     else "0", r["timed_out"], f"{r['compile_ms_p50']:.1f}", f"{r['compile_ms_p99']:.1f}",
                     f"{r['valid_rejected']} of {r['valid_total']}", f"{r['invalid_accepted']} of {r['invalid_total']}",
                     ", ".join(f"{k} {v}" for k, v in r["served_by"].items()),
                     ", ".join(f"{b} {c['p50']:.1f} / {c['p99']:.1f}" for b, c in r["compile_ms_by_backend"].items())])
    table = markdown_table(["set", "backend", "served", "refused (by keyword, top 6)", "timed out",
                            "compile p50 ms", "compile p99 ms", "valid rejected", "invalid accepted",
                            "compiled by", "compile p50 / p99 ms by backend"], rows)
    checks = acceptance(results)
    check_table = markdown_table(["acceptance (dev split)", "measured", "ok"],
                                 [[c["check"], c["value"], "yes" if c["ok"] else "NO"] for c in checks])
    cost_rows = [[n, costs[n]["fills"], f"{costs[n]['fill_us_p50']:.1f}", f"{costs[n]['fill_us_p99']:.1f}",
                  f"{costs[n]['fill_us_mean']:.1f}", costs[n]["trees"], f"{costs[n]['tree_us_per_node_p50']:.1f}",
                  f"{costs[n]['tree_us_per_node_p99']:.1f}"] for n in ("xgrammar", "llguidance")]
    cost_table = markdown_table(["backend", "fills", "fill us p50", "fill us p99", "fill us mean", "trees",
                                 "tree us/node p50", "tree us/node p99"], cost_rows)
    md = (f"# Schema coverage per grammar backend\n\n`python benchmarks/bench_schema_coverage.py"
          f"{'' if args.limit is None else f' --limit {args.limit}'} --timeout {args.timeout:g}` on {machine().get('cpu', '?')} "
          f"(CPU, {machine()['cpu_count']} cores), SmolLM2 tokenizer, JSON Schema semantics (strict=False), "
          f"at most 16 whitespace in a run. Sets: dev = JSONSchemaBench dev split ({sizes['dev']} schemas), "
          f"conformance = JSON-Schema-Test-Suite draft 2020-12 ({sizes['conformance']} groups). "
          f"xgrammar = our normalizer + xgrammar {version('xgrammar')}; llguidance {version('llguidance')}; auto = llguidance, falling back to "
          f"the normalizer + xgrammar where llguidance refuses.\n\n" + table + "\n" + check_table +
          f"\n## Mask cost per token (dev schemas both serve: {costs['schemas']})\n\n"
          "One `fill_bitmask` per token of a valid instance (the state after each token); a draft tree's "
          f"rows per node (`traverse_draft_tree`, a {TREE_DEPTH}-token chain with a wrong sibling at each depth: "
          "xgrammar's native walk, llguidance's Python walk). Single thread.\n\n" + cost_table)
    payload = {"machine": machine(), "args": vars(args), "sizes": sizes, "acceptance": checks, "coverage":
               {k: {kk: vv for kk, vv in v.items() if kk != "served_ids"} for k, v in results.items()},
               "mask_costs": costs}
    write_results("schema_coverage", payload, md)
    labels = list(results)
    bar_plot(RESULTS / "schema_coverage.png", [k.replace("/", "\n") for k in labels],
             {"served": [results[k]["served"] for k in labels],
              "valid rejected": [results[k]["valid_rejected"] for k in labels],
              "invalid accepted": [results[k]["invalid_accepted"] for k in labels]},
             "schemas / instances", "Schema coverage per grammar backend")


if __name__ == "__main__":
    main()

"""Recall@k of BM25, dense and hybrid retrieval on lookups of rare tokens (codes, acronyms, numbers, names), built
from a knowledge base's own passages, and (``--sets``) on ordinary question sets over the same knowledge base.

The lookup set is deterministic (a function of the passages, ``--max-df``, ``--per-class`` and ``--seed``):

* a token is a match of the knowledge base's BM25 token pattern, compared as BM25 indexes it (lower-cased, stemmed);
  its document frequency is the number of passages (title or text) holding it; it is *rare* when that is at most
  ``--max-df``;
* its class, from how it is written: ``code`` (letters and digits: ``486SX``, ``i487``), ``number`` (digits only:
  ``98``, ``1774``), ``acronym`` (two or more capitals, or a short capitalised symbol: ``IUPAC``, ``CLOS``, ``Cf``),
  ``name`` (a capitalised word of four or more letters that does not start a sentence: ``Cavendish``); English stop
  words and other tokens are never queries;
* ``title`` lookups: a passage title of at most three tokens, one of them rare and of a class above; the query is the
  title, the gold the passages so titled. ``mention`` lookups: a rare token of a passage's text that is no title; the
  gold the passages holding it;
* queries alternate between the bare token and ``What is X?`` (words that are themselves rare in a corpus, such as
  "passage" or "mentions" in FOLDOC, would make a query more than a lookup of X), in sorted order; at most
  ``--per-class`` per (lookup, class), drawn with ``random.Random(seed)``.

A query is found at k when a gold passage is among the k retrieved (each retriever asked for k passages, as a model
with ``n_docs = k`` asks). ``--sets`` (QA files or ``demo:SPLIT``) adds ordinary questions, a passage being gold as in
``benchmarks/hybrid_recall.py`` (the Elements sets' ``element`` is its title; otherwise it holds a gold answer).

    python benchmarks/rare_token_recall.py --sets demo:dev,demo:natural_dev,demo:test,demo:natural   # the demo KB
    python benchmarks/rare_token_recall.py --kb data/foldoc/kb --sets data/foldoc/val.jsonl --out FOLDOC.json
    python benchmarks/rare_token_recall.py --fusion score,rrf --bm25-weight 0.5,1,2    # compare fusions
    python benchmarks/rare_token_recall.py --write-set lookups.jsonl     # also write the lookup set (query, gold rows)

Prints a Markdown table per set (recall@k in %, and hybrid / BM25) and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import Stemmer  # noqa: E402
import torch  # noqa: E402
from bm25s.stopwords import STOPWORDS_EN  # noqa: E402

from rag.demo import qa_path  # noqa: E402
from rag.demo.kb import ensure_demo_kb  # noqa: E402
from rag.eval.metrics import has_answer  # noqa: E402
from rag.knowledge.bm25 import BM25Retriever  # noqa: E402
from rag.knowledge.hybrid import BM25_WEIGHT, NUMERAL_WEIGHT, RRF_K, HybridRetriever  # noqa: E402
from rag.knowledge.knowledge_base import KnowledgeBase  # noqa: E402
from rag.knowledge.retriever import DenseRetriever, default_query_encoder  # noqa: E402

CLASSES = ("code", "number", "acronym", "name")
STOP = frozenset(STOPWORDS_EN)
TEMPLATES = ("{}", "What is {}?")
SENTENCE_END = re.compile(r"(?:^|[.!?]\s*|\n\s*)$")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kb", default=None, help="knowledge base with a BM25 index (default: the demo knowledge base)")
    p.add_argument("--sets", default="", help="comma-separated ordinary QA files or demo:SPLIT, measured the same way")
    p.add_argument("--ks", default="1,3,10", help="comma-separated k")
    p.add_argument("--max-df", type=int, default=3, help="a token is rare when at most this many passages hold it")
    p.add_argument("--per-class", type=int, default=300, help="at most this many lookups per (title|mention, class)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fusion", default="score", help="comma-separated hybrid fusions (score, rrf)")
    p.add_argument("--bm25-weight", default=str(BM25_WEIGHT), help="β of score fusion; a comma-separated list sweeps it")
    p.add_argument("--numeral-weight", default=str(NUMERAL_WEIGHT),
                   help="score fusion's factor on β for queries with a digit; a comma-separated list sweeps it")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--show-losses", type=int, default=5, help="print up to this many lookups BM25 finds at 1 and hybrid not")
    p.add_argument("--write-set", type=Path, default=None, help="also write the lookup set here (JSON lines)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "rare_token_recall.json")
    return p.parse_args(argv)


def token_class(word: str, start: int, text: str) -> str | None:
    """The class of `word` (as written, found at `start` of `text`), or None when it is no lookup token."""
    if word.lower() in STOP:
        return None
    has_digit, has_alpha = any(c.isdigit() for c in word), any(c.isalpha() for c in word)
    if has_digit and has_alpha:
        return "code"
    if has_digit:
        return "number"
    if not word.isalpha():
        return None
    capitals = sum(c.isupper() for c in word)
    if capitals >= 2 or (word[0].isupper() and len(word) <= 3 and not SENTENCE_END.search(text[:start])):
        return "acronym"
    if word[0].isupper() and len(word) >= 4 and not SENTENCE_END.search(text[:start]):
        return "name"
    return None


def lookup_set(passages, token_pattern: str, stemmer: str | None, *, max_df: int, per_class: int,
               seed: int) -> list[dict]:
    """The rare-token lookups of the module docstring: dicts with ``query``, ``token``, ``lookup`` (title|mention),
    ``class`` and ``gold`` (sorted passage rows). Tokens are compared as BM25 indexes them: lower-cased, then stemmed
    by `stemmer` (a PyStemmer algorithm; None: not stemmed)."""
    pattern = re.compile(token_pattern)
    stem = Stemmer.Stemmer(stemmer).stemWord if stemmer else (lambda w: w)
    key = functools.cache(lambda word: stem(word.lower()))
    holders: dict[str, set[int]] = defaultdict(set)
    for row, p in enumerate(passages):
        for field in (p.title or "", p.text):
            for m in pattern.finditer(field):
                holders[key(m.group())].add(row)
    titled: dict[str, list[int]] = defaultdict(list)
    for row, p in enumerate(passages):
        if p.title:
            titled[p.title].append(row)
    titles_lower = {t.lower() for t in titled}
    candidates: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for title, rows in titled.items():
        words = list(pattern.finditer(title))
        if not 1 <= len(words) <= 3:
            continue
        kinds = [token_class(m.group(), m.start(), title) for m in words if len(holders[key(m.group())]) <= max_df]
        kinds = [k for k in kinds if k]
        if kinds:
            candidates[("title", kinds[0])][title.lower()] = {"token": title, "gold": sorted(rows)}
    for p in passages:
        for m in pattern.finditer(p.text):
            word, low = m.group(), key(m.group())
            if len(holders[low]) > max_df or word.lower() in titles_lower:
                continue
            cls = token_class(word, m.start(), p.text)
            if cls and all(low not in c for (lk, _), c in candidates.items() if lk == "mention"):
                candidates[("mention", cls)][low] = {"token": word, "gold": sorted(holders[low])}
    rng = random.Random(seed)
    out = []
    for lookup in ("title", "mention"):
        for cls in CLASSES:
            group = [candidates[(lookup, cls)][t] for t in sorted(candidates[(lookup, cls)])]
            picked = sorted(rng.sample(range(len(group)), min(per_class, len(group))))
            for j, i in enumerate(picked):
                item = group[i]
                query = TEMPLATES[j % 2].format(item["token"])
                out.append({"query": query, "token": item["token"], "lookup": lookup, "class": cls, "gold": item["gold"]})
    return out


def qa_records(spec: str) -> list[dict]:
    path = qa_path(spec[5:]) if spec.startswith("demo:") else Path(spec)
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def qa_gold(passages, record: dict) -> list[int]:
    if "element" in record:
        return [i for i, p in enumerate(passages) if p.title == record["element"]]
    return [i for i, p in enumerate(passages) if has_answer(p, record["answers"])]


def retrieved_rows(retrievers: dict, queries: list[str], q: torch.Tensor, k: int) -> dict[str, np.ndarray]:
    """Each retriever's ``(B, k)`` rows for `queries` (dense vectors `q`, computed once)."""
    out = {}
    for name, r in retrievers.items():
        if isinstance(r, DenseRetriever):
            out[name] = r.search(q, k).rows.numpy()
        elif isinstance(r, HybridRetriever):
            out[name] = r.search(queries, q, k).rows.numpy()
        else:
            out[name] = r.retrieve(queries, k).rows.numpy()
    return out


def measure(retrievers: dict, encoder, items: list[dict], ks: list[int], groups: list[str]) -> tuple[dict, dict]:
    """Recall@k in % per group (``all`` and the given item keys) and retriever, and per-item hits at each k."""
    queries = [it["query"] for it in items]
    q = torch.from_numpy(encoder.encode(queries, show_progress=False))
    hits = {}
    for k in ks:
        for name, rows in retrieved_rows(retrievers, queries, q, k).items():
            hits[(name, k)] = [bool(set(r.tolist()) & set(it["gold"])) for r, it in zip(rows, items)]
    table = {}
    for group in ["all", *groups]:
        for label in sorted({"all" if group == "all" else f"{group}={it[group]}" for it in items}):
            idx = [i for i, it in enumerate(items) if label == "all" or f"{group}={it[group]}" == label]
            row = {"n": len(idx)}
            for (name, k), h in hits.items():
                row[f"{name} R@{k}"] = round(100 * sum(h[i] for i in idx) / len(idx), 1)
            table[label] = row
    return table, hits


def print_table(title: str, table: dict, names: list[str], ks: list[int]) -> None:
    hybrids = [n for n in names if n not in ("bm25", "dense")]
    cols = [f"{n} R@{k}" for k in ks for n in names]
    print(f"\n{title}\n\n| group | n | " + " | ".join(cols) + " | " +
          " | ".join(f"{h} / bm25 @{k}" for k in ks for h in hybrids) + " |")
    print("|---|---:|" + "---:|" * (len(cols) + len(ks) * len(hybrids)))
    for label, row in table.items():
        ratios = []
        for k in ks:
            for h in hybrids:
                b = row[f"bm25 R@{k}"]
                ratios.append(f"{row[f'{h} R@{k}'] / b:.3f}" if b else "-")
        print(f"| {label} | {row['n']} | " + " | ".join(str(row[c]) for c in cols) + " | " + " | ".join(ratios) + " |")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    kb = ensure_demo_kb(show_progress=False) if args.kb is None else KnowledgeBase.open(args.kb)
    if kb.bm25 is None:
        raise SystemExit(f"{kb.path}: has no BM25 index; build the knowledge base with `rag index build --bm25`")
    encoder = default_query_encoder(kb)
    dense = DenseRetriever(kb, encoder)
    bm25 = BM25Retriever(kb.bm25, kb.get_passages, knowledge_base=kb)
    retrievers = {"bm25": bm25, "dense": dense}
    weights = [float(w) for w in args.bm25_weight.split(",")]
    factors = [float(f) for f in args.numeral_weight.split(",")]
    for fusion in args.fusion.split(","):
        for w, f in [(w, f) for w in weights for f in factors] if fusion == "score" else [(BM25_WEIGHT, 1.0)]:
            name = "rrf" if fusion == "rrf" else "hybrid" + (f" β={w}" if len(weights) > 1 else "") + (
                f" ×{f}" if len(factors) > 1 else "")
            retrievers[name] = HybridRetriever(dense, bm25, fusion=fusion, rrf_k=RRF_K, bm25_weight=w, numeral_weight=f)
    names = list(retrievers)
    passages = kb.all_passages()
    items = lookup_set(passages, kb.bm25.token_pattern, kb.bm25.stemmer_name, max_df=args.max_df, per_class=args.per_class,
                       seed=args.seed)
    if args.write_set:
        args.write_set.write_text("".join(json.dumps(it) + "\n" for it in items), encoding="utf-8")
    report = {"kb": str(kb.path), "passages": len(kb), "max_df": args.max_df, "per_class": args.per_class,
              "seed": args.seed, "bm25_title_weight": kb.bm25.title_weight, "ks": ks, "sets": {}}
    table, hits = measure(retrievers, encoder, items, ks, ["lookup", "class"])
    report["sets"]["rare-token lookups"] = table
    print_table(f"rare-token lookups over {kb.path} ({len(kb)} passages, df <= {args.max_df})", table, names, ks)
    for h in names[2:]:
        lost = [it for i, it in enumerate(items) if hits[("bm25", ks[0])][i] and not hits[(h, ks[0])][i]]
        for it in lost[: args.show_losses]:
            print(f"  {h} loses at @{ks[0]}: {it['query']!r} (gold rows {it['gold']})")
    for spec in [s for s in args.sets.split(",") if s]:
        recs = qa_records(spec)
        items_qa = [{"query": r["question"], "gold": qa_gold(passages, r)} for r in recs]
        table, _ = measure(retrievers, encoder, items_qa, ks, [])
        report["sets"][spec] = table
        print_table(f"{spec}", table, names, ks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Hot-swap demonstration on real text: a model's answers follow the knowledge base swapped in.

Lewis et al. (2020, §4.5) show that a RAG model's world knowledge can be updated by replacing
its index, without retraining. This script reproduces that test on the bundled Elements demo
(``rag/demo``: 137 real passages from a public-domain database) with a *controlled edit of real
facts*, so that the two knowledge bases differ in known facts and nothing else:

* **Knowledge base A** is the demo knowledge base (:func:`rag.demo.kb.ensure_demo_kb`: the corpus
  embedded by the bundled all-MiniLM-L6-v2).
* **Knowledge base B** is a counterfactual edition of the same passages: for a chosen set of
  elements (default: the elements of the held-out dev and test questions, which no training
  question mentions) the chemical symbol, the atomic weight and the discovery year are *rotated
  among those elements* — a seeded derangement, so every edited value differs from the original
  and is the real value of another element, written in exactly the original surface form
  (``Symbol: X.``, ``Atomic weight: W.``, ``... in YYYY``). Every other passage is byte-identical.
  It is built with A's encoder, index settings and BM25 option, so the model accepts it as a
  drop-in replacement.
* **Question sets**: ``qa_A`` = the held-out questions about edited facts with their original
  answers, ``qa_B`` = the same questions with the edited answers. Edited facts are the symbol,
  atomic-weight and discovery-year questions, and the inverse symbol questions ("which element
  has the symbol Fe?"), whose answer changes too because the symbol moved to another element.
  A ``control`` set asks unchanged facts (atomic number, element from atomic number) and should
  score the same on both knowledge bases.

One model is then scored on every (knowledge base, question set) pair with the library's
hot-swap evaluation (:func:`rag.eval.hotswap_eval.evaluate_hotswap`, the code behind
``rag hotswap-eval``): a model that reads its answers from the retrieved passages scores high on
the diagonal (matched) and low off it (mismatched). Finally a *live swap* on a loaded pipeline
(:func:`rag.load` + :class:`rag.knowledge.hotswap.KnowledgeBaseSlot`) asks three edited-fact
questions on A, swaps to B, asks again, and swaps back, printing each answer with the
knowledge-base version that produced it.

Usage (the demo checkpoint ``checkpoints/demo`` by default; a few CPU minutes)::

    python examples/hotswap_demo.py --out runs/hotswap_demo
    python examples/hotswap_demo.py --model path/to/checkpoint --limit 20     # quick look

Writes to ``--out``: ``elements_counterfactual.jsonl`` (corpus B), ``edits.json`` (element, field,
old, new), ``kb_B/`` (knowledge base B), ``qa_A.jsonl`` / ``qa_B.jsonl`` / ``qa_control.jsonl``,
``results.md`` (the accuracy table), ``results.json`` (the full matrices, settings and the live
transcript) and ``hotswap_demo.png`` (the matched/mismatched heatmap).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a clone without `pip install -e .`
    sys.path.insert(0, str(REPO))

from rag.demo import SPLITS, load_demo_qa  # noqa: E402
from rag.demo.build_elements import YEAR_PATTERN  # noqa: E402  (the pattern the year questions were generated with)
from rag.knowledge.passages import Passage  # noqa: E402
from rag.utils.errors import ConfigError, RagError  # noqa: E402
from rag.utils.io import atomic_write_json, atomic_write_text  # noqa: E402

logger = logging.getLogger("hotswap_demo")

FIELDS = ("symbol", "atomic_weight", "year")
"""Facts rotated among the chosen elements."""
EDITED_TYPES = {"symbol": "symbol", "name_from_symbol": "symbol", "atomic_weight": "atomic_weight", "year": "year"}
"""Question type -> the edited field its answer depends on."""
CONTROL_TYPES = ("atomic_number", "name_from_number")
"""Question types whose answers the edit leaves unchanged."""

_SYMBOL = re.compile(r"^Symbol: ([^\s.]+)\.(?= |$)")
_WEIGHT = re.compile(r"(?:^|(?<=\. ))Atomic weight: (\S+?)\.(?= |$)")


# ---------------------------------------------------------------------------- the corpus edit


@dataclass(frozen=True)
class FactSpan:
    """One fact's value and its character span in a passage text."""

    value: str
    start: int
    end: int


@dataclass(frozen=True)
class Edit:
    """One edited fact: `field` of `element` changed from `old` to `new`, the real value of `source`."""

    element: str
    passage_id: str
    field: str
    old: str
    new: str
    source: str


def locate_facts(text: str) -> dict[str, FactSpan]:
    """The editable facts stated in an Elements passage: ``symbol``, ``atomic_weight``, ``year``.

    Symbol and atomic weight are read from the ``Symbol: X.`` / ``Atomic weight: W.`` fields the
    corpus builder wrote; the year is the one the demo's year questions were generated from (the
    first year after "discovered", "isolated", ... in the description). Absent facts are omitted.
    """
    facts = {}
    for name, pattern in (("symbol", _SYMBOL), ("atomic_weight", _WEIGHT), ("year", YEAR_PATTERN)):
        m = pattern.search(text)
        if m:
            facts[name] = FactSpan(m.group(1), m.start(1), m.end(1))
    return facts


def value_derangement(values: Sequence[str], rng: random.Random, *, tries: int = 1000) -> list[int]:
    """A permutation `perm` with ``values[perm[i]] != values[i]`` for every i.

    It is one cycle through a seeded shuffle (i takes the value of the next element in the
    shuffled order), redrawn while equal values (two elements discovered the same year) would
    meet. Raises RagError when no such permutation exists (a value held by more than half).
    """
    n = len(values)
    if n < 2:
        raise RagError(f"cannot rotate {n} value(s) among themselves; choose at least two elements with this fact")
    most = max(values.count(v) for v in set(values))
    if 2 * most > n:
        raise RagError(f"{most} of {n} elements share one value, so no rotation changes them all; choose other elements")
    for _ in range(tries):
        order = list(range(n))
        rng.shuffle(order)
        perm = [0] * n
        for k in range(n):
            perm[order[k]] = order[(k + 1) % n]
        if all(values[perm[i]] != values[i] for i in range(n)):
            return perm
    raise RagError(f"found no rotation of {n} values that changes every one in {tries} tries; choose other elements")


def edit_corpus(passages: Sequence[Passage], elements: Sequence[str], *, fields: Sequence[str] = FIELDS,
                seed: int = 0) -> tuple[list[Passage], list[Edit]]:
    """The counterfactual corpus: each of `fields` rotated among the passages titled `elements`.

    For every field, the chosen elements whose passage states it exchange their values through
    :func:`value_derangement` (seeded by `seed` and the field). Only the value's characters change
    (a discovery year stated twice in one passage changes in both places, so that B does not
    contradict itself); passages of other elements are returned unchanged (the same objects).

    Returns:
        (passages in the original order, edits sorted by element then field)

    Raises:
        RagError: an element has no passage, a field is unknown, or a field cannot be rotated.
    """
    unknown = [f for f in fields if f not in FIELDS]
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown}; choose among {', '.join(FIELDS)}")
    by_title = {p.title: i for i, p in enumerate(passages)}
    missing = sorted(set(elements) - set(by_title))
    if missing:
        raise RagError(f"no passage titled {missing}; choose elements from the corpus titles")
    chosen = sorted(set(elements))
    facts = {e: locate_facts(passages[by_title[e]].text) for e in chosen}
    replacements: dict[str, list[tuple[FactSpan, str]]] = {e: [] for e in chosen}
    edits = []
    for fi, field in enumerate(fields):
        holders = [e for e in chosen if field in facts[e]]
        values = [facts[e][field].value for e in holders]
        perm = value_derangement(values, random.Random(seed * 1000 + fi))
        for i, e in enumerate(holders):
            source = holders[perm[i]]
            span = facts[e][field]
            spans = [span]
            if field == "year":  # the same year stated again ("... discovered X in 1964. ... discovered Y in 1964.")
                text = passages[by_title[e]].text
                spans = [FactSpan(span.value, m.start(), m.end()) for m in re.finditer(rf"\b{re.escape(span.value)}\b", text)]
            replacements[e] += [(s, values[perm[i]]) for s in spans]
            edits.append(Edit(e, passages[by_title[e]].id, field, values[i], values[perm[i]], source))
    out = list(passages)
    for e, reps in replacements.items():
        if not reps:
            continue
        text = passages[by_title[e]].text
        for span, new in sorted(reps, key=lambda r: r[0].start, reverse=True):  # right to left: spans stay valid
            text = text[: span.start] + new + text[span.end :]
        old = passages[by_title[e]]
        out[by_title[e]] = Passage(old.id, old.title, text)
    for ed in edits:  # the edited passage must state the new value where the questions look for it
        got = locate_facts(out[by_title[ed.element]].text).get(ed.field)
        if got is None or got.value != ed.new:
            raise RagError(f"{ed.element}: after the edit the {ed.field} reads {got and got.value!r}, not {ed.new!r}")
    edits.sort(key=lambda ed: (ed.element, FIELDS.index(ed.field)))
    return out, edits


def corpus_jsonl(passages: Sequence[Passage]) -> str:
    """Passages as JSONL in the bundled corpus's exact format (one ``{"id", "title", "text"}`` per line)."""
    return "".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}, ensure_ascii=False) + "\n" for p in passages)


# ---------------------------------------------------------------------------- question sets


def question_sets(rows: Sequence[dict], edits: Sequence[Edit], *,
                  types: Sequence[str] = tuple(EDITED_TYPES)) -> dict[str, list[dict]]:
    """Split demo QA rows about edited elements into ``A`` / ``B`` (edited facts) and ``control``.

    ``A`` keeps the original answers, ``B`` has the same questions in the same order with the
    answers the counterfactual corpus states (``original_answers`` keeps the old ones). For
    ``name_from_symbol`` ("which element has the symbol Fe?") the B answer is the element that
    received that symbol. ``control`` holds the questions of :data:`CONTROL_TYPES` about the same
    elements (unchanged answers).

    Raises:
        RagError: a question's answer disagrees with the fact the corpus states (QA and corpus
            out of sync), or `types` names a type that is not editable.
    """
    bad = [t for t in types if t not in EDITED_TYPES]
    if bad:
        raise ConfigError(f"question type(s) {bad} are not edited; choose among {', '.join(EDITED_TYPES)}")
    edited = {(ed.element, ed.field): ed for ed in edits}
    new_symbol_owner = {ed.new: ed.element for ed in edits if ed.field == "symbol"}
    elements = {ed.element for ed in edits}
    sets: dict[str, list[dict]] = {"A": [], "B": [], "control": []}
    for q in rows:
        if q["element"] not in elements:
            continue
        t = q["type"]
        if t in CONTROL_TYPES:
            sets["control"].append(dict(q))
            continue
        if t not in types:
            continue
        ed = edited.get((q["element"], EDITED_TYPES[t]))
        if ed is None:
            continue
        if t == "name_from_symbol":
            if not re.search(rf"\b{re.escape(ed.old)}\b", q["question"]) or q["answers"] != [q["element"]]:
                raise RagError(f"question {q['question']!r} does not ask for the element with {q['element']}'s symbol {ed.old!r}")
            new = new_symbol_owner[ed.old]
        else:
            if ed.old not in q["answers"]:
                raise RagError(f"question {q['question']!r} answers {q['answers']} but the corpus states {ed.old!r}")
            new = ed.new
        sets["A"].append(dict(q))
        sets["B"].append({**q, "answers": [new], "original_answers": list(q["answers"])})
    return sets


def held_out_elements(splits: Sequence[str] = ("dev", "test")) -> list[str]:
    """Elements asked about in the given demo QA splits (dev/test: absent from every training question)."""
    return sorted({q["element"] for s in splits for q in load_demo_qa(s)})


def write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------- knowledge base B


def build_counterfactual_kb(kb_a, passages: Sequence[Passage], out: Path, *, encoder=None, show_progress: bool = True):
    """Knowledge base B at `out`: `passages` embedded and indexed exactly as `kb_a` was.

    The document encoder is re-loaded from `kb_a`'s manifest (name, pooling, normalisation,
    length; or `encoder`, a TextEncoder) and must have the same weights fingerprint; the index
    spec and the BM25 option are `kb_a`'s. An existing `out` holding the same passages, encoder
    and index is reused; anything else there is replaced.

    Raises:
        RagError: the encoder does not reproduce `kb_a`'s fingerprint.
    """
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    want = kb_a.encoder
    passages = list(passages)
    if (out / "manifest.json").is_file():
        try:
            kb = KnowledgeBase.open(out)
            if (kb.encoder.get("fingerprint") == want.get("fingerprint") and kb.index_spec == kb_a.index_spec
                    and (kb.bm25 is None) == (kb_a.bm25 is None) and kb.all_passages() == passages):
                logger.info("reusing knowledge base B at %s (%s)", out, kb.version)
                return kb
        except RagError as e:
            logger.warning("%s: rebuilding knowledge base B (%s)", out, e)
    if encoder is None:
        encoder = TextEncoder(want["name"], pooling=want.get("pooling", "auto"), normalize=want.get("normalize"),
                              max_length=want.get("max_length", 256), role="context")
    got = encoder.identity()
    if got["fingerprint"] != want.get("fingerprint"):
        raise RagError(f"encoder {want['name']!r} now loads weights {got['fingerprint'][:12]}..., but knowledge base A "
                       f"({kb_a.path}) was embedded by {str(want.get('fingerprint'))[:12]}...; rebuild A first")
    return KnowledgeBase.build(
        passages, encoder, out, index=kb_a.index_spec, bm25=kb_a.bm25 is not None, show_progress=show_progress,
        overwrite=True, build_info={"corpus": "rag.demo (Elements database), counterfactual edition (examples/hotswap_demo.py)",
                                    "edited_from": kb_a.version},
    )


# ---------------------------------------------------------------------------- evaluation


def markdown_table(main, control=None) -> str:
    """The EM (F1) matrix as a markdown table: rows = knowledge bases, columns = question sets (diagonal in bold)."""
    cols = [f"{label} (n={n})" for label, n in zip(main.data_labels, main.n_questions)]
    if control is not None:
        cols += [f"{label} (n={n})" for label, n in zip(control.data_labels, control.n_questions)]
    lines = ["| knowledge base | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for i, (label, version) in enumerate(zip(main.kb_labels, main.kb_versions)):
        cells = []
        for j in range(len(main.data_labels)):
            cell = f"{100 * main.em[i][j]:.1f} ({100 * main.f1[i][j]:.1f})"
            cells.append(f"**{cell}**" if main.paired and i == j else cell)
        if control is not None:
            cells += [f"{100 * control.em[i][j]:.1f} ({100 * control.f1[i][j]:.1f})" for j in range(len(control.data_labels))]
        lines.append(f"| {label} (`{version}`) | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Exact match (token F1), %. qa_A: edited-fact questions with the original answers; qa_B: the same questions "
                 "with the edited answers; control: questions about unchanged facts. Bold: each question set on its own "
                 "knowledge base.")
    if main.paired:
        lines.append(f"Matched EM {100 * main.matched():.1f}, mismatched EM {100 * main.mismatched():.1f}.")
    return "\n".join(lines)


def pick_live_questions(qa_a: Sequence[dict], qa_b: Sequence[dict], n: int = 3) -> list[dict]:
    """`n` edited-fact questions for the live swap, of as many different types as possible, about one
    element when it has them all (the first such element in question order)."""
    pairs = [(a, b) for a, b in zip(qa_a, qa_b)]
    by_element: dict[str, list] = {}
    for a, b in pairs:
        by_element.setdefault(a["element"], []).append((a, b))
    want = ["symbol", "atomic_weight", "year", "name_from_symbol"][:n]
    chosen = next((qs for qs in by_element.values() if {a["type"] for a, _ in qs} >= set(want)), None)
    if chosen is not None:
        picked = [next((a, b) for a, b in chosen if a["type"] == t) for t in want]
    else:
        picked, seen = [], set()
        for a, b in pairs:
            if a["type"] not in seen:
                picked.append((a, b))
                seen.add(a["type"])
        picked += [p for p in pairs if p not in picked][: max(0, n - len(picked))]
        picked = picked[:n]
    return [{"question": a["question"], "type": a["type"], "element": a["element"], "answer_A": a["answers"][0],
             "answer_B": b["answers"][0]} for a, b in picked]


def live_swap(pipe, kb_b_path: Path, questions: Sequence[dict], **gen_kw) -> dict:
    """Ask `questions` on the serving knowledge base, swap to B, ask again, swap back, ask again.

    Uses a :class:`KnowledgeBaseSlot` over the pipeline's retriever, as a server would. Returns
    the transcript: per phase the knowledge-base version, the swap timing, and per question the
    answer, the version that produced it and the top passage's text.
    """
    from rag.knowledge.hotswap import KnowledgeBaseSlot

    slot = KnowledgeBaseSlot.for_model(pipe)
    qs = [q["question"] for q in questions]
    phases = []

    def ask(label: str, swap=None) -> None:
        answers = pipe.generate(qs, **gen_kw)
        phases.append({
            "phase": label, "kb_version": slot.version, "swap": None if swap is None else swap.to_dict(),
            "answers": [{"question": q["question"], "answer": a.text, "kb_version": a.kb_version,
                         "expected_A": q["answer_A"], "expected_B": q["answer_B"],
                         "top_passage": f"{a.passages[0].title}: {a.passages[0].text}" if a.passages else None}
                        for q, a in zip(questions, answers)],
        })

    ask("A")
    try:
        ask("B", slot.swap(kb_b_path))
    finally:
        back = slot.swap_back()
    ask("A again", back)
    return {"questions": list(questions), "phases": phases}


def print_live(transcript: dict, file=None) -> None:
    """Print a :func:`live_swap` transcript (to stdout by default)."""
    file = sys.stdout if file is None else file
    for ph in transcript["phases"]:
        swap = ph["swap"]
        how = "" if swap is None else (f"  ({swap['kind']} in {swap['seconds']:.3f} s, "
                                       f"lock held {1e3 * swap['commit_seconds']:.3f} ms)")
        print(f"\n[{ph['phase']}] serving {ph['kb_version']}{how}", file=file)
        for a in ph["answers"]:
            print(f"  Q: {a['question']}", file=file)
            print(f"     answer {a['answer']!r} from {a['kb_version']}   (A says {a['expected_A']!r}, B says "
                  f"{a['expected_B']!r})",
                  file=file)
            if a["top_passage"]:
                top = a["top_passage"]
                print(f"     top passage: {top[:110]}{'...' if len(top) > 110 else ''}", file=file)


# ---------------------------------------------------------------------------- the script


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring for the outputs.")
    ap.add_argument("--model", default=None, help="RagModel checkpoint directory (default: checkpoints/demo)")
    ap.add_argument("--out", type=Path, default=Path("runs/hotswap_demo"), help="output directory (default: runs/hotswap_demo)")
    ap.add_argument("--kb-a", type=Path, default=None,
                    help="knowledge base A (default: the demo knowledge base, built on first use by rag.demo.kb.ensure_demo_kb)")
    ap.add_argument("--splits", default="dev,test", help="demo QA splits to ask (default: dev,test, the held-out elements)")
    ap.add_argument("--elements", default=None,
                    help="comma-separated element names to edit (default: every element asked about in --splits)")
    ap.add_argument("--types", default=",".join(EDITED_TYPES),
                    help=f"edited-fact question types (default: {','.join(EDITED_TYPES)})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the rotation (default 0)")
    ap.add_argument("--no-control", action="store_true", help="skip the unchanged-facts control column")
    ap.add_argument("--live", type=int, default=3, help="questions in the live-swap transcript (0: skip it)")
    ap.add_argument("--limit", type=int, default=None, help="score only the first N questions of each set")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--n-docs", type=int, default=None, help="passages per question (default: the model's)")
    ap.add_argument("--num-beams", type=int, default=1)
    ap.add_argument("--decoding", choices=["thorough", "fast"], default="thorough")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    args.splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    bad = [s for s in args.splits if s not in SPLITS]
    if bad or not args.splits:
        ap.error(f"--splits: unknown split(s) {bad}; choose among {', '.join(SPLITS)}")
    args.types = [t.strip() for t in args.types.split(",") if t.strip()]
    if args.elements is not None:
        args.elements = [e.strip() for e in args.elements.split(",") if e.strip()]
    return args


def run(args: argparse.Namespace, *, encoder=None) -> dict:
    """Everything the script does; returns what it writes to ``results.json``.

    `encoder` (a TextEncoder) replaces the one re-loaded from knowledge base A's manifest
    for building B (tests pass a tiny one).
    """
    import torch

    from rag.eval.hotswap_eval import evaluate_hotswap
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.pipeline.api import load

    torch.set_num_threads(args.threads)
    if args.quiet:
        import datasets
        import transformers

        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    show = not args.quiet

    # Knowledge base A and the model.
    if args.kb_a is None:
        from rag.demo.kb import ensure_demo_kb

        kb_a = ensure_demo_kb(show_progress=show)
    else:
        kb_a = KnowledgeBase.open(args.kb_a)
    if args.model is None:
        from rag.demo.model import demo_checkpoint_dir

        args.model = str(demo_checkpoint_dir())

    # Knowledge base B: the counterfactual edition.
    rows = [q for s in args.splits for q in load_demo_qa(s)]
    elements = args.elements if args.elements is not None else sorted({q["element"] for q in rows})
    passages_a = kb_a.all_passages()
    passages_b, edits = edit_corpus(passages_a, elements, seed=args.seed)
    corpus_file = out / "elements_counterfactual.jsonl"
    atomic_write_text(corpus_file, corpus_jsonl(passages_b))
    atomic_write_json(out / "edits.json", {"seed": args.seed, "elements": sorted(set(elements)), "fields": list(FIELDS),
                                           "edits": [asdict(e) for e in edits]})
    kb_b = build_counterfactual_kb(kb_a, passages_b, out / "kb_B", encoder=encoder, show_progress=show)
    n_changed = sum(a.text != b.text for a, b in zip(passages_a, passages_b))
    print(f"knowledge base A: {kb_a.path} ({kb_a.version}, {len(kb_a)} passages)")
    print(f"knowledge base B: {kb_b.path} ({kb_b.version}): {len(edits)} facts of {len({e.element for e in edits})} elements "
          f"rotated, {n_changed} passages changed, {len(passages_b) - n_changed} identical")
    for e in edits[:6]:
        print(f"  {e.element}: {e.field} {e.old} -> {e.new} (the real {e.field} of {e.source})")
    if len(edits) > 6:
        print(f"  ... {len(edits) - 6} more in {out / 'edits.json'}")

    # Question sets.
    sets = question_sets(rows, edits, types=args.types)
    if not sets["A"]:
        raise RagError("no edited-fact questions: the chosen elements have no questions of the chosen types in --splits")
    files = {name: write_jsonl(out / f"qa_{name}.jsonl", qs) for name, qs in sets.items() if qs}
    print(f"questions: {len(sets['A'])} about edited facts (qa_A / qa_B), {len(sets['control'])} about unchanged facts (control)")

    # One model, both knowledge bases, both question sets.
    pipe = load(args.model, knowledge_base=kb_a.path)
    gen_kw = dict(n_docs=args.n_docs, num_beams=args.num_beams, decoding=args.decoding, max_new_tokens=args.max_new_tokens)
    eval_kw = dict(batch_size=args.batch_size, limit=args.limit, kb_labels=["A: Elements", "B: edited"],
                   show_progress=show, **gen_kw)
    kbs = [kb_a.path, kb_b.path]
    main = evaluate_hotswap(pipe, kbs, [files["A"], files["B"]], data_labels=["qa_A: original", "qa_B: edited"],
                            **eval_kw)
    control = None
    if not args.no_control and "control" in files:
        control = evaluate_hotswap(pipe, kbs, [files["control"]], data_labels=["control: unchanged"], **eval_kw)
    table = markdown_table(main, control)
    print()
    print(table)
    plot = main.plot(out / "hotswap_demo.png")
    atomic_write_text(out / "results.md", table + "\n")

    transcript = None
    if args.live > 0:
        transcript = live_swap(pipe, kb_b.path, pick_live_questions(sets["A"], sets["B"], args.live), **gen_kw)
        print("\nlive swap on one loaded pipeline:")
        print_live(transcript)

    result = {
        "model": str(args.model),
        "kb_A": {"path": str(kb_a.path), "version": kb_a.version},
        "kb_B": {"path": str(kb_b.path), "version": kb_b.version, "edited_facts": len(edits), "changed_passages": n_changed},
        "edited": main.to_dict(),
        "control": None if control is None else control.to_dict(),
        "live_swap": transcript,
        "settings": {"splits": args.splits, "types": args.types, "seed": args.seed, "limit": args.limit,
                     "threads": args.threads, **gen_kw},
        "files": {"corpus": str(corpus_file), "edits": str(out / "edits.json"), "table": str(out / "results.md"),
                  "heatmap": str(plot), **{f"qa_{k}": str(v) for k, v in files.items()}},
    }
    atomic_write_json(out / "results.json", result)
    print(f"\nwrote {out / 'results.md'}, {out / 'results.json'}, {plot}")
    return result


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    for handler in logging.getLogger().handlers:  # libraries that set their own loggers to DEBUG (bm25s) stay quiet
        handler.setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    args = parse_args(argv)
    try:
        run(args)
    except RagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Build ``elements_natural_dev.jsonl`` (``demo:natural_dev``): naturally worded questions of the kinds of
``demo:natural``, about other elements, to choose between recipes on while ``demo:natural`` stays a test set.

Answers come from the corpus itself: the field header (symbol, atomic number, atomic weight) and a single
"discovered by NAME in YEAR" / "discovered in YEAR by NAME" sentence; each question kind has its own wordings, none
of them a training template. Deterministic (``--seed``); ``python -m rag.demo.natural_dev`` rewrites the file.
"""

from __future__ import annotations

import argparse
import json
import random
import re

from rag.demo import DEMO_DIR, EVAL_SETS, load_demo_corpus, load_demo_qa
from rag.utils.io import atomic_write_text

_FIELDS = re.compile(r"^Symbol: (\S+)\. Atomic number: (\d+)\. Atomic weight: ([\d.]+)\.")
_NAME = r"((?:[A-Z]\.\s?)*[A-Z][a-z]+(?: (?:[A-Z]\.\s?)*[A-Z][a-z]+)*)"
_BY_IN = re.compile(r"\b[Dd]iscovered by " + _NAME + r" in (1[5-9]\d\d)\b")
_IN_BY = re.compile(r"\b[Dd]iscovered in (1[5-9]\d\d) by " + _NAME + r"\b")

WORDINGS = {
    "discoverer": ("Who was the discoverer of {n}?", "Which scientist discovered {n}?", "Who is credited with discovering {n}?",
                   "{N} was discovered by whom?"),
    "year": ("What year was {n} first discovered?", "{N} was discovered in which year?",
             "In what year did the discovery of {n} happen?"),
    "protons": ("How many protons are in a {n} atom?", "What is the number of protons in {n}?", "{N} has how many protons?"),
    "name_from_number": ("Name the element with {z} protons.", "Element number {z} is which element?",
                         "What's element {z} of the periodic table?"),
    "symbol": ("What letters stand for {n} on the periodic table?", "Give the chemical symbol of {n}.", "{N}'s symbol is what?"),
    "name_from_symbol": ("What element does the symbol {s} stand for?", "{s} is the symbol of which element?"),
    "atomic_weight": ("What's the atomic mass of {n}?", "How heavy is {n}'s atom, in atomic mass units?"),
}
COUNTS = {"discoverer": 12, "year": 7, "protons": 6, "name_from_number": 6, "symbol": 6, "name_from_symbol": 5,
          "atomic_weight": 4}


def _discovery(text: str):
    """(discoverer, year) of the passage's one "discovered by … in …" sentence, else None."""
    found = [(m.group(1), m.group(2)) for m in _BY_IN.finditer(text)] + [(m.group(2), m.group(1)) for m in _IN_BY.finditer(text)]
    return found[0] if len(found) == 1 else None


def build(seed: int = 7) -> list[dict]:
    """The question set: per kind ``COUNTS[kind]`` elements (at most two kinds per element), none asked in ``natural``."""
    rng = random.Random(seed)
    asked = {r["element"] for r in load_demo_qa("natural")}
    passages = [p for p in load_demo_corpus()
                if p.title not in asked and not p.title.lower().startswith(("un", "deuterium", "tritium"))]
    rng.shuffle(passages)
    rows, kinds_of = [], {}
    for kind, count in COUNTS.items():
        made = 0
        for p in passages:
            if made == count:
                break
            fields = _FIELDS.match(p.text)
            if fields is None or len(kinds_of.get(p.title, ())) >= 2:
                continue
            symbol, number, weight = fields.groups()
            if kind in ("discoverer", "year"):
                found = _discovery(p.text)
                if found is None:
                    continue
                who, year = found
                answers = ([who] + ([who.split()[-1]] if " " in who else [])) if kind == "discoverer" else [year]
            else:
                answers = {"protons": [number], "symbol": [symbol], "atomic_weight": [weight]}.get(kind, [p.title])
            wording = WORDINGS[kind][made % len(WORDINGS[kind])]
            question = wording.format(n=p.title.lower(), N=p.title, z=number, s=symbol)
            rows.append({"question": question, "answers": answers, "type": kind, "element": p.title})
            kinds_of.setdefault(p.title, []).append(kind)
            made += 1
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    rows = build(args.seed)

    atomic_write_text(DEMO_DIR / EVAL_SETS["natural_dev"], "".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} questions -> {DEMO_DIR / EVAL_SETS['natural_dev']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

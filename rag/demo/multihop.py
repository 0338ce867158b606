"""Two-hop questions over the bundled Elements corpus with their Self-Ask decompositions (for Self-Ask training and
evaluation, Yoran et al. 2024 §3).

Each question goes through a bridge element: "what is the chemical symbol of the element discovered by Priestley?"
-> ``Follow up: which element was discovered by Priestley?`` (Oxygen) -> ``Follow up: what is the chemical symbol of
oxygen?`` (O). Bridges: the discoverer (only surnames that name one element in the corpus), the atomic number, the
symbol. The second follow-up is the demo QA question of that type verbatim, and every record keeps the element's QA
split, so held-out elements' multi-hop questions are held out too.

``python -m rag.demo.multihop`` rewrites ``rag/demo/elements_multihop.jsonl`` (deterministic, seed 0).
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from typing import Optional

from rag.demo import DEMO_DIR, SPLITS, load_demo_corpus, load_demo_qa
from rag.utils.files import parse_json
from rag.utils.io import atomic_write_text

MULTIHOP_PATH = DEMO_DIR / "elements_multihop.jsonl"
DISCOVERER = re.compile(r"\b[Dd]iscovered (?:\w+ )?(?:in \d{4} )?by (?:Sir )?((?:[A-Z][a-z]+ )*(?:(?:de|del|von) "
                        r")?[A-Z][a-z]{2,})"
                        r"(?! [A-Z]\.| \.| "  # not a name cut at an initial ("Glenn T."), nor "Berkeley researchers"
                        r"researchers)\b")
PARTICLES = ("de", "del", "von")
ATTRIBUTE_WORDS = {"symbol": "chemical symbol", "atomic_number": "atomic number", "atomic_weight": "atomic weight",
                   "year": "discovery year"}

__all__ = ["MULTIHOP_PATH", "discoverers", "build_multihop", "load_multihop", "main"]


def discoverers() -> dict[str, str]:
    """Element title -> its discoverer's surname, for surnames that occur in exactly one element's passage."""
    found = {}
    for p in load_demo_corpus():
        m = DISCOVERER.search(p.text)
        if m:
            words = m.group(1).split()
            cut = next((i for i, w in enumerate(words) if w in PARTICLES), len(words) - 1)  # "Manuel del Rio" -> "del Rio"
            found[p.title] = " ".join(words[cut:])
    counts = defaultdict(int)
    for surname in found.values():
        counts[surname] += 1
    return {title: s for title, s in found.items() if counts[s] == 1}


def _by_element() -> tuple[dict[str, dict[str, dict]], dict[str, str]]:
    qa: dict[str, dict[str, dict]] = defaultdict(dict)
    split_of = {}
    for split in SPLITS:
        for x in load_demo_qa(split):
            qa[x["element"]][x["type"]] = x
            split_of[x["element"]] = split
    return qa, split_of


def _record(question: str, bridge: dict, second: dict, element: str, split: str, kind: str) -> dict:
    return {"question": question, "answers": list(second["answers"]), "type": kind, "element": element, "split": split,
            "follow_ups": [{"question": bridge["question"], "answer": bridge["answer"]},
                           {"question": second["question"], "answer": second["answers"][0]}]}


def build_multihop(seed: int = 0, per_bridge: int = 1) -> list[dict]:
    """The two-hop records: ``question``, ``answers``, ``type`` (``<bridge>-><attribute>``), ``element``, ``split`` and
    ``follow_ups`` (two ``{"question", "answer"}``). `per_bridge` attributes are drawn (seeded) per element and bridge."""
    rng = random.Random(seed)
    qa, split_of = _by_element()
    found = discoverers()
    out = []
    for element in sorted(qa):
        types = qa[element]
        bridges: list[tuple[str, dict, str]] = []
        if element in found:
            bridges.append(("discoverer", {"question": f"which element was discovered by {found[element]}?", "answer": element},
                            f"the element discovered by {found[element]}"))
        if "name_from_number" in types:
            t = types["name_from_number"]
            n = t["question"].rsplit(" ", 1)[-1].rstrip("?")
            bridges.append(("number", {"question": t["question"], "answer": element}, f"the element with atomic number {n}"))
        if "name_from_symbol" in types:
            t = types["name_from_symbol"]
            s = t["question"].rsplit(" ", 1)[-1].rstrip("?")
            bridges.append(("symbol", {"question": t["question"], "answer": element}, f"the element with the symbol {s}"))
        for bridge, first, phrase in bridges:
            excluded = {"number": "atomic_number", "symbol": "symbol"}.get(bridge)
            attributes = [a for a in ATTRIBUTE_WORDS if a in types and a != excluded]
            for a in rng.sample(attributes, min(per_bridge, len(attributes))):
                question = f"what is the {ATTRIBUTE_WORDS[a]} of {phrase}?"
                out.append(_record(question, first, types[a], element, split_of[element], f"{bridge}->{a}"))
    return out


def load_multihop(split: Optional[str] = None) -> list[dict]:
    """The bundled two-hop records (of one QA split when given)."""
    with open(MULTIHOP_PATH, encoding="utf-8") as f:
        rows = [parse_json(line, f"{MULTIHOP_PATH}:{n}", fix="reinstall rag") for n, line in enumerate(f, 1)]
    return [r for r in rows if split is None or r["split"] == split]


def main() -> None:
    rows = build_multihop()
    atomic_write_text(MULTIHOP_PATH, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    counts = defaultdict(int)
    for r in rows:
        counts[r["split"]] += 1
    print(f"wrote {len(rows)} questions to {MULTIHOP_PATH} ({dict(counts)})")


if __name__ == "__main__":
    main()

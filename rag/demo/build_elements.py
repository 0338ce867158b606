"""Build the bundled demo corpus and QA pairs from the Elements database.

Source: Jay F. Kominek's "The Elements" database (public domain), as packaged by
Debian in `dict-elements` (`/usr/share/dictd/elements.dict.dz`). Run::

    apt-get install dict-elements
    python -m rag.demo.build_elements            # rewrites rag/demo/*.jsonl

The outputs are committed, so users never need the Debian package. Questions are
generated from each entry's fields; the held-out splits (dev, test) ask about
elements that appear in no training question, so their answers exist only in the
corpus: a closed-book model cannot know them, a retrieval-augmented one can.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
from pathlib import Path

from rag.utils.io import atomic_write_text

DICT_PATH = Path("/usr/share/dictd/elements.dict.dz")
OUT_DIR = Path(__file__).resolve().parent
_FIELD = re.compile(r"^(Symbol|Atomic number|Atomic weight|Atomic Weight|Weight):\s*(.+)$")
YEAR_PATTERN = re.compile(r"\b(?:discovered|isolated|identified|first made|produced|synthesi[sz]ed)\b[^.]*?\b(1[5-9]\d\d)\b",
                          re.I)


def parse_entries(raw: str) -> list[dict]:
    """Split the dict source into entries: headword, fields, and description."""
    entries = []
    blocks = re.split(r"\n\s*\n", raw)
    for block in blocks:
        lines = [ln.strip() for ln in block.strip().splitlines() if ln.strip()]
        if not lines or lines[0].startswith("00-database") or lines[0].startswith("00database"):
            continue
        head = lines[0]
        if not re.fullmatch(r"[A-Za-z]+", head):
            continue
        fields, desc = {}, []
        for ln in lines[1:]:
            m = _FIELD.match(ln)
            if m and not desc:
                fields[m.group(1).lower()] = m.group(2).strip()
            else:
                desc.append(ln)
        text = re.sub(r"\s+", " ", " ".join(desc)).replace("{", "").replace("}", "").strip()
        entries.append({"name": head, "fields": fields, "description": text})
    return entries


def passage_text(entry: dict) -> str:
    parts = []
    f = entry["fields"]
    if "symbol" in f:
        parts.append(f"Symbol: {f['symbol']}.")
    if "atomic number" in f:
        parts.append(f"Atomic number: {f['atomic number']}.")
    if "atomic weight" in f:
        parts.append(f"Atomic weight: {f['atomic weight']}.")
    if entry["description"]:
        parts.append(entry["description"])
    return " ".join(parts)


def questions_for(entry: dict) -> list[dict]:
    """NQ-open style QA pairs whose answers are stated in the entry's passage."""
    name = entry["name"].lower()
    title = _title(entry["name"])
    f = entry["fields"]
    qa = []
    if "symbol" in f:
        qa.append({"question": f"what is the chemical symbol of {name}?", "answers": [f["symbol"]], "type": "symbol"})
        qa.append({"question": f"which element has the symbol {f['symbol']}?", "answers": [title], "type": "name_from_symbol"})
    if "atomic number" in f:
        qa.append({"question": f"what is the atomic number of {name}?", "answers": [f["atomic number"]], "type": "atomic_number"})
        qa.append({"question": f"which element has atomic number {f['atomic number']}?", "answers": [title],
                   "type": "name_from_number"})
    if "atomic weight" in f:
        qa.append({"question": f"what is the atomic weight of {name}?", "answers": [f["atomic weight"]], "type": "atomic_weight"})
    m = YEAR_PATTERN.search(entry["description"])
    if m:
        qa.append({"question": f"in what year was {name} discovered?", "answers": [m.group(1)], "type": "year"})
    for q in qa:
        q["element"] = title
    return qa


def _title(name: str) -> str:
    return name if name.isupper() else name.capitalize()


def build(dict_path: Path = DICT_PATH, out_dir: Path = OUT_DIR, seed: int = 0, held_out: float = 0.3) -> dict:
    # The database is Latin-1 (e.g. "Wöhler"), not UTF-8.
    raw = gzip.open(dict_path, "rt", encoding="latin-1").read()
    entries = parse_entries(raw)
    corpus = [{"id": f"elements/{e['name'].lower()}", "title": _title(e["name"]), "text": passage_text(e)} for e in entries]
    # Held-out elements: every question about them goes to dev/test, none to train.
    askable = sorted({_title(e["name"]) for e in entries if questions_for(e)})
    rng = random.Random(seed)
    rng.shuffle(askable)
    n_held = int(round(len(askable) * held_out))
    dev_set, test_set = set(askable[: n_held // 2]), set(askable[n_held // 2 : n_held])
    splits: dict[str, list[dict]] = {"train": [], "dev": [], "test": []}
    for e in entries:
        for q in questions_for(e):
            split = "dev" if q["element"] in dev_set else "test" if q["element"] in test_set else "train"
            splits[split].append(q)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "elements.jsonl", "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in corpus))
    for split, rows in splits.items():
        atomic_write_text(out_dir / f"elements_qa_{split}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return {"passages": len(corpus), **{split: len(rows) for split, rows in splits.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dict", type=Path, default=DICT_PATH, help="path to elements.dict.dz")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(build(args.dict, args.out, args.seed)))


if __name__ == "__main__":
    main()

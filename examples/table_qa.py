"""Table-of-facts QA from Debian's ``iso-codes`` (ISO 639-3 languages): pages that are tables of rows, questions that
ask one cell of one row, for trying ``rag fit`` on a corpus shape unlike a dictionary.

    apt-get install iso-codes
    python examples/table_qa.py --out data/iso639_pages        # 7,910 rows, 8 to a page

writes ``corpus.jsonl``: pages of ``--rows-per-page`` rows in code order, each row ``code | name | scope | type;``
(e.g. ``tlh | Klingon | individual | constructed;``) titled by the page's first and last code, and ``train.jsonl`` /
``val.jsonl`` / ``test.jsonl``, split by row (a held-out row is in the corpus and in no training question), each row
asked one way, at random: "What is the ISO 639-3 code of the Klingon language?" -> ``tlh`` or "Which language has
the ISO 639-3 code tlh?" -> ``Klingon``. A reader must find the row the question names among its neighbours and copy
the right cell; closed-book, a model can only guess codes from names. Build its knowledge base with
``rag index build --corpus data/iso639_pages/corpus.jsonl --encoder minilm --index flat --bm25 --out
data/iso639_pages/kb``. iso-codes is LGPL-2.1; the files are built here, never committed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rag.utils.io import atomic_write_text  # noqa: E402

SOURCE = Path("/usr/share/iso-codes/json/iso_639-3.json")
SCOPES = {"I": "individual", "M": "macrolanguage", "S": "special"}
TYPES = {"L": "living", "E": "extinct", "A": "ancient", "H": "historical", "C": "constructed", "S": "special"}
QUESTIONS = ("What is the ISO 639-3 code of the {name} language?", "Which language has the ISO 639-3 code {code}?")


def read_rows(path: Path) -> list[dict]:
    """Rows (code, name, scope, type) of ISO 639-3 whose name is unique and has no table separator."""
    try:
        records = json.loads(path.read_text(encoding="utf-8"))["639-3"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{path}: not iso-codes' ISO 639-3 JSON ({e}); apt-get install iso-codes, or pass --source") from None
    names: dict[str, int] = {}
    for r in records:
        names[r["name"].lower()] = names.get(r["name"].lower(), 0) + 1
    return [{"code": r["alpha_3"], "name": r["name"], "scope": SCOPES.get(r.get("scope"), "other"),
             "type": TYPES.get(r.get("type"), "other")}
            for r in records if names[r["name"].lower()] == 1 and "|" not in r["name"] and ";" not in r["name"]]


def pages(rows: list[dict], per_page: int) -> list[dict]:
    rows = sorted(rows, key=lambda r: r["code"])
    out = []
    for i in range(0, len(rows), per_page):
        chunk = rows[i:i + per_page]
        out.append({"id": f"t{len(out)}", "title": f"ISO 639-3 {chunk[0]['code']} - {chunk[-1]['code']}",
                    "text": " ".join(f"{r['code']} | {r['name']} | {r['scope']} | {r['type']};" for r in chunk)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=SOURCE)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows-per-page", type=int, default=8)
    p.add_argument("--held-out", type=int, default=600, help="rows held out (half validation, half test)")
    p.add_argument("--train", type=int, default=2500, help="training questions")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = read_rows(args.source)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    docs = pages(rows, args.rows_per_page)
    atomic_write_text(args.out / "corpus.jsonl", "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    chosen = rows[:]
    rng.shuffle(chosen)
    n_val = args.held_out // 2
    splits = {"val": chosen[:n_val], "test": chosen[n_val:args.held_out],
              "train": chosen[args.held_out:args.held_out + args.train]}
    for name, split in splits.items():
        lines = []
        for r in split:
            ask = rng.randrange(2)
            lines.append(json.dumps({"question": QUESTIONS[ask].format(**r), "answers": [r["code"] if ask == 0 else r["name"]]},
                                    ensure_ascii=False) + "\n")
        atomic_write_text(args.out / f"{name}.jsonl", "".join(lines))
    print(f"{args.out}: {len(rows)} rows in {len(docs)} pages; " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

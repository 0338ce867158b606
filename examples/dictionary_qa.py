"""Definition QA from a dictd dictionary (Debian ``dict-foldoc``, ``dict-jargon``, ``dict-gcide``...): a corpus and
"What is X?" questions whose answers exist only in the corpus, for trying ``rag fit`` on data the package never saw.

    apt-get download dict-foldoc && dpkg -x dict-foldoc_*.deb /tmp/foldoc
    python examples/dictionary_qa.py /tmp/foldoc/usr/share/dictd/foldoc --out data/foldoc      # 3,000 entries

writes ``corpus.jsonl`` (one document per entry: title = headword, text = definition), ``train.jsonl`` /
``val.jsonl`` / ``test.jsonl`` (``{"question": "What is X?", "answers": [first sentence of X's definition]}``, split by
entry: a held-out term's definition is in the corpus and in no training answer). Build its knowledge base with
``rag index build --corpus data/foldoc/corpus.jsonl --encoder minilm --index flat --out data/foldoc/kb``. The
dictionaries' licences allow this use; the files are built here, never committed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rag.utils.io import atomic_write_text  # noqa: E402

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64(s: str) -> int:
    v = 0
    for ch in s:
        v = v * 64 + _B64.index(ch)
    return v


def read_dictd(base: Path) -> list[tuple[str, str]]:
    """(headword, definition) of every distinct entry of ``base.index`` / ``base.dict.dz``, markup removed."""
    data = gzip.open(base.with_suffix(".dict.dz")).read()
    seen, out = set(), []
    for line in base.with_suffix(".index").read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith("00"):
            continue
        span = (_b64(parts[1]), _b64(parts[2]))
        if span in seen:
            continue
        seen.add(span)
        lines = data[span[0]:span[0] + span[1]].decode("utf-8", errors="replace").strip("\n").split("\n")
        head = lines[0].strip() or parts[0]
        text = " ".join(" ".join(lines[1:]).split())
        text = " ".join(re.sub(r"[{}]", "", re.sub(r"<[^>]*>", " ", text)).split())  # field tags, cross-reference braces
        text = re.sub(r"\(\d{4}-\d{2}-\d{2}\)\s*$", "", text).strip()  # the entry's date stamp
        out.append((head, text))
    return out


def first_sentence(text: str) -> str:
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return (m.group(1) if m else text).strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dictionary", type=Path, help="the dictd base path (without .index / .dict.dz)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--entries", type=int, default=3000)
    p.add_argument("--held-out", type=int, default=300, help="terms held out (half validation, half test)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    entries = []
    for head, text in read_dictd(args.dictionary):
        answer = first_sentence(text)
        if 4 <= len(answer.split()) <= 30 and len(text.split()) >= 6 and head.lower() not in answer.lower()[:len(head) + 2]:
            entries.append((head, text, answer))
    heads = {}
    for e in entries:
        heads.setdefault(e[0].lower(), e)  # one entry per headword
    rng = random.Random(args.seed)
    chosen = sorted(heads.values())
    rng.shuffle(chosen)
    chosen = chosen[:args.entries]
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "corpus.jsonl", "".join(
        json.dumps({"id": f"e{i}", "title": h, "text": t}, ensure_ascii=False) + "\n" for i, (h, t, _) in enumerate(chosen)))
    n_val = args.held_out // 2
    splits = {"val": chosen[:n_val], "test": chosen[n_val:args.held_out], "train": chosen[args.held_out:]}
    for name, rows in splits.items():
        atomic_write_text(args.out / f"{name}.jsonl", "".join(
            json.dumps({"question": f"What is {h}?", "answers": [a]}, ensure_ascii=False) + "\n" for h, _, a in rows))
    print(f"{args.out}: {len(chosen)} entries; " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Definition QA from a dictd dictionary (Debian ``dict-foldoc``, ``dict-jargon``, ``dict-gcide``...): a corpus and
"What is X?" questions whose answers exist only in the corpus, for trying ``rag fit`` on data the package never saw.

    apt-get download dict-foldoc && dpkg -x dict-foldoc_*.deb /tmp/foldoc
    python examples/dictionary_qa.py /tmp/foldoc/usr/share/dictd/foldoc --out data/foldoc      # 3,000 entries

writes ``corpus.jsonl`` (one document per entry: title = headword, text = definition), ``train.jsonl`` /
``val.jsonl`` / ``test.jsonl`` (``{"question": "What is X?", "answers": [first sentence of X's definition]}``, split by
entry: a held-out term's definition is in the corpus and in no training answer).

``--entries-per-page N`` makes the other shape, a glossary: N short entries per document ("term: its first sense. term:
..."), in alphabetical order, the answer one entry's few words, so the reader has to find the entry the question names
among its neighbours (WordNet, 1,500 pages of 6):

    python examples/dictionary_qa.py /usr/share/dictd/wn --entries 9000 --entries-per-page 6 --train 2500 \
        --held-out 300 --question "What does {term} mean?" --out data/wn_pages

Build its knowledge base with ``rag index build --corpus data/foldoc/corpus.jsonl --encoder minilm --index flat --out
data/foldoc/kb``. The dictionaries' licences allow this use; the files are built here, never committed.
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


def short_definition(text: str, max_words: int) -> str:
    """The first sense of a definition, without WordNet's part-of-speech and sense markers ("n 1: ..."), up to its
    first ';', '[', ':' or sentence end."""
    text = re.sub(r"^(?:n|v|adj|adv)\s+(?:1:\s*)?", "", text.strip())
    text = re.split(r"\s+2:\s|;|\[|:|(?<=[.!?])\s", text, maxsplit=1)[0].strip().rstrip(".")
    words = text.split()
    return " ".join(words) if len(words) <= max_words else ""


def pages(entries: list[tuple[str, str]], per_page: int) -> list[dict]:
    """(term, short definition) entries, alphabetical, `per_page` to a document titled by its first and last term."""
    entries = sorted(entries, key=lambda e: e[0].lower())
    out = []
    for i in range(0, len(entries), per_page):
        chunk = entries[i:i + per_page]
        out.append({"id": f"p{len(out)}", "title": f"{chunk[0][0]} - {chunk[-1][0]}",
                    "text": " ".join(f"{t}: {d}." for t, d in chunk)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dictionary", type=Path, help="the dictd base path (without .index / .dict.dz)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--entries", type=int, default=3000)
    p.add_argument("--held-out", type=int, default=300, help="terms held out (half validation, half test)")
    p.add_argument("--train", type=int, default=None, help="training questions (default: every entry not held out)")
    p.add_argument("--entries-per-page", type=int, default=0,
                   help="pack this many short entries into each document (0: one document per entry)")
    p.add_argument("--max-answer-words", type=int, default=12, help="with --entries-per-page: the longest definition kept")
    p.add_argument("--question", default="What is {term}?", help="the question template ({term} is the headword)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if "{term}" not in args.question:
        p.error("--question must contain {term}")
    entries = []
    for head, text in read_dictd(args.dictionary):
        if args.entries_per_page:
            answer = short_definition(text, args.max_answer_words)
            if len(answer.split()) >= 3 and re.fullmatch(r"[A-Za-z][A-Za-z-]*", head):
                entries.append((head, answer, answer))
            continue
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
    if args.entries_per_page:
        docs = pages([(h, t) for h, t, _ in chosen], args.entries_per_page)
    else:
        docs = [{"id": f"e{i}", "title": h, "text": t} for i, (h, t, _) in enumerate(chosen)]
    atomic_write_text(args.out / "corpus.jsonl", "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    n_val = args.held_out // 2
    train_end = len(chosen) if args.train is None else args.held_out + args.train
    splits = {"val": chosen[:n_val], "test": chosen[n_val:args.held_out], "train": chosen[args.held_out:train_end]}
    for name, rows in splits.items():
        atomic_write_text(args.out / f"{name}.jsonl", "".join(
            json.dumps({"question": args.question.format(term=h), "answers": [a]}, ensure_ascii=False) + "\n"
            for h, _, a in rows))
    print(f"{args.out}: {len(chosen)} entries in {len(docs)} documents; " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

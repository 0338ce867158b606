"""examples/dictionary_qa.py: a dictd dictionary becomes a corpus and "What is X?" splits by term."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

EXAMPLE = "dictionary_qa"

def _b64(n: int) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out = alphabet[n % 64] + out
        n //= 64
        if n == 0:
            return out


def _dictd(tmp_path: Path, entries: list[tuple[str, str]]) -> Path:
    body, index = b"", []
    for head, text in entries:
        chunk = f"{head}\n\n   {text}\n\n".encode()
        index.append(f"{head}\t{_b64(len(body))}\t{_b64(len(chunk))}")
        body += chunk
    base = tmp_path / "toy"
    base.with_suffix(".index").write_text("\n".join(index) + "\n")
    with gzip.open(base.with_suffix(".dict.dz"), "wb") as f:
        f.write(body)
    return base


def test_corpus_and_splits(demo, tmp_path):
    entries = [(f"term{i}", f"<field> A {{thing}} number {i} that does something useful. More words here for term{i}.")
               for i in range(40)]
    base = _dictd(tmp_path, entries + [("short", "Too short.")])
    assert demo.main([str(base), "--out", str(tmp_path / "out"), "--entries", "30", "--held-out", "10"]) == 0
    corpus = [json.loads(line) for line in open(tmp_path / "out" / "corpus.jsonl")]
    splits = {s: [json.loads(line) for line in open(tmp_path / "out" / f"{s}.jsonl")] for s in ("train", "val", "test")}
    assert len(corpus) == 30 and [len(splits[s]) for s in ("train", "val", "test")] == [20, 5, 5]
    texts = {c["title"]: c["text"] for c in corpus}
    assert all("<" not in t and "{" not in t for t in texts.values())  # markup removed
    terms = {s: {r["question"][len("What is "):-1] for r in rows} for s, rows in splits.items()}
    assert not (terms["train"] & (terms["val"] | terms["test"]))  # split by term
    for rows in splits.values():
        for r in rows:
            term = r["question"][len("What is "):-1]
            assert texts[term].startswith(r["answers"][0])  # the answer is the first sentence of its own entry

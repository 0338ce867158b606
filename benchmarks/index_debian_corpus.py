"""The real corpus of ``benchmarks/index_curves.py``: Debian's text sources converted to JSONL (title, text, id).

Reads the dictd dictionaries (``apt-get install dict-wn dict-elements dict-jargon dict-foldoc dict-gcide``:
``/usr/share/dictd/NAME.index`` + ``NAME.dict.dz``, one document per distinct entry of at least 5 words) and the
python3 HTML docs (``apt-get install python3-doc``: every page once, tags and scripts stripped, at least 20 words), and
writes ``OUT/NAME.jsonl``; ``rag index build`` / ``index_curves.py --corpus`` then split them into ≤ 100-word
passages (wn 150,830, elements 150, jargon 3,095, foldoc 14,260, python3-doc 18,153, gcide 138,646)::

    python benchmarks/index_debian_corpus.py /data/debian-text
    python benchmarks/index_curves.py --corpus /data/debian-text/{wn,elements,jargon,foldoc,python3-doc}.jsonl ...
"""

from __future__ import annotations

import argparse
import gzip
import json
from html.parser import HTMLParser
from pathlib import Path

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
DICTS = ("elements", "jargon", "foldoc", "wn", "gcide")


def b64(s: str) -> int:
    """A dictd index offset/length (base64 digits, most significant first)."""
    n = 0
    for c in s:
        n = n * 64 + B64.index(c)
    return n


def dictd(name: str, root: Path, out: Path) -> int:
    data = gzip.open(root / f"{name}.dict.dz").read()
    seen: set = set()
    n = 0
    with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
        for line in open(root / f"{name}.index", encoding="utf-8", errors="replace"):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3 or parts[0].startswith(("00-database", "00database")):
                continue
            span = (b64(parts[1]), b64(parts[2]))
            if span in seen:  # several headwords point at one entry
                continue
            seen.add(span)
            text = " ".join(data[span[0]:span[0] + span[1]].decode("utf-8", "replace").split())
            if len(text.split()) >= 5:
                n += 1
                f.write(json.dumps({"id": f"{name}:{n}", "title": parts[0], "text": text}) + "\n")
    return n


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.title = ""
        self._skip = 0
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("script", "style")
        self._in_title |= tag == "title"

    def handle_endtag(self, tag):
        self._skip -= tag in ("script", "style")
        if tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        elif not self._skip:
            self.parts.append(data)


def python_docs(root: Path, out: Path) -> int:
    pages, seen = [], set()
    for p in sorted(root.glob("python3*/html/**/*.html")):  # the packages share one tree through links: each page once
        if p.resolve() not in seen:
            seen.add(p.resolve())
            pages.append(p)
    n = 0
    with open(out / "python3-doc.jsonl", "w", encoding="utf-8") as f:
        for p in pages:
            t = _Text()
            t.feed(p.read_text(errors="replace"))
            text = " ".join(" ".join(t.parts).split())
            if len(text.split()) >= 20:
                n += 1
                f.write(json.dumps({"id": f"py:{p.relative_to(root)}", "title": t.title.strip(), "text": text}) + "\n")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--dictd", default="/usr/share/dictd")
    ap.add_argument("--doc", default="/usr/share/doc")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in DICTS:
        if (Path(args.dictd) / f"{name}.index").exists():
            print(name, dictd(name, Path(args.dictd), out))
    print("python3-doc", python_docs(Path(args.doc), out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

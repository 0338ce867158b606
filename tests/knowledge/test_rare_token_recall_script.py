"""benchmarks/rare_token_recall.py: the rare-token lookup set is a deterministic function of the passages, its classes
follow how a token is written, and its gold passages are those holding the token as BM25 indexes it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from rag.knowledge.bm25 import TOKEN_PATTERN
from rag.knowledge.passages import Passage

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rare_token_recall.py"


def load():
    spec = importlib.util.spec_from_file_location("rare_token_recall_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


PASSAGES = [
    Passage("0", "Commodore 1571", "A disk drive. Designed by Commodore engineers."),
    Passage("1", "Commodore 1570", "A single-sided version of the Commodore 1571, sold in 1986."),
    Passage("2", "Californium", "Symbol: Cf. Atomic number: 98. Discovered by Seaborg and others."),
    Passage("3", "Einsteinium", "Symbol: Es. Atomic number: 99. Named after Einstein; Seaborg again."),
    Passage("4", "drives", "Drives are devices. The drive is a device. Drives hold disks."),
]


def test_the_lookup_set_holds_rare_codes_numbers_symbols_and_names_with_the_passages_that_hold_them():
    bench = load()
    items = bench.lookup_set(PASSAGES, TOKEN_PATTERN, "english", max_df=2, per_class=50, seed=0)
    by_token = {it["token"]: it for it in items}
    assert by_token["Commodore 1571"]["lookup"] == "title" and by_token["Commodore 1571"]["gold"] == [0]
    assert by_token["Commodore 1571"]["class"] == "number"  # "1571" is the title's rare token ("Commodore" starts it)
    assert by_token["Cf"]["class"] == "acronym" and by_token["Cf"]["gold"] == [2]  # a symbol after "Symbol:"
    assert by_token["98"]["class"] == "number" and by_token["98"]["gold"] == [2]
    assert by_token["1986"]["gold"] == [1]
    assert by_token["Seaborg"]["class"] == "name" and by_token["Seaborg"]["gold"] == [2, 3]  # held by two passages
    assert by_token["Einstein"]["class"] == "name"
    assert "Designed" not in by_token and "Symbol" not in by_token  # sentence starts are no names
    assert "drive" not in {t.lower() for t in by_token}  # "drive"/"drives" one stem, in three passages: not rare
    assert all(it["query"] in (it["token"], f"What is {it['token']}?") for it in items)
    assert bench.lookup_set(PASSAGES, TOKEN_PATTERN, "english", max_df=2, per_class=50, seed=0) == items  # deterministic
    assert len(bench.lookup_set(PASSAGES, TOKEN_PATTERN, "english", max_df=2, per_class=1, seed=0)) <= 8  # 2 lookups × 4
    assert not [it for it in bench.lookup_set(PASSAGES, TOKEN_PATTERN, "english", max_df=1, per_class=50, seed=0)
                if it["token"] == "Seaborg"]

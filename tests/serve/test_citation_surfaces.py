"""Citations on every surface: ``rag generate`` (text and --json), ``POST /generate``, the OpenAI routes' ``rag`` field
(whole and streamed), and the page's own filter of them (run with node). Each surface carries exactly what
:func:`rag.generation.answers.cite` computes from the answer's own provenance."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import asdict
from importlib import resources

import httpx
import openai
import pytest
from serve_support import serving

import rag
from rag.cli import main
from rag.generation.answers import Answer, PassageProvenance, SegmentProvenance, cite
from rag.serve.app import ServeLimits

QUESTION = "what is the atomic number of iron?"
PROMPT = "The capital of France is"


def _rebuilt(d: dict) -> Answer:
    """The Answer a JSON answer was written from (its provenance fields; citations are derived, not read)."""
    fields = {k: d[k] for k in Answer.__dataclass_fields__}
    fields["passages"] = [PassageProvenance(**p) for p in d["passages"]]
    fields["segments"] = None if d["segments"] is None else [SegmentProvenance(**s) for s in d["segments"]]
    return Answer(**fields)


def _check(d: dict) -> None:
    cites = d["citations"]
    assert cites == [asdict(c) for c in cite(_rebuilt(d))]
    assert [c["number"] for c in cites] == list(range(1, len(cites) + 1))
    assert len({c["passage"] for c in cites}) == len(cites)  # each passage cited once
    assert all(d["passages"][c["passage"]]["id"] == c["id"] for c in cites)
    assert d["cited_text"] == (f"{d['text'].rstrip()} " + "".join(f"[{c['number']}]" for c in cites) if cites else d["text"])


@pytest.mark.parametrize("marginalization", ["sequence", "token"])
def test_generate_route_answers_carry_their_citations(rag_server, marginalization):
    url, _ = rag_server
    r = httpx.post(f"{url}/generate", json={"questions": [QUESTION, "who discovered oxygen?"], "max_new_tokens": 6,
                                            "min_new_tokens": 2, "marginalization": marginalization}, timeout=120)
    assert r.status_code == 200, r.text
    for d in r.json()["answers"]:
        assert d["citations"]  # read from passages: at least the top one is cited
        _check(d)
        if marginalization == "token":
            assert all(c["first_token"] is not None for c in d["citations"])
            firsts = [c["first_token"] for c in d["citations"]]
            assert firsts == sorted(firsts)  # numbered in the order the tokens used them
        else:
            weights = [c["weight"] for c in d["citations"]]
            assert weights == sorted(weights, reverse=True)  # by rank of the posterior


def test_openai_routes_carry_the_citations_in_their_rag_field(rag_server):
    url, _ = rag_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    want = httpx.post(f"{url}/generate", json={"questions": [QUESTION], "max_new_tokens": 4}, timeout=120).json()["answers"][0]
    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model="tiny", max_tokens=4, messages=messages)
    [c] = chat.model_extra["rag"]["choices"]
    assert c["citations"] == want["citations"] and c["cited_text"] == want["cited_text"]
    _check(c)
    chunks = list(client.chat.completions.create(model="tiny", max_tokens=4, messages=messages, stream=True))
    [final] = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert final.model_extra["rag"]["choices"][0]["citations"] == want["citations"]
    comp = client.completions.create(model="tiny", prompt=QUESTION, max_tokens=4)
    assert comp.model_extra["rag"]["choices"][0]["cited_text"] == want["cited_text"]


def test_in_context_ralm_answers_cite_the_passages_of_their_segments(serve_layout, tiny_gpt2_dir):
    pipe = rag.load(tiny_gpt2_dir, knowledge_base=serve_layout["kbs"]["kb_a"].path, stride=4, query_length=8, max_length=96,
                    doc_max_length=24)
    with serving(pipe, limits=ServeLimits(request_timeout=None)) as (url, _):
        comp = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8)
    d = comp.model_extra["rag"]["choices"][0]
    _check(d)
    assert d["segments"] and d["citations"][0]["first_token"] == 0
    assert {c["id"] for c in d["citations"]} == {s["passage_id"] for s in d["segments"]}


def test_cli_generate_prints_the_markers_and_their_passages(capsys, serve_layout):
    assert main(["generate", "--model", serve_layout["model"], QUESTION, "--max-new-tokens", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    _check(d)
    assert main(["generate", "--model", serve_layout["model"], QUESTION, "--max-new-tokens", "4", "--show-passages", "3"]) == 0
    out = capsys.readouterr().out
    assert f"\nA: {d['cited_text']}    (log p" in out
    for c in d["citations"]:
        if c["number"] <= 3:  # the top three by posterior are shown, each cited one with its marker
            assert f"[{c['number']}] posterior" in out and f"{c['title']} [{c['id']}]" in out


def test_the_page_draws_only_citations_that_name_a_passage_of_the_answer():
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on PATH: the page's citation filter is checked in a browser by test_serve_page.py")
    script = resources.files("rag.serve").joinpath("static", "app.js")
    answer = {"passages": [{"id": "a"}, {"id": "b"}, {"id": "c"}],
              "citations": [{"number": 2, "passage": 0}, {"number": 1, "passage": 2}, {"number": 3, "passage": 3},
                            {"number": "4", "passage": 1}, {"number": 5, "passage": -1}, None, {"number": 6, "passage": 1.5}]}
    harness = ("const element = () => ({ value: '', addEventListener() {}, classList: { toggle() {}, add() {}, remove() {} } });"
               "global.window = global; global.document = { getElementById: element, addEventListener() {},"
               "  body: { classList: { toggle() {} } } };"
               f"require({json.dumps(str(script))});"
               "const a = JSON.parse(process.argv[1]);"
               "process.stdout.write(JSON.stringify([window.ragPageCitations(a), window.ragPageCitations({passages: []}),"
               "  window.ragPageCitations({passages: [{}], citations: 'x'})]));")
    out = subprocess.run([node, "-e", harness, json.dumps(answer)], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == [[{"number": 1, "passage": 2}, {"number": 2, "passage": 0}], [], []]

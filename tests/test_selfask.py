"""Self-Ask (§3): the prompt format, parsing of well-formed and malformed chains, the loop's stop reasons (never a hang),
every intermediate step returned for the NLI filter, and the bundled two-hop decompositions."""

from __future__ import annotations

import pytest

from rag.retrobust.selfask import (
    FINAL,
    FOLLOW_UP,
    INTERMEDIATE,
    SelfAskStep,
    chain_training_examples,
    format_chain,
    next_action,
    parse_chain,
    self_ask,
    step_hypotheses,
)
from rag.utils.errors import ConfigError

Q = "what is the chemical symbol of the element discovered by Priestley?"
STEPS = [SelfAskStep("which element was discovered by Priestley?", "Oxygen", "Oxygen. It was discovered by Priestley in 1774."),
         SelfAskStep("what is the chemical symbol of oxygen?", "O", "Oxygen. Symbol: O. Atomic number: 8.")]


def test_format_and_parse_round_trip():
    text = format_chain(Q, STEPS, final="O")
    assert text.splitlines() == [
        f"Question: {Q}", "Are follow up questions needed here: Yes.",
        f"{FOLLOW_UP} which element was discovered by Priestley?", f"{INTERMEDIATE} Oxygen",
        f"{FOLLOW_UP} what is the chemical symbol of oxygen?", f"{INTERMEDIATE} O", f"{FINAL} O"]
    chain = parse_chain(text)
    assert chain.well_formed and chain.final == "O"
    assert chain.steps == [(s.question, s.answer) for s in STEPS]
    with_ctx = format_chain(Q, STEPS, with_premises=True)
    assert "Context: Oxygen. Symbol: O. Atomic number: 8." in with_ctx
    assert parse_chain(with_ctx).steps == chain.steps  # Context lines are skipped


@pytest.mark.parametrize("text, steps, final, malformed", [
    # markers sharing a line, a trailing full stop dropped (kept in an abbreviation)
    ("Follow up: who? Intermediate answer: Priestley. So the final answer is: O.", [("who?", "Priestley")], "O", []),
    ("So the final answer is: 15.999.", [], "15.999", []),
    ("So the final answer is: the U.S.", [], "the U.S.", []),
    # an unanswered follow-up, no final answer
    ("Follow up: which element?\n", [("which element?", None)], None, []),
    # intermediate answer with no follow-up, stray text, empty value, text after the final answer
    ("Intermediate answer: Oxygen\nI think so\nFollow up:\nSo the final answer is: O\nFollow up: more?",
     [], "O", ["intermediate answer without a follow-up: Oxygen", "I think so", "empty follow_up", "follow_up: more?"]),
    ("", [], None, []),
])
def test_parse_malformed_chains(text, steps, final, malformed):
    chain = parse_chain(text)
    assert chain.steps == steps and chain.final == final and chain.malformed == malformed
    assert not chain.well_formed or (final is not None and not malformed)


def test_next_action():
    assert next_action(" Follow up: what is the symbol of oxygen?\nIntermediate answer: O") == ("follow_up",
                                                                                                "what is the symbol of oxygen?")
    assert next_action("So the final answer is: O\n") == ("final", "O")
    assert next_action("Intermediate answer: O") == ("malformed", "intermediate: O")
    assert next_action("the answer is O") == ("malformed", "the answer is O")
    assert next_action("   ") == ("malformed", "")
    assert next_action("follow up : which element has atomic number 8?") == ("follow_up", "which element has atomic number 8?")
    assert next_action("so the final answer is : o") == ("final", "o")


class ScriptedReader:
    """A reader that continues the chain from a fixed script, recording every prompt it saw."""

    def __init__(self, lines):
        self.lines, self.prompts = list(lines), []

    def __call__(self, prompt):
        self.prompts.append(prompt)
        return self.lines[min(len(self.prompts) - 1, len(self.lines) - 1)]


def _retrieve_and_read(follow_up):
    facts = {s.question: s for s in STEPS}
    s = facts[follow_up]
    return s.answer, s.premise


def test_loop_answers_each_follow_up_with_retrieval_until_the_final_answer():
    reader = ScriptedReader([f"{FOLLOW_UP} {STEPS[0].question}\n{INTERMEDIATE} Nitrogen", f"{FOLLOW_UP} {STEPS[1].question}",
                             f"{FINAL} O"])
    r = self_ask(Q, reader, _retrieve_and_read, prefix="EXAMPLES\n\n")
    assert (r.answer, r.stopped, r.reader_calls) == ("O", "final_answer", 3)
    assert r.steps == STEPS  # the reader's own "Nitrogen" was ignored: retrieval answers follow-ups
    assert reader.prompts[1] == "EXAMPLES\n\n" + format_chain(Q, STEPS[:1])
    assert r.prompt.endswith(f"{FINAL} O\n")
    assert step_hypotheses(r) == [(s.premise, f"{s.question} {s.answer}") for s in STEPS]
    assert r.provenance()["steps"][1] == {"question": STEPS[1].question, "answer": "O", "premise": STEPS[1].premise}


def test_reader_that_never_finishes_stops_at_the_step_limit():
    calls = iter(range(1000))
    reader = lambda prompt: f"{FOLLOW_UP} question {next(calls)}?"  # noqa: E731  never writes the final marker
    r = self_ask(Q, reader, lambda q: ("x", None), max_steps=3)
    assert (r.answer, r.stopped, len(r.steps), r.reader_calls) == (None, "step_limit", 3, 3)
    assert step_hypotheses(r) == []  # no retrieved premise, nothing for NLI to check
    assert self_ask(Q, reader, lambda q: ("x", None), max_steps=0).stopped == "step_limit"


def test_malformed_and_repeated_continuations_stop_with_the_reason():
    r = self_ask(Q, ScriptedReader(["I do not know"]), _retrieve_and_read)
    assert (r.answer, r.stopped, r.steps, r.last_output) == (None, "malformed", [], "I do not know")
    assert r.provenance()["last_output"] == "I do not know"
    r = self_ask(Q, ScriptedReader([f"{FOLLOW_UP} {STEPS[0].question}"]), _retrieve_and_read, max_steps=10)
    assert (r.stopped, len(r.steps), r.reader_calls) == ("repeated_follow_up", 1, 2)


def test_bad_step_limit():
    with pytest.raises(ConfigError, match="max_steps"):
        self_ask(Q, ScriptedReader([f"{FINAL} O"]), _retrieve_and_read, max_steps=-1)


def test_bundled_multihop_decompositions():
    from rag.demo import load_demo_corpus, load_demo_qa
    from rag.demo.multihop import build_multihop, discoverers, load_multihop

    rows = load_multihop()
    assert rows == build_multihop()  # the file is what the builder writes
    priestley = [r for r in rows if r["question"] == Q]
    assert priestley and priestley[0]["answers"] == ["O"]
    assert [f["answer"] for f in priestley[0]["follow_ups"]] == ["Oxygen", "O"]
    assert discoverers()["Oxygen"] == "Priestley" and "Cerium" not in discoverers()  # "Martin ." is no surname
    text = {p.title: p.text for p in load_demo_corpus()}
    held_out = {x["element"] for s in ("dev", "test") for x in load_demo_qa(s)}
    for r in rows:
        first, second = r["follow_ups"]
        assert first["answer"] == r["element"] and second["answer"] == r["answers"][0]
        assert second["answer"] in text[r["element"]]  # the answer is in the bridge element's passage
        assert (r["split"] != "train") == (r["element"] in held_out)
    assert {r["type"].split("->")[0] for r in rows} == {"discoverer", "number", "symbol"}
    assert len(load_multihop("test")) + len(load_multihop("dev")) + len(load_multihop("train")) == len(rows)


def test_chain_training_examples_teach_each_step():
    from rag.demo.multihop import load_multihop

    records = load_multihop("train")
    examples = chain_training_examples(records)
    assert len(examples) == 3 * len(records)  # two follow-ups and the final answer per question
    first, second, last = examples[:3]
    assert first[1] == f"{FOLLOW_UP} {records[0]['follow_ups'][0]['question']}"
    assert second[0].endswith(f"{INTERMEDIATE} {records[0]['follow_ups'][0]['answer']}\n")
    assert second[1] == f"{FOLLOW_UP} {records[0]['follow_ups'][1]['question']}"
    chain = parse_chain(last[0] + last[1])
    assert last[1] == f"{FINAL} {records[0]['answers'][0]}" and chain.well_formed and chain.final == records[0]["answers"][0]

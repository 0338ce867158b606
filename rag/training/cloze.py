"""Cloze question-answer pairs made from a corpus's own sentences, after Lewis et al. 2019 ("Unsupervised Question
Answering by Cloze Translation"), with rule-based translation: the reading practice of
:mod:`rag.training.reading_practice` (``source: cloze``) and the corpus-only recipe's training data.

A sentence's year, number, name or the noun phrase after a verb and preposition ("used in ...") is the answer, and the
sentence with that span replaced by a wh-phrase (fronted where the rule knows how, "What is Oxygen used in?") and its
leading "It" by the passage's title is the question; the passage keeps its real title. A passage's first sentence that
is a noun phrase ("Blue-white metallic element") defines its title ("What is Zinc?", "What kind of element is Zinc?"),
a sentence that opens with its verb ("Chemically resembles sulphur") is read with the title as its subject ("What does
Selenium chemically resemble?"), and a question asked in place ("Tungsten is used in what?") is also asked wh-word
first ("What is Tungsten used in?"). There is no part-of-speech tagger: a word is taken for a verb only where the
sentence shows it.
"""

from __future__ import annotations

import random
import re
from typing import Optional, Sequence

from rag.knowledge.passages import Passage

__all__ = ["cloze_pairs", "split_sentences", "MAX_PRACTICE_PASSAGE_WORDS", "MAX_CLOZE_SENTENCE_WORDS", "MAX_SPAN_WORDS"]

_YEAR = re.compile(r"\b(?:in|In|by|By|since|until|from|around|about) ((?:1[0-9]|20)[0-9]{2})\b")
_NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)( ?%| percent)?(?![\w.]\w)(?![^\W\d_])")
"""A number standing alone, with its percent sign: not one glued to letters ("157K", "1.39x10^10", "288Uup": a unit, a
power or a name's part, no answer to ask "how many" of)."""
_PERSON = (r"(?:(?:[A-Z]\.)+ ?[A-Z][A-Za-z'-]*[a-z]\b|[A-Z][A-Za-z'-]*[a-z]\b)"
           r"(?: (?:and |de |von |van )?(?:(?:[A-Z]\.)+ ?)?[A-Z][A-Za-z'-]*[a-z]\b)*")
"""A person's name, whole: initials and a surname ("W.H. Wollaston"), or names with middle initials and particles
("Martin H. Klaproth", "Carl F. Auer von Welsbach", "Edwin M. McMillan", "Albert Ghiorso and Glenn T. Seaborg")."""
_NAME = re.compile(rf"(?<=\bby )({_PERSON})")
_VERB_PREP = re.compile(r"^(?P<subject>[^,]{1,40}?) (?P<aux>is|are|was|were) (?P<verb>(?:commonly |mainly |also |often |widely )?"
                        r"(?:used|found|obtained|separated|produced|made|extracted|named|employed|present|prepared|known)) "
                        r"(?P<prep>in|for|as|from|by|with|on|after|to) (?P<answer>[a-z][\w-]*(?: [\w-]+){0,5}?)"
                        r"(?=[,.;:]| and | or | which | to | in | of | with | from | as |$)")
MAX_PRACTICE_PASSAGE_WORDS = 80
"""A longer passage is read, for a cloze pair, as the five sentences around the pair's own (its answer always inside a
reader's window of a few hundred tokens)."""
MAX_CLOZE_SENTENCE_WORDS = 60
"""Longer sentences (or text without sentence ends) make no cloze question: each question is the whole sentence."""
_PRONOUN = re.compile(r"^(It|Its|This element|The element)\b")
_FRAGMENT = re.compile(r"^(?:(?:First|Later|Also|Originally|Independently) [a-z]+ed|[A-Z][a-z]+ed)\b")
_BY_NAME = re.compile(r"^(?P<subject>.+?) (?:was|were) (?P<verb>(?:first |later |also |independently )?[a-z]+ed) by "
                      rf"(?P<name>{_PERSON})(?P<rest>.*)$")
_SUBJECT = re.compile(r"^(?P<subject>[A-Z][\w-]*(?: [\w-]+){0,3}?) (?P<aux>is|are|was|were|has|have) (?P<rest>\w.*)$")
"""A sentence whose subject is a short noun phrase ("Carbon-14 is commonly used in radioactive dating"): the subject is
the answer of "What is commonly used in radioactive dating?", the kind of "which isotope / compound / form ...?"
question whose answer opens the sentence."""
_CLOZE_SENTENCE = re.compile(r"(?<=[.!?])(?<!\b[A-Z]\.)\s+(?=[A-Z(])")
"""Sentence ends: a period before a capital, not after an initial ("W.H. Wollaston" stays one sentence)."""


def split_sentences(text: str) -> list[str]:
    """`text`'s sentences (:data:`_CLOZE_SENTENCE`'s ends)."""
    return _CLOZE_SENTENCE.split(text.strip())


_SPAN_TOKEN = re.compile(r"\w[\w'-]*\w|\w|[^\w\s]")
_SPAN_ANCHORS = frozenset("a an the in of for as with into from by to on than called named is are was were".split())
_SPAN_STOP = frozenset("""a an the in of for as with into from by to on than at and or but nor not no so if it its this that these
those which who whom whose what when where why how then there here all any some such other another each every both
either neither one ones more most less least much many few very also only even still just about above after again
against before below between during over under up down out off through until while is are was were be been being has
have had having do does did can could may might must shall should will would used found made known called named
discovered isolated obtained produced formed given taken seen said nothing something anything everything ask first
hence however currently finally later directly thus therefore usually""".split())
MAX_SPAN_WORDS = 4
"""The most words of a span answer (a noun phrase or name after a preposition, article or copula)."""


def _span_pairs(body: str, title: str) -> list[tuple[str, str]]:
    """Span cloze of one sentence (`body`, its subject already named): every run of up to :data:`MAX_SPAN_WORDS`
    content words right after a preposition, article or copula ("used in *thermometers*", "formerly called
    *wolfram*", "form of *Cobalt-60*") is an answer, and the sentence with the run (and its article) replaced by
    "what" the question. Runs that are, or hold, the passage's title, or a bare number (the number rule's), are not."""
    toks = [(m.group(), m.start(), m.end()) for m in _SPAN_TOKEN.finditer(body)]
    title_words = {w.lower() for w in title.split()}
    out = []
    i = 0
    while i < len(toks):
        word = toks[i][0].lower()
        j = i + 1
        if word in _SPAN_ANCHORS:
            while j < len(toks) and toks[j][0][0].isalnum() and toks[j][0].lower() not in _SPAN_STOP:
                j += 1
        run = toks[i + 1:j]
        if run and word in ("is", "are", "was", "were") and run[0][0].lower().endswith(("ed", "ly")):
            run = []  # "was identified", "is generally": a verb or an adverb, not a noun phrase
        if run and len(run[-1][0]) == 1 and run[-1][0].isupper() and j < len(toks) and toks[j][0] == ".":
            run = []  # "by Edwin M. McMillan": a name cut at an initial (the name rule asks for it whole)
        answer = body[run[0][1]:run[-1][2]] if run else ""
        if (run and len(run) <= MAX_SPAN_WORDS and len(answer) >= 2 and len(run) < len(toks) - 3
                and not any(t[0].lower() in title_words for t in run)
                and not all(t[0].replace(".", "").isdigit() for t in run)):
            start = toks[i][1] if word in ("a", "an", "the") else run[0][1]
            question = body[:start] + "what" + body[run[-1][2]:]
            out.append((question + "?", answer))
        i = max(j, i + 1)
    return out


def _subject_pairs(body: str, title: str) -> list[tuple[str, str]]:
    """Subject cloze of one sentence (`body`): a subject of at most :data:`MAX_SPAN_WORDS` words before its verb
    ("*Au-198* is used in treating cancer") is the answer of the sentence asked with "what" in its place ("What is
    used in treating cancer?"); not the passage's title itself, a pronoun or a determiner (those are no answer to
    read)."""
    m = _SUBJECT.match(body)
    if not m:
        return []
    subject, rest = m.group("subject"), m.group("rest")
    words = subject.split()
    if (len(words) > MAX_SPAN_WORDS or subject.lower() == title.lower() or words[0].lower() in _SPAN_STOP
            or any(w.lower() in ("which", "that", "who", "whose") for w in words)  # a relative clause: not the subject
            or subject.lower().startswith(f"{title.lower()}'s") or len(rest.split()) < 3):
        return []
    return [(f"What {m.group('aux')} {rest}?", subject)]


def _subject(sentence: str, title: str) -> str:
    """`sentence` with a leading pronoun standing for the passage's subject replaced by `title`, and a fragment that
    starts with a participle ("Discovered by ...") given `title` as its subject."""
    if _FRAGMENT.match(sentence):
        return f"{title} was {sentence[0].lower()}{sentence[1:]}"
    return _PRONOUN.sub(lambda m: f"{title}'s" if m.group(1) == "Its" else title, sentence, count=1)


_AUX = frozenset("is are was were be been being has have had can could will would may might must shall should do does did"
                 .split())
_FIELD = re.compile(r"^[A-Z][\w ()-]{0,30}: ")
"""A field ("Symbol: Zn", "Atomic weight: 65.38"): no sentence, nor a passage's definition."""
_VERB_FIRST = re.compile(r"^(?:(?P<adverb>[A-Z][a-z]+ly) (?P<verb>[a-z]+s)|(?P<Verb>[A-Z][a-z]+s))(?P<rest> [a-z].*)$")
"""A sentence that opens with its verb, the passage's subject left unsaid ("Chemically resembles sulphur", "Belongs to
the actinoid series"): a dictionary's or a data sheet's way of describing its headword."""


def _base_form(verb: str) -> str:
    """The base form of a verb of the third person ("resembles" -> "resemble", "reaches" -> "reach", "carries" ->
    "carry"), for a question with "does"."""
    if verb.endswith("ies") and len(verb) > 4:
        return verb[:-3] + "y"
    if verb.endswith(("sses", "shes", "ches", "xes", "oes")):
        return verb[:-2]
    return verb[:-1]


_NOT_VERBS = frozenset("""perhaps always sometimes whereas besides towards afterwards nowadays thus yes its his hers ours
yours theirs this does less unless plus minus versus across various previous famous news series species means physics
mathematics analysis basis thesis status bus gas lens""".split())
_AFTER_PLURAL = frozenset("""include includes are were have can could may might will would do use allow provide contain make
show take exist become need""".split())
"""Words that follow a plural noun, not a verb ("Examples include ...", "Touchpads use ..."): after one, the word ending
in "s" was the noun."""


def _is_verb(word: str, following: str = "") -> bool:
    """`word` can be a verb of the third person: ends in one "s" (not "-ss", "-us", "-is", "-ys"), not a stop word nor a
    known word of another kind, and `following` (the next word) is no verb that a plural noun would take."""
    w = word.lower()
    return (len(w) >= 4 and w.endswith("s") and not w.endswith(("ss", "us", "is", "ys")) and w not in _SPAN_STOP
            and w not in _AUX and w not in _NOT_VERBS and following.lower().strip(",;") not in _AFTER_PLURAL)


def _definition_pairs(sentence: str, title: str) -> list[tuple[str, str]]:
    """The definition of a passage (its first sentence, when a noun phrase without a verb: "Blue-white metallic
    element", "Attractive greyish-white metal"), asked as "What is TITLE?" -> the noun phrase, and "What kind of HEAD is
    TITLE?" -> the words before its head noun (dictionaries, glossaries and data sheets open with such a phrase)."""
    tokens = sentence.rstrip(".!?").split()
    words = [w.strip(",;") for w in tokens]
    if not words or not sentence[:1].isupper() or any(w.lower() in _AUX for w in words) or _FRAGMENT.match(sentence):
        return []
    phrase = []
    for w, token in zip(words, tokens):
        if w.lower() in _SPAN_STOP or not re.fullmatch(r"[A-Za-z][\w'-]*", w) or w.lower().endswith(("ing", "ed")):
            break
        phrase.append(w)
        if token.endswith(","):
            break
    if not 2 <= len(phrase) <= MAX_SPAN_WORDS or any(w.lower() in title.lower().split() for w in phrase):
        return []
    following = words[len(phrase)].lower() if len(phrase) < len(words) else ""
    if (following and following not in _SPAN_STOP and not following.endswith(("ing", "ed"))
            and not tokens[len(phrase) - 1].endswith(",")):
        return []  # the phrase runs on into a word it does not name (a verb: "Multiple allotropic forms exist")
    answer = " ".join(phrase)
    return [(f"What is {title}?", answer), (f"What kind of {phrase[-1].lower()} is {title}?", " ".join(phrase[:-1]))]


def _verb_object_pairs(body: str, title: str) -> list[tuple[str, str]]:
    """The object of the verb a sentence about `title` opens with ("Selenium chemically resembles sulphur"), asked with
    "does" ("What does Selenium chemically resemble?" -> "sulphur"): the object is up to :data:`MAX_SPAN_WORDS` content
    words after the verb (and an article), not a preposition's (the span cloze asks those)."""
    m = re.match(rf"^{re.escape(title)} (?:(?P<adverb>[a-z]+ly) )?(?P<verb>[a-z]+) (?:(?:the|a|an) )?(?P<rest>.*)$", body)
    if not m or not _is_verb(m.group("verb"), m.group("rest").split(" ")[0]):
        return []
    toks = m.group("rest").split(" ")
    run = []
    for t in toks:
        word = t.rstrip(",;")
        if word.lower() in _SPAN_STOP or not re.fullmatch(r"[\w'-]+", word) or len(run) == MAX_SPAN_WORDS:
            break
        run.append(word)
        if t.endswith((",", ";")):
            break
    if not run or any(w.lower() in title.lower().split() for w in run) or all(w.isdigit() for w in run):
        return []
    answer = " ".join(run)
    after = m.group("rest")[m.group("rest").index(answer) + len(answer):]
    if after.startswith(","):
        after = ""
    elif after and (after.split()[0] not in ("in", "from", "with", "into", "for", "to", "on", "at", "by")
                    or len(after.split()) > 6):
        return []  # "forms a number of complexes", "allows X and has Y": the object's head, or one clause, is not the answer
    adverb = f"{m.group('adverb')} " if m.group("adverb") else ""
    return [(f"What does {title} {adverb}{_base_form(m.group('verb'))}{after}?", answer)]


def _fronted(question: str, title: str, verb_known: bool = True) -> Optional[str]:
    """A question asked in place ("Tungsten is used in what?") asked as people ask it, its wh-word first and subject and
    auxiliary inverted ("What is Tungsten used in?"; "Uranium has what?" -> "What does Uranium have?"; "Yttrium
    belongs to what?" -> "What does Yttrium belong to?"); None when "what" does not end it or no auxiliary (or, after
    `title`, a verb) follows a short subject. A verb is asked about only where `verb_known` (the sentence opened with
    it, or with a pronoun before it: "Examples include ..." opens with a noun)."""
    m = re.match(r"^(?P<subject>[A-Z][\w'-]*(?: [\w'-]+){0,3}?) (?P<aux>is|are|was|were|can|will|has|have)"
                 r"(?P<middle>(?: [\w'-]+)*?) what\?$", question)
    verb = re.match(rf"^{re.escape(title)} (?P<adverb>[a-z]+ly )?(?P<verb>[a-z]+)(?P<middle>(?: [\w'-]+)*?) what\?$", question)
    middle = verb.group("middle").split() if verb else []
    if verb and verb_known and _is_verb(verb.group("verb"), (middle or ["what"])[0]) and len(middle) <= 4 and "and" not in middle:
        return f"What does {title} {verb.group('adverb') or ''}{_base_form(verb.group('verb'))}{verb.group('middle')}?"
    if not m or m.group("subject").split()[0].lower() in _SPAN_STOP:
        return None
    aux, subject, middle = m.group("aux"), m.group("subject"), m.group("middle")
    if len(middle.split()) > 8:
        return None
    if aux in ("has", "have") and not re.match(r" (?:been|\w+(?:ed|en|wn))\b", middle):  # "has been ...": an auxiliary
        return f"What {'does' if aux == 'has' else 'do'} {subject} have{middle}?"
    return f"What {aux} {subject}{middle}?"


def _sentence_bodies(sentence: str, title: str) -> list[tuple[str, bool]]:
    """The sentence's statements about `title`, subject named, each with whether the word after the subject is known to
    be a verb: the sentence itself (known where a pronoun opened it: "It reaches ..."), and where it opens with its
    verb ("Chemically resembles sulphur") or a noun phrase and such a clause ("Metalloid element, belongs to group
    16") the clause with `title` as its subject ("Selenium chemically resembles sulphur")."""
    text = sentence.strip().rstrip(".!?").strip()
    bodies = [(_subject(text, title), bool(_PRONOUN.match(text)) and not text.startswith("Its"))]
    head, _, tail = text.partition(", ")
    for clause in (text, tail.strip()[:1].upper() + tail.strip()[1:] if tail else ""):
        m = _VERB_FIRST.match(clause)
        following = m.group("rest").split()[0] if m else ""
        # "Chemically resembles ...", "Belongs to ...", "Forms a ...": an adverb before it, or a preposition, an article or
        # an adverb after it, tells a verb from a plural noun ("Contributors tend to ...")
        verb_like = m and (m.group("adverb") or following in _SPAN_ANCHORS or following in ("up", "out", "off", "down")
                           or following.endswith("ly"))
        if verb_like and _is_verb(m.group("verb") or m.group("Verb"), following) and (clause is text or " " in head):
            verb = m.group("verb") or m.group("Verb").lower()
            adverb = f"{m.group('adverb').lower()} " if m.group("adverb") else ""
            bodies.append((f"{title} {adverb}{verb}{m.group('rest')}", True))
    return bodies


def _cloze_pairs(sentence: str, title: str, max_answer_words: int, definition: bool = False) -> list[tuple[str, str]]:
    """The (question, answer) pairs of one sentence (see the module docstring), answers as they stand in it; with
    `definition`, the sentence is its passage's first and may define the title (:func:`_definition_pairs`)."""
    out = _definition_pairs(sentence.strip(), title) if definition else []
    for body, verb_known in _sentence_bodies(sentence, title):
        if not 4 <= len(body.split()) <= MAX_CLOZE_SENTENCE_WORDS:
            continue
        found = _body_pairs(body, title) + (_verb_object_pairs(body, title) if verb_known else [])
        fronted = [(_fronted(q, title, verb_known), a) for q, a in found]
        out += found + [(q, a) for q, a in fronted if q is not None]
    seen, unique = set(), []
    for q, a in out:
        q = q[0].upper() + q[1:]
        if a and len(a.split()) <= max_answer_words and a not in q and (q, a) not in seen:
            seen.add((q, a))
            unique.append((q, a))
    return unique


def _body_pairs(body: str, title: str) -> list[tuple[str, str]]:
    """The pairs of one statement (`body`, its subject named): verb and preposition, year, number, span, subject, name."""
    out = []
    m = _VERB_PREP.match(body)
    if m and m.group("answer").lower() != title.lower():
        verb = m.group("verb")
        out.append((f"What {m.group('aux')} {m.group('subject')} {verb} {m.group('prep')}?", m.group("answer")))
    for y in _YEAR.finditer(body):
        out.append((body[:y.start(1)] + "what year" + body[y.end(1):] + "?", y.group(1)))
    years = {y.group(1) for y in _YEAR.finditer(body)}
    for n in _NUMBER.finditer(body):
        before, after = body[:n.start()], body[n.end():]
        if n.group(1) in years or before.rstrip().endswith(":") or before[-1:] in "-*^" or after[:1] in "*^":
            continue  # "Atomic number: 8" is a field, "Au-195" and "10^7" parts of a name or a number
        unit = n.group(2) or ""
        wh = "what percentage" if unit.strip() in ("%", "percent") else "how many" if "." not in n.group(1) else "what value"
        out.append((body[:n.start()] + wh + body[n.end():] + "?", n.group(1) + unit))
    out.extend(_span_pairs(body, title))
    out.extend(_subject_pairs(body, title))
    by = _BY_NAME.match(body)
    if by:  # "Oxygen was discovered by Priestley in 1774" -> "Who discovered Oxygen in 1774?"
        out.append((f"Who {by.group('verb')} {by.group('subject')}{by.group('rest')}?", by.group("name")))
    else:
        for nm in _NAME.finditer(body):
            if nm.group(1).lower() != title.lower():
                out.append((body[:nm.start()] + "whom" + body[nm.end():] + "?", nm.group(1)))
    return out


def cloze_pairs(passages: Sequence[Passage], n: int, *, seed: int = 0,
                max_answer_words: int = 24) -> list[tuple[str, str, Passage]]:
    """Up to `n` cloze (question, answer, passage read) triples from `passages`' sentences (see the module docstring);
    deterministic for `seed` (every passage's pairs, in a seeded order). Empty when no sentence yields one."""
    rng = random.Random(seed)
    order = list(range(len(passages)))
    rng.shuffle(order)
    found = []
    for i in order:  # passages in a seeded order until `n` pairs are found: a large corpus is not read whole
        p = passages[i]
        sentences = split_sentences(p.text)
        long = len(p.text.split()) > MAX_PRACTICE_PASSAGE_WORDS
        first = next((k for k, sentence in enumerate(sentences) if not _FIELD.match(sentence)), None)
        for k, sentence in enumerate(sentences):
            pairs = _cloze_pairs(sentence, p.title.strip(), max_answer_words, definition=k == first)
            # a long passage is read as the sentences around the asked one, so that a reader's window never cuts the answer
            read = Passage(p.id, p.title, " ".join(sentences[max(0, k - 2):k + 3])) if pairs and long else p
            found.extend((question, answer, read) for question, answer in pairs)
        if len(found) >= n:
            break
    rng.shuffle(found)
    return found[:n]

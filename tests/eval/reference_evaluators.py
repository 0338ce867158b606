"""REFERENCE CODE, transcribed for the parity tests only (never imported by rag/): the official evaluators whose numbers
`rag evaluate` must equal. Each function below is the reference's own code, kept line for line apart from names.

1. SQuAD v1.1 ``evaluate-v1.1.py`` (Rajpurkar et al. 2016; https://rajpurkar.github.io/SQuAD-explorer/, the v1.1
   evaluation script; distributed with the dataset, licence CC BY-SA 4.0 like the dataset it ships with):
   ``normalize_answer``, ``f1_score``, ``exact_match_score``, ``metric_max_over_ground_truths``.
2. KILT (Petroni et al. 2021; https://github.com/facebookresearch/KILT, ``kilt/eval_downstream.py`` and
   ``kilt/eval_retrieval.py``; MIT licence, Copyright (c) Facebook, Inc. and its affiliates): ``get_gold_answers``,
   ``_get_ids_list``, ``_computeRprec``, ``rprecision``, and the KILT-EM / KILT-F1 rule of ``_calculate_metrics``.
"""

import re
import string
from collections import Counter


# ---------------------------------------------------------------- SQuAD v1.1 evaluate-v1.1.py
def squad_normalize_answer(s):
    """Lower text and remove punctuation, articles and extra whitespace."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def squad_f1_score(prediction, ground_truth):
    prediction_tokens = squad_normalize_answer(prediction).split()
    ground_truth_tokens = squad_normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    f1 = (2 * precision * recall) / (precision + recall)
    return f1


def squad_exact_match_score(prediction, ground_truth):
    return squad_normalize_answer(prediction) == squad_normalize_answer(ground_truth)


def squad_metric_max_over_ground_truths(metric_fn, prediction, ground_truths):
    scores_for_ground_truths = []
    for ground_truth in ground_truths:
        score = metric_fn(prediction, ground_truth)
        scores_for_ground_truths.append(score)
    return max(scores_for_ground_truths)


# ---------------------------------------------------------------- KILT eval_downstream.py / eval_retrieval.py
def kilt_get_gold_answers(gold):
    ground_truths = set()
    for item in gold["output"]:
        if "answer" in item and item["answer"] and len(item["answer"].strip()) > 0:
            ground_truths.add(item["answer"].strip())
    return ground_truths


def _remove_duplicates(obj):
    obj_tmp = []
    for o in obj:
        if o not in obj_tmp:
            obj_tmp.append(o)
    return obj_tmp


def kilt_get_ids_list(datapoint, rank_keys):
    ids_list = []
    for output in datapoint["output"]:
        current_ids_list = []
        if "provenance" in output:
            for provenance in output["provenance"]:
                if any(rank_key not in provenance for rank_key in rank_keys):
                    pass
                else:
                    current_ids_list.append("+".join([str(provenance[rank_key]).strip() for rank_key in rank_keys]))
        ids_list.append(_remove_duplicates(current_ids_list))
    return ids_list


def kilt_computeRprec(guess_ids, gold_ids):
    R = len(gold_ids)
    num = 0
    for prediction in guess_ids[:R]:
        if str(prediction).strip() in gold_ids:
            num += 1
    Rprec = num / R if R > 0 else 0
    return Rprec


def kilt_rprecision(guess_item, gold_item, rank_keys):
    gold_ids_list = kilt_get_ids_list(gold_item, rank_keys)
    guess_ids = kilt_get_ids_list(guess_item, rank_keys)[0]
    Rprec_vector = []
    for gold_ids in gold_ids_list:
        Rprec = kilt_computeRprec(guess_ids, gold_ids)
        Rprec_vector.append(Rprec)
    return max(Rprec_vector)


def kilt_downstream(guess_item, gold_item):
    """One question's (em, f1, KILT-em, KILT-f1) as ``_calculate_metrics`` accumulates them (rank_keys wikipedia_id)."""
    gold_candidate_answers = kilt_get_gold_answers(gold_item)
    guess_answer = str(guess_item["output"][0]["answer"]).strip()
    local_em = squad_metric_max_over_ground_truths(squad_exact_match_score, guess_answer, gold_candidate_answers)
    local_f1 = squad_metric_max_over_ground_truths(squad_f1_score, guess_answer, gold_candidate_answers)
    Rprec = kilt_rprecision(guess_item, gold_item, rank_keys=["wikipedia_id"])
    kilt_em = local_em if Rprec == 1 else 0
    kilt_f1 = local_f1 if Rprec == 1 else 0
    return local_em, local_f1, kilt_em, kilt_f1

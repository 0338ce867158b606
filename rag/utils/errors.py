"""Exceptions raised for user errors. Each message names the file or field at fault and the fix."""

from __future__ import annotations


class RagError(ValueError):
    """Base class of every error `rag` raises for bad input, configuration or files."""


class CorpusError(RagError):
    """A corpus file or dataset cannot be ingested (missing field, bad bytes, duplicate id, empty)."""


class KnowledgeBaseError(RagError):
    """A knowledge-base directory is missing, incomplete, or incompatible with the query encoder."""


class IntegrityError(KnowledgeBaseError):
    """A file's checksum does not match the one recorded when it was written."""


class ConfigError(RagError):
    """A configuration value is invalid."""


class OutputExistsError(RagError, FileExistsError):
    """An output path exists and may not be replaced (no overwrite asked, or it is not the writer's own kind)."""


class RetrievalError(RagError):
    """A remote retrieval service failed: its cluster is unreachable, or a query failed on its retry too."""

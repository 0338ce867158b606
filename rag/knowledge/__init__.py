"""The non-parametric memory: corpora, text encoders, FAISS indexes, knowledge bases, retrievers."""

"""Retrieval-augmented models built from a retriever and a generator."""

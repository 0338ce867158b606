"""Retrieval-augmented models, one folder per method.

RAG (Lewis et al. 2020), In-Context RALM (Ram et al. 2023), REPLUG (Shi et al. 2023)."""

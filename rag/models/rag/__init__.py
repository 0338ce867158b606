"""RAG (Lewis et al. 2020): query encoder + retriever + generator, RAG-Sequence / RAG-Token losses and decoding, checkpoints."""

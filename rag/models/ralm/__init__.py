"""In-Context RALM (Ram et al. 2023): a frozen causal LM reading retrieved documents before its prefix; rerankers (§6)."""

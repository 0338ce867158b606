"""REPLUG (Shi et al. 2023): ensembles of a (black-box) LM over K documents, and the LM-supervised retrieval loss (LSR)."""

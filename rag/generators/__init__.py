"""The generators a reader runs: loading any seq2seq or causal LM, the CPU warm-start reader, tiny models, the demo LM."""

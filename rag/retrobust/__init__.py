"""RetRobust (Yoran et al. 2024): the NLI back-off that ignores irrelevant context, and Self-Ask chains."""

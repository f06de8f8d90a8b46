"""Which algorithms implement which collective: names only, so a command line can be checked
without importing torch.  communicator.py maps each name to its implementation (and a test
keeps the two the same)."""

ALGORITHMS = {
    "allreduce": ("ring", "doubling", "halving-doubling", "tree", "ps", "hierarchical", "native", "torch"),
    "reduce_scatter": ("ring", "ps", "hierarchical", "native", "torch"),
    "allgather": ("ring", "ps", "hierarchical", "native", "torch"),
    "broadcast": ("tree", "ps", "hierarchical", "native", "torch"),
    "reduce": ("tree", "ps", "native", "torch"),
    "alltoallv": ("pairwise", "native"),
}
ALL_ALGORITHMS = ("auto",) + tuple(dict.fromkeys(a for algos in ALGORITHMS.values() for a in algos))

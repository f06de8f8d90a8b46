"""Which algorithms implement which collective: names only, so a command line can be checked
without importing torch.  communicator.py maps each name to its implementation (and a test
keeps the two the same)."""

ALGORITHMS = {
    "allreduce": ("ring", "doubling", "halving-doubling", "tree", "ps", "hierarchical", "native", "torch", "nccl"),
    "reduce_scatter": ("ring", "ps", "hierarchical", "native", "torch", "nccl"),
    "allgather": ("ring", "ps", "hierarchical", "native", "torch", "nccl"),
    "broadcast": ("tree", "ps", "hierarchical", "native", "torch", "nccl"),
    "reduce": ("tree", "ps", "native", "torch", "nccl"),
    "alltoallv": ("pairwise", "native"),
}
ALL_ALGORITHMS = ("auto",) + tuple(dict.fromkeys(a for algos in ALGORITHMS.values() for a in algos))

# Algorithms that torch.distributed runs (gloo or NCCL on the default group; NCCL on a group of
# its own), not psrt over MPI: they move CUDA tensors where they are and need
# init_torch_distributed.
THROUGH_TORCH = ("torch", "nccl")

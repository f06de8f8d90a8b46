"""Mixture-of-Experts with expert parallelism: routing (routing.py), the MoE feed-forward
layer whose experts are spread over an expert-parallel group and reached by all-to-all
(layer.py).  The training step that reduces dense gradients over data parallelism and expert
gradients over the expert-data-parallel group only is psrt/train/moe.py."""

"""What one step cost: the record every data-parallel strategy and layout returns."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    """What one step cost, for the summary table and the JSONL metrics.

    `loss` is the mean loss over the global batch (averaged over workers) where the strategy
    can provide it cheaply (ddp and zero reduce it together with the gradients); a strategy
    that reports only this worker's mean sets extra["loss_scope"] = "local".
    """
    loss: float = float("nan")
    compute_s: float = 0.0        # forward + backward (+ optimizer where local)
    comm_s: float = 0.0           # time blocked in communication (not hidden by overlap)
    bytes_sent: int = 0           # bytes this rank put on the wire in this step
    extra: dict = field(default_factory=dict)

"""The components of a psrt.train run, one concern each, on psrt.train.events' events.

    restarts     --resume, and a run mpi_launch --restarts started again: load, say, note steps
    in_job       in-job recovery (ULFM): commit each step, shrink and go on after a lost rank
    heartbeat    the watchdog hears each finished step
    summary      the step totals and the summary row
    routing      --model moe: routed and dropped tokens, the all-to-all beside its model
    metrics      --metrics: one JSONL line per step
    progress     the lead worker's progress line
    checkpoints  --checkpoint: every --checkpoint-every steps and at the end, atomic
    ledger       the memory ledger: what each rank holds, activations, ZeRO's formula
    evaluation   the held-out loss and accuracy of the trained model
    saving       --save: the one-process model's parameters
    tensorboard  --tensorboard: a TensorBoard event file per strategy
    timeline     --trace: the Chrome-trace timeline of every rank
    user         --callback module:Class, the user's own

psrt/train/loop.py puts them together in that order; none imports another, nor the core.
"""

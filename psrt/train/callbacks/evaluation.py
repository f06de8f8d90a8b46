"""The trained model on the held-out set: mean loss and accuracy (next-character accuracy for
text), measured by the lead worker on the one-process model."""
from __future__ import annotations

import torch

from psrt import faults
from psrt.dp.device import to as to_device
from psrt.train.events import Callback
from psrt.train.models import loss_and_correct


@torch.no_grad()
def evaluate(model, dataset, batch: int = 512, loss=None) -> tuple[float | None, float | None]:
    """(mean loss, accuracy) on the held-out set; for text, next-character accuracy.  None
    for what cannot be measured: an empty test set, accuracy of targets that are not classes."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    device = next(model.parameters()).device
    for i in range(0, len(dataset.test_x), batch):
        x, y = to_device((dataset.test_x[i:i + batch], dataset.test_y[i:i + batch]), device)
        value, c, n = loss_and_correct(model, (x, y), dataset.task, loss)
        loss_sum += float(value) * n
        correct = None if c is None or correct is None else correct + c
        count += n
    model.train()
    if not count:
        return None, None
    return loss_sum / count, None if correct is None else correct / count


class Evaluation(Callback):

    def __init__(self):
        self.loss = self.accuracy = None

    def on_evaluate(self, run, model) -> None:
        faults.strike_if_asked("evaluation", run.total)
        if run.is_lead:
            self.loss, self.accuracy = evaluate(model, run.dataset, loss=run.built.criterion)

    def on_gather(self, run, mine: dict) -> None:
        mine.update(test_loss=self.loss, test_acc=self.accuracy)

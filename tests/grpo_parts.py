"""The trainer and the update-rank worker wired with the GRPO recipe's micro-batch update (`update_micro_batch`), as
`forge.stages` and the Ray adapter wire them, for tests that build them directly."""

from __future__ import annotations

import functools

from forge import trainer, workers
from forge.recipes.grpo import update_micro_batch

Trainer = functools.partial(trainer.Trainer, micro_update=update_micro_batch)
TrainerWorker = functools.partial(workers.TrainerWorker, micro_update=update_micro_batch)

"""The trainer and the update-rank worker wired with the GRPO recipe's micro-batch update (`update_micro_batch`), as
`forge.compose.local_stages` and the Ray adapter wire them, built from a run config (`forge.compose`), for tests that
build them directly."""

from __future__ import annotations

import functools

from forge import compose
from forge.recipes.grpo import update_micro_batch

Trainer = functools.partial(compose.trainer, micro_update=update_micro_batch)
TrainerWorker = functools.partial(compose.trainer_worker, micro_update=update_micro_batch)

"""openpipe-art (ART) compatibility, all of it: what an ART program sends art-sky, and how art-sky answers it.

ART moves monthly. art-sky supports a range of its releases, each end tested against the real package (tests/
test_openpipe_art.py): from the last release for Python 3.11 to the newest tested one (`releases.py`). An ART
program changes one line, its backend (`art_sky.LocalBackend()`, `SSHBackend`, `SkyPilotBackend`); everything it
then calls lands here:

- `releases.py`: the supported range, the release lines and what each brought, the check at `register()`;
- `protocol.py`: ART's Backend protocol (`register`, `_prepare_backend_for_training`, `_get_step`,
  `exact_adapter_lease`, `_train_sft`, ...), mixed into every art-sky backend;
- `training.py`: `backend.train`'s keywords per release line, mapped to art-sky's trainer or refused by name, and
  the `TrainResult` ART's code expects back;
- `models.py`: a model's run (ART's `run_name` lineage), its LoRA (`lora_config`, `_internal_config`) and its chat
  template arguments, and ART's SFT settings;
- `capture.py`: trajectories recorded ART's capture way (`art.trajectory(...)`: `Trajectory.exchanges`) as the
  conversations art-sky trains.

Nothing here imports openpipe-art at module level: ART's objects are read by their fields, so art-sky's own client
needs no ART, and ART's names are looked up only when an ART program is running.
"""

from .releases import NEWEST, OLDEST

__all__ = ["NEWEST", "OLDEST"]

"""Print, as JSON, the reduce dtype FSDP2 uses per unit under --reduce-vocabulary-in-16-bit.

Runs in one process on a fake process group of world size 2 (no values are exchanged).
Arguments: DATA, then fairseq training flags.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from launching.fake_group import trainer_on_fake_group  # noqa: E402

trainer = trainer_on_fake_group(sys.argv[1:], world_size=2)
report = {
    unit.name: str(unit.modules[0]._get_fsdp_state()._mp_policy.reduce_dtype)
    for unit in trainer.sharding_plan.units
}
print(json.dumps(report))

"""Run ``fairseq-train`` (under torchrun) and record each rank's parameter shards after
every update, to compare replicas of hybrid sharding.

Usage: train_with_checksums.py OUT_DIR FAIRSEQ_ARGS...
Each rank appends ``{"update", "sha256"}`` lines to ``OUT_DIR/rank{RANK}.jsonl``: a hash of
its local parameter shards in parameter order, taken after every ``train_step``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

import fairseq_shard_plugin
from fairseq_shard_plugin.training.trainer import ShardedTrainer


def shard_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        digest.update(name.encode())
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    out = Path(sys.argv[1]) / f"rank{os.environ['RANK']}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    train_step = ShardedTrainer.train_step

    def recorded_train_step(self: ShardedTrainer, samples: Any, raise_oom: bool = False) -> Any:
        logging_output = train_step(self, samples, raise_oom)
        self.wait_for_host_step()  # with --cpu-offload the update may still be running
        record = {"update": self.get_num_updates(), "sha256": shard_digest(self._model)}
        with out.open("a") as log:
            log.write(json.dumps(record) + "\n")
        return logging_output

    ShardedTrainer.train_step = recorded_train_step  # type: ignore[method-assign]
    sys.argv = ["fairseq-train", *sys.argv[2:]]
    from fairseq_cli.train import cli_main

    # the plugin's modules are imported already, so fairseq skips its user dir
    fairseq_shard_plugin.activate()

    cli_main()


if __name__ == "__main__":
    main()

"""A model built for a checkpoint (generation, ``from_pretrained``) is checked against it.

fairseq builds such a model from the checkpoint's model config and the current task's
dictionaries, then copies the weights in; where the dictionary differs (the nllb branch's
data-source tags, another ``--srcdict``), torch's size-mismatch traceback for every
parameter was all that said so. fairseq reads the checkpoint just before it builds the
model (hook 6 notes what it read: :func:`..run_hooks.checkpoint_read`), so the
task compares the shapes first and names the first difference in one line.
"""

from __future__ import annotations

from typing import Any

from fairseq_shard_plugin.checkpoint.errors import describe_shape_difference, state_dict_shapes
from fairseq_shard_plugin.errors import ShardPluginError
from fairseq_shard_plugin.run_hooks import checkpoint_read


class CheckpointModelMismatchError(ShardPluginError, ValueError):
    """A model built for a checkpoint cannot hold its weights; the message says why."""


class MatchingTheCheckpoint:
    """Mixin for a ``FairseqTask``: see the module docstring."""

    def build_model(self, cfg: Any, from_checkpoint: bool = False) -> Any:
        model = super().build_model(cfg, from_checkpoint)  # type: ignore[misc]
        read = checkpoint_read()
        if from_checkpoint and read is not None:
            problem = describe_shape_difference(read.path, read.shapes,
                                                state_dict_shapes(model))
            if problem:
                raise CheckpointModelMismatchError(problem)
        return model

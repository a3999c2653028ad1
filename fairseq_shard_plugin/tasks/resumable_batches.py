"""Batches that do not depend on the epoch a training (re)started in, so resumes are exact.

fairseq groups examples into batches when a task first builds its epoch iterator, with the
random seed of the epoch it is built in, and then reuses that iterator (and its batches)
for every later epoch when the dataset allows it. A training that runs from epoch 1 keeps
epoch 1's batches throughout; one resumed in epoch 3 builds epoch 3's batches instead and
so, from the resume on, trains on different batches than the run it continues. The mixin
below builds a reusable iterator with epoch 1's batches whatever the epoch, as an
uninterrupted run would hold; the checkpoint's iterator state then restores the epoch and
position. Iterators rebuilt every epoch (``--rebuild-batches``, datasets that cannot be
reused across epochs, such as the multilingual task's resampled ones) are left as fairseq
builds them: their batches already follow the epoch.
"""

from __future__ import annotations

from typing import Any

from fairseq_shard_plugin.errors import ShardingConfigError

# fairseq's assertion (its batch_by_size) when a sentence exceeds the batch's token budget
_TOO_LONG = "Sentences lengths should not exceed max_tokens="


class EpochIndependentBatches:
    """Mixin for a ``FairseqTask``: see the module docstring. A sentence longer than the
    token budget of a split that may not skip it (validation) is one line that says what
    to change, not fairseq's assertion."""

    def get_batch_iterator(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._epoch_independent_iterator(dataset, *args, **kwargs)
        except AssertionError as error:
            if not str(error).startswith(_TOO_LONG):
                raise
            splits = [name for name, each in getattr(self, "datasets", {}).items()
                      if each is dataset]
            split = splits[0] if splits else "these"
            raise ShardingConfigError(
                f"a sentence of the {split} data is longer than the batches' "
                f"{kwargs.get('max_tokens')} tokens (fairseq: {error}): raise --max-tokens "
                "(or --max-tokens-valid), or add --skip-invalid-size-inputs-valid-test to "
                "skip such sentences in validation") from None

    def _epoch_independent_iterator(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
        epoch = kwargs.get("epoch", 1)  # fairseq passes it by keyword
        reused = (
            not kwargs.get("disable_iterator_cache", False)
            and not kwargs.get("update_epoch_batch_itr", False)
            and not getattr(self.cfg, "rebuild_batches", False)  # type: ignore[attr-defined]
            and self.can_reuse_epoch_itr(dataset)  # type: ignore[attr-defined]
        )
        built = dataset in getattr(self, "dataset_to_epoch_iter", {})  # then fairseq reuses it
        if not reused or built or epoch == 1:
            return super().get_batch_iterator(dataset, *args, **kwargs)  # type: ignore[misc]
        iterator = super().get_batch_iterator(  # type: ignore[misc]
            dataset, *args, **dict(kwargs, epoch=1))
        # the epoch itself is the requested one (a resume then restores it, with the
        # position, from the checkpoint's iterator state)
        iterator.epoch = epoch
        dataset.set_epoch(epoch)
        return iterator

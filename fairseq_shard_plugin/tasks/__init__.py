"""What registers with fairseq: the sharded translation and multilingual tasks and their
configuration, the NLLB architectures, the chunked cross-entropy criterion, resumable
batch iteration.

May import :mod:`..sharding` (the plugin's options, the wrap policy's names),
:mod:`..checkpoint` (its shape wording) and :mod:`..run_hooks` (what hook 6 read); nothing
above.
"""


def register() -> None:
    """Register the plugin's tasks, criterion and architectures with fairseq (idempotent:
    Python imports each module once). Installs no hook (see the package's ``activate``)."""
    from fairseq_shard_plugin.tasks import (  # noqa: F401  (each registers with fairseq)
        chunked_criterion,
        nllb_architectures,
        sharded_multilingual,
        sharded_translation,
    )

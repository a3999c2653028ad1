"""The console scripts (``fairseq-shard-*``): argument parsing and printing around the
logic of the subpackages they call.

Importing this package keeps two known-harmless third-party messages off the scripts'
output (:func:`quiet_third_party`): fairscale's import-time FutureWarnings about
``torch.cuda.amp`` and fairseq's "Please install tensorboardX", logged when its speech tasks
are imported. Neither concerns checkpoints, estimates or data.
"""

from __future__ import annotations

import logging
import warnings


def quiet_third_party() -> None:
    """Silence the two messages above, and nothing else."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"fairscale(\.|$)")
    logging.getLogger("fairseq.tasks.text_to_speech").setLevel(logging.WARNING)


quiet_third_party()

"""``fairseq-shard-user-dir``: the folder to give fairseq as ``--user-dir``, from anywhere.

fairseq takes ``--user-dir`` as a path (relative to the working directory, or to fairseq's
own package): a non-editable install beside fairseq is found by its name, an editable one
(``make``'s) only from the checkout. ``--user-dir "$(fairseq-shard-user-dir)"`` names the
installed package's folder wherever the command runs.
"""

from __future__ import annotations

from pathlib import Path

import fairseq_shard_plugin


def main() -> None:
    print(Path(fairseq_shard_plugin.__file__).resolve().parent)


if __name__ == "__main__":
    main()

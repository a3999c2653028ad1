"""``fairseq-shard-user-dir``: the folder to give fairseq as ``--user-dir``, from anywhere;
with ``--configs``, the folder of the plugin's Hydra configs (``--config-dir``).

fairseq takes ``--user-dir`` as a path (relative to the working directory, or to fairseq's
own package): a non-editable install beside fairseq is found by its name, an editable one
(``make``'s) only from the checkout. ``--user-dir "$(fairseq-shard-user-dir)"`` names the
installed package's folder wherever the command runs. The configs are the checkout's
``configs/nllb`` (an editable install), or the copy ``pip install`` put under
``PREFIX/share/fairseq-shard-plugin`` (``--config-dir configs/nllb`` worked only from the
checkout, T1 #10, session 25).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import fairseq_shard_plugin

PACKAGE = Path(fairseq_shard_plugin.__file__).resolve().parent
INSTALLED_CONFIGS = Path("share") / "fairseq-shard-plugin" / "configs" / "nllb"


def configs_folder(package: Path = PACKAGE, prefix: Path = Path(sys.prefix)) -> Path | None:
    """The folder of the NLLB configs: the checkout's, else the installed copy, else None."""
    for folder in (package.parent / "configs" / "nllb", prefix / INSTALLED_CONFIGS):
        if (folder / "tiny.yaml").is_file():
            return folder
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fairseq-shard-user-dir", description=__doc__)
    parser.add_argument("--configs", action="store_true",
                        help="print the folder of the plugin's Hydra configs (--config-dir)")
    if not parser.parse_args(argv).configs:
        print(PACKAGE)
        return
    folder = configs_folder()
    if folder is None:
        parser.exit(1, f"{parser.prog}: error: no configs beside {PACKAGE} nor under "
                       f"{Path(sys.prefix) / INSTALLED_CONFIGS}: reinstall the plugin with "
                       "pip from its source tree\n")
    print(folder)


if __name__ == "__main__":
    main()

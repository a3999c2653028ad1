from pathlib import Path

from setuptools import find_packages, setup

# the Hydra configs, installed under PREFIX/share (fairseq-shard-user-dir --configs names them)
CONFIGS = [(f"share/fairseq-shard-plugin/{folder}",
            sorted(str(path) for path in Path(folder).glob("*.yaml")))
           for folder in sorted({str(path.parent) for path in Path("configs").rglob("*.yaml")})]

setup(
    name="fairseq-shard-plugin",
    version="0.1.0",
    description="fairseq --user-dir plugin: per-layer parameter sharding that reduces memory",
    packages=find_packages(include=["fairseq_shard_plugin", "fairseq_shard_plugin.*"]),
    # the C host Adam step, compiled on first use (sharding/native_adam.py)
    package_data={"fairseq_shard_plugin.sharding": ["native_adam.c"]},
    data_files=CONFIGS,
    python_requires=">=3.10",
    # torch and fairseq are not pinned here: an existing fairseq (e.g. the NLLB branch) and
    # its torch must never be replaced, not even to meet a floor (the package refuses a torch
    # older than 2.11 itself: torch_support.py). Install torch first (the Makefile pins
    # 2.13.0).
    install_requires=["torch"],
    extras_require={
        # A prebuilt Python 3.11 build of fairseq 0.12.3, for machines without one.
        "fairseq": ["ve-fairseq==0.12.3"],
        "fairscale": ["fairscale==0.4.13"],
        "test": ["pytest>=8", "ruff>=0.6"],
        "bench": ["matplotlib>=3.8"],
    },
    entry_points={
        "console_scripts": [
            "fairseq-shard-synthetic-data=fairseq_shard_plugin.cli.synthetic_data:main",
            "fairseq-shard-measure-train=fairseq_shard_plugin.cli.measure_train:main",
            "fairseq-shard-consolidate=fairseq_shard_plugin.cli.consolidate:main",
            "fairseq-shard-verify=fairseq_shard_plugin.cli.verify:main",
            "fairseq-shard-estimate=fairseq_shard_plugin.cli.estimate:main",
            "fairseq-shard-prepare-nllb-branch=fairseq_shard_plugin.cli.nllb_branch:main",
            "fairseq-shard-user-dir=fairseq_shard_plugin.cli.user_dir:main",
        ],
    },
)

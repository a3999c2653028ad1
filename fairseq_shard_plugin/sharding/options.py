"""The plugin's sharding options: one dataclass, mixed into the plugin's task configs.


Fields become ordinary fairseq flags (``shard_engine`` -> ``--shard-engine``) and Hydra keys
(``task.shard_engine``). A run whose task does not carry them gets the defaults.
No ``from __future__ import annotations`` here: fairseq reads the field types at runtime.
"""


from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass

SHARD_ENGINES = ChoiceEnum(["fsdp2", "fairscale"])
SHARD_STRATEGIES = ChoiceEnum(["full", "hybrid"])
CHECKPOINT_FORMATS = ChoiceEnum(["auto", "full", "sharded"])


# what --save-on-signal catches by default (Slurm sends SIGUSR1 before the time limit
# when asked to with --signal, and SIGTERM when it preempts or cancels)
DEFAULT_SIGNALS = "SIGUSR1,SIGTERM"

# metadata key of the flags the memory estimator models (``fairseq-shard-estimate`` takes
# them, and a running training passes them on): :data:`MODELLED_FLAGS`
MODELLED = "modelled_by_the_estimator"


@dataclass
class ShardingConfig(FairseqDataclass):
    """Options of ``--ddp-backend fully_sharded`` when the plugin is loaded."""

    shard_engine: SHARD_ENGINES = field(  # type: ignore[valid-type]
        default="fsdp2",
        metadata={
            "help": "sharding engine: fsdp2 (torch fully_shard; CPU/gloo and CUDA/NCCL) or "
            "fairscale (fairscale FSDP, flat parameters; CUDA only)"
        },
    )
    keep_root_gathered: bool = field(
        default=False,
        metadata={
            MODELLED: True,
            "help": "keep the root unit's parameters gathered between forward and backward, "
            "as fairscale's root does in stock fairseq (costs memory; for comparison)"
        },
    )
    keep_vocabulary_gathered: bool = field(
        default=False,
        metadata={
            MODELLED: True,
            "help": "keep the vocabulary unit (shared embeddings and output projection) "
            "gathered from its first use in forward to the end of backward: one all-gather "
            "per step instead of one per use, for vocabulary x d_model x 2 bytes per rank "
            "(16-bit compute)"
        },
    )
    root_unit_only: bool = field(
        default=False,
        metadata={
            MODELLED: True,
            "help": "shard only the root unit, as stock fairseq does when every layer is "
            "below --min-params-to-wrap (for comparison: no per-layer units)"
        },
    )
    layers_per_unit: int = field(
        default=1,
        metadata={
            "help": "consecutive layers of a stack (encoder, decoder) sharded as one unit: "
            "about N times fewer layer units (all-gathers, reduce-scatters, FSDP hooks), for "
            "up to 2(N - 1) more layers gathered at a time in backward (fsdp2 only)"
        },
    )
    reduce_in_16_bit: bool = field(
        default=False,
        metadata={
            MODELLED: True,
            "help": "with --fp16/--bf16, reduce-scatter gradients in 16 bits instead of fp32 "
            "(halves gradient traffic; less precise)"
        },
    )
    reduce_vocabulary_in_16_bit: bool = field(
        default=False,
        metadata={
            MODELLED: True,
            "help": "with --fp16/--bf16, reduce-scatter only the vocabulary unit's gradient in "
            "16 bits: its fp32 copy (vocabulary x d_model x 4 bytes) is the largest transient "
            "at the end of backward"
        },
    )
    shard_strategy: SHARD_STRATEGIES = field(  # type: ignore[valid-type]
        default="full",
        metadata={
            "help": "full: shard over all ranks; hybrid: shard within a node, replicate "
            "across nodes (2-D device mesh, HSDP)"
        },
    )
    shard_group_size: int = field(
        default=0,
        metadata={
            "help": "ranks per shard group with --shard-strategy hybrid; 0: ranks per node "
            "from the launcher (torchrun LOCAL_WORLD_SIZE, Slurm tasks or GPUs per node)"
        },
    )
    no_memory_report: bool = field(
        default=False,
        metadata={
            "help": "do not log per-step peak memory (on CPU the live-tensor meter costs time)"
        },
    )
    no_host_step_overlap: bool = field(
        default=False,
        metadata={
            "help": "with --cpu-offload, run the host's Adam step in line, after backward; "
            "by default each unit's update runs in a background thread while the next "
            "forward computes the units before it (the same results, bit for bit)"
        },
    )
    export_consolidated: Optional[str] = field(  # noqa: UP045 (fairseq parses Optional[])
        default=None,
        metadata={
            "help": "at the end of training, also write the final model as one standard "
            "fairseq checkpoint (weights only) to this path, for fairseq-generate --path"
        },
    )
    save_on_signal: str = field(
        default=DEFAULT_SIGNALS,
        metadata={
            "help": "signals (comma-separated, or none) on which every rank saves "
            "checkpoint_last.pt after the current update and exits with 128 + the signal "
            "number: Slurm's preemption SIGTERM, --signal=USR1@120 before a time limit"
        },
    )
    checkpoint_format: CHECKPOINT_FORMATS = field(  # type: ignore[valid-type]
        default="auto",
        metadata={
            "help": "auto: sharded under --cpu-offload with the fsdp2 engine (a full save "
            "would gather the model and optimizer state in rank 0's host memory), full "
            "otherwise; full: standard fairseq checkpoints (full tensors gathered to rank 0); "
            "sharded: each rank writes its own shards (torch.distributed.checkpoint) under "
            "checkpoint_shards/ and the usual names hold a small index; both resume on any "
            "number of ranks and fairseq-shard-consolidate reads both"
        },
    )


def take_use_sharded_state(cfg: Any) -> bool:
    """fairseq's ``--use-sharded-state`` (fairscale's per-rank files, which fairseq's recipes
    and GPU tests pass) taken as the plugin's sharded format: ``--checkpoint-format
    sharded`` set where it was ``auto``, and fairseq's flag cleared so that fairseq names
    and saves checkpoints as usual (the plugin's index and shard files). True when taken;
    a ShardingConfigError where the run asks for another format or engine."""
    from omegaconf import open_dict

    from fairseq_shard_plugin.errors import ShardingConfigError

    if not cfg.distributed_training.use_sharded_state:
        return False
    options = sharding_options(cfg.task)
    if options.checkpoint_format == "full":
        raise ShardingConfigError(
            "--use-sharded-state asks for per-rank checkpoint files, --checkpoint-format full "
            "for one: remove one of them")
    if options.shard_engine != "fsdp2":
        raise ShardingConfigError(
            "--use-sharded-state is the sharded checkpoint format, which needs --shard-engine "
            "fsdp2: remove it to save one full checkpoint with the fairscale engine")
    with open_dict(cfg.task):
        cfg.task.checkpoint_format = "sharded"
    cfg.distributed_training.use_sharded_state = False
    return True


def checkpoint_format(cfg: Any) -> str:
    """``--checkpoint-format`` of the run, ``auto`` resolved (see its help): ``full`` or
    ``sharded``."""
    options = sharding_options(cfg.task)
    if options.checkpoint_format != "auto":
        return options.checkpoint_format
    offloaded = bool(cfg.distributed_training.cpu_offload)
    return "sharded" if offloaded and options.shard_engine == "fsdp2" else "full"


# the modelled boolean options by field name (``root_unit_only`` -> ``--root-unit-only``)
MODELLED_FLAGS = tuple(f.name for f in fields(ShardingConfig) if f.metadata.get(MODELLED))


def option_help(name: str) -> str:
    """The help text of the option ``name`` (a field name)."""
    return next(f.metadata["help"] for f in fields(ShardingConfig) if f.name == name)


def sharding_options(task_cfg: Any) -> "ShardingConfig":
    """Read the sharding options from a task config, with defaults for absent fields."""
    values = {}
    for option in fields(ShardingConfig):
        value = getattr(task_cfg, option.name, None) if task_cfg is not None else None
        if isinstance(value, Enum):  # a choice from a Hydra config: fairseq's enum member
            value = value.value
        if value is not None:
            values[option.name] = value
    return ShardingConfig(**values)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# every sharding option as its flag (options of the plugin's tasks, not of fairseq's)
SHARDING_FLAGS = frozenset(_flag(f.name) for f in fields(ShardingConfig)
                           if not f.name.startswith("_"))


def options_given(task_cfg: Any) -> list[str]:
    """The sharding options set to other than their defaults, as flags."""
    given, defaults = sharding_options(task_cfg), ShardingConfig()
    return [_flag(option.name) for option in fields(ShardingConfig)
            if not option.name.startswith("_")
            and getattr(given, option.name) != getattr(defaults, option.name)]


def add_sharding_args(parser: Any) -> None:
    """Add the sharding options to an argparse-configured task's parser."""
    gen_parser_from_dataclass(parser, ShardingConfig())

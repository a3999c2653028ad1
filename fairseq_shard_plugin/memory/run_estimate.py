"""What ``fairseq-shard-estimate`` predicts for the run in progress.

The trainer logs the predicted peak before the first step (on a GPU, with a warning when it
exceeds the device) and the predicted host peak (:func:`host_memory_warning` compares that
with the machine's memory), and a step that runs out of memory quotes the prediction with a
command the user can rerun with other settings. The estimator's flags are read from the
run's own configuration, so the command printed is the run as configured.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from fairseq.models import ARCH_MODEL_REGISTRY

from fairseq_shard_plugin.checkpoint.space import readable
from fairseq_shard_plugin.memory.estimate import (
    CHUNKED,
    CRITERIA,
    LAYER_NORM_SWITCHES,
    PROG,
    EstimateError,
    layer_sizes,
    shape_of,
)
from fairseq_shard_plugin.memory.estimate import run as run_estimator
from fairseq_shard_plugin.memory.model import GIB, ModelShape
from fairseq_shard_plugin.sharding.options import (
    MODELLED_FLAGS,
    checkpoint_format,
    sharding_options,
)
from fairseq_shard_plugin.sharding.settings import ranks_per_node

logger = logging.getLogger(__name__)

MODELLED_OPTIMIZERS = ("adam", "sgd")
# Share of a GPU's memory the estimate may fill: the rest is the CUDA context, the caching
# allocator's fragmentation and what the estimate leaves out.
DEVICE_HEADROOM = 0.9
# the host's peak case in the predicted host peak line
HOST_CASE_WORDS = {"model construction": "building the model (fp32, sharded layer by layer)",
                   "training step": "the training step",
                   "save, full format": "a full-format save (gathered on rank 0)",
                   "save, sharded format": "a sharded save"}


@dataclass(frozen=True)
class Prediction:
    """The estimator's figures for a run, and the command that printed them."""

    command: str
    peak_gib: float
    peak_phase: str
    host_gib: float = 0.0  # model state on the host (--cpu-offload), not in the peak
    budget_gib: float | None = None
    max_tokens: int | None = None  # within the budget
    most_with: dict | None = None  # the feature that fits the most tokens, and how many
    host: dict | None = None  # the estimator's host report (per case, and the peak)

    @property
    def host_peak_bytes(self) -> float | None:
        """Predicted host peak per rank: building the model, a step or a save."""
        return None if self.host is None else self.host["peak"]["per_rank_gib"] * GIB

    def host_text(self) -> str:
        """The predicted host peak in one line ("" without a host report)."""
        if self.host is None:
            return ""
        peak, ranks = self.host["peak"], self.host["ranks_per_node"]
        where = HOST_CASE_WORDS.get(peak["case"], peak["case"])
        text = (f"predicted host peak: {readable(peak['per_rank_gib'] * GIB)} per rank during "
                f"{where}; at most {readable(peak['per_host_gib'] * GIB)} for this node's "
                f"{ranks} rank{'s' if ranks != 1 else ''} together")
        return text + (" (CPU ranks: the host's memory is their device memory)"
                       if self.host["cpu"] else "")

    def fit_text(self) -> str:
        """Which --max-tokens fit within the budget, as a clause ("" without a budget)."""
        if self.budget_gib is None or self.max_tokens is None:
            return ""
        text = (f"at most --max-tokens {self.max_tokens:,} fits in {self.budget_gib:.1f} GiB"
                if self.max_tokens else
                f"its model state alone exceeds {self.budget_gib:.1f} GiB")
        if self.most_with is not None:
            text += f", {self.most_with['max_tokens']:,} with {self.most_with['flag']}"
        return text


@dataclass(frozen=True)
class RunDescription:
    """A run as the estimator's flags, with its model's shape read from the model itself."""

    flags: list[str]
    shape: ModelShape


def model_flags(model: torch.nn.Module, shape: ModelShape) -> list[str]:
    """The estimator's size flags for a built encoder-decoder transformer and its shape,
    whatever configuration built it (flags, an arch's defaults, Hydra's nested keys)."""
    flags = ["--vocab", str(shape.vocabulary)]
    for side in ("encoder", "decoder"):
        flags += [f"--{side}-layers", str(getattr(shape, f"{side}_layers")),
                  f"--{side}-embed-dim", str(getattr(shape, f"{side}_dim")),
                  f"--{side}-ffn-embed-dim", str(getattr(shape, f"{side}_ffn")),
                  f"--{side}-attention-heads", str(getattr(shape, f"{side}_heads"))]
    dropout = max(layer_sizes(model.encoder.layers[0])[3],  # type: ignore[index]
                  layer_sizes(model.decoder.layers[0])[3])  # type: ignore[index]
    shared = model.encoder.embed_tokens is model.decoder.embed_tokens
    flags += ["--attention-dropout", str(dropout),
              "--share-all-embeddings" if shared else "--no-share-all-embeddings"]
    # the layer norms fairseq adds by switch: final ones (pre-norm), after the embeddings
    present = {"encoder_normalize_before": getattr(model.encoder, "layer_norm", None),
               "decoder_normalize_before": getattr(model.decoder, "layer_norm", None),
               "layernorm_embedding": getattr(model.encoder, "layernorm_embedding", None)}
    return flags + ["--" + switch.replace("_", "-") for switch in LAYER_NORM_SWITCHES
                    if present[switch] is not None]


def describe_run(cfg: Any, model: torch.nn.Module, shard_group_size: int) -> RunDescription | None:
    """:func:`run_description`, or None (with the reason logged) where the estimator does
    not model the run. A prediction is a notice: whatever goes wrong here is logged, never
    a reason to stop training."""
    try:
        return run_description(cfg, model, shard_group_size)
    except Exception as error:  # noqa: BLE001
        logger.info(f"no memory prediction for this run: {error}")
        return None


def run_description(cfg: Any, model: torch.nn.Module, shard_group_size: int) -> RunDescription:
    """The run configured by ``cfg`` (fairseq's config, from flags or Hydra) as
    ``fairseq-shard-estimate`` flags, its shape read from ``model``, built and not sharded
    yet. :class:`EstimateError` says what the estimator does not model."""
    arch = getattr(cfg.model, "arch", None) or getattr(cfg.model, "_name", None)
    optimizer = getattr(cfg.optimizer, "_name", None)
    criterion = getattr(cfg.criterion, "_name", None)
    shape = shape_of(model)
    empty = [stack for stack in ("encoder", "decoder")
             if getattr(getattr(model, stack, None), "layers", None) is not None
             and len(getattr(model, stack).layers) == 0]
    if shape is None and empty and arch in ARCH_MODEL_REGISTRY:
        raise EstimateError(f"--{empty[0]}-layers 0: the estimator models transformers with "
                            "at least one encoder and one decoder layer")
    if shape is None or arch not in ARCH_MODEL_REGISTRY:
        raise EstimateError(f"--arch {arch} is not an encoder-decoder transformer the "
                            "estimator models")
    if cfg.dataset.max_tokens is None:
        raise EstimateError("the estimator models batches of --max-tokens, not --batch-size")
    if cfg.dataset.max_tokens < 1:
        raise EstimateError(f"--max-tokens {cfg.dataset.max_tokens}: give the tokens per "
                            "batch, at least 1")
    if optimizer not in MODELLED_OPTIMIZERS:
        raise EstimateError(f"--optimizer {optimizer} is not modelled (one of "
                            f"{', '.join(MODELLED_OPTIMIZERS)})")
    if criterion not in CRITERIA:
        raise EstimateError(f"--criterion {criterion} is not modelled (one of "
                            f"{', '.join(CRITERIA)})")
    flags = ["--arch", str(arch), *model_flags(model, shape),
             "--world-size", str(shard_group_size), "--max-tokens", str(cfg.dataset.max_tokens),
             "--optimizer", optimizer, "--criterion", criterion]
    for name in ("memory_efficient_fp16", "fp16", "memory_efficient_bf16", "bf16"):
        if getattr(cfg.common, name, False):
            flags.append("--" + name.replace("_", "-"))
            break
    if optimizer == "adam" and getattr(cfg.optimizer, "fp16_adam_stats", False):
        flags.append("--fp16-adam-stats")
    if getattr(cfg.common, "cpu", False):
        flags.append("--cpu")
    if criterion == CHUNKED:
        flags += ["--loss-chunk-tokens", str(cfg.criterion.loss_chunk_tokens)]
    options = sharding_options(cfg.task)
    flags += ["--" + name.replace("_", "-") for name in MODELLED_FLAGS if getattr(options, name)]
    if options.layers_per_unit > 1:
        flags += ["--layers-per-unit", str(options.layers_per_unit)]
    update_freq = max(getattr(cfg.optimization, "update_freq", None) or [1])
    if update_freq > 1:
        flags += ["--update-freq", str(update_freq)]
    if getattr(cfg.model, "checkpoint_activations", False):
        flags.append("--checkpoint-activations")
    if cfg.distributed_training.cpu_offload:
        flags.append("--cpu-offload")
    if cfg.distributed_training.no_reshard_after_forward:
        flags.append("--no-reshard-after-forward")
    saved_as = checkpoint_format(cfg)
    if saved_as != "full":
        flags += ["--checkpoint-format", saved_as]
    return RunDescription(flags, shape)


def predict(run: RunDescription | None, tokens_per_sentence: int | None = None,
            budget_gib: float | None = None, ranks_on_node: int | None = None,
            cpu: bool = False) -> Prediction | None:
    """The estimator's figures for ``run`` (None: no run described), computed in this
    process on the run's own model shape (arithmetic only); ``ranks_on_node`` and ``cpu``
    (ranks on CPUs) where known, for the host peak."""
    if run is None:
        return None
    flags = list(run.flags)
    if tokens_per_sentence:
        flags += ["--tokens-per-sentence", str(tokens_per_sentence)]
    if ranks_on_node:
        flags += ["--ranks-per-node", str(ranks_on_node)]
    if cpu and "--cpu" not in flags:
        flags.append("--cpu")
    if budget_gib is not None:
        flags += ["--memory-budget", f"{budget_gib:.2f}"]
    report = run_estimator(flags, run.shape)
    fits = report["fits"] or {}
    requested = report["configurations"]["requested"]
    return Prediction(
        command=shlex.join([PROG, *flags]), peak_gib=requested["peak_gib"],
        peak_phase=requested["peak_phase"], host_gib=requested["host_gib"],
        budget_gib=budget_gib,
        max_tokens=fits.get("max_tokens", {}).get("requested"),
        most_with=fits.get("most_with"), host=report["host"],
    )


def tokens_per_sentence(samples: Any) -> int | None:
    """Average target tokens per sentence of a step's samples, if they say."""
    tokens = sentences = 0
    for sample in samples if isinstance(samples, list) else [samples]:
        if isinstance(sample, dict) and sample.get("nsentences"):
            tokens += int(sample.get("ntokens", 0))
            sentences += int(sample["nsentences"])
    return round(tokens / sentences) if sentences and tokens else None


def device_budget_gib(device: torch.device) -> float | None:
    """What the estimate may fill on ``device``: most of a GPU's memory; None on CPU (the
    host's memory is shared with everything else)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory * DEVICE_HEADROOM / GIB


def mean_sentence_tokens(task: Any, subsets: str) -> int | None:
    """Mean tokens per sentence (the longer side of each pair, as fairseq's batching counts
    them) of the first loaded dataset among ``subsets``; fairseq loads the validation
    subsets before it builds the trainer."""
    datasets = getattr(task, "datasets", None) or {}
    for subset in (subsets or "").split(","):
        sizes = getattr(datasets.get(subset), "sizes", None)
        if sizes is None:
            continue
        lengths = np.asarray(sizes)
        if lengths.ndim == 2:
            lengths = lengths.max(axis=1)
        if lengths.ndim == 1 and len(lengths):
            return max(1, round(float(lengths.mean())))
    return None


def log_predicted_peak(run: RunDescription | None, device: torch.device, task: Any = None,
                       valid_subsets: str = "") -> Prediction | None:
    """Before the first step: the predicted peak, and a warning where it will not fit; at
    the mean sentence length of the loaded validation data (the estimator's 64 without);
    then the predicted host peak. Returns the prediction (None: none made), whose
    ``host_peak_bytes`` :func:`host_memory_warning` takes."""
    try:
        sentence_tokens = mean_sentence_tokens(task, valid_subsets)
        budget = device_budget_gib(device)
        prediction = predict(run, sentence_tokens, budget_gib=budget,
                             ranks_on_node=ranks_per_node(), cpu=device.type == "cpu")
    except Exception as error:  # noqa: BLE001 (a notice, never a reason to stop training)
        logger.info(f"no memory prediction for this run: {error}")
        return None
    if prediction is None:  # describe_run logged why
        return None
    sentences = (f"sentences of {sentence_tokens} tokens as in the validation data"
                 if sentence_tokens else "sentences of 64 tokens")
    host = (f" on the device, {readable(prediction.host_gib * GIB)} of model state on the host"
            if prediction.host_gib else "")
    logger.info(f"predicted peak: {readable(prediction.peak_gib * GIB)} per rank{host}, in the "
                f"{prediction.peak_phase} ({sentences}); to compare settings: "
                f"{prediction.command}")
    if budget is not None and prediction.peak_gib > budget:
        logger.warning(f"the predicted peak exceeds {budget:.1f} GiB, {DEVICE_HEADROOM:.0%} "
                       f"of this GPU's memory: {prediction.fit_text()}")
    logger.info(prediction.host_text())
    return prediction


def host_ram_bytes() -> int | None:
    """This machine's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_memory_warning(predicted_host_peak_bytes: float | None,
                        ranks_on_node: int | None = None,
                        ram_bytes: float | None = None) -> str | None:
    """A one-line warning where the predicted host peak per rank exceeds a rank's share of
    this machine's RAM (``ram_bytes``, default physical memory, over ``ranks_on_node``,
    default the launcher's ranks per node, else 1), saying what to change; None where it
    fits or nothing is known."""
    ram = host_ram_bytes() if ram_bytes is None else ram_bytes
    if predicted_host_peak_bytes is None or not ram:
        return None
    ranks = ranks_on_node or ranks_per_node() or 1
    share = ram / ranks
    if predicted_host_peak_bytes <= share:
        return None
    return (f"the predicted host peak, {readable(predicted_host_peak_bytes)} per rank, exceeds "
            f"{readable(share)}, this machine's {readable(ram)} of RAM over {ranks} "
            f"rank{'s' if ranks != 1 else ''}: run fewer ranks per node, save with "
            "--checkpoint-format sharded (a full save gathers the model on rank 0), keep "
            "model state in 16 bits (--memory-efficient-fp16 or --memory-efficient-bf16, "
            f"--fp16-adam-stats) or add swap ({PROG} shows the host memory of each case)")


def out_of_memory_clause(run: RunDescription | None, samples: Any,
                         device: torch.device) -> str | None:
    """What the estimator says of a step that ran out of memory, as a clause for its
    one-line error; None where it does not model the run."""
    prediction = predict(run, tokens_per_sentence(samples), device_budget_gib(device))
    if prediction is None:
        return None
    fit = prediction.fit_text()
    return (f"{PROG} puts this step at {readable(prediction.peak_gib * GIB)} per rank"
            + (f" ({fit})" if fit else "")
            + f"; compare settings with: {prediction.command}")

"""``fairseq-shard-estimate``: per-rank memory of a sharded fairseq training, before the run.

Builds the model through fairseq on the meta device (exact parameter counts and sharding
units, no memory), then applies :mod:`fairseq_shard_plugin.memory.model`. Prints GiB per
rank for unsharded training, stock fairseq's ``fully_sharded`` policy and the requested
configuration side by side, and which feature would lower the peak most.

    fairseq-shard-estimate --arch nllb_dense_600m --world-size 2 --max-tokens 4096 --fp16
    fairseq-shard-estimate --world-size 2 --memory-budget 22 -- <fairseq-train arguments>
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from fairseq_shard_plugin.errors import ShardPluginError
from fairseq_shard_plugin.memory.estimate_config import defaults_from_hydra_config
from fairseq_shard_plugin.memory.model import (
    GIB,
    HOST_CASES,
    Estimate,
    HostSetup,
    ModelShape,
    TrainingSetup,
    comparison,
    comparison_setups,
    estimate,
    fits_most_with,
    helps_most,
    host_memory,
    largest_tokens,
    training_host_peak,
)
from fairseq_shard_plugin.sharding.options import MODELLED_FLAGS, option_help
from fairseq_shard_plugin.sharding.settings import precision_name

PROG = "fairseq-shard-estimate"
EPILOG = ("A training command as written: put its fairseq-train arguments after --; the "
          "estimator's flags are read from it (printed first) and options given before -- "
          "override them.")
CHUNKED = "chunked_label_smoothed_cross_entropy"
STOCK = "label_smoothed_cross_entropy"
# fairseq's criteria that hold the same tensors as STOCK (measured equal to 0.01%:
# benchmarks/results/memory_cross_entropy.*)
LIKE_STOCK = ("cross_entropy",)
CRITERIA = (STOCK, CHUNKED, *LIKE_STOCK)
# fairseq's switches that add parameters (layer norms), passed on as they are
LAYER_NORM_SWITCHES = ("encoder_normalize_before", "decoder_normalize_before",
                       "layernorm_embedding")
SIZE_FLAGS = ("encoder_layers", "decoder_layers", "encoder_embed_dim", "decoder_embed_dim",
              "encoder_ffn_embed_dim", "decoder_ffn_embed_dim", "encoder_attention_heads",
              "decoder_attention_heads")


class EstimateError(ShardPluginError, ValueError):
    """Bad input, reported as one line naming the flag to change."""


# values every estimate rests on, which the output names when the defaults were taken
ASSUMED = ("arch", "vocab", "world_size", "max_tokens")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                usage=f"{PROG} [options] [-- fairseq-train arguments]",
                                epilog=EPILOG)
    p.add_argument("--config", action="append",
                   help="a fairseq-hydra-train config (e.g. configs/nllb/dense_600m.yaml): its "
                   "model, precision, optimizer, criterion, max tokens and plugin keys become "
                   "the defaults; flags given as well override them (not with a training "
                   "command after --, which describes the whole run); repeated, the configs "
                   "compose in order, as Hydra's + groups do (--config finetune_3_3b.yaml "
                   "--config hardware/one_24gb_gpu.yaml)")
    p.add_argument("--arch", default="nllb_dense_600m",
                   help="any registered fairseq encoder-decoder transformer arch (default: "
                   "%(default)s, NLLB-600M's shape)")
    for flag in SIZE_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=int, help="override the arch's value")
    p.add_argument("--attention-dropout", type=float,
                   help="override the arch's (with dropout the attention keeps probabilities)")
    for switch in LAYER_NORM_SWITCHES:
        p.add_argument("--" + switch.replace("_", "-"), action="store_true",
                       help="fairseq's flag (on where the arch sets it)")
    p.add_argument("--share-all-embeddings", action=argparse.BooleanOptionalAction,
                   default=None, help="default: the arch's (on for nllb_dense_*)")
    p.add_argument("--vocab", type=int, default=256206,
                   help="dictionary size, source=target (default: %(default)s, NLLB's)")
    p.add_argument("--world-size", type=int, default=2,
                   help="ranks sharing the model (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="tokens per rank and step (default: %(default)s)")
    p.add_argument("--update-freq", type=int, default=1, metavar="N",
                   help="micro-batches per update (fairseq's; above 1 every gradient shard "
                   "stays live from the second micro-batch on)")
    p.add_argument("--tokens-per-sentence", type=int, default=64,
                   help="sentence length (attention memory grows with it)")
    precision = p.add_mutually_exclusive_group()
    for flag in ("fp16", "bf16"):
        precision.add_argument("--" + flag, action="store_true",
                               help="16-bit compute, fp32 master and gradient shards")
    for flag in ("memory-efficient-fp16", "memory-efficient-bf16"):
        precision.add_argument("--" + flag, action="store_true",
                               help="16-bit compute, parameter and gradient shards")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--fp16-adam-stats", action="store_true",
                   help="Adam's two moments in fp16 (fp32 otherwise)")
    p.add_argument("--criterion", choices=CRITERIA, default=STOCK,
                   help=f"{', '.join(LIKE_STOCK)}: modelled as {STOCK} (the same tensors)")
    p.add_argument("--loss-chunk-tokens", type=int, default=1024)
    for name in MODELLED_FLAGS:  # the plugin's own, as a training takes them
        p.add_argument("--" + name.replace("_", "-"), action="store_true",
                       help=option_help(name))
    p.add_argument("--layers-per-unit", type=int, default=1, metavar="N",
                   help=option_help("layers_per_unit"))
    for flag in ("checkpoint-activations", "cpu-offload"):  # fairseq's
        p.add_argument("--" + flag, action="store_true")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="fairseq's flag: every unit stays gathered from forward to backward")
    p.add_argument("--cpu", action="store_true",
                   help="the ranks run on CPUs: host memory is their device memory, and "
                   "their collectives run over gloo (whose reduce-scatter copies its input)")
    p.add_argument("--ranks-per-node", type=int,
                   help="ranks sharing one host's memory (default: the world size)")
    p.add_argument("--checkpoint-format", choices=("full", "sharded"), default="full",
                   help="the plugin's flag: the format the run saves in (its host peak)")
    p.add_argument("--checkpoint-file-gib", type=float, metavar="GIB",
                   help="size of the released weights to fine-tune from (default: fp32 "
                   "weights alone, 4 B per parameter)")
    p.add_argument("--memory-budget", type=float, metavar="GIB",
                   help="also print the largest --max-tokens whose estimated peak fits in "
                   "GIB per rank (e.g. a GPU's memory less some headroom)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags, with defaults from ``--config`` where one is given."""
    p = parser()
    from_config: dict[str, Any] = {}
    options = {a.dest: a.choices for a in p._actions if a.dest not in ("help", "config", "json")}
    for config in p.parse_known_args(argv)[0].config or ():  # later ones override (T4 #4)
        try:
            from_config.update(defaults_from_hydra_config(config, options))
        except ValueError as error:
            raise EstimateError(f"--config {config}: {error}") from None
    p.set_defaults(**from_config)
    parsed = p.parse_args(argv)
    given = {flag.split("=")[0] for flag in argv or () if flag.startswith("--")}
    # the run's defining values that came from neither a flag nor the config
    parsed.assumed = [f"--{name.replace('_', '-')} {getattr(parsed, name)}"
                      for name in ASSUMED if f"--{name.replace('_', '-')}" not in given
                      and name not in from_config]
    return parsed


def _check(options: argparse.Namespace) -> None:
    for flag in ("vocab", "world_size", "max_tokens", "tokens_per_sentence",
                 "loss_chunk_tokens", "ranks_per_node", "layers_per_unit", "update_freq",
                 *SIZE_FLAGS):
        value = getattr(options, flag)
        if value is not None and value < 1:
            raise EstimateError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    for flag in ("memory_budget", "checkpoint_file_gib"):
        value = getattr(options, flag)
        if value is not None and not 0 < value < math.inf:
            raise EstimateError(f"--{flag.replace('_', '-')} must be a size above 0 GiB, "
                                f"got {value}")
    dropout = options.attention_dropout
    if dropout is not None and not 0 <= dropout < 1:
        raise EstimateError(f"--attention-dropout must be a probability in [0, 1), got {dropout}")
    if options.vocab < 5:
        raise EstimateError("--vocab must exceed fairseq's 4 special symbols")


def setup_from(options: argparse.Namespace) -> TrainingSetup:
    precision = precision_name(options)  # the estimator's flags are named as fairseq's
    return TrainingSetup(
        world_size=options.world_size, tokens=options.max_tokens,
        tokens_per_sentence=options.tokens_per_sentence, precision=precision,
        optimizer=options.optimizer,
        **{name: getattr(options, name) for name in MODELLED_FLAGS},
        layers_per_unit=options.layers_per_unit, update_freq=options.update_freq,
        keep_all_gathered=options.no_reshard_after_forward,
        chunked_loss=options.criterion == CHUNKED, loss_chunk_tokens=options.loss_chunk_tokens,
        checkpoint_activations=options.checkpoint_activations, cpu_offload=options.cpu_offload,
        params_in_16_bit=options.memory_efficient_fp16 or options.memory_efficient_bf16,
        fp16_adam_stats=options.fp16_adam_stats, gloo_collectives=options.cpu,
    )


def host_setup_from(options: argparse.Namespace) -> HostSetup:
    file = options.checkpoint_file_gib
    return HostSetup(ranks_per_node=options.ranks_per_node or options.world_size,
                     cpu=options.cpu, checkpoint_file_bytes=None if file is None else file * GIB)


def _fairseq_args(options: argparse.Namespace) -> list[str]:
    argv = [".", "--task", "translation", "--arch", options.arch]
    for flag in SIZE_FLAGS:
        value = getattr(options, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    if options.attention_dropout is not None:
        argv += ["--attention-dropout", str(options.attention_dropout)]
    if options.share_all_embeddings:
        argv.append("--share-all-embeddings")
    argv += ["--" + switch.replace("_", "-") for switch in LAYER_NORM_SWITCHES
             if getattr(options, switch)]
    return argv


def shape_from_fairseq(options: argparse.Namespace) -> ModelShape:
    """Build the model on the meta device through fairseq and read its shape."""
    from fairseq import options as fairseq_options
    from fairseq.data import Dictionary
    from fairseq.models import ARCH_MODEL_REGISTRY
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    from fairseq_shard_plugin.tasks import register

    register()  # the nllb_dense_* archs

    if options.arch not in ARCH_MODEL_REGISTRY:
        raise EstimateError(f"--arch {options.arch} is not a registered fairseq architecture")
    dictionary = Dictionary()
    for index in range(options.vocab - len(dictionary)):
        dictionary.add_symbol(f"t{index}")
    args = fairseq_options.parse_args_and_arch(
        fairseq_options.get_training_parser(), _fairseq_args(options))
    if options.share_all_embeddings is False:
        args.share_all_embeddings = False
    task = TranslationTask(TranslationConfig(), dictionary, dictionary)
    model = build_without_memory(lambda: task.build_model(args), options.arch)
    shape = shape_of(model)
    if shape is None:
        raise EstimateError(f"--arch {options.arch} is not an encoder-decoder transformer "
                            "with encoder and decoder layers")
    return shape


def build_without_memory(build: Callable[[], Any], arch: str) -> Any:
    """``build()``'s model on the meta device, or with fake tensors where its initialisation
    reads data (BART's copies its weights through the CPU); either way no memory. A model
    fairseq cannot build is an :class:`EstimateError`."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    def failed(error: Exception) -> EstimateError:
        return EstimateError(f"--arch {arch}: fairseq could not build it "
                             f"({type(error).__name__}: {error})")

    try:
        with torch.device("meta"):
            return build()
    except NotImplementedError:
        pass
    except Exception as error:  # noqa: BLE001 (any arch's own failure, in one line)
        raise failed(error) from None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            return build()
    except Exception as error:  # noqa: BLE001
        raise failed(error) from None


def layer_sizes(layer: Any) -> tuple[int, int, int, float] | None:
    """(d, ffn, heads, attention dropout) of a fairseq transformer layer, else None."""
    fc1, attention = getattr(layer, "fc1", None), getattr(layer, "self_attn", None)
    if not (hasattr(fc1, "in_features") and hasattr(attention, "num_heads")):
        return None
    dropout = getattr(getattr(attention, "dropout_module", None), "p", 0.0)
    return fc1.in_features, fc1.out_features, attention.num_heads, float(dropout or 0.0)


def shape_of(model: Any) -> ModelShape | None:
    """The shape of a built, unsharded encoder-decoder transformer (on any device, meta
    included) and its sharding units; None for other models."""
    from fairseq_shard_plugin.sharding.wrap_policy import build_plan, parameter_count

    encoder, decoder = getattr(model, "encoder", None), getattr(model, "decoder", None)
    encoder_layers, decoder_layers = (getattr(encoder, "layers", None),
                                      getattr(decoder, "layers", None))
    embeddings = getattr(decoder, "embed_tokens", None)
    if not (encoder_layers and decoder_layers and hasattr(embeddings, "num_embeddings")):
        return None
    sizes = (layer_sizes(encoder_layers[0]), layer_sizes(decoder_layers[0]))
    if sizes[0] is None or sizes[1] is None:
        return None
    (encoder_dim, encoder_ffn, encoder_heads, encoder_dropout), \
        (decoder_dim, decoder_ffn, decoder_heads, decoder_dropout) = sizes

    layers = {id(layer) for layer in (*encoder_layers, *decoder_layers)}
    vocab_units = [parameter_count(unit.modules) for unit in build_plan(model).units
                   if id(unit.modules[0]) not in layers]
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point() and b.numel() > 1)
    return ModelShape(
        vocabulary=embeddings.num_embeddings,
        encoder_layers=len(encoder_layers), decoder_layers=len(decoder_layers),
        encoder_dim=encoder_dim, decoder_dim=decoder_dim,
        encoder_ffn=encoder_ffn, decoder_ffn=decoder_ffn,
        encoder_heads=encoder_heads, decoder_heads=decoder_heads,
        parameters=parameter_count([model]),
        encoder_layer_parameters=parameter_count([encoder_layers[0]]),
        decoder_layer_parameters=parameter_count([decoder_layers[0]]),
        vocabulary_unit_parameters=max(vocab_units, default=0),
        buffer_elements=buffers,
        attention_dropout=max(encoder_dropout, decoder_dropout) > 0,
    )


ROWS = (("parameters", "params"), ("gradients", "grads"), ("optimizer state", "optimizer"),
        ("buffers", "buffers"), ("activations", "activations"),
        ("temporaries", "temporaries"), ("peak", "peak"))


def _ranks(count: int) -> str:
    return f"{count} rank{'' if count == 1 else 's'}"


def table(results: dict[str, Estimate], setup: TrainingSetup) -> str:
    names = {"unsharded": f"unsharded ({_ranks(1)})",
             "stock-policy": f"stock policy ({_ranks(setup.world_size)})",
             "requested": f"this run ({_ranks(setup.world_size)})"}
    width = max(len(n) for n in names.values()) + 2
    lines = ["GiB per rank".ljust(18) + "".join(n.rjust(width) for n in names.values())]
    for label, field in ROWS:
        values = (getattr(results[key], field) / GIB for key in names)
        lines.append(label.ljust(18) + "".join(f"{v:{width}.2f}" for v in values))
    lines.append("peak during".ljust(18) + "".join(
        results[key].peak_phase.rjust(width) for key in names))
    lines.append("(breakdown of what is live at the peak; gradient shards after backward: "
                 + ", ".join(f"{results[key].step_grads / GIB:.2f}" for key in names)
                 + " GiB)")
    if results["requested"].host:
        lines.append(f"model state on the host (--cpu-offload): "
                     f"{results['requested'].host / GIB:.2f} GiB per rank")
    return "\n".join(lines)


def host_report(shape: ModelShape, setup: TrainingSetup, options: argparse.Namespace
                ) -> dict[str, Any]:
    """Host memory of the requested configuration in each case, GiB per rank and per host,
    and the peak of a training saving in its ``--checkpoint-format``."""
    host = host_setup_from(options)
    cases = host_memory(shape, setup, host)
    case, peak = training_host_peak(cases, options.checkpoint_format)
    file = host.checkpoint_file_bytes
    return {
        "ranks_per_node": host.ranks_per_node, "cpu": host.cpu,
        "checkpoint_format": options.checkpoint_format,
        "checkpoint_file_gib": (4 * shape.parameters if file is None else file) / GIB,
        "cases": {name: {"per_rank_gib": each.per_rank / GIB,
                         "per_host_gib": each.per_host / GIB} for name, each in cases.items()},
        "peak": {"case": case, "per_rank_gib": peak.per_rank / GIB,
                 "per_host_gib": peak.per_host / GIB},
    }


def host_table(host: dict[str, Any]) -> str:
    """The host report as a small table, with what it assumes in one line."""
    per_host = f"per host ({_ranks(host['ranks_per_node'])})"
    width = len(per_host) + 2
    lines = ["Host GiB, this run".ljust(28) + "per rank".rjust(width) + per_host.rjust(width)]
    rows = [(name, host["cases"][name]) for name in HOST_CASES]
    rows.append((f"peak ({host['checkpoint_format']} saves)", host["peak"]))
    for label, each in rows:
        lines.append(label.ljust(28) + f"{each['per_rank_gib']:{width}.2f}"
                     + f"{each['per_host_gib']:{width}.2f}")
    file = f"{host['checkpoint_file_gib']:.2f} GiB"
    loads = (f"the loads count their mapped file ({file} of released weights) in each rank "
             "but once per host: clean page cache, which the kernel reclaims")
    if host["cpu"]:
        lines.append("(CPU ranks: host memory is the device memory, so the training step is "
                     f"the peak above; {loads})")
    else:
        lines.append("(GPU ranks: each builds the model in fp32 on the host, sharding each "
                     "layer (or group of --layers-per-unit layers) as it is built; a full "
                     f"save gathers on rank 0; {loads}; --cpu for CPU ranks)")
    return "\n".join(lines)


def run(argv: list[str] | None = None, shape: ModelShape | None = None) -> dict[str, Any]:
    """Parse ``argv`` and return the estimate as a JSON-ready dict; ``shape``, where given
    (a model already built), replaces the model ``argv`` describes."""
    options = parse(argv)
    _check(options)
    from_command = shape is not None  # the values are the training command's
    if shape is None:
        shape = shape_from_fairseq(options)
    setup = setup_from(options)
    results = comparison(shape, setup)
    best = helps_most(shape, setup)
    free_speedup = None
    if not (setup.keep_vocabulary_gathered or setup.keep_all_gathered or setup.root_unit_only):
        gathered = estimate(shape, replace(setup, keep_vocabulary_gathered=True)).peak
        if gathered <= results["requested"].peak * 1.001:
            free_speedup = {"flag": "--keep-vocabulary-gathered", "peak_gib": gathered / GIB}
    without_effect = ([f"--layers-per-unit {setup.layers_per_unit} (--root-unit-only makes no "
                       "layer units)"] if setup.root_unit_only and setup.layers_per_unit > 1
                      else [])
    return {
        "assumed": [] if from_command else options.assumed,
        "without_effect": without_effect,
        "model": asdict(shape), "setup": asdict(setup),
        "configurations": {name: est.gib() for name, est in results.items()},
        "host": host_report(shape, setup, options),
        "helps_most": None if best is None else {
            "feature": best[0], "flag": best[1], "saves_gib": best[2] / GIB,
            "peak_gib": (results["requested"].peak - best[2]) / GIB},
        "free_speedup": free_speedup,
        "fits": None if options.memory_budget is None else fits(
            shape, setup, options.memory_budget * GIB),
        "_estimates": results,
    }


def fits(shape: ModelShape, setup: TrainingSetup, budget: float) -> dict[str, Any]:
    """The largest --max-tokens of each configuration within ``budget`` bytes per rank, and
    the off feature that fits the most."""
    best = fits_most_with(shape, setup, budget)
    return {
        "budget_gib": budget / GIB,
        "max_tokens": {name: largest_tokens(shape, each, budget)
                       for name, each in comparison_setups(setup).items()},
        "most_with": None if best is None else {
            "feature": best[0], "flag": best[1], "max_tokens": best[2]},
    }


def fits_line(report: dict[str, Any]) -> str:
    fit, runs = report["fits"], report["fits"]["max_tokens"]

    def tokens(count: int) -> str:
        return f"{count:,}" if count else "none"

    line = (f"Within {fit['budget_gib']:.2f} GiB per rank: --max-tokens "
            f"{tokens(runs['requested'])} for this run (unsharded {tokens(runs['unsharded'])}"
            f", stock policy {tokens(runs['stock-policy'])})")
    if not runs["requested"]:
        line += ": its model state alone does not fit"
    best = fit["most_with"]
    if best is not None:
        line += f"; {best['max_tokens']:,} with {best['feature']} ({best['flag']})"
    return line + "."


def helps_most_line(report: dict[str, Any]) -> str:
    best = report["helps_most"]
    if best is None:
        return "No further feature lowers the estimated peak."
    return (f"Helps most: {best['feature']} ({best['flag']}): peak "
            f"{report['configurations']['requested']['peak_gib']:.2f} -> "
            f"{best['peak_gib']:.2f} GiB per rank.")

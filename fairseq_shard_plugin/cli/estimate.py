"""``fairseq-shard-estimate``: per-rank memory of a sharded training before the run
(:mod:`..memory.estimate`; a training command after ``--``: :mod:`..memory.estimate_command`)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import warnings

from fairseq_shard_plugin.cli.estimate_command import (
    command_notes,
    flags_from_training_command,
    split_command,
)
from fairseq_shard_plugin.memory.estimate import (
    PROG,
    EstimateError,
    fits_line,
    helps_most_line,
    host_table,
    run,
    table,
)
from fairseq_shard_plugin.memory.model import TrainingSetup


def main(argv: list[str] | None = None) -> None:
    logging.getLogger("fairseq").setLevel(logging.WARNING)  # import-time notices
    warnings.filterwarnings("ignore", category=FutureWarning)
    flags, training_command = split_command(sys.argv[1:] if argv is None else argv)
    try:
        if training_command is None:
            report = run(flags)
        else:
            if any(flag == "--config" or flag.startswith("--config=") for flag in flags):
                raise EstimateError(  # its values were silently overridden by the command's
                    "give --config FILE or a training command after --, not both (the "
                    "command's flags and defaults describe the whole run)")
            notes = command_notes(flags, training_command)
            flags, shape = flags_from_training_command(flags, training_command)
            report = run(flags, shape)
            report["flags"], report["notes"] = flags, notes
    except EstimateError as error:
        sys.exit(f"{PROG}: error: {error}")
    try:
        _print(report, flags, training_command is not None)
    except BrokenPipeError:  # the reader stopped early (| head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def _print(report: dict, flags: list[str], from_command: bool) -> None:
    estimates = report.pop("_estimates")
    if "--json" in flags:
        print(json.dumps(report, indent=2))
        return
    shape, setup = report["model"], report["setup"]
    if from_command:
        print(f"The training command as the estimator's flags: {shlex.join([PROG, *flags])}")
        for note in report["notes"]:
            print(note)
    if report["assumed"]:
        print(f"Assumed, as nothing gave them: {', '.join(report['assumed'])} (give them, "
              "--config FILE, or your training command after --, for your run)")
    for flag in report["without_effect"]:
        print(f"No effect in this run: {flag}")
    print(f"{shape['parameters'] / 1e6:.1f}M parameters (vocabulary unit "
          f"{shape['vocabulary_unit_parameters'] / 1e6:.1f}M), {setup['tokens']} tokens per "
          f"rank, {setup['precision']} compute, {TrainingSetup(**setup).state_description()}")
    print(table(estimates, TrainingSetup(**setup)))
    print(helps_most_line(report))
    if report["fits"]:
        print(fits_line(report))
    if report["free_speedup"]:
        print(f"Faster at no memory cost: {report['free_speedup']['flag']} (the vocabulary "
              "unit gathered once per step, not at each use); the peak stays "
              f"{report['free_speedup']['peak_gib']:.2f} GiB per rank.")
    print(host_table(report["host"]))


if __name__ == "__main__":
    main()

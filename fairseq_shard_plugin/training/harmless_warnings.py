"""Deprecation warnings that fairseq's own code triggers in Hydra and torch on every run,
hidden once the plugin is active: each by its category and the start of its message.

None of them concerns anything a user can change: fairseq 0.12 composes its config with
Hydra's old ``experimental`` API and package headers, asks for pinned memory on CPU ranks,
enters ``torch.cuda.amp.autocast`` in every step and passes attention masks of two dtypes.
Under torchrun each rank printed each of them, about sixty lines before the first log line.
fairscale's import-time FutureWarnings come before fairseq loads the plugin and stay.
"""

from __future__ import annotations

import warnings

# (category, regular expression matching the start of the message, its source)
HARMLESS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"hydra\.experimental\.(initialize|compose)\(\) is no longer experimental",
     "fairseq's convert_namespace_to_omegaconf"),
    (UserWarning, r"\s*The version_base parameter is not specified", "the same, Hydra 1.3"),
    (UserWarning, r"In '[^']*': Usage of deprecated keyword in package header",
     "fairseq's config files (# @package _group_)"),
    (UserWarning, r"\s*'[^']*' is validated against ConfigStore schema with the same name",
     "fairseq's config dataclasses"),
    (UserWarning, r"\s*The strict flag in the compose API is deprecated",
     "fairseq's compose call"),
    (UserWarning, r"'pin_memory' argument is set as true but no accelerator is found",
     "fairseq's data loader on CPU ranks"),
    (FutureWarning, r"`torch\.cuda\.amp\.autocast\(args\.\.\.\)` is deprecated",
     "fairseq's train_step"),
    (UserWarning, r"Support for mismatched key_padding_mask and attn_mask is deprecated",
     "fairseq's MultiheadAttention"),
)


def hide_harmless_warnings() -> None:
    """Install a filter for each of :data:`HARMLESS` (idempotent: ``warnings`` keeps one
    copy of an identical filter)."""
    for category, message, _source in HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)

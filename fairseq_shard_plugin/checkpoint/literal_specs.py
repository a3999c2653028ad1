"""Evaluate fairseq's layer-spec strings as data, never as code.

fairseq's convolutional models build their layers from strings in the model config, run
through Python's ``eval`` (``--encoder-layers "[(512, 3)] * 20"``). A checkpoint carries that
config, so loading a stranger's fconv checkpoint in stock fairseq runs whatever the string
says. :func:`literal_spec` accepts what such specs are made of, literals (numbers, strings,
True/False/None, tuples, lists, dicts) joined by ``+`` and ``*``, and refuses everything
else, names and calls included, with one line naming the text. Repetition is bounded, so a
spec cannot ask for unbounded memory either. :func:`unsafe_spec` finds such a spec in a
checkpoint, so that no export or verdict passes one on to stock fairseq.
"""

from __future__ import annotations

import ast
from typing import Any

from fairseq_shard_plugin.errors import ShardPluginError

# the most elements a spec may build by repetition (fairseq's own specs hold a few dozen)
MAX_ELEMENTS = 100_000


class UnsafeSpecError(ShardPluginError, ValueError):
    """A layer spec that is not plain data; the message shows it."""


def _refused(text: str, what: str) -> UnsafeSpecError:
    shown = text if len(text) <= 120 else text[:117] + "..."
    return UnsafeSpecError(f"the model config's layer spec {shown!r} {what}: only literals "
                           "joined by + and * are evaluated (a crafted checkpoint?)")


def _value(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_value(item, text) for item in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_value(k, text): _value(v, text)  # type: ignore[arg-type]
                for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand, text)
        if type(operand) in (int, float):
            return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _value(node.left, text), _value(node.right, text)
        if isinstance(node.op, ast.Mult):
            sequence, count = (left, right) if type(right) is int else (right, left)
            if type(count) is int and isinstance(sequence, (list, tuple, str)):
                if len(sequence) * max(count, 0) > MAX_ELEMENTS:
                    raise _refused(text, f"repeats to more than {MAX_ELEMENTS} elements")
                return sequence * count
            if type(left) in (int, float) and type(right) in (int, float):
                return left * right
        elif type(left) is type(right) and type(left) in (list, tuple, str, int, float):
            if isinstance(left, (list, tuple, str)) and len(left) + len(right) > MAX_ELEMENTS:
                raise _refused(text, f"grows to more than {MAX_ELEMENTS} elements")
            return left + right
        raise _refused(text, f"combines a {type(left).__name__} and a {type(right).__name__}")
    raise _refused(text, f"holds {type(node).__name__.lower()} syntax")


def literal_spec(text: Any, *unused: Any) -> Any:
    """The value of the spec ``text`` (fairseq's ``eval(args.encoder_layers)``); a value that
    is not a string (already evaluated) is returned as it is."""
    if not isinstance(text, str):
        return text
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        raise _refused(text, f"is not valid Python ({error.msg})") from None
    return _value(tree.body, text)


# the model config fields fairseq's models pass to the builtin ``eval`` (fconv, fconv_lm,
# fconv_self_att, lightconv_lm, transformer_lm, multires_hubert, wav2vec, s2t_wav_transformer)
EVALUATED_FIELDS = ("encoder_layers", "decoder_layers", "encoder_attention",
                    "decoder_attention", "self_attention", "project_input", "gated_attention",
                    "downsample", "pretrained", "character_filters", "conv_feature_layers",
                    "conv_aggregator_layers", "override_encoder_layers")


def _model_configs(state: dict[str, Any]) -> list[Any]:
    """The model configs a checkpoint holds: ``cfg["model"]`` and the legacy ``args``."""
    cfg = state.get("cfg")
    model = cfg.get("model") if isinstance(cfg, dict) else getattr(cfg, "model", None)
    return [section for section in (model, state.get("args")) if section is not None]


def unsafe_spec(state: dict[str, Any]) -> str | None:
    """Why the checkpoint ``state`` must not reach stock fairseq: the first layer spec of
    its model config that :func:`literal_spec` refuses (stock fairseq would ``eval`` it
    when it builds the model), or None."""
    for section in _model_configs(state):
        for field in EVALUATED_FIELDS:
            text = (section.get(field) if isinstance(section, dict)
                    else getattr(section, field, None))
            try:
                literal_spec(text)
            except UnsafeSpecError as error:
                return f"{error}; stock fairseq would run it as code when it builds the model"
    return None

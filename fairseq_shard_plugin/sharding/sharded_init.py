"""Random initialisation of parameters that are already sharded, exactly as unsharded.

Layers are sharded as fairseq builds them (:func:`.parallelize.shard_layer_as_built`), but
some models initialise their parameters again once every layer exists: ``BARTModel``
(and so mBART) ends its ``__init__`` with ``apply(init_bert_params)``, which fills each
weight with ``normal_``. On a sharded parameter that fill runs on each rank's shard from
the same random state, so every rank drew the same numbers for its rows (a weight's halves
came out equal on 2 ranks) and the random stream moved on by a shard's worth, not a
parameter's, which changed every weight drawn afterwards.

While :func:`full_tensor_random_fills` is active, a random in-place fill of a sharded
parameter draws the whole parameter on the CPU, where fairseq builds its models, in fp32
for a 16-bit parameter (fairseq builds in fp32 and casts later), and keeps this rank's
part: every rank consumes the random stream as an unsharded build does, and the model is
the one stock fairseq initialises, whatever the number of ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

_RANDOM_FILLS = frozenset(
    getattr(packet, overload)
    for packet in (torch.ops.aten.normal_, torch.ops.aten.uniform_, torch.ops.aten.bernoulli_,
                   torch.ops.aten.random_, torch.ops.aten.exponential_, torch.ops.aten.cauchy_,
                   torch.ops.aten.log_normal_, torch.ops.aten.geometric_)
    for overload in packet.overloads())


class _WholeParameterRandomFills(TorchDispatchMode):
    """Sees every operation first (before DTensor's own dispatch): a random fill of a
    sharded tensor is done on the whole tensor, and the rest runs as it would."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if (func not in _RANDOM_FILLS or not isinstance(target, DTensor)
                or any(isinstance(arg, DTensor) for arg in (*args[1:], *kwargs.values()))):
            return func(*args, **kwargs)
        dtype = torch.float32 if target.dtype in (torch.float16, torch.bfloat16) else (
            target.dtype)
        whole = torch.empty(target.shape, dtype=dtype, device="cpu")
        func(whole, *args[1:], **kwargs)  # (the mode is off inside its own handler)
        part = distribute_tensor(whole, target.device_mesh, target.placements,
                                 src_data_rank=None).to_local()  # split here, no messages
        target.to_local().copy_(part)
        return target


@contextlib.contextmanager
def full_tensor_random_fills() -> Iterator[None]:
    """While a model is built with its layers sharded, random fills of sharded parameters
    give the values of an unsharded build (see the module's docstring)."""
    with _WholeParameterRandomFills():
        yield

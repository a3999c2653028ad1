"""Adam over shards of any precision: fp32 arithmetic, 16-bit storage where asked.

fairseq's Adam (AdamW's decoupled weight decay) on the local shards, with what fairseq
offers only through apex's CUDA ``FusedAdamV1``:

- 16-bit parameters and gradients (``--memory-efficient-fp16/bf16``): each step reads the
  16-bit shard and gradient into fp32, updates in fp32 and rounds the result back, as
  fairseq's memory-efficient optimizers do;
- 16-bit moments (``--fp16-adam-stats``): each moment is stored in fp16, divided by a scale
  taken from the largest magnitude of the whole parameter (FusedAdamV1's scheme: ``scale =
  1e-8 + max|m| / 65504``). The maximum is taken across ranks, so the stored values do not
  depend on how many ranks share the parameter: a checkpoint reloads exactly on any world
  size, in FusedAdamV1's state layout (``exp_avg`` and ``exp_avg_sq`` in fp16,
  ``exp_avg_scale`` and ``exp_avg_sq_scale`` as floats).

The arithmetic is torch's fused Adam kernel (``torch.optim.adam.adam(fused=True)``, on CPU
and CUDA), over chunks of at most :data:`CHUNK_ELEMENTS` elements, so the fp32 copies of
16-bit tensors stay bounded. torch adds epsilon after the bias correction of the second
moment and fairseq before it; passing ``eps / sqrt(1 - beta2^t)`` gives fairseq's update.
The loss scale and clipping factor are applied inside the kernel, in fp32 (``grad_factor``),
never by rescaling 16-bit gradients in place.

On the host, shards take the C step of ``native_adam`` instead (the same arithmetic in one
pass per element, or two with scaled moments; for fp32 state as fast as torch's kernel, for
16-bit state several times faster than torch's over fp32 copies); torch's kernel remains
where the C step cannot be built, and on GPUs.
"""

from __future__ import annotations

import ctypes
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch.optim.adam import adam as torch_adam

from fairseq_shard_plugin.sharding.host_step_overlap import BackgroundHostStep, jobs_by_unit
from fairseq_shard_plugin.sharding.native_adam import (
    DTYPE_CODES,
    SWITCH,
    AdamGroup,
    AdamTensor,
    native_library,
)

FLOAT16_MAX = 65504.0
CHUNK_ELEMENTS = 1 << 24  # largest fp32 working set per kernel call: 16 B x this
MOMENTS = ("exp_avg", "exp_avg_sq")
SCALES = ("exp_avg_scale", "exp_avg_sq_scale")

# Called with a 1-D fp32 tensor of per-parameter maxima, replaces them in place by their
# maxima over the ranks sharing the parameters (None: one rank holds whole parameters).
MaxOverRanks = Callable[[torch.Tensor], None]


class ShardedAdam(torch.optim.Optimizer):
    """Adam (fairseq's semantics) over fp32 or 16-bit tensors, moments fp32 or scaled fp16."""

    def __init__(self, params: Sequence[torch.Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, fp16_moments: bool = False,
                 max_over_ranks: MaxOverRanks | None = None, native: bool = True) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.fp16_moments = fp16_moments
        self.max_over_ranks = max_over_ranks
        self.native = native  # the C step where it applies (False: always torch's kernel)
        self.background: BackgroundHostStep | None = None  # see run_in_background
        self._unit_of: dict[int, int] = {}
        self._default_unit = 0
        self._background_threads: int | None = None
        self._inline_seconds = 0.0  # see take_inline_seconds

    def run_in_background(self, background: BackgroundHostStep, unit_of: dict[int, int],
                          default_unit: int, threads: int | None = None) -> None:
        """Run the C step's updates as ``background``'s per-unit jobs from now on:
        ``unit_of`` maps ``id(parameter)`` to its unit (``default_unit`` for the others);
        each job on ``threads`` threads (None: torch's count). The torch route (no
        compiler, device tensors) stays in line."""
        self.background, self._unit_of, self._default_unit = background, unit_of, default_unit
        self._background_threads = threads

    def wait_for_background(self) -> None:
        """Block until the background updates of the last step have finished."""
        if self.background is not None:
            self.background.wait_all()

    def take_inline_seconds(self) -> float:
        """Seconds spent in :meth:`step` since the last call, after the previous step's
        background updates had finished (those waits the background counts)."""
        seconds, self._inline_seconds = self._inline_seconds, 0.0
        return seconds

    def state_dict(self) -> dict[str, Any]:
        self.wait_for_background()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading, except that moments keep their kind: torch casts state to its
        parameter's dtype, which would round fp32 moments of 16-bit parameters; scaled
        moments (with ``exp_avg_scale``) are fp16, whatever dtype the file holds."""
        moments = {index: {key: entry[key] for key in MOMENTS if key in entry}
                   for index, entry in state_dict.get("state", {}).items()}
        super().load_state_dict(state_dict)
        params = [param for group in self.param_groups for param in group["params"]]
        for index, entry in moments.items():
            param = params[index]
            scaled = SCALES[0] in self.state[param]
            for key, value in entry.items():
                # fairseq's checkpoint writer (utils.move_to_cpu) upcasts fp16 to fp32:
                # scaled moments were fp16, and go back without loss
                self.state[param][key] = (value.half() if scaled else value).to(param.device)
        if self.fp16_moments:
            self._quantize_fp32_moments()

    def _quantize_fp32_moments(self) -> None:
        """Moments loaded in fp32 (a checkpoint of a run without ``--fp16-adam-stats``)
        stored as scaled fp16 from now on; one all-reduce of their maxima, in the same
        order on every rank (every rank loads the same checkpoint)."""
        loaded = [state for state in self.state.values()
                  if "exp_avg" in state and state["exp_avg"].dtype == torch.float32]
        maxima = torch.tensor([[_largest_magnitude(state[key]) for key in MOMENTS]
                               for state in loaded]).view(-1, 2)
        if self.max_over_ranks is not None:
            self.max_over_ranks(maxima.view(-1))
        for state, scales in zip(loaded, 1e-8 + maxima / FLOAT16_MAX, strict=True):
            for key, scale_key, scale in zip(MOMENTS, SCALES, scales.tolist(), strict=True):
                state[key] = (state[key] / scale).half()
                state[scale_key] = scale

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None,
             grad_factor: float = 1.0) -> Any:
        """One update; gradients are multiplied by ``grad_factor`` (in fp32) first."""
        loss = closure() if closure is not None else None
        self.wait_for_background()
        start = time.perf_counter()
        for group in self.param_groups:
            # every parameter has its place in the scales (the same on every rank, whichever
            # of its shards has a gradient); only those with one are updated
            params = group["params"]
            # scales over ranks come back; otherwise each batch of the C step records its own
            rows = self._update_group(group, params, grad_factor)
            for index, param in enumerate(params):
                if param.grad is None:
                    continue
                state = self.state[param]
                state["step"] = state.get("step", 0) + 1
                if rows is not None:
                    state.update(zip(SCALES, rows[index], strict=True))
        self._inline_seconds += time.perf_counter() - start
        return loss

    def _update_group(self, group: dict[str, Any], params: list[torch.Tensor],
                      grad_factor: float) -> list[list[float]] | None:
        """Updates the parameters with gradients; returns the new moments' scales as host
        floats, a row per parameter, when moments are scaled fp16 (and, for the C step,
        taken over ranks here)."""
        if self._takes_native_step(params):
            library = native_library()
            if library is not None:
                scales = self._native_update(library, group, params, grad_factor)
                return scales.tolist() if scales is not None else None
        scales = self._next_scales(group, params, grad_factor) if self.fp16_moments else None
        rows = scales.tolist() if scales is not None else None  # host floats, no reads
        for chunk in _chunks(params, self.state):
            self._update(group, chunk, grad_factor, rows)
        return rows

    def _takes_native_step(self, params: list[torch.Tensor]) -> bool:
        """Whether the C step applies: host tensors of known dtypes, contiguous, and scaled
        moments already fp16 (a checkpoint's fp32 ones are converted by the torch route)."""
        updated = [param for param in params if param.grad is not None]
        if not self.native or not updated:
            return False
        for param in updated:
            tensors = [param, param.grad, *(self.state[param].get(key) for key in MOMENTS)]
            for tensor in (tensor for tensor in tensors if tensor is not None):
                if (tensor.device.type != "cpu" or tensor.dtype not in DTYPE_CODES
                        or not tensor.is_contiguous()):
                    return False
            moments = self.state[param].get("exp_avg")
            if self.fp16_moments and moments is not None and moments.dtype != torch.float16:
                return False
        return True

    def _native_update(self, library: Any, group: dict[str, Any], params: list[torch.Tensor],
                       grad_factor: float) -> torch.Tensor | None:
        """The C step over every parameter with a gradient: with scaled moments, a pass for
        their largest values, then the update pass. Returns the scales when their maxima
        were taken over ranks here (else each batch's step records its own).

        With :attr:`background` set, each unit's parameters are one job of the background
        thread (:mod:`.host_step_overlap`); the maxima over ranks, a collective, stay in
        line. The inputs of every job are fixed here (learning rate, step, scales), and it
        holds references to its gradients, which fairseq drops before the jobs may end."""
        beta1, beta2 = group["betas"]
        updated = [(index, param) for index, param in enumerate(params)
                   if param.grad is not None]
        entries = [self._native_entry(group, param) for _, param in updated]
        constants = AdamGroup(beta2=beta2, avg_sq_grad_coefficient=1 - beta2,
                              lerp_weight=1 - beta1,
                              keep=1 - group["lr"] * group["weight_decay"],
                              grad_divisor=1.0 / grad_factor)
        threads = torch.get_num_threads()
        if self.background is not None and self._background_threads is not None:
            threads = self._background_threads
        scales = None
        if self.fp16_moments and self.max_over_ranks is not None:
            scales = self._scales_over_ranks(library, len(params), updated, entries,
                                             constants, threads)
        batches = ({0: list(range(len(updated)))} if self.background is None else jobs_by_unit(
            range(len(updated)), lambda position: self._unit_of.get(
                id(updated[position][1]), self._default_unit)))
        jobs = {}
        for unit, positions in batches.items():
            batch = [updated[position][1] for position in positions]
            jobs[unit] = functools.partial(
                _native_step, library, [entries[position] for position in positions],
                [self.state[param] for param in batch], constants, threads,
                self.fp16_moments and scales is None,
                [(param, param.grad) for param in batch])
        if self.background is None:
            jobs[0]()
        else:
            self.background.run(jobs)
        return scales

    def _native_entry(self, group: dict[str, Any], param: torch.Tensor) -> AdamTensor:
        """One parameter's pointers and constants for the C step (moments created here)."""
        beta1, beta2 = group["betas"]
        state = self.state[param]
        if self.fp16_moments:
            _ensure_scaled_moments(state, param)
        else:
            _ensure_fp32_moments(state, param)
        step = state.get("step", 0) + 1
        bias_correction2 = 1 - beta2**step
        entry = AdamTensor()
        entry.param, entry.grad = param.data_ptr(), param.grad.data_ptr()
        entry.exp_avg = state["exp_avg"].data_ptr()
        entry.exp_avg_sq = state["exp_avg_sq"].data_ptr()
        entry.numel = param.numel()
        entry.param_dtype = DTYPE_CODES[param.dtype]
        entry.grad_dtype = DTYPE_CODES[param.grad.dtype]
        entry.moment_dtype = DTYPE_CODES[state["exp_avg"].dtype]
        entry.scale_in[:] = [float(state.get(key, 1.0)) for key in SCALES]
        entry.step_size = group["lr"] / (1 - beta1**step)
        entry.bias_correction2_sqrt = math.sqrt(bias_correction2)
        entry.eps = group["eps"] / math.sqrt(bias_correction2)
        return entry

    def _scales_over_ranks(self, library: Any, count: int,
                           updated: list[tuple[int, torch.Tensor]], entries: list[AdamTensor],
                           constants: AdamGroup, threads: int) -> torch.Tensor:
        """The new moments' scales ``[count, 2]`` from their largest values on this rank,
        then the maxima over ranks (one all-reduce); written into ``entries``."""
        largest = _moment_maxima(library, _array(entries), constants, threads)
        maxima = torch.zeros(count, 2)
        maxima[[index for index, _ in updated]] = largest
        self.max_over_ranks(maxima.view(-1))
        scales = 1e-8 + maxima / FLOAT16_MAX
        for entry, (index, _) in zip(entries, updated, strict=True):
            entry.scale_out[:] = scales[index].tolist()
        return scales

    def _next_scales(self, group: dict[str, Any], params: list[torch.Tensor],
                     grad_factor: float) -> torch.Tensor:
        """The scales of this step's new 16-bit moments, ``[len(params), 2]``: a first pass
        computes each new moment's largest magnitude chunk by chunk, and one all-reduce
        takes the maxima over the ranks, before any moment is overwritten. Each chunk's
        arithmetic is a few multi-tensor (``_foreach``) operations, and the maxima stay on
        their device until one copy brings them all to the host: on a GPU, a handful of
        launches per chunk and one synchronisation per step, not about ten launches and
        three synchronisations per parameter."""
        beta1, beta2 = group["betas"]
        found: list[tuple[list[int], torch.Tensor]] = []  # (indices, [|m|max, v max] rows)
        for chunk in _chunks(params, self.state):
            pieces = [piece for piece in chunk if piece.stop > piece.start]
            if not pieces:
                continue
            # the factor goes into the coefficients: fp32 gradients are read in place,
            # and the update still reads them unscaled
            grads = _as_fp32([_flat(piece.param.grad)[piece.start:piece.stop]
                              for piece in pieces])
            avgs, avg_sqs = _fp32_moments(self.state, pieces)
            torch._foreach_mul_(avgs, beta1)
            torch._foreach_add_(avgs, grads, alpha=(1 - beta1) * grad_factor)
            torch._foreach_mul_(avg_sqs, beta2)
            torch._foreach_addcmul_(avg_sqs, grads, grads, value=(1 - beta2) * grad_factor**2)
            # the infinity norm is the largest magnitude, exactly; the second moment is
            # never negative, so its largest magnitude is its largest value
            largest = torch.stack([torch.stack(torch._foreach_norm(moments, math.inf))
                                   for moments in (avgs, avg_sqs)], dim=1)
            found.append(([piece.index for piece in pieces], largest))
        largest_of = [[0.0, 0.0] for _ in params]
        if found:
            device = found[0][1].device
            rows = torch.cat([largest.to(device) for _, largest in found]).tolist()
            indices = [index for chunk_indices, _ in found for index in chunk_indices]
            for index, row in zip(indices, rows, strict=True):  # host floats: no kernels
                largest_of[index] = [_larger(a, b) for a, b in zip(largest_of[index], row,
                                                                    strict=True)]
        maxima = torch.tensor(largest_of, dtype=torch.float32).view(len(params), 2)
        if self.max_over_ranks is not None:
            self.max_over_ranks(maxima.view(-1))
        return 1e-8 + maxima / FLOAT16_MAX

    def _update(self, group: dict[str, Any], chunk: list[_Piece], grad_factor: float,
                rows: list[list[float]] | None) -> None:
        """torch's fused Adam over one chunk of pieces, in fp32, written back (scaled fp16
        moments divided by ``rows[index]``, the scales of the ``index``-th parameter); the
        copies to and from 16 bits are multi-tensor operations over the whole chunk."""
        beta1, beta2 = group["betas"]
        step = self.state[chunk[0].param].get("step", 0) + 1
        device = chunk[0].param.device
        if rows is None:
            for piece in chunk:
                _ensure_fp32_moments(self.state[piece.param], piece.param)
        targets = [_flat(piece.param)[piece.start:piece.stop] for piece in chunk]
        params = _as_fp32(targets)  # the targets themselves when already fp32
        grads = _as_fp32([_flat(piece.param.grad)[piece.start:piece.stop] for piece in chunk])
        exp_avgs, exp_avg_sqs = _fp32_moments(self.state, chunk)
        torch_adam(
            params, grads, exp_avgs, exp_avg_sqs, [],
            # made on the device (a fill, not a copy from host memory that would wait for
            # the queued kernels), one tensor for the chunk's step counts
            list(torch.full((len(chunk),), float(step - 1), device=device).unbind()),
            fused=True,
            grad_scale=(None if grad_factor == 1.0
                        else torch.full((), 1.0 / grad_factor, device=device)),
            decoupled_weight_decay=True, amsgrad=False, maximize=False,
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"] / math.sqrt(1 - beta2**step),
        )
        copied = [(target, fp32) for target, fp32 in zip(targets, params, strict=True)
                  if fp32 is not target]
        if copied:
            torch._foreach_copy_([target for target, _ in copied], [fp32 for _, fp32 in copied])
        if rows is not None:
            for which, moments in enumerate((exp_avgs, exp_avg_sqs)):
                torch._foreach_div_(moments, [rows[piece.index][which] for piece in chunk])
                torch._foreach_copy_(
                    [_flat(self.state[piece.param][MOMENTS[which]])[piece.start:piece.stop]
                     for piece in chunk], moments)


class _Piece(NamedTuple):
    """Elements ``start:stop`` of the flattened ``param``, the ``index``-th updated."""

    index: int
    param: torch.Tensor
    start: int
    stop: int


def _array(entries: list[AdamTensor]) -> ctypes.Array[AdamTensor]:
    """The C step's array of ``entries`` (copies of them)."""
    return (AdamTensor * len(entries))(*entries)


def _moment_maxima(library: Any, array: ctypes.Array[AdamTensor], constants: AdamGroup,
                   threads: int) -> torch.Tensor:
    """The largest magnitude of each new moment, ``[len(array), 2]`` (the C step's pass)."""
    largest = torch.zeros(len(array), 2)
    _check_native(library.adam_moment_maxima(array, len(array), ctypes.byref(constants),
                                             ctypes.c_void_p(largest.data_ptr()), threads))
    return largest


_NO_MEMORY = 2  # native_adam.c's STEP_NO_MEMORY (STEP_JOIN_FAILED is 1, STEP_OK 0)


def _check_native(status: int) -> None:
    """Raise for a failed C step, by ``native_adam.c``'s status codes."""
    if status == _NO_MEMORY:
        raise MemoryError("the C host Adam step found no host memory for its per-thread "
                          "maxima (a few KiB): the host is out of memory")
    if status:
        raise RuntimeError(f"the C host Adam step could not join one of its threads "
                           f"(pthread_join failed, status {status}): "
                           f"{SWITCH}=0 in the environment steps in torch instead")


def _native_step(library: Any, entries: list[AdamTensor], states: list[dict[str, Any]],
                 constants: AdamGroup, threads: int, find_scales: bool,
                 keep_alive: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The C step over one batch of parameters (their ``entries`` and optimizer
    ``states``); with ``find_scales`` (scaled moments, one rank per parameter) the batch's
    maxima pass first, whose scales it records. ``keep_alive`` holds the tensors the
    entries point into until the step has run."""
    array = _array(entries)
    if find_scales:
        scales = 1e-8 + _moment_maxima(library, array, constants, threads) / FLOAT16_MAX
        for entry, state, pair in zip(array, states, scales.tolist(), strict=True):
            entry.scale_out[:] = pair
            state.update(zip(SCALES, pair, strict=True))
    _check_native(library.adam_update(array, len(array), ctypes.byref(constants), threads))


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1)  # local shards and their gradients are contiguous


def _pieces(param: torch.Tensor) -> Iterator[tuple[int, int]]:
    """``param``'s elements in runs of at most :data:`CHUNK_ELEMENTS`."""
    numel = param.numel()
    for start in range(0, max(numel, 1), CHUNK_ELEMENTS):
        yield start, min(start + CHUNK_ELEMENTS, numel)


def _as_fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` in fp32: fp32 ones as they are, the others copied in one multi-tensor
    copy (one launch on a GPU instead of one per tensor)."""
    converted = list(tensors)
    narrow = [index for index, tensor in enumerate(tensors) if tensor.dtype != torch.float32]
    if narrow:
        copies = [torch.empty_like(tensors[index], dtype=torch.float32) for index in narrow]
        torch._foreach_copy_(copies, [tensors[index] for index in narrow])
        for index, copy in zip(narrow, copies, strict=True):
            converted[index] = copy
    return converted


def _fp32_moments(state: dict[torch.Tensor, dict[str, Any]], pieces: list[_Piece]
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Both moments of ``pieces`` in fp32: views of fp32 moments, copies of scaled 16-bit
    ones multiplied by their scales (as this optimizer or FusedAdamV1 stores them); zeros
    at first."""
    moments: list[list[torch.Tensor]] = []
    for moment_key, scale_key in zip(MOMENTS, SCALES, strict=True):
        stored = []
        for piece in pieces:
            _ensure_scaled_moments(state[piece.param], piece.param)
            stored.append(_flat(state[piece.param][moment_key])[piece.start:piece.stop])
        values = _as_fp32(stored)
        scaled = [(values[index], float(state[piece.param].get(scale_key, 1.0)))
                  for index, piece in enumerate(pieces)
                  if stored[index].dtype != torch.float32]
        if scaled:
            torch._foreach_mul_([value for value, _ in scaled], [scale for _, scale in scaled])
        moments.append(values)
    return moments[0], moments[1]


def _ensure_scaled_moments(state: dict[str, Any], param: torch.Tensor) -> None:
    """Moments stored as scaled fp16 (created zero, with unit scales, at the first step)."""
    if "exp_avg" not in state:
        for key in MOMENTS:
            state[key] = torch.zeros_like(param, dtype=torch.float16)
        state.update(dict.fromkeys(SCALES, 1.0))


def _ensure_fp32_moments(state: dict[str, Any], param: torch.Tensor) -> None:
    """Moments stored in fp32 (created, or converted from a 16-bit checkpoint's)."""
    if "exp_avg" not in state:
        for key in MOMENTS:
            state[key] = torch.zeros_like(param, dtype=torch.float32)
    elif state["exp_avg"].dtype != torch.float32:
        for moment_key, scale_key in zip(MOMENTS, SCALES, strict=True):
            state[moment_key] = state[moment_key].float().mul_(float(state.pop(scale_key, 1.0)))


def _larger(a: float, b: float) -> float:
    """The larger of two maxima, NaN winning (as ``torch.maximum`` and the C step)."""
    return b if b > a or math.isnan(b) else a


def _largest_magnitude(tensor: torch.Tensor) -> float:
    """max |x| in one pass and without a temporary (``abs`` would allocate one)."""
    if not tensor.numel():
        return 0.0
    smallest, largest = torch.aminmax(tensor)
    return max(-float(smallest), float(largest))


def _chunks(params: list[torch.Tensor], state: dict[torch.Tensor, dict[str, Any]]
            ) -> Iterator[list[_Piece]]:
    """The pieces of ``params`` with gradients in chunks of at most :data:`CHUNK_ELEMENTS`
    elements, each of one step count and device (the kernel takes one epsilon and one
    device per call). Decided per rank: the update has no collective."""
    chunk: list[_Piece] = []
    elements = 0
    for index, param in enumerate(params):
        if param.grad is None:
            continue
        key = (state[param].get("step", 0), param.device)
        for start, stop in _pieces(param):
            if chunk and (elements + stop - start > CHUNK_ELEMENTS or key != (
                    state[chunk[0].param].get("step", 0), chunk[0].param.device)):
                yield chunk
                chunk, elements = [], 0
            chunk.append(_Piece(index, param, start, stop))
            elements += stop - start
    if chunk:
        yield chunk


def with_fp32_moments(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict whose scaled fp16 moments are turned into fp32 ones, for an
    optimizer that stores fp32 moments (fairseq's Adam after a ``--fp16-adam-stats`` run)."""
    converted = {}
    for index, entry in state_dict.get("state", {}).items():
        if "exp_avg_scale" in entry:
            entry = {key: value for key, value in entry.items() if key not in SCALES}
            for moment_key, scale_key in zip(MOMENTS, SCALES, strict=True):
                entry[moment_key] = (state_dict["state"][index][moment_key].float()
                                     * float(state_dict["state"][index][scale_key]))
        converted[index] = entry
    return {**state_dict, "state": converted}

"""Analytic per-rank memory of one sharded training step (pure arithmetic, no torch).

The model follows how the plugin holds memory (see ``precision.py``, ``engines/fsdp2.py``,
``chunked_cross_entropy.py``) and what torch FSDP2 allocates:

- resident: the parameter shards, Adam's two moments and, after backward, the gradient
  shards, per parameter / N (:attr:`TrainingSetup.state_bytes`): fp32 master and gradient
  shards (4 + 4 B) with ``--fp16``/``--bf16`` or fp32 training, 16-bit ones (2 + 2 B) with
  ``--memory-efficient-fp16``/``-bf16``; fp32 moments (4 + 4 B), fp16 ones with
  ``--fp16-adam-stats`` (2 + 2 B): 16, 12 or 8 B per parameter; no persistent 16-bit copy
  of fp32 shards;
- a unit in use is all-gathered into a compute-dtype copy (b bytes per parameter); a root
  kept gathered (stock fairseq's policy) holds the whole model from forward to the end of
  backward; in backward each unit's unsharded gradient (b bytes) is copied into a
  reduce-scatter input of the reduce dtype (fp32 unless ``--reduce-in-16-bit``) before
  its 1/N slice is kept, cast to the gradient shard's dtype where that differs (on CPU,
  torch's ``_chunk_cat`` first concatenates the gradient in
  b bytes, one more unit-sized temporary); the tied vocabulary unit is used last by the
  encoder's embedding, so its gradient (its three uses summed in place by autograd) is
  reduced at the very end of backward;
- fairseq's label-smoothed loss keeps fp32 log-probabilities (tokens x V x 4 B) and its
  backward holds two more tensors of that size at once; the chunked criterion holds one
  chunk of logits (16-bit and fp32) and a V x d gradient accumulator in the weight's dtype;
- saved activations per token and layer of fairseq's pre-norm transformer, measured on CPU
  (the attention there runs torch's math path, which keeps fp32 attention probabilities,
  their dropout noise and the dropped probabilities: 12 B per head and source token in
  the encoder, 20 B over the decoder's two attentions); with activation checkpointing only
  each layer's input is kept, plus one layer's activations while it is recomputed; a
  layer's backward adds its own working set (:func:`layer_backward_working_set`, fitted);
- with ``--update-freq`` above 1 every gradient shard is live through the whole step from
  the second micro-batch on (each micro-batch reduce-scatters into them);
- the optimizer step's transient (:func:`optimizer_step_temporary`): one fp32 tensor of the
  largest local shard, or with 16-bit parameters or moments fp32 copies of one chunk of at
  most 2**24 elements; on the host with ``--cpu-offload``.

An all-gather of fp32 shards first casts the rank's shard to the compute dtype (1/N of the
unit, freed once the gather's output is filled); with 16-bit shards no cast is needed. That
copy is short-lived and falls at none of the moments below, so it is not counted either way.

Host memory (:func:`host_memory`) is modelled per case, one function each: building the
model, the training step, a save and a resume in either checkpoint format and the load of
released weights; per rank and per host (a node's ranks together).

The peak is the largest of a few moments of the step; each is a sum of the tensors live
then, as the CPU allocator's events show them (``allocator_meter.AllocatorMeter``). The
breakdown is that of the peak moment: gradient shards and activations count only if they
are live then (a peak in the loss's backward comes before any gradient exists), and
temporaries are the rest. ``benchmarks/memory.py`` cannot see inside its measured peak and
breaks it down by the step's state instead (its note says how), so their columns differ
where the peak falls before the gradients exist or after the activations are freed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """Sizes of an encoder-decoder transformer, and of its sharding units, in parameters."""

    vocabulary: int
    encoder_layers: int
    decoder_layers: int
    encoder_dim: int
    decoder_dim: int
    encoder_ffn: int
    decoder_ffn: int
    encoder_heads: int
    decoder_heads: int
    parameters: int  # all parameters
    encoder_layer_parameters: int
    decoder_layer_parameters: int
    vocabulary_unit_parameters: int  # the largest vocabulary unit (tied: embedding+projection)
    buffer_elements: int = 0  # floating-point buffers (sinusoidal positions), cast to b
    attention_dropout: bool = True  # keeps attention probabilities (CPU math path)

    def layer_unit(self, layers_per_unit: int = 1) -> int:
        """Parameters of the largest layer unit: up to ``layers_per_unit`` layers of one
        stack."""
        return max(min(layers_per_unit, self.encoder_layers) * self.encoder_layer_parameters,
                   min(layers_per_unit, self.decoder_layers) * self.decoder_layer_parameters)

    def largest_unit(self, layers_per_unit: int = 1) -> int:
        return max(self.vocabulary_unit_parameters, self.layer_unit(layers_per_unit))


@dataclass(frozen=True)
class TrainingSetup:
    """Everything besides the model that decides a rank's memory."""

    world_size: int = 2
    tokens: int = 4096  # per rank and step; source and target alike
    tokens_per_sentence: int = 64
    precision: str = "fp16"  # fp16 | bf16 | fp32
    optimizer: str = "adam"  # adam | sgd
    root_unit_only: bool = False
    layers_per_unit: int = 1  # --layers-per-unit: consecutive layers of a stack per unit
    update_freq: int = 1  # --update-freq: micro-batches per update (gradient shards kept)
    keep_root_gathered: bool = False
    keep_vocabulary_gathered: bool = False  # per-layer plans: no reshard after forward
    keep_all_gathered: bool = False  # --no-reshard-after-forward: no unit reshards after forward
    chunked_loss: bool = False
    loss_chunk_tokens: int = 1024
    checkpoint_activations: bool = False
    cpu_offload: bool = False
    reduce_in_16_bit: bool = False
    reduce_vocabulary_in_16_bit: bool = False  # only the vocabulary unit (per-layer plans)
    # --memory-efficient-fp16/-bf16: parameter and gradient shards in the compute dtype
    params_in_16_bit: bool = False
    fp16_adam_stats: bool = False  # --fp16-adam-stats: Adam's two moments in fp16
    # CPU ranks (gloo): a reduce-scatter holds a copy of its whole input besides it
    # (benchmarks/gloo_reduce_scatter.py); NCCL does not
    gloo_collectives: bool = False

    @property
    def sentence(self) -> int:
        """Tokens per sentence: no longer than a batch (fairseq skips longer ones)."""
        return min(self.tokens_per_sentence, self.tokens)

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def param_bytes(self) -> int:
        """Bytes per element of a parameter shard, and of its gradient shard."""
        return self.compute_bytes if self.params_in_16_bit else 4

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer state per parameter: Adam's two moments (fp32, or fp16 with
        ``--fp16-adam-stats``); none for SGD."""
        if self.optimizer != "adam":
            return 0
        return 2 * (2 if self.fp16_adam_stats else 4)

    @property
    def state_bytes(self) -> int:
        """Model state per parameter, all ranks together: parameter, gradient and optimizer
        state; a rank holds 1/N of it. Adam: fp32 or ``--fp16`` 16, ``--fp16
        --fp16-adam-stats`` 12, ``--memory-efficient-fp16`` 12, with ``--fp16-adam-stats`` 8."""
        return 2 * self.param_bytes + self.optimizer_bytes

    @property
    def sixteen_bit_state(self) -> bool:
        """Parameters or Adam's moments kept in 16 bits (the chunked optimizer step)."""
        return self.param_bytes < 4 or (self.optimizer == "adam" and self.fp16_adam_stats)

    def state_description(self) -> str:
        """The model state in words, e.g. ``16-bit parameter and gradient shards, adam
        with fp16 moments (8 B per parameter / N)``."""
        shards = ("16-bit parameter and gradient shards" if self.param_bytes < 4
                  else "fp32 master and gradient shards")
        moments = ""
        if self.optimizer == "adam":
            moments = " with fp16 moments" if self.fp16_adam_stats else " with fp32 moments"
        return (f"{shards}, {self.optimizer}{moments} ({self.state_bytes} B per parameter "
                f"/ {self.world_size})")

    @property
    def reduce_bytes(self) -> int:
        return self.compute_bytes if self.reduce_in_16_bit else 4

    @property
    def vocabulary_reduce_bytes(self) -> int:
        if self.reduce_vocabulary_in_16_bit and not self.root_unit_only:
            return self.compute_bytes
        return self.reduce_bytes


# Features a user can turn on, with the flag that does it (for "helps most").
FEATURES: dict[str, tuple[str, dict]] = {
    "per-layer units": ("drop --root-unit-only", {"root_unit_only": False}),
    "resharded root": ("drop --keep-root-gathered", {"keep_root_gathered": False}),
    "resharded vocabulary": ("drop --keep-vocabulary-gathered",
                             {"keep_vocabulary_gathered": False}),
    "resharded units": ("drop --no-reshard-after-forward", {"keep_all_gathered": False}),
    "chunked loss": ("--criterion chunked_label_smoothed_cross_entropy",
                     {"chunked_loss": True}),
    "activation checkpointing": ("--checkpoint-activations", {"checkpoint_activations": True}),
    "CPU offload": ("--cpu-offload", {"cpu_offload": True}),
    "16-bit vocabulary reduction": ("--reduce-vocabulary-in-16-bit",
                                    {"reduce_vocabulary_in_16_bit": True}),
    "16-bit reduction": ("--reduce-in-16-bit", {"reduce_in_16_bit": True}),
}


@dataclass(frozen=True)
class Estimate:
    """Per-rank bytes: what is live at the peak, by kind, and the phase the peak falls in.

    ``temporaries`` are the rest: gathered parameters, unsharded gradients and reduction
    buffers, logits and their gradients."""

    params: float
    grads: float
    optimizer: float
    buffers: float
    activations: float
    temporaries: float
    peak: float
    peak_phase: str
    host: float  # model state kept on the host (--cpu-offload), not in ``peak``
    phases: dict[str, float]
    step_grads: float  # the gradient shards once backward has ended (``grads``: at the peak)
    host_step: float = 0.0  # the optimizer step's transient on the host (--cpu-offload)

    def gib(self) -> dict[str, float | str | dict]:
        fields = ("params", "grads", "optimizer", "buffers", "activations", "temporaries",
                  "peak", "host", "step_grads", "host_step")
        out: dict = {f"{name}_gib": getattr(self, name) / GIB for name in fields}
        out["peak_phase"] = self.peak_phase
        out["phases_gib"] = {name: value / GIB for name, value in self.phases.items()}
        return out


def layer_activation_bytes(d: int, ffn: int, heads: int, sentence: int, b: int,
                           decoder: bool, attention_dropout: bool = True) -> float:
    """Bytes a layer keeps for backward per token, with compute dtype of ``b`` bytes.

    Fitted to live-tensor measurements of fairseq's layers on CPU (torch 2.13, d 256 and
    1024, ffn 512 to 4096, fp32 and bf16, sentences of 32 and 64 tokens; exact to 0.3%).
    With attention dropout torch's attention runs its math path (fp32 q/k/v, attention
    probabilities, dropout noise and dropped probabilities); without it the encoder's
    attention is fused and keeps no probabilities.
    """
    if attention_dropout:
        if decoder:
            return 8 * d + (16 * d + ffn) * b + 20 * heads * sentence + 13
        return 12 * d + (7 * d + ffn) * b + 12 * heads * sentence + 8
    if decoder:
        return 2 * d + (16 * d + ffn) * b + 6 * heads * sentence + 13
    return (10 * d + ffn) * b + 32


def activation_bytes(shape: ModelShape, setup: TrainingSetup) -> tuple[float, float]:
    """(kept from forward to backward, extra while one layer is recomputed), per rank."""
    b, tokens, s = setup.compute_bytes, setup.tokens, setup.sentence
    encoder = layer_activation_bytes(shape.encoder_dim, shape.encoder_ffn,
                                     shape.encoder_heads, s, b, False, shape.attention_dropout)
    decoder = layer_activation_bytes(shape.decoder_dim, shape.decoder_ffn,
                                     shape.decoder_heads, s, b, True, shape.attention_dropout)
    # embedding dropout noise and output, final layer norm output, for encoder and decoder
    outside = 3 * b * (shape.encoder_dim + shape.decoder_dim)
    if setup.checkpoint_activations:
        inputs = (shape.encoder_layers * shape.encoder_dim
                  + shape.decoder_layers * shape.decoder_dim) * b
        return tokens * (inputs + outside), tokens * max(encoder, decoder)
    layers = shape.encoder_layers * encoder + shape.decoder_layers * decoder
    return tokens * (layers + outside), 0.0


CHUNK_ELEMENTS = 2**24  # the 16-bit optimizer step's chunk, in elements


def largest_local_elements(shape: ModelShape, setup: TrainingSetup) -> float:
    """Elements of the largest unit's shard on one rank (the whole model's, root only)."""
    unit = shape.parameters if setup.root_unit_only else shape.largest_unit(
        setup.layers_per_unit)
    return unit / setup.world_size


def optimizer_step_temporary(shape: ModelShape, setup: TrainingSetup) -> float:
    """Bytes the optimizer step allocates on top of the model state (on the host with
    ``--cpu-offload``).

    fp32 state: one fp32 temporary of the largest local shard (Adam's denominator, or the
    squared gradient of the norm). 16-bit parameters or moments: the step runs over chunks
    of at most 2**24 elements, holding fp32 copies of one chunk's parameter, gradient and,
    for Adam, both moments: 16 B (SGD: 8 B) x min(2**24, largest local shard).
    """
    local = largest_local_elements(shape, setup)
    if not setup.sixteen_bit_state:
        return 4 * local
    copies = 4 if setup.optimizer == "adam" else 2
    return 4 * copies * min(CHUNK_ELEMENTS, local)


def layer_backward_working_set(shape: ModelShape, setup: TrainingSetup) -> float:
    """Bytes a layer's backward allocates besides what it recomputes and the gathered
    copies: gradients of its feed-forward activations (2 x tokens x ffn x b), fp32 ones of
    its d-wide activations (5 B x tokens x d), and unsharded gradients waiting for their
    reduction (1.25 x a layer's parameters x b; FSDP2 copies them out at world size 1 too).
    Fitted to the allocator meter's peaks of layer-bound shapes (d 256 and 512, ffn 1,024
    and 2,048, 2,048 and 4,096 tokens, fp32 and bf16, 1 and 2 ranks): within 3%
    (``python -m benchmarks.estimate_layers``)."""
    d, ffn = max(shape.encoder_dim, shape.decoder_dim), max(shape.encoder_ffn, shape.decoder_ffn)
    b = setup.compute_bytes
    return setup.tokens * (2 * ffn * b + 5 * d) + 1.25 * b * shape.layer_unit()


def estimate(shape: ModelShape, setup: TrainingSetup) -> Estimate:
    """Per-rank peak memory of one training step (after the first: Adam's state exists)."""
    n, b, r = setup.world_size, setup.compute_bytes, setup.reduce_bytes
    g = setup.param_bytes  # the parameter and gradient shards' dtype
    rv = setup.vocabulary_reduce_bytes  # the vocabulary unit's reduce dtype

    def reduce_scatter(unit: int, bytes_: int) -> float:
        """Peak of one unit's reduce-scatter, its unsharded gradient (b bytes) alive
        throughout: copied into the reduce buffer (torch's CPU ``_chunk_cat`` first builds a
        concatenated copy in b bytes), then the 1/N output (cast to the gradient shard's
        dtype where the reduction's differs: fp32 shards reduced in 16 bits, 16-bit shards
        reduced in fp32) and, over gloo, the collective's copy of the reduce buffer."""
        output = bytes_ * unit / n + (g * unit / n if bytes_ != g else 0)
        gloo_copy = bytes_ * unit if setup.gloo_collectives and n > 1 else 0.0
        return b * unit + bytes_ * unit + max(b * unit, output + gloo_copy)

    p, tokens, vocab, d = shape.parameters, setup.tokens, shape.vocabulary, shape.decoder_dim
    params, grads = g * p / n, g * p / n
    optimizer = setup.optimizer_bytes * p / n
    buffers = shape.buffer_elements * b
    host, step_temporary, host_step = 0.0, optimizer_step_temporary(shape, setup), 0.0
    if setup.cpu_offload and not setup.gloo_collectives:  # shards, their gradients and
        # Adam's state stay on the host, and the optimizer steps there (on CPU ranks the
        # host is the device: offloading moves nothing out of the peak)
        host, params, grads, optimizer = params + grads + optimizer, 0.0, 0.0, 0.0
        step_temporary, host_step = 0.0, step_temporary

    per_layer_units = not setup.root_unit_only
    vocab_unit = shape.vocabulary_unit_parameters if per_layer_units else p
    layer_unit = shape.layer_unit(setup.layers_per_unit)
    kept_gathered = b * p if (setup.root_unit_only and setup.keep_root_gathered) else 0.0
    if n == 1 and setup.root_unit_only:  # world size 1: the gathered copy stays
        kept_gathered = b * p

    saved, recompute = activation_bytes(shape, setup)
    s = setup.sentence
    loss_saved = 4 * tokens if setup.chunked_loss else 4 * tokens * vocab
    # --keep-vocabulary-gathered: the vocabulary unit's 16-bit copy stays from the encoder
    # embedding's forward to the end of backward, so it is live wherever activations are
    # (the layers' backward below counts it already, as FSDP keeps it there anyway)
    keep_all = per_layer_units and setup.keep_all_gathered
    vocab_kept = (b * vocab_unit if per_layer_units and (setup.keep_vocabulary_gathered
                                                        or keep_all) else 0.0)
    # --no-reshard-after-forward: every layer's 16-bit copy too stays from its forward to its
    # backward (then FSDP frees it), so all of them are live until the layers' backward
    layers_kept = b * (p - vocab_unit) if keep_all else 0.0
    activations = saved + loss_saved + kept_gathered + vocab_kept + layers_kept
    # gathered 16-bit copy of the vocabulary unit while it is used (unless already counted)
    vocab_gathered = 0.0 if kept_gathered or vocab_kept else b * vocab_unit

    # Each moment of the step, as the tensors live then; gradient shards exist only from
    # backward on (fairseq drops them at the step's start) and activations until it ends.
    state = {"params": params, "optimizer": optimizer, "buffers": buffers}
    # --update-freq above 1: each micro-batch's backward reduce-scatters into the gradient
    # shards, so from the second on all of them are live through the whole step
    accumulated = grads if setup.update_freq > 1 else 0.0
    if accumulated:
        state["grads"] = accumulated
    moments: dict[str, dict[str, float]] = {}
    if setup.chunked_loss:
        chunk = min(setup.loss_chunk_tokens, tokens)
        # one chunk of logits in the compute dtype and in fp32 (16-bit compute), in forward
        # (log-sum-exp in place) and in backward, where the weight-gradient accumulator in
        # the weight's dtype and the hidden-state gradient are live too
        logits = 4 * chunk * vocab + (b * chunk * vocab if b < 4 else 0)
        moments["loss forward"] = dict(state, activations=activations,
                                       temporaries=vocab_gathered + logits)
        loss_extra = logits + b * vocab * d + b * tokens * d + vocab_gathered
    else:
        # fp32 gradient of the log-probabilities and log_softmax's fp32 input gradient
        loss_extra = 2 * 4 * tokens * vocab
    moments["loss backward"] = dict(state, activations=activations, temporaries=loss_extra)

    if per_layer_units:
        # the vocabulary unit is used last by the encoder's embedding, so its gradient is
        # reduced at the end of backward, after every other unit's: at the encoder
        # embedding's backward the gathered copy, the gradient summed so far and the one
        # being added to it (in place) are live; then the unit's reduce-scatter
        other_grads = max(grads - g * vocab_unit / n, 0.0)  # none on the device if offloaded
        moments["end of backward"] = dict(
            state, grads=max(other_grads, accumulated),
            temporaries=max(3 * b * vocab_unit, reduce_scatter(vocab_unit, rv)))
        # a layer's backward: the vocabulary unit's gathered copy and unsharded gradient
        # (both kept until the encoder embedding's backward), two gathered layers, one layer
        # being recomputed and the gradients of its fp32 attention probabilities (two
        # copies, math attention path), and the larger of every saved activation (the first
        # layer in backward) and every other unit's gradient shard (the last)
        heads = max(shape.encoder_heads, shape.decoder_heads)
        attention_grads = 8 * heads * s * tokens if shape.attention_dropout else 0.0
        gathered = (2 * b * vocab_unit + 2 * b * layer_unit + recompute + attention_grads
                    + layer_backward_working_set(shape, setup))
        if keep_all:  # at the first layer's backward every layer is still gathered, in
            # place of the two counted (that layer and the next, prefetched)
            gathered += layers_kept - 2 * b * layer_unit
        live = {"activations": saved} if saved >= other_grads else {"grads": other_grads}
        if accumulated:  # (the accumulated shards are in ``state``) and every activation
            live = {"activations": saved}
        moments["layer backward"] = dict(state, temporaries=kept_gathered + gathered, **live)
    else:
        # one unit holds the model: its unsharded gradients next to the gathered copy, then
        # one reduce-scatter of everything (whose input gradient is already counted above)
        moments["end of backward"] = dict(
            state, temporaries=max(2 * b * p, reduce_scatter(p, r) - b * p))
    # optimizer: every gradient, and the step's transient (none here if offloaded)
    moments["optimizer step"] = dict(state, grads=grads, temporaries=step_temporary)
    phases = {name: sum(parts.values()) for name, parts in moments.items()}
    peak_phase = max(phases, key=phases.__getitem__)
    at_peak = moments[peak_phase]
    return Estimate(params, at_peak.get("grads", 0.0), optimizer, buffers,
                    at_peak.get("activations", 0.0), at_peak["temporaries"], phases[peak_phase],
                    peak_phase, host, phases, grads, host_step)


def comparison_setups(setup: TrainingSetup) -> dict[str, TrainingSetup]:
    """The three configurations side by side: unsharded (world size 1, the model gathered),
    stock fairseq's policy (one root unit kept gathered, stock loss, N ranks), requested."""
    plain = dict(chunked_loss=False, checkpoint_activations=False, cpu_offload=False,
                 reduce_in_16_bit=False, reduce_vocabulary_in_16_bit=False)
    return {
        "unsharded": replace(setup, world_size=1, root_unit_only=True, keep_root_gathered=True,
                             **plain),
        "stock-policy": replace(setup, root_unit_only=True, keep_root_gathered=True, **plain),
        "requested": setup,
    }


def comparison(shape: ModelShape, setup: TrainingSetup) -> dict[str, Estimate]:
    """:func:`comparison_setups`, estimated."""
    return {name: estimate(shape, each) for name, each in comparison_setups(setup).items()}


def features_off(setup: TrainingSetup) -> dict[str, tuple[str, TrainingSetup]]:
    """Each feature of :data:`FEATURES` not on yet: (its flag, the setup with it on)."""
    return {name: (flag, replace(setup, **change)) for name, (flag, change) in FEATURES.items()
            if any(getattr(setup, key) != value for key, value in change.items())}


def helps_most(shape: ModelShape, setup: TrainingSetup) -> tuple[str, str, float] | None:
    """(feature, flag, bytes saved) of the off feature that lowers the peak most, if any."""
    base = estimate(shape, setup).peak
    best = None
    for name, (flag, changed) in features_off(setup).items():
        saved = base - estimate(shape, changed).peak
        if saved > 0 and (best is None or saved > best[2]):
            best = (name, flag, saved)
    return best


TOKENS_STEP = 64  # --max-tokens suggestions are multiples of this


def largest_tokens(shape: ModelShape, setup: TrainingSetup, budget: float,
                   most: int = 1 << 22) -> int:
    """The largest ``--max-tokens`` (a multiple of :data:`TOKENS_STEP`, at most ``most``)
    whose estimated peak stays within ``budget`` bytes per rank; 0 if none does. The peak
    grows with the tokens (every term is non-decreasing in them), so a bisection finds it."""

    def fits(tokens: int) -> bool:
        return estimate(shape, replace(setup, tokens=tokens)).peak <= budget

    low, high = 0, most // TOKENS_STEP  # fits(low * step) holds (0: nothing), high: unknown
    if fits(high * TOKENS_STEP):
        return high * TOKENS_STEP
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle * TOKENS_STEP):
            low = middle
        else:
            high = middle
    return low * TOKENS_STEP


def fits_most_with(shape: ModelShape, setup: TrainingSetup,
                   budget: float) -> tuple[str, str, int] | None:
    """(feature, flag, largest --max-tokens) of the off feature that fits the most tokens
    within ``budget``, if one fits more than ``setup`` itself."""
    best = None
    base = largest_tokens(shape, setup, budget)
    for name, (flag, changed) in features_off(setup).items():
        tokens = largest_tokens(shape, changed, budget)
        if tokens > base and (best is None or tokens > best[2]):
            best = (name, flag, tokens)
    return best


# Host memory: what a node's RAM must hold besides (or, on CPU ranks, as) the device's.


@dataclass(frozen=True)
class HostSetup:
    """What decides host memory besides the training setup."""

    ranks_per_node: int  # ranks sharing one host's memory
    cpu: bool = False  # the ranks compute on the host (--cpu): its memory is the device's
    checkpoint_file_bytes: float | None = None  # released weights to load (None: 4 B/param)


@dataclass(frozen=True)
class HostPeak:
    """Host bytes of one case: the largest rank's own (rank 0's for a full save), and a
    node's ranks together with what they share counted once."""

    per_rank: float
    per_host: float


def construction_host(shape: ModelShape, setup: TrainingSetup, host: HostSetup
                      ) -> HostPeak:
    """Building the model: fairseq builds each rank's model in fp32 on the host, and the
    plugin shards every transformer layer as soon as it is built
    (``parallelize.shard_layer_as_built``); the layers' shards stay on the host on CPU ranks
    or with ``--cpu-offload`` (on a GPU they move to it). The peak is the largest of three
    moments, all ranks of a node at once:

    - the last layer built: the parameters outside the layers in fp32 (embeddings, norms)
      and one layer in fp32; with ``--layers-per-unit N`` also the layers of its stack
      waiting for the N-th (cast already under 16-bit shards), and the rest of the encoder
      (its layer count modulo N), which waits until the model is built;
    - the decoder's output projection built: fairseq creates it as a new fp32
      ``nn.Linear`` (vocabulary x dimension, initialised) before tying it to the embedding,
      after every layer exists (``TransformerDecoderBase.build_output_projection``);
    - the rest sharded after the last layer: with 16-bit parameter shards the rest is cast
      first (its fp32 and 16-bit copies alive together), then FSDP copies it into this
      rank's shards (the unsharded copy still alive); the rests of both stacks too."""
    layers = (shape.encoder_layers * shape.encoder_layer_parameters
              + shape.decoder_layers * shape.decoder_layer_parameters)
    outside_layers = shape.parameters - layers
    on_host = _state_on_host(setup, host)
    shards = setup.param_bytes * layers / setup.world_size if on_host else 0.0
    per_unit = 1 if setup.root_unit_only else setup.layers_per_unit
    stacks = ((shape.encoder_layers, shape.encoder_layer_parameters),
              (shape.decoder_layers, shape.decoder_layer_parameters))
    # each stack's layers waiting for the N-th beside the one built, and each stack's rest
    waiting = [setup.param_bytes * (min(per_unit, count) - 1) * size for count, size in stacks]
    rests = [setup.param_bytes * (count % per_unit) * size if per_unit > 1 else 0.0
             for count, size in stacks]
    last_layer = 4.0 * outside_layers + max(
        4.0 * shape.encoder_layer_parameters + waiting[0],
        4.0 * shape.decoder_layer_parameters + waiting[1] + rests[0])
    cast = setup.param_bytes * outside_layers if setup.param_bytes < 4 else 0.0
    rest_sharded = (setup.param_bytes * outside_layers / setup.world_size if on_host
                    else 0.0)
    rest = max(4.0 * outside_layers + cast,
               setup.param_bytes * outside_layers + rest_sharded) + sum(rests)
    projection = shape.vocabulary * shape.decoder_dim
    tied = shape.vocabulary_unit_parameters < 2 * projection  # embedding and projection
    untied_projection = (4.0 * (outside_layers + projection) + sum(rests)) if tied else 0.0
    per_rank = max(last_layer, untied_projection, rest) + shards
    return HostPeak(per_rank, host.ranks_per_node * per_rank)


def resident_host(result: Estimate, host: HostSetup) -> float:
    """Model state a rank keeps on the host between steps: on CPU ranks all of it (parameter,
    gradient and optimizer shards, buffers); with ``--cpu-offload`` on GPUs the offloaded
    shards (:attr:`Estimate.host`); on GPUs otherwise none."""
    if host.cpu:
        return (result.params + result.step_grads + result.optimizer + result.buffers
                + result.host)
    return result.host


def training_step_host(result: Estimate, host: HostSetup) -> HostPeak:
    """The training step: on CPU ranks the host is the device, so the step's peak itself
    (plus, offloaded, the state and the optimizer step's transient); on GPUs with
    ``--cpu-offload`` the offloaded state plus that transient; on GPUs otherwise none."""
    if host.cpu:
        step = max(result.peak, result.phases["optimizer step"] + result.host_step)
        per_rank = step + result.host
    else:
        per_rank = result.host + result.host_step
    return HostPeak(per_rank, host.ranks_per_node * per_rank)


def full_save_host(shape: ModelShape, setup: TrainingSetup, result: Estimate,
                   host: HostSetup) -> HostPeak:
    """A save in the full format: the whole model and its optimizer state are gathered into
    rank 0's host memory, P x (parameter bytes + optimizer bytes) (the model state's bytes
    less the gradients), on top of rank 0's own host state; the other ranks hold their own."""
    gathered = shape.parameters * (setup.param_bytes + setup.optimizer_bytes)
    resident = resident_host(result, host)
    return HostPeak(resident + gathered, host.ranks_per_node * resident + gathered)


def sharded_save_host(shape: ModelShape, setup: TrainingSetup, result: Estimate,
                      host: HostSetup) -> HostPeak:
    """A save in the sharded format: each rank writes its own shards, staging about one unit
    of them at a time (its shard of the largest unit's parameters and optimizer state), on
    top of its own host state."""
    staged = largest_local_elements(shape, setup) * (setup.param_bytes + setup.optimizer_bytes)
    per_rank = resident_host(result, host) + staged
    return HostPeak(per_rank, host.ranks_per_node * per_rank)


def _state_on_host(setup: TrainingSetup, host: HostSetup) -> bool:
    """Whether the shards live on the host: CPU ranks or ``--cpu-offload``."""
    return host.cpu or setup.cpu_offload


def _host_shards(shape: ModelShape, setup: TrainingSetup, host: HostSetup,
                 bytes_per_parameter: float) -> float:
    """A rank's shards of ``bytes_per_parameter`` x P where they live on the host (none on
    GPUs without offload)."""
    on_host = _state_on_host(setup, host)
    return bytes_per_parameter * shape.parameters / setup.world_size if on_host else 0.0


def _mapped_load(shape: ModelShape, setup: TrainingSetup, host: HostSetup, file: float,
                 kept: float) -> HostPeak:
    """A load of a ``file`` that ``torch.load`` maps: its pages are clean page cache,
    counted in each rank's RSS but held once per host (and reclaimable). Each rank's own:
    the ``kept`` shards and, where they live on the host, one fp32 slice of a unit being
    copied (``load_state_dict`` copies the mapped tensors' slices tensor by tensor)."""
    copying = 4.0 * largest_local_elements(shape, setup) if _state_on_host(setup, host) else 0.0
    private = kept + copying
    return HostPeak(private + file, file + host.ranks_per_node * private)


def released_load_host(shape: ModelShape, setup: TrainingSetup, host: HostSetup
                       ) -> HostPeak:
    """Fine-tuning from released weights (``--finetune-from-model``, or ``--restore-file``
    with ``--reset-optimizer``; 4 B x parameters unless its size is given): no optimizer
    state or gradient exists yet: each rank keeps its parameter shards."""
    file = host.checkpoint_file_bytes
    file = 4.0 * shape.parameters if file is None else file
    return _mapped_load(shape, setup, host, file,
                        _host_shards(shape, setup, host, setup.param_bytes))


def full_resume_host(shape: ModelShape, setup: TrainingSetup, host: HostSetup) -> HostPeak:
    """Resuming from a full checkpoint of this run: fairseq writes parameters and moments
    in fp32 (12 B x parameters with Adam, 4 B with SGD); each rank keeps its parameter and
    optimizer shards (the optimizer state is sliced before torch loads it)."""
    moments = 8.0 if setup.optimizer == "adam" else 0.0
    file = (4.0 + moments) * shape.parameters
    kept = _host_shards(shape, setup, host, setup.param_bytes + setup.optimizer_bytes)
    return _mapped_load(shape, setup, host, file, kept)


def sharded_resume_host(shape: ModelShape, setup: TrainingSetup, host: HostSetup
                        ) -> HostPeak:
    """Resuming from a sharded checkpoint: each rank reads its shards into fresh tensors
    (read, not mapped); the optimizer takes its own as they are, the parameters are copied
    into the model's shards, so a rank briefly holds its parameter shards twice."""
    kept = _host_shards(shape, setup, host, 2 * setup.param_bytes + setup.optimizer_bytes)
    return HostPeak(kept, host.ranks_per_node * kept)


HOST_CASES = ("model construction", "training step", "save, full format",
              "save, sharded format", "load of released weights", "resume, full format",
              "resume, sharded format")


def host_memory(shape: ModelShape, setup: TrainingSetup, host: HostSetup
                ) -> dict[str, HostPeak]:
    """Host memory of each case of :data:`HOST_CASES`."""
    result = estimate(shape, setup)
    return {
        "model construction": construction_host(shape, setup, host),
        "training step": training_step_host(result, host),
        "save, full format": full_save_host(shape, setup, result, host),
        "save, sharded format": sharded_save_host(shape, setup, result, host),
        "load of released weights": released_load_host(shape, setup, host),
        "resume, full format": full_resume_host(shape, setup, host),
        "resume, sharded format": sharded_resume_host(shape, setup, host),
    }


def training_host_peak(cases: dict[str, HostPeak], checkpoint_format: str = "full"
                       ) -> tuple[str, HostPeak]:
    """The largest host need of a training that saves in ``checkpoint_format``, over
    building the model, its steps and its saves (a load only where it resumes, so not
    counted): (the case of the largest per rank, that per rank and the largest per host)."""
    names = ("model construction", "training step", f"save, {checkpoint_format} format")
    name = max(names, key=lambda each: cases[each].per_rank)
    return name, HostPeak(cases[name].per_rank, max(cases[each].per_host for each in names))

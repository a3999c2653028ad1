"""NLLB-200 dense architectures for fairseq's ``transformer`` model.

Pre-norm encoder-decoder transformers with all embeddings shared and 16 attention heads:

| name | layers enc+dec | d_model | ffn | parameters at vocabulary 256,206 |
|---|---|---|---|---|
| nllb_dense_600m | 12+12 | 1024 | 4096 | 615.1M |
| nllb_dense_1_3b | 24+24 | 1024 | 8192 | 1.37B |
| nllb_dense_3_3b | 24+24 | 2048 | 8192 | 3.34B |

The NLLB recipe (fairseq's ``nllb`` branch, ``examples/nllb/modeling``) names these shapes
``transformer_12_12``, ``transformer_24_24`` and ``transformer_24_24_big``: its sweep script
turns those grid names into ``--arch transformer`` plus size flags, so fairseq itself never
defines them. They are registered here as the same architectures, so an ``arch`` copied from
a recipe config works as ``--arch``.

Every value can still be overridden from the command line, as with any fairseq architecture.
"""

from argparse import Namespace

from fairseq.models import register_model_architecture
from fairseq.models.transformer import base_architecture


def _nllb_dense(args: Namespace, layers: int, dim: int, ffn: int) -> None:
    defaults = {
        "encoder_layers": layers, "decoder_layers": layers,
        "encoder_embed_dim": dim, "decoder_embed_dim": dim,
        "encoder_ffn_embed_dim": ffn, "decoder_ffn_embed_dim": ffn,
        "encoder_attention_heads": 16, "decoder_attention_heads": 16,
        "encoder_normalize_before": True, "decoder_normalize_before": True,
        "share_all_embeddings": True, "dropout": 0.1,
        "attention_dropout": 0.1, "activation_dropout": 0.0,
    }
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    base_architecture(args)


@register_model_architecture("transformer", "nllb_dense_600m")
@register_model_architecture("transformer", "transformer_12_12")
def nllb_dense_600m(args: Namespace) -> None:
    _nllb_dense(args, layers=12, dim=1024, ffn=4096)


@register_model_architecture("transformer", "nllb_dense_1_3b")
@register_model_architecture("transformer", "transformer_24_24")
def nllb_dense_1_3b(args: Namespace) -> None:
    _nllb_dense(args, layers=24, dim=1024, ffn=8192)


@register_model_architecture("transformer", "nllb_dense_3_3b")
@register_model_architecture("transformer", "transformer_24_24_big")
def nllb_dense_3_3b(args: Namespace) -> None:
    _nllb_dense(args, layers=24, dim=2048, ffn=8192)

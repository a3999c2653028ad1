"""How a model is sharded: the plugin's flags (``options``), the wrap policy (which modules
become units), the engines that apply it (torch FSDP2, fairscale), mixed precision with
fp32 master shards, the optimizer's view of local shards, the global gradient norm, and
conversion between shards and full tensors.

Imports fairseq, torch and the plugin's :mod:`..errors` only, never its other subpackages.
"""

"""How a model is sharded: the plugin's flags (``options``), the wrap policy (which modules
become units), the engines that apply it (torch FSDP2, fairscale), mixed precision with
fp32 master shards, the optimizer's view of local shards, the global gradient norm, and
conversion between shards and full tensors.

Imports fairseq and torch only, never the plugin's other subpackages.
"""

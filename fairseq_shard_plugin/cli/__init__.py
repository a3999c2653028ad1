"""The console scripts (``fairseq-shard-*``): argument parsing and printing around the
logic of the subpackages they call.
"""

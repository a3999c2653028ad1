"""Checkpoints: full and sharded (DCP) formats, crash-safe writes, integrity checks, loading
without running pickled code, one-line explanations of what cannot be loaded, and the
consolidate/verify logic behind the console scripts.

May import :mod:`..sharding` (options, full tensors) and :mod:`..errors`; nothing above
(the trainer's own checkpoint I/O is :mod:`..training.trainer_files`).
"""

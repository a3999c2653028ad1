"""Start fairseq trainings and tools on this machine's CPU ranks, as torchrun and srun would.

Shared by ``tests/`` and ``benchmarks/`` (neither imports the other), so both run trainings
exactly the same way: :mod:`.harness` launches and reads logs, :mod:`.forkserver` starts
ranks quickly under the tests, :mod:`.fake_group` builds a sharded trainer for N ranks in
one process, :mod:`.scaling` runs the memory-scaling trainings, ``stock_launch.sh`` runs
stock fairseq on CPU ranks.
"""

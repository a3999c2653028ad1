"""The training run: the sharded Trainer, the launch environment (torchrun, Slurm, CPU
ranks), checks of a configuration before training, signals, out-of-memory stops and the
data position across world sizes.

May import every subpackage below it (sharding, checkpoint, memory, tasks).
"""

"""CPU ranks give freed blocks back to the system at once (memory/host_allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fairseq_shard_plugin.memory.host_allocator import MMAP_THRESHOLD, VARIABLE, return_freed_blocks

# In a fresh process (the allocator's state is per process): free a 24 MiB block (glibc
# then raises its mmap threshold to 24 MiB), take 12 blocks of 16 MiB, free all but the
# last (which keeps the heap's top in use), and print how much of them RSS still holds.
HELD = """
import sys, torch
from fairseq_shard_plugin.memory.host_allocator import return_freed_blocks
def rss_mib():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) // 1024
said = return_freed_blocks() if sys.argv[1] == "plugin" else None
big = torch.ones(6 * 2**20)
del big
before = rss_mib()
blocks = [torch.ones(2**22) for _ in range(12)]
last = blocks[-1]
del blocks
print(said, rss_mib() - before)
"""


def held_mib(how: str) -> tuple[str, int]:
    env = {name: value for name, value in os.environ.items() if name != VARIABLE}
    completed = subprocess.run([sys.executable, "-c", HELD, how], capture_output=True,
                               text=True, check=True, env=env)
    said, held = completed.stdout.rsplit(maxsplit=1)
    return said, int(held)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_blocks_freed_on_a_cpu_rank_leave_its_rss() -> None:
    said, held = held_mib("plugin")
    assert said == f"glibc's mmap threshold at {MMAP_THRESHOLD // 2**20} MiB ({VARIABLE})"
    assert held <= 24  # the one 16 MiB block still alive, and small change
    _, held_by_default = held_mib("stock")
    assert held_by_default >= 150  # glibc's default kept the freed 176 MiB


def test_a_setting_of_the_users_own_is_kept() -> None:
    assert return_freed_blocks({VARIABLE: "65536"}) is None

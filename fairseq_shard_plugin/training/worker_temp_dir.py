"""One temporary folder for a rank and its DataLoader workers, removed when the rank exits."""

from __future__ import annotations

import multiprocessing.util


def share_temp_dir_with_data_workers() -> None:
    """A DataLoader worker that hands a batch's shared memory to its rank opens a socket in
    a ``pymp-*`` folder of its own, which multiprocessing removes only when the worker ends
    by itself. Workers ended at exit (by multiprocessing's SIGTERM, or by
    ``signal_stop._end_daemon_children``) left theirs in the temporary directory: 4 folders
    per 1-rank run of stock fairseq with --num-workers 2. Made here, before any worker
    forks, the rank's folder is the one its workers inherit, and the rank removes it when
    it exits."""
    multiprocessing.util.get_temp_dir()

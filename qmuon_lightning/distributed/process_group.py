"""Orderly end of a multi-process run."""

from __future__ import annotations

import torch.distributed as dist


def shut_down_process_group() -> bool:
    """Wait for every rank, then destroy the default process group; ``True`` if there was one.

    Call it at the end of a training script that succeeded (``qmuon-train`` does). Without it a
    gloo run leaves the group to interpreter shutdown: its C++ worker threads can still be alive
    while Python finalizes, and the process aborts with ``terminate called without an active
    exception`` (exit status -6) after a run that had succeeded; CI saw this once on a 2-process
    ``qmuon_fsdp`` fit. The barrier keeps a rank from closing its sockets while another one still
    talks to it. Do not call it after an exception: a barrier with a failed peer waits for the
    process-group timeout instead of letting the job exit.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.barrier()
    dist.destroy_process_group()
    return True

"""torchrun --max-restarts with gloo: does the restarted attempt form its process group? (torch only)

    python -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 1 benchmarks/torchrun_gloo_restart_repro.py

Attempt 0: both ranks form a gloo group, then rank 1 exits with an error; torchrun restarts both.
Attempt 1 should print "pg ok" twice and "done" twice. Seen with torch 2.13 (CPU) on the 2-core
test machine: attempt 1's gloo full-mesh connect goes to attempt 0's (dead) address
("Gloo connectFullMesh failed ... Connection refused"; with static rendezvous it hangs instead),
so ``qmuon-train`` under ``torchrun --max-restarts`` cannot come back on CPU/gloo there
(docs/reliability.md). No qmuon_lightning or Lightning code is involved.
"""

import datetime
import os
import time

import torch.distributed as dist

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
rank = int(os.environ["RANK"])
print(f"attempt {attempt} rank {rank} init", flush=True)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
print(f"attempt {attempt} rank {rank} pg ok", flush=True)
dist.barrier()
if attempt == 0 and rank == 1:
    time.sleep(1)
    os._exit(1)
if attempt == 0:
    time.sleep(30)  # rank 0 waits; torchrun stops it when rank 1 fails
dist.barrier()
print(f"attempt {attempt} rank {rank} done", flush=True)
dist.destroy_process_group()

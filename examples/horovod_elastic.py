#!/usr/bin/env python3
"""Horovod elastic (PyTorch, gloo on CPU works) that loses nothing when a host is preempted.

    # hosts.txt: the pool, one `host:slots` per line; /shared/leaving: seen by the driver
    cat > discover.sh <<'EOF'
    #!/bin/sh
    exec python3 -m spotguard horovod-hosts --hosts hosts.txt --leaving /shared/leaving
    EOF
    chmod +x discover.sh
    horovodrun -np 4 --min-np 2 --host-discovery-script ./discover.sh \\
        python3 examples/horovod_elastic.py --ckpt-dir /shared/ckpt --leaving /shared/leaving

At the notice every rank agrees on one step (spotguard.horovod.should_checkpoint: an
hvd.allreduce MAX of the flag), commits the elastic state, rank 0 saves a durable copy, every
rank acks; the preempted host's ranks mark it leaving and every rank trains on. The discovery
script drops the host, the driver tells the workers, every rank raises HostsUpdatedInterrupt at
the same step (should_checkpoint(state) checks each step after a checkpoint): the survivors keep
their state and re-form without the host, whose workers leave. If the host dies first, the
survivors roll back to the commit made at the notice.
`state.batch` counts batches done, so the step saved, committed and resumed from are one number.
"""

import argparse
import os
import sys
import time
from pathlib import Path

try:
    import spotguard  # pip install ./clients/python (from a spotguard checkout; PyPI after a release)
except ImportError:  # running from a checkout: the package lives in clients/python
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
    import spotguard

import horovod.torch as hvd  # noqa: E402
import spotguard.horovod as sgh  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", type=Path, required=True, help="shared storage")
    p.add_argument("--leaving", type=Path, required=True, help="leaving-host markers (shared)")
    p.add_argument("--batches", type=int, default=100000)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--commit-every", type=int, default=50)
    args = p.parse_args()

    spotguard.install()
    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size()),
                                   named_parameters=model.named_parameters())

    start = 0
    saved = sorted(args.ckpt_dir.glob("step-*.pt")) if args.ckpt_dir.is_dir() else []
    if saved and hvd.rank() == 0:
        state_dict = torch.load(saved[-1], weights_only=True)
        model.load_state_dict(state_dict["model"])
        start = int(state_dict["step"])
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=start)

    def save(s: hvd.elastic.TorchState) -> str:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        path = args.ckpt_dir / f"step-{s.batch:08d}.pt"
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({"step": s.batch, "model": model.state_dict()}, tmp)
        os.replace(tmp, path)
        return str(path)

    @hvd.elastic.run
    def train(s: hvd.elastic.TorchState) -> None:
        spotguard.resumed(s.batch)
        if hvd.rank() == 0:
            print(f"world size {hvd.size()}: resumed from batch {s.batch}", flush=True)
        data = torch.Generator().manual_seed(1000 * s.batch + hvd.rank())
        for batch in range(s.batch, args.batches):
            x = torch.randn(64, 32, generator=data)
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) * 0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.step_time)
            s.batch = batch + 1
            if sgh.should_checkpoint(s):
                sgh.checkpoint(s, args.leaving, save=save, step=s.batch)
                print(f"rank {hvd.rank()}: committed batch {s.batch} at the notice", flush=True)
            elif s.batch % args.commit_every == 0:
                s.commit()

    train(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())

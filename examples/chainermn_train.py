#!/usr/bin/env python3
"""ChainerMN (MPI data parallel) that checkpoints when spotguard asks, every rank at the same
iteration, and resumes from that iteration.

    pip install ./clients/python 'setuptools<70' wheel 'numpy<1.24' mpi4py   # the helper, from a spotguard checkout
    pip install --no-build-isolation chainer                  # Chainer 7.8.1, ChainerMN included
    spotguard drill -- mpiexec -n 2 python3 examples/chainermn_train.py --ckpt-dir /tmp/ckpt
    mpiexec -n 2 python3 examples/chainermn_train.py --ckpt-dir /tmp/ckpt      # resumes

A small regression MLP on synthetic data, the data scattered over the ranks
(``chainermn.scatter_dataset``), a multi-node optimizer (the gradients all-reduced over MPI) and
a Chainer ``Trainer``. :class:`SpotguardSnapshot`, a Chainer extension run after every iteration:

* every rank asks :func:`spotguard.should_checkpoint` (its own flag: the agent signals every
  rank, at slightly different times) and the ranks agree through an MPI all-reduce (MAX), so all
  of them save at the same iteration;
* each rank saves its whole trainer state (model, optimizer, its iterator's position in its
  shard of the data) as ``iter-<N>/rank-<r>.npz``, atomically; after a barrier rank 0 marks the
  iteration complete (``iter-<N>/COMPLETE``) — together one multi-node snapshot;
* every rank acks ``done`` with the iteration and exits 143 (``mpiexec`` then reports 143: a
  retryable exit for Kubeflow's ``ExitCode`` policy or a Job ``podFailurePolicy``).

On start every rank loads its file of the newest complete snapshot (rank 0 picks it and tells the
others) and training goes on from that iteration, the iterators where they were.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path
from typing import Optional

try:
    import spotguard  # pip install ./clients/python (from a spotguard checkout; PyPI after a release)
except ImportError:  # running from a checkout: the package lives in clients/python
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
    import spotguard

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy as np
from chainer import training
from mpi4py import MPI

COMPLETE = "COMPLETE"


def snapshot_dir(ckpt_dir: Path, iteration: int) -> Path:
    return ckpt_dir / f"iter-{iteration:08d}"


def latest_complete(ckpt_dir: Path) -> Optional[int]:
    """The newest iteration whose snapshot every rank finished (rank 0 marked it complete)."""
    found = sorted(ckpt_dir.glob(f"iter-*/{COMPLETE}")) if ckpt_dir.is_dir() else []
    return int(found[-1].parent.name.split("-")[1]) if found else None


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # never a torn snapshot


class SpotguardSnapshot(training.Extension):
    """Checkpoint on spotguard's signal, every rank at the same iteration (module docstring)."""

    trigger = (1, "iteration")
    priority = training.PRIORITY_WRITER

    def __init__(self, comm: chainermn.CommunicatorBase, ckpt_dir: Path) -> None:
        self.comm = comm
        self.ckpt_dir = ckpt_dir

    def initialize(self, trainer: training.Trainer) -> None:
        spotguard.install()  # main thread, before the first iteration
        t0 = time.monotonic()
        found = latest_complete(self.ckpt_dir) if self.comm.rank == 0 else None
        found = self.comm.mpi_comm.bcast(found, root=0)
        path = None
        if found is not None:
            path = snapshot_dir(self.ckpt_dir, found) / f"rank-{self.comm.rank}.npz"
            chainer.serializers.load_npz(str(path), trainer)
            print(f"rank {self.comm.rank}: resumed from iteration {found} ({path})", flush=True)
        # The file this rank acked: the agent reports the recovery from its interruption.
        spotguard.resumed(trainer.updater.iteration, checkpoint=path,
                          restore_seconds=time.monotonic() - t0)

    def __call__(self, trainer: training.Trainer) -> None:
        mine = spotguard.should_checkpoint()  # this rank's flag (no torch.distributed here)
        if not self.comm.mpi_comm.allreduce(int(mine), op=MPI.MAX):
            return
        it = trainer.updater.iteration
        left = spotguard.time_left()
        if left is not None and left < 2.0:
            spotguard.ack("skipped", step=it)
            spotguard.exit_after_checkpoint()
        d = snapshot_dir(self.ckpt_dir.resolve(), it)
        buf = io.BytesIO()
        chainer.serializers.save_npz(buf, trainer)
        path = d / f"rank-{self.comm.rank}.npz"
        write_atomic(path, buf.getvalue())
        self.comm.mpi_comm.Barrier()  # every rank's file is there
        if self.comm.rank == 0:
            write_atomic(d / COMPLETE, f"{self.comm.size}\n".encode())
        self.comm.mpi_comm.Barrier()  # the snapshot is complete before anyone says done
        spotguard.ack("done", step=it, checkpoint=path)
        print(f"rank {self.comm.rank}: saved iteration {it} to {path}; exiting 143", flush=True)
        spotguard.exit_after_checkpoint()


class MLP(chainer.Chain):
    def __init__(self) -> None:
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(16, 64)
            self.l2 = L.Linear(64, 1)

    def forward(self, x: np.ndarray) -> chainer.Variable:
        return self.l2(F.relu(self.l1(x)))


class Slow(training.Extension):
    """Extra seconds per iteration (a stand-in for real work on a CPU-only rehearsal)."""

    trigger = (1, "iteration")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, trainer: training.Trainer) -> None:
        time.sleep(self.seconds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", type=Path,
                   default=Path(os.environ.get("CHECKPOINT_DIR") or "checkpoints"),
                   help="storage that outlives the node, seen by every rank "
                        "(default $CHECKPOINT_DIR or ./checkpoints)")
    p.add_argument("--iterations", type=int, default=100_000)
    p.add_argument("--step-time", type=float, default=0.01, help="extra seconds per iteration")
    args = p.parse_args()

    comm = chainermn.create_communicator("naive")  # CPU, MPI through mpi4py
    rng = np.random.RandomState(0)
    x = rng.randn(4096, 16).astype(np.float32)
    data = chainer.datasets.TupleDataset(x, (x.sum(axis=1, keepdims=True) * 0.1).astype(np.float32))
    train = chainermn.scatter_dataset(data if comm.rank == 0 else None, comm, shuffle=True, seed=0)
    model = L.Classifier(MLP(), lossfun=F.mean_squared_error)
    model.compute_accuracy = False
    opt = chainermn.create_multi_node_optimizer(chainer.optimizers.Adam(), comm)
    opt.setup(model)
    it = chainer.iterators.SerialIterator(train, batch_size=32, shuffle=True)
    updater = training.StandardUpdater(it, opt)
    trainer = training.Trainer(updater, (args.iterations, "iteration"),
                               out=str(args.ckpt_dir / "out"))
    trainer.extend(Slow(args.step_time))
    trainer.extend(SpotguardSnapshot(comm, args.ckpt_dir))
    print(f"rank {comm.rank}/{comm.size}: training (pid {os.getpid()}, "
          f"SPOTGUARD_DIR={spotguard.checkpoint_dir()})", flush=True)
    trainer.run()
    if comm.rank == 0:
        print(f"training finished at iteration {updater.iteration}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

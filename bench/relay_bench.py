#!/usr/bin/env python3
"""Driver of bench/relay.sh (read its header first): the namespaces and links exist; this starts
the store and the two receiving peers once, then, per arm and size, a fresh doomed node (its
GCE metadata emulator, a uid-1000 trainer, its agent), raises the preemption, kills the node at
the notice's end, waits for the peers and checks the store."""

import argparse
import calendar
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

MIB = 1 << 20
ACCESS_KEY = "benchkey"
SECRET_KEY = "benchsecretkey"
BUCKET = "ckpt"
LOCATION = f"s3://{BUCKET}/run1"
TRAINER_UID = 1000
EMULATOR_PORT = 8081
METRICS_PORT = 9100
RELAY_PORT = 7443
S3_PORT = 9000
SHIPPED_CAPS = ["--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all,+kill,+sys_ptrace"]

# The trainer: the helper's handler; on the signal it saves BYTES in 8 shards (each MiB starts
# with its shard and MiB index, so no two MiBs are alike) and 4 small files, acks them staged,
# waits for the agent's answer, records its times (written aside, then renamed) and exits.
TRAINER = r"""
import json, os, struct, sys, time
import spotguard
spotguard.install()
open(os.environ["READY"], "w").close()
while not spotguard.should_checkpoint():
    time.sleep(0.002)
signal_at = time.time()
path = os.environ["STAGED"]
os.makedirs(path)
mibs = int(os.environ["STAGED_MIB"])
block = memoryview(os.urandom(1 << 20))
for i in range(8):
    n = mibs // 8 + (1 if i < mibs % 8 else 0)
    with open(os.path.join(path, f"__{i}_0.distcp"), "wb") as f:
        for j in range(n):
            f.write(struct.pack("<QQ", i, j))
            f.write(block[16:])
for name in (".metadata", "extra/rng.pt", "extra/optim_meta.json", "extra/config.json"):
    p = os.path.join(path, name)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "wb") as f:
        f.write(os.urandom(4096))
saved_at = time.time()
answer = spotguard.ack_staged(path, step=int(os.environ["STEP"]))
out = {"signal_at": signal_at, "saved_at": saved_at, "answer": answer.state,
       "error": answer.error, "exit_at": time.time()}
with open(os.environ["RESULT"] + ".t", "w") as f:
    json.dump(out, f)
os.rename(os.environ["RESULT"] + ".t", os.environ["RESULT"])
spotguard.exit_after_checkpoint()
"""


def in_ns(ns, cmd):
    return ["ip", "netns", "exec", ns] + cmd


def store_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SPOTGUARD_"))}
    env.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    return env


def wait_for(what, cond, timeout, proc=None):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            sys.exit(f"{what}: the process exited ({proc.returncode})")
        if time.monotonic() > deadline:
            sys.exit(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def curl(ns, url, data=None):
    cmd = ["curl", "-s", "--max-time", "5", url]
    if data is not None:
        cmd += ["-X", "POST", "-d", data]
    p = subprocess.run(in_ns(ns, cmd), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return p.stdout if p.returncode == 0 else None


def rfc3339(text):
    """Seconds since the epoch of `2026-11-29T06:30:00.123456789Z`."""
    main, _, frac = text.rstrip("Z").partition(".")
    secs = calendar.timegm(time.strptime(main, "%Y-%m-%dT%H:%M:%S"))
    return secs + (float("0." + frac) if frac else 0.0)


def log_follower(proc, path, lines):
    """Copy `proc`'s output to `path`, keeping the lines in `lines` too."""
    def pump():
        with open(path, "w") as out:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                lines.append(line)
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def kill(proc):
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def catches_usr1(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)))
    except OSError:
        pass
    return False


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(8 * MIB)
            if not b:
                return h.hexdigest()
            h.update(b)


def staged_files(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = p
    return out


class Bench:
    def __init__(self, a):
        self.a = a
        self.work = a.work
        self.bin = a.spotguard
        self.procs = []
        self.step = 0
        self.s3root = os.path.join(self.work, "s3root")
        self.logs = os.path.join(self.work, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.key = os.path.join(self.work, "relay.key")
        with open(self.key, "w") as f:
            f.write(os.urandom(24).hex())
        os.chmod(self.key, 0o600)
        self.peers = a.ns_peers.split(",")

    # The store and the peers, started once.

    def start_store(self):
        shutil.rmtree(self.s3root, ignore_errors=True)
        os.makedirs(os.path.join(self.s3root, BUCKET))
        p = subprocess.Popen(
            in_ns(self.a.ns_store, ["s3s-fs", "--host", "0.0.0.0", "--port", str(S3_PORT),
                                    "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY,
                                    self.s3root]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, RUST_LOG="s3s_fs=info"))
        self.procs.append(p)
        lines = []
        log_follower(p, os.path.join(self.logs, "s3s-fs.log"), lines)
        wait_for("s3s-fs", lambda: any("server is running" in l for l in lines), 30, p)

    def agent_cmd(self, ns, base, store_addr, extra):
        return in_ns(ns, ["setpriv"] + SHIPPED_CAPS + ["--", self.bin, "run", "--mode=host",
                          "--cloud=gce", f"--metadata-endpoint=http://127.0.0.1:{EMULATOR_PORT}",
                          "--poll-interval=1s", f"--gce-preemption-notice={self.a.notice}s",
                          f"--state-dir={base}/state", f"--checkpoint-dir={base}/ckpt",
                          f"--metrics-addr=127.0.0.1:{METRICS_PORT}", "--gpu=off",
                          "--log-format=json", "--log-level=info",
                          f"--upload-allow=s3://{BUCKET}",
                          f"--upload-endpoint=http://{store_addr}:{S3_PORT}",
                          f"--relay-key-file={self.key}"]
                     + ([f"--drain-reserve={self.a.drain_reserve}"] if self.a.drain_reserve else [])
                     + extra)

    def emulator(self, ns, name):
        p = subprocess.Popen(in_ns(ns, [self.bin, "emulate", "--cloud", "gce", "--listen",
                                        f"127.0.0.1:{EMULATOR_PORT}"]),
                             stdout=open(os.path.join(self.logs, f"{name}-emulator.log"), "w"),
                             stderr=subprocess.STDOUT)
        wait_for(f"{name} emulator", lambda: curl(ns, f"http://127.0.0.1:{EMULATOR_PORT}/spotguard/state"),
                 30, p)
        return p

    def start_peers(self):
        self.fingerprints = []
        self.peer_staging = []
        self.peer_lines = []
        for i, ns in enumerate(self.peers, start=1):
            base = os.path.join(self.work, f"peer{i}")
            shutil.rmtree(base, ignore_errors=True)
            os.makedirs(os.path.join(base, "staging"))
            out = subprocess.run([self.bin, "relay", "fingerprint", "--state-dir", f"{base}/state"],
                                 check=True, stdout=subprocess.PIPE, text=True).stdout
            fp = re.search(r"\b[0-9a-f]{64}\b", out)
            if not fp:
                sys.exit(f"peer{i}: no fingerprint in {out!r}")
            self.fingerprints.append(fp.group(0))
            self.peer_staging.append(os.path.join(base, "staging"))
            self.procs.append(self.emulator(ns, f"peer{i}"))
            p = subprocess.Popen(
                self.agent_cmd(ns, base, f"10.77.{1 + i}.2",
                               # No trainer runs on a peer here; host mode wants a target.
                               ["--checkpoint-cmdline=relay_bench_no_trainer",
                                f"--relay-listen=0.0.0.0:{RELAY_PORT}",
                                f"--relay-staging-dir={base}/staging"]),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=store_env())
            self.procs.append(p)
            lines = []
            self.peer_lines.append(lines)
            log_follower(p, os.path.join(self.logs, f"peer{i}-agent.log"), lines)
            wait_for(f"peer{i} agent", lambda: any("relay receiver listening" in l for l in lines),
                     60, p)

    def peers_idle(self):
        return all(not os.listdir(s) for s in self.peer_staging)

    # One trial.

    def trial(self, arm, mib):
        a = self.a
        self.step += 1
        step = self.step
        base = os.path.join(self.work, "doomed")
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
        os.chmod(base, 0o755)
        local = os.path.join(base, "local")
        os.makedirs(local)
        os.chown(local, TRAINER_UID, TRAINER_UID)
        staged = os.path.join(local, f"step-{step}")
        result = os.path.join(local, "result.json")
        ready = os.path.join(local, "ready")
        name = f"{arm}-{mib}MiB"
        ns = a.ns_doomed
        emu = trainer = agent = None
        lines = []
        links = ["store"] + [f"peer{i}" for i in range(1, len(self.peers) + 1)]
        # A fresh node: its links up again (the last trial's death took them down).
        for dev in links:
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
        for addr in ["10.77.1.2"] + [f"10.77.{10 + i}.2" for i in range(1, len(self.peers) + 1)]:
            wait_for(f"a route to {addr}", lambda: subprocess.run(
                ["ip", "-n", ns, "route", "get", addr], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL).returncode == 0, 10)
        try:
            emu = self.emulator(ns, f"doomed-{name}")
            env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.path.join(a.repo, "clients/python"),
                   "SPOTGUARD_DIR": os.path.join(base, "ckpt"), "STAGED": staged,
                   "STAGED_MIB": str(mib), "RESULT": result, "READY": ready, "STEP": str(step)}
            trainer = subprocess.Popen(
                in_ns(ns, ["setpriv", f"--reuid={TRAINER_UID}", f"--regid={TRAINER_UID}",
                           "--clear-groups", "python3", "-c", TRAINER]),
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(self.logs, f"doomed-{name}-trainer.log"), "w"))
            wait_for("trainer", lambda: os.path.exists(ready) and catches_usr1(trainer.pid), 30,
                     trainer)
            with open(os.path.join(base, "trainer.pid"), "w") as f:
                f.write(str(trainer.pid))
            peers = [f"--relay-peers=10.77.{10 + i}.2:{RELAY_PORT}#{fp}"
                     for i, fp in enumerate(self.fingerprints, start=1)]
            agent = subprocess.Popen(
                self.agent_cmd(ns, base, "10.77.1.2",
                               [f"--checkpoint-pidfile={base}/trainer.pid",
                                f"--checkpoint-upload={LOCATION}", f"--relay={arm}"] + peers),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=store_env())
            log_follower(agent, os.path.join(self.logs, f"doomed-{name}-agent.log"), lines)

            def polled():
                m = curl(ns, f"http://127.0.0.1:{METRICS_PORT}/metrics") or ""
                return re.search(r"^spotguard_metadata_polls_total\{.*\} [1-9]", m, re.M)
            wait_for("doomed agent", polled, 60, agent)
            load = os.getloadavg()[0]
            raised = curl(ns, f"http://127.0.0.1:{EMULATOR_PORT}/spotguard/notice",
                          json.dumps({"kind": "interruption"}))
            if not raised:
                sys.exit("the emulator did not raise the notice")
            visible = rfc3339(json.loads(raised)["visible_at"])
            death = visible + a.notice
            time.sleep(max(0.0, death - time.time()))
            # The VM is gone: its links first, then every process on it.
            for dev in links:
                subprocess.run(["ip", "-n", ns, "link", "set", dev, "down"], check=True)
            for pid in subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE,
                                      text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            killed = time.time()
        finally:
            for p in (agent, trainer, emu):
                kill(p)
        trainer_out = None
        if os.path.exists(result):
            with open(result) as f:
                trainer_out = json.load(f)
        # The peers finish: a relay published, or given up (nothing left on their volumes).
        wait_s = a.wait if a.wait else mib * MIB / (a.peer_store_rate * 1e6) * 1.5 + 90
        t0 = time.monotonic()
        while arm != "off" and not self.peers_idle() and time.monotonic() - t0 < wait_s:
            time.sleep(0.2)
        settled = time.monotonic() - t0
        published_at = None
        manifest = os.path.join(self.s3root, BUCKET, "run1", f"step-{step}", "manifest.json")
        if os.path.exists(manifest):
            published_at = os.stat(manifest).st_mtime
        intact, why = self.verify(staged, manifest)
        relay_at = None
        relay_peer = None
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            text = json.dumps(rec)
            if relay_at is None and "relaying to a peer" in text:
                ts = rec.get("timestamp") or rec.get("ts") or rec.get("time")
                relay_at = rfc3339(ts) - visible if isinstance(ts, str) else None
            if "the relay's peer published" in text:
                relay_peer = rec.get("peer") or (rec.get("fields") or {}).get("peer")
        verified_at = None
        for pl in self.peer_lines:
            for line in list(pl):
                if "relay verified; publishing" in line and f'"step-{step}"' in line:
                    verified_at = rfc3339(json.loads(line)["timestamp"]) - visible
        row = {
            "relay_verified_s": verified_at,
            "arm": arm, "mib": mib, "step": step, "intact": intact, "why": why,
            "downtime_s": (trainer_out["exit_at"] - visible) if trainer_out else None,
            "save_s": (trainer_out["saved_at"] - trainer_out["signal_at"]) if trainer_out else None,
            "answer": trainer_out["answer"] if trainer_out else None,
            "relay_started_s": relay_at, "relay_peer": relay_peer,
            "published_s": (published_at - visible) if published_at else None,
            "killed_s": killed - visible, "settled_wait_s": settled,
            "peers_idle": self.peers_idle(), "load1": load,
        }
        # Make room: the store's copy and the staged tree go.
        shutil.rmtree(os.path.join(self.s3root, BUCKET, "run1", f"step-{step}"), ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        if not self.peers_idle():
            wait_for("the peers' staging volumes to empty", self.peers_idle, 120)
        return row

    def verify(self, staged, manifest):
        if not os.path.exists(manifest):
            return False, "no manifest"
        with open(manifest) as f:
            m = json.load(f)
        listed = sorted(e["path"] for e in m.get("files", []))
        files = staged_files(staged)
        if listed != sorted(files):
            return False, f"the manifest lists {len(listed)} files, {len(files)} were staged"
        top = os.path.dirname(manifest)
        for rel, path in files.items():
            obj = os.path.join(top, rel)
            if not os.path.exists(obj):
                return False, f"{rel}: not in the store"
            if sha256(obj) != sha256(path):
                return False, f"{rel}: bytes differ"
        return True, "intact"

    def close(self):
        for p in reversed(self.procs):
            kill(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spotguard", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--store-rate", type=float, required=True)
    ap.add_argument("--peer-rate", type=float, required=True)
    ap.add_argument("--peer-store-rate", type=float, required=True)
    ap.add_argument("--notice", type=float, default=30)
    ap.add_argument("--drain-reserve", default="")
    ap.add_argument("--start-mib", type=int, default=32)
    ap.add_argument("--step", type=float, default=1.5)
    ap.add_argument("--max-mib", type=int, default=4096)
    ap.add_argument("--arms", default="off,auto")
    ap.add_argument("--refine", type=int, default=1)
    ap.add_argument("--wait", type=float, default=0)
    ap.add_argument("--rt", default="none")
    ap.add_argument("--ns-store", required=True)
    ap.add_argument("--ns-doomed", required=True)
    ap.add_argument("--ns-peers", required=True)
    a = ap.parse_args()

    version = subprocess.run([a.spotguard, "--version"], stdout=subprocess.PIPE, text=True).stdout.strip()
    print(f"{version}; store link {a.store_rate:g} MB/s (peers' {a.peer_store_rate:g} MB/s), "
          f"peer link {a.peer_rate:g} MB/s, GCE notice {a.notice:g} s, drain reserve "
          f"{a.drain_reserve or 'default (8s on gce)'}; ladder from {a.start_mib} MiB x{a.step:g}; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; scheduling: {a.rt}", flush=True)
    started = time.monotonic()
    b = Bench(a)
    rows = []
    try:
        b.start_store()
        b.start_peers()
        def one(arm, mib):
            row = b.trial(arm, mib)
            rows.append(row)
            fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)
            print(f"  relay {arm:4s} {mib:6d} MiB: {'published intact' if row['intact'] else row['why']:28s} "
                  f"trainer downtime {fmt(row['downtime_s'], '{:.2f}')} s (save {fmt(row['save_s'], '{:.2f}')} s, "
                  f"{row['answer']}), relay from {fmt(row['relay_started_s'])} s, peer verified at "
                  f"{fmt(row['relay_verified_s'])} s, published at {fmt(row['published_s'])} s, "
                  f"load {row['load1']:.2f}", flush=True)
            return row["intact"]

        for arm in a.arms.split(","):
            mib, good, bad = a.start_mib, 0, None
            while mib <= a.max_mib:
                if not one(arm, mib):
                    bad = mib
                    break
                good = mib
                mib = max(mib + 1, int(round(mib * a.step)))
            # Between the last size published and the first one not: geometric midpoints.
            for _ in range(a.refine):
                if not good or bad is None:
                    break
                mid = int(round((good * bad) ** 0.5))
                if mid <= good or mid >= bad:
                    break
                if one(arm, mid):
                    good = mid
                else:
                    bad = mid
    finally:
        b.close()
    with open(os.path.join(a.work, "relay-bench.json"), "w") as f:
        json.dump(rows, f, indent=1)

    arms = a.arms.split(",")
    best = {arm: max([r["mib"] for r in rows if r["arm"] == arm and r["intact"]], default=0)
            for arm in arms}
    failed = {arm: min([r["mib"] for r in rows if r["arm"] == arm and not r["intact"]], default=None)
              for arm in arms}
    common = set.intersection(*[{r["mib"] for r in rows if r["arm"] == arm} for arm in arms])
    print()
    print("| relay | largest published intact (MiB) | first size not published (MiB) | "
          "trainer downtime, median over the sizes both arms ran (s) | relay started after the notice, median (s) |")
    print("|---|---:|---:|---:|---:|")
    for arm in arms:
        d = [r["downtime_s"] for r in rows if r["arm"] == arm and r["mib"] in common and r["downtime_s"] is not None]
        rs = [r["relay_started_s"] for r in rows if r["arm"] == arm and r["relay_started_s"] is not None]
        print(f"| {arm} | {best[arm]} | {failed[arm] or '-'} | "
              f"{statistics.median(d) if d else float('nan'):.2f} | "
              f"{statistics.median(rs) if rs else float('nan'):.1f} |")
    if len(arms) == 2 and best[arms[0]]:
        print(f"\nratio {arms[1]} / {arms[0]}: {best[arms[1]] / best[arms[0]]:.1f}x "
              f"(each largest size is below its arm's limit by less than the gap to its first size not published)")
    print(f"bench took {time.monotonic() - started:.0f} s; load at the end {os.getloadavg()[0]:.2f}; "
          f"rows in {os.path.join(a.work, 'relay-bench.json')}")


if __name__ == "__main__":
    main()

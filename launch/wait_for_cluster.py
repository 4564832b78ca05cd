"""Wait until a Ray cluster has its nodes and, optionally, its job server; exit 1 on timeout.

    python launch/wait_for_cluster.py --address HEAD_IP:6379 --nodes 4 --job-server http://127.0.0.1:8265

Launch scripts start the head and the workers in the background and call this before submitting, because
``ray job submit`` fails outright if the job server is not up yet, and a recipe's placement groups wait
only two minutes for GPUs that a late worker would bring.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
import urllib.error
import urllib.request


def gcs_listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except OSError:
        return False


def alive_nodes() -> int:
    import ray

    return sum(1 for node in ray.nodes() if node["Alive"])


def job_server_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/version", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch/wait_for_cluster.py", description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="the head's GCS address, HOST:PORT")
    p.add_argument("--nodes", type=int, default=1, help="how many alive nodes to wait for")
    p.add_argument("--job-server", help="also wait for the job server at this URL (http://HOST:8265)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    args = p.parse_args(argv)
    deadline, nodes = time.monotonic() + args.timeout, 0
    while not gcs_listening(args.address):
        if time.monotonic() > deadline:
            print(f"wait_for_cluster: nothing listens at {args.address}", file=sys.stderr)
            return 1
        time.sleep(1)
    import ray

    ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        while time.monotonic() < deadline:
            nodes = alive_nodes()
            if nodes >= args.nodes and (args.job_server is None or job_server_up(args.job_server)):
                print(f"wait_for_cluster: {nodes} node(s) up at {args.address}", flush=True)
                return 0
            time.sleep(1)
    finally:
        ray.shutdown()
    server = f" and the job server at {args.job_server}" if args.job_server else ""
    print(
        f"wait_for_cluster: {nodes} of {args.nodes} node(s){server} after {args.timeout:.0f}s",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""Which S3 client for blockkv.pool.s3: boto3 or obstore, on 4 MiB objects.

Starts moto's server on 127.0.0.1 and times, with each client, a plain PUT, a
conditional PUT (``If-None-Match: *``, the pool's create) and a GET of the same
random 4 MiB object, reporting the median of ``--rounds`` runs. Loopback and
moto's Python server bound the figures, so they compare the clients' own cost,
not a real bucket.

    python tools/s3_clients.py [--rounds 16] [--mib 4]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable

import boto3
import obstore
from moto.server import ThreadedMotoServer
from obstore.store import S3Store


def median_seconds(rounds: int, op: Callable[[int], object]) -> float:
    times = []
    for i in range(rounds):
        started = time.perf_counter()
        op(i)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--mib", type=int, default=4)
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench",
                            aws_secret_access_key="bench", region_name="us-east-1")
        boto.create_bucket(Bucket="bench")
        obs = S3Store("bench", endpoint=endpoint, access_key_id="bench", secret_access_key="bench",
                      region="us-east-1", client_options={"allow_http": True})
        data = os.urandom(args.mib << 20)
        rows = {
            "boto3": (
                lambda i: boto.put_object(Bucket="bench", Key=f"b/{i}", Body=data),
                lambda i: boto.put_object(Bucket="bench", Key=f"bc/{i}", Body=data, IfNoneMatch="*"),
                lambda i: boto.get_object(Bucket="bench", Key=f"b/{i}")["Body"].read(),
            ),
            "obstore": (
                lambda i: obstore.put(obs, f"o/{i}", data, use_multipart=False),
                lambda i: obstore.put(obs, f"oc/{i}", data, mode="create"),
                lambda i: obstore.get(obs, f"o/{i}").bytes(),
            ),
        }
        print(f"{args.mib} MiB objects, median of {args.rounds}, moto server on loopback")
        print(f"{'client':8} {'put MiB/s':>10} {'create MiB/s':>13} {'get MiB/s':>10}")
        for client, ops in rows.items():
            put, create, get = (args.mib / median_seconds(args.rounds, op) for op in ops)
            print(f"{client:8} {put:10.0f} {create:13.0f} {get:10.0f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()

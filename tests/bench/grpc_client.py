"""CPU per call of grpcio's asyncio client, against the HTTP/1.1 transports' figures.

Starts a ``nemesis.v1.HandlerService`` server (grpcio asyncio) in its own
process on core 1, then on core 0, at the delivery benchmark's concurrency:

  (1) a bare loop of ``grpc.aio`` unary calls (``Deliver``, one event with the
      benchmark's payload), the client library alone;
  (2) a bare loop of Nemesis' gRPC transport (``GrpcTransport.deliver``);
  (3) for comparison, a bare loop of the h1 transport to an HTTP handler.

Prints calls per second and CPU microseconds per call (``time.process_time``
of the client process). Usage: ``python tests/bench/grpc_client.py [--calls N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from tests.bench.delivery import PAYLOAD, WARM_UP, Handler, _run, free_port, pin  # noqa: E402


async def serve(port: int) -> None:
    import grpc
    from grpc import aio

    from nemesis.proto import SERVICE
    from nemesis.proto.nemesis.v1 import handler_pb2 as pb

    async def deliver(request: pb.DeliverRequest, context: object) -> pb.DeliverResponse:
        return pb.DeliverResponse()

    server = aio.server()
    handler = grpc.unary_unary_rpc_method_handler(
        deliver,
        request_deserializer=pb.DeliverRequest.FromString,
        response_serializer=pb.DeliverResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Deliver": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def timed_loop(call: Any, count: int, concurrency: int) -> tuple[float, float]:
    """(calls/s, CPU us per call) of ``concurrency`` workers making ``count`` calls."""
    remaining = count
    done, mark, started = 0, count // WARM_UP, time.perf_counter()
    cpu_started = time.process_time()

    async def worker() -> None:
        nonlocal remaining, done, started, cpu_started
        while remaining > 0:
            remaining -= 1
            await call(remaining)
            done += 1
            if done == mark:
                started, cpu_started = time.perf_counter(), time.process_time()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return (count - mark) / elapsed, cpu / (count - mark) * 1e6


async def bare_grpc(port: int, count: int, concurrency: int) -> tuple[float, float]:
    from grpc import aio

    from nemesis.proto import SERVICE
    from nemesis.proto.nemesis.v1 import handler_pb2 as pb

    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        deliver = channel.unary_unary(
            f"/{SERVICE}/Deliver",
            request_serializer=pb.DeliverRequest.SerializeToString,
            response_deserializer=pb.DeliverResponse.FromString,
        )

        async def call(n: int) -> None:
            event = pb.Event(id=f"bench:0:{n}", source="nemesis/bench", type="t", data=PAYLOAD)
            await deliver(pb.DeliverRequest(event=event), timeout=10)

        return await timed_loop(call, count, concurrency)


def _events(count: int) -> list[Any]:
    from nemesis.broker.port import Message
    from nemesis.delivery.port import Event

    return [
        Event(Message("bench", n % 4, n, PAYLOAD, created_at=1764460800.0), f"bench:{n}", "t")
        for n in range(count)
    ]


async def transport_loop(url: str, kind: str, count: int, concurrency: int) -> tuple[float, float]:
    from nemesis.config.models import TargetConfig

    target = TargetConfig.model_validate({"url": url, "timeout_s": 10})
    transport: Any
    if kind == "grpc":
        from nemesis.delivery.grpc import GrpcTransport

        transport = GrpcTransport(target, integration="bench", max_connections=concurrency)
    else:
        from nemesis.delivery.h1 import H1Transport

        transport = H1Transport(target, integration="bench", max_connections=concurrency)
    events = _events(count)
    try:
        return await timed_loop(lambda n: transport.deliver(events[n]), count, concurrency)
    finally:
        await transport.close()


def child(name: str, args: list[str]) -> None:
    if name == "serve":
        _run(serve(int(args[0])))
        return
    port, count, concurrency = (int(a) for a in args)
    if name == "bare-grpc":
        result = _run(bare_grpc(port, count, concurrency))
    elif name == "transport-grpc":
        result = _run(transport_loop(f"grpc://127.0.0.1:{port}", "grpc", count, concurrency))
    else:
        result = _run(transport_loop(f"http://127.0.0.1:{port}/", "h1", count, concurrency))
    print(json.dumps(result))


def run_child(name: str, *args: str) -> tuple[float, float]:
    output = subprocess.run(
        [*pin(0), sys.executable, __file__, "--child", name, *args],
        capture_output=True,
        text=True,
        check=True,
    )
    rate, cpu_us = json.loads(output.stdout.strip().splitlines()[-1])
    return rate, cpu_us


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    grpc_port = free_port()
    server = subprocess.Popen(
        [*pin(1), sys.executable, __file__, "--child", "serve", str(grpc_port)]
    )
    http = Handler()
    try:
        time.sleep(2.0)  # the gRPC server's start
        loop_args = (str(args.calls), str(args.concurrency))
        rows: dict[str, list[tuple[float, float]]] = {
            "bare-grpc": [],
            "transport-grpc": [],
            "h1": [],
        }
        for _ in range(args.repeat):
            rows["bare-grpc"].append(run_child("bare-grpc", str(grpc_port), *loop_args))
            rows["transport-grpc"].append(run_child("transport-grpc", str(grpc_port), *loop_args))
            rows["h1"].append(run_child("h1", str(http.port), *loop_args))
    finally:
        server.terminate()
        server.wait()
        http.close()
    names = {
        "bare-grpc": "(1) bare grpc.aio unary calls",
        "transport-grpc": "(2) GrpcTransport.deliver",
        "h1": "(3) H1Transport.deliver (HTTP/1.1)",
    }
    print(f"\ngRPC client cost, {args.concurrency} calls in flight (median of {args.repeat})")
    for key, label in names.items():
        rates = sorted(rate for rate, _ in rows[key])
        cpus = sorted(cpu for _, cpu in rows[key])
        print(
            f"  {label:<38} {rates[len(rates) // 2]:>9,.0f} calls/s"
            f"  {cpus[len(cpus) // 2]:>6.1f} us CPU each"
            f"  (runs: {', '.join(f'{c:.1f}' for c in cpus)})"
        )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
        sys.exit(0)
    main()

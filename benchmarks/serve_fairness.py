"""Cheap requests under one heavy client (issue #28, point 3): `rag serve` latencies with and without a client that
keeps sending the heaviest request the default limits admit.

A server (the demo model by default, default limits, one model slot) runs on 127.0.0.1 in this process. A cheap
client sends, one after the other, ``--cheap`` requests alternating ``POST /retrieve`` (k=1) and a one-question greedy
``POST /generate``; its latencies are measured

1. with no other client (``idle``),
2. while a heavy client keeps one ``/generate`` of 16 questions x 20 passages x 8 beams x 64 new tokens in flight
   (``heavy``: fair turns, the server's default), and
3. optionally (``--fifo-baseline M``: M cheap requests) the same with fair turns off (``fairness_quantum=inf``: first
   come, first served between units — how the server behaved before, except that deadlines act between units).

The heavy client reconnects after each answer (a 504 at the 60 s deadline: such a request cannot finish in time on a
CPU); it is stopped by closing its connection, which stops its work at the next unit boundary. Every loop is bounded.
Prints p50 / p95 / max per phase and request kind, the heavy requests' outcomes, and the server's longest unit of model
work (the most a cheap request can wait for the model once it is first in line); ``--out`` writes them as JSON.

    python benchmarks/serve_fairness.py --cheap 40 --fifo-baseline 4 --out benchmarks/results/serve_fairness.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _proc import machine_info  # noqa: E402  (benchmarks/_proc.py)

ELEMENTS = ["iron", "oxygen", "gold", "neon", "carbon", "helium", "sodium", "copper", "silver", "tin", "lead", "zinc",
            "mercury", "argon", "nickel", "cobalt"]
HEAVY = {"questions": [f"what is the atomic weight of {e}?" for e in ELEMENTS], "n_docs": 20, "num_beams": 8,
         "max_new_tokens": 64}
CHEAP_QUESTIONS = ["who discovered oxygen?", "what is the atomic number of iron?", "what is the chemical symbol of tungsten?",
                   "which element is a noble gas used in signs?"]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


class HeavyClient:
    """Keeps one heavy /generate in flight over a raw socket (closing it is a disconnect the server acts on)."""

    def __init__(self, url: str):
        self.addr = urlsplit(url)
        self.stop = threading.Event()
        self.outcomes: list[tuple[int, float]] = []  # (status, seconds)
        self.sock = None
        self.thread = threading.Thread(target=self._loop, name="heavy-client", daemon=True)

    def _loop(self) -> None:
        body = json.dumps(HEAVY).encode()
        head = (f"POST /generate HTTP/1.1\r\nHost: {self.addr.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        while not self.stop.is_set():
            t0 = time.perf_counter()
            sock = socket.create_connection((self.addr.hostname, self.addr.port), timeout=0.5)
            self.sock = sock
            sock.sendall(head + body)
            data = b""
            while not self.stop.is_set():
                try:
                    chunk = sock.recv(65536)
                except socket.timeout:
                    continue
                if not chunk:
                    break
                data += chunk
            sock.close()
            if data:
                self.outcomes.append((int(data.split(b" ", 2)[1]), time.perf_counter() - t0))

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def cheap_run(client, n: int) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """`n` cheap requests, alternating /retrieve and a one-question greedy /generate; latencies (seconds, until the
    response, whatever its status) and statuses per kind."""
    lat: dict[str, list[float]] = {"retrieve": [], "generate": []}
    status: dict[str, list[int]] = {"retrieve": [], "generate": []}
    for i in range(n):
        q = CHEAP_QUESTIONS[i // 2 % len(CHEAP_QUESTIONS)]
        kind = "retrieve" if i % 2 == 0 else "generate"
        body = {"questions": [q], "k": 1} if kind == "retrieve" else {"questions": [q], "num_beams": 1}
        t0 = time.perf_counter()
        r = client.post(f"/{kind}", json=body)
        lat[kind].append(time.perf_counter() - t0)
        status[kind].append(r.status_code)
    return lat, status


def wait_running(client, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/health").json()["requests"]["running"] < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the heavy request never started")
        time.sleep(0.05)


def phase(pipe, name: str, n: int, heavy: bool, quantum: float) -> dict:
    import httpx

    from rag.serve.app import background_server, create_app
    from rag.serve.scheduler import DEFAULT_QUANTUM

    app = create_app(pipe, fairness_quantum=quantum if quantum else DEFAULT_QUANTUM)
    with background_server(app) as url, httpx.Client(base_url=url, timeout=300) as client:
        cheap_run(client, 2)  # warm-up: first-call costs are not what is measured (no heavy client yet)
        hc = None
        if heavy:
            hc = HeavyClient(url)
            hc.start()
            wait_running(client)
        try:
            lat, status = cheap_run(client, n)
        finally:
            if hc is not None:
                hc.close()
        health = client.get("/health").json()["requests"]
    result = {"phase": name, "heavy_client": heavy, "fairness_quantum": quantum or DEFAULT_QUANTUM,
              "kinds": {k: {"n": len(v), "p50": percentile(v, 0.5), "p95": percentile(v, 0.95), "max": max(v),
                            "mean": statistics.fmean(v), "not_200": sum(c != 200 for c in status[k])} for k, v in lat.items()
                        if v},
              "latencies": lat, "statuses": status, "server": health}
    if hc is not None:
        result["heavy_requests"] = [{"status": s, "seconds": round(t, 2)} for s, t in hc.outcomes]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="model to serve (default: the demo RAG model)")
    p.add_argument("--cheap", type=int, default=40, help="cheap requests per phase (alternating /retrieve and /generate)")
    p.add_argument("--fifo-baseline", type=int, default=0, metavar="M",
                   help="also run M cheap requests with fair turns off (each may wait for a heavy request's 60 s deadline)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    if args.cheap < 2 or args.fifo_baseline < 0:
        p.error("--cheap must be >= 2 and --fifo-baseline >= 0")
    import torch

    import rag

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    pipe = rag.load(args.model)
    phases = [phase(pipe, "idle", args.cheap, False, 0.0), phase(pipe, "heavy", args.cheap, True, 0.0)]
    if args.fifo_baseline:
        phases.append(phase(pipe, "heavy, first come first served", args.fifo_baseline, True, float("inf")))
    print(f"{'phase':<34}{'kind':<10}{'n':>4}{'p50 s':>9}{'p95 s':>9}{'max s':>9}{'not 200':>9}")
    for ph in phases:
        for kind, s in ph["kinds"].items():
            print(f"{ph['phase']:<34}{kind:<10}{s['n']:>4}{s['p50']:>9.3f}{s['p95']:>9.3f}{s['max']:>9.3f}{s['not_200']:>9}")
    for ph in phases:
        srv = ph["server"]
        extra = ""
        if "heavy_requests" in ph:
            extra = " heavy requests: " + ", ".join(f"{h['status']} in {h['seconds']} s"
                                                    for h in ph["heavy_requests"]) or " none finished"
        print(f"{ph['phase']}: longest unit of model work {srv['longest_unit_seconds']} s, {srv['handovers']} handovers,"
              f" {srv['timed_out']} timed out;{extra}")
    if args.out:
        from rag.utils.io import atomic_write_json

        atomic_write_json(args.out, {"machine": machine_info(torch.get_num_threads()), "command": " ".join(sys.argv),
                                     "model": args.model,
                                     "heavy_request": {k: v for k, v in HEAVY.items() if k != "questions"} | {
                                         "questions": len(HEAVY["questions"])}, "phases": phases})
    return 0


if __name__ == "__main__":
    sys.exit(main())

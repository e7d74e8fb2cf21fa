"""Load test of ``layerleap serve``: N clients send streamed chat completions without pause for a fixed
time on loopback, with the real ``openai`` client, at each client count given, and the run reports
errors, latency and time-to-first-token percentiles, tokens/s, the server's queue wait and memory
(docs/SERVING.md); ``--baseline`` runs each level against a one-request-at-a-time server too.

    python benchmarks/serve_load.py --clients 1,4,16,32 --seconds 30 --max-tokens 64 --baseline --json load.json

The server runs as a subprocess (``layerleap serve`` on a free 127.0.0.1 port, the given --method,
--dtype, --threads).  Every request streams, so the first token's time is measured too; each has a
timeout, and after the deadline clients finish the request they are in and stop: the run is bounded
by --seconds + --timeout.  Prompts are Spec-Bench first turns, cycled.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from layerleap.core.kernels import cpu_signature
from layerleap.datasets import spec_bench


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "layerleap",
        "serve",
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--method",
        args.method,
        "--port",
        str(port),
        "--threads",
        str(args.threads),
        "--max-batch",
        str(args.max_batch),
        "--max-running",
        str(args.max_running),
        "--no-access-log",
        *[a for o in args.opt or [] for a in ("--opt", o)],
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.load(r)["status"] == "ok":
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up in 300 s")


def client(url: str, model: str, prompts: list[str], first: int, args, deadline: float, out: list, lock) -> None:
    import openai

    c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=args.timeout)
    i = first
    while time.monotonic() < deadline:
        prompt = prompts[i % len(prompts)]
        i += args.clients
        t0 = time.perf_counter()
        rec = {"start": t0, "ok": False, "tokens": 0, "ttft_s": None}
        try:
            stream = c.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=args.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if rec["ttft_s"] is None and chunk.choices and chunk.choices[0].delta.content:
                    rec["ttft_s"] = time.perf_counter() - t0
                if chunk.usage is not None:
                    rec["tokens"] = chunk.usage.completion_tokens
            rec["ok"] = rec["tokens"] > 0
            if not rec["ok"]:
                rec["error"] = "no tokens"
        except Exception as e:  # noqa: BLE001  (every failure is counted, not raised)
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
        rec["latency_s"] = time.perf_counter() - t0
        with lock:
            out.append(rec)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def rss_mib(pid: int) -> dict:
    """The server's resident memory now and at its peak (MiB), from /proc."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out["rss_mib" if line.startswith("VmRSS") else "peak_rss_mib"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def queue_wait_p99(metrics: str) -> float | None:
    """The p99 queue wait from the server's histogram: the upper bound of the bucket that holds it."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = [
        (float(s.labels["le"]), s.value)
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "layerleap_queue_wait_seconds_bucket"
    ]
    total = max((v for _, v in buckets), default=0)
    return next((le for le, v in sorted(buckets) if v >= 0.99 * total), None) if total else None


def load_level(url: str, port: int, proc, prompts: list[str], clients: int, args) -> dict:
    """``clients`` clients for ``args.seconds``: the level's report."""
    records: list[dict] = []
    lock = threading.Lock()
    args.clients = clients
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    deadline = time.monotonic() + args.seconds
    threads = [
        threading.Thread(target=client, args=(url, args.model, prompts, k, args, deadline, records, lock))
        for k in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.seconds + args.timeout + 30)
    wall = time.perf_counter() - t0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    ok = [r for r in records if r["ok"]]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "clients": clients,
        "wall_s": wall,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": sorted({r.get("error", "") for r in records if not r["ok"]})[:5],
        **{f"latency_p{q}_s": percentile(lat, q) for q in (50, 95, 99)},
        "latency_mean_s": statistics.fmean(lat) if lat else None,
        **{f"ttft_p{q}_s": percentile(ttft, q) for q in (50, 95, 99)},
        "queue_wait_p99_s (server, cumulative)": queue_wait_p99(metrics),
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        **rss_mib(proc.pid),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--method", default="greedy")
    ap.add_argument("--opt", action="append", help="an option of --method (repeatable)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the server's torch threads")
    ap.add_argument("--clients", default="16", help="client counts, comma-separated: one level each (e.g. 1,4,16,32)")
    ap.add_argument("--seconds", type=float, default=120.0, help="per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=2)
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="also run every level against a server that answers "
        "one request at a time (--max-batch 1 --max-running 1 --no-continuous), interleaved",
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]

    prompts = [p.text for p in spec_bench(categories=["writing", "roleplay", "qa", "stem", "humanities"], n=20)]
    modes = {"server": []}
    if args.baseline:
        modes["one at a time"] = ["--max-batch", "1", "--max-running", "1", "--no-continuous"]
    report = {
        "command": " ".join(["python", "benchmarks/serve_load.py", *sys.argv[1:]]),
        "cpu": cpu_signature(),
        "cores": os.cpu_count(),
        "model": args.model,
        "dtype": args.dtype,
        "method": args.method,
        "options": args.opt or [],
        "server_threads": args.threads,
        "seconds": args.seconds,
        "max_tokens": args.max_tokens,
        "max_batch": args.max_batch,
        "max_running": args.max_running,
        "runs": [],
    }
    for clients in levels:  # the modes interleaved level by level: both see the same machine load
        for mode, extra in modes.items():
            port = free_port()
            proc = start_server(args, port, extra)
            try:
                run = load_level(f"http://127.0.0.1:{port}/v1", port, proc, prompts, clients, args)
            finally:
                proc.terminate()
                proc.wait(60)
            run["mode"] = mode
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
    if args.json:
        from layerleap.files import write_json

        write_json(args.json, report)


if __name__ == "__main__":
    main()

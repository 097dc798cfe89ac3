#!/usr/bin/env python3
"""Load generator for the HA drill: a webhook provider that retries (standard library only).

Sends `--rate` new webhooks per second to the gateway's ingest URL, each with a unique
delivery id in the `X-Delivery-Id` header (the source's dedupe key) and in the body.
Like a real provider, it retries a webhook until it gets a 2xx: after a non-2xx
answer, a refused or reset connection, or no answer within `--timeout`; the retry
delay grows from 0.25 s to at most 2 s (with jitter), much faster than a real
provider, so the drill sees the first moment the gateway accepts writes again.

Every attempt is recorded (start, end, status or error kind), and for every webhook
when it was first sent and when it was acknowledged. On SIGTERM (or after
`--max-seconds`) it stops creating webhooks, keeps retrying the unacknowledged ones
for up to `--finish-seconds`, writes everything to `--out` (JSON) and exits.

    loadgen.py --target 127.0.0.1:18080 --path /ingest/drill --rate 150 --out load.json
"""

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import time

# First bytes of a few answers per status, so a 500's message reaches the report.
SAMPLES_PER_STATUS = 5


class Stats:
    def __init__(self):
        self.webhooks = {}        # id -> {"first", "acked", "attempts", "dup_ack"}
        self.attempts = []        # [start, end, status] per attempt
        self.samples = collections.defaultdict(list)
        self.window = collections.Counter()   # statuses since the last progress line


async def post_once(host, port, path, delivery_id, body, timeout):
    """One attempt on a fresh connection. Returns (status, text): status is the HTTP
    status as a string, or an error kind (conn_refused, conn_reset, timeout, ...)."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        head = (
            f"POST {path} HTTP/1.1\r\n"
            f"Host: {host}:{port}\r\n"
            "Content-Type: application/json\r\n"
            f"X-Delivery-Id: {delivery_id}\r\n"
            "X-Event-Type: drill.tick\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        writer.write(head + body)
        await writer.drain()

        async def read_answer():
            status_line = await reader.readline()
            if not status_line:
                return "conn_closed", ""
            parts = status_line.split()
            status = parts[1].decode() if len(parts) > 1 else "bad_status_line"
            length = None
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            data = await (reader.readexactly(length) if length is not None else reader.read())
            return status, data.decode("utf-8", "replace")

        return await asyncio.wait_for(read_answer(), timeout)
    except asyncio.TimeoutError:
        return "timeout", ""
    except ConnectionRefusedError:
        return "conn_refused", ""
    except (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError):
        return "conn_reset", ""
    except OSError as e:
        return f"os_error_{e.errno}", str(e)
    finally:
        if writer is not None:
            writer.close()


async def send_webhook(args, stats, sem, n, stop_retrying):
    delivery_id = f"{args.run_id}-{n:07d}"
    body = json.dumps({"delivery_id": delivery_id, "n": n, "sent_at": time.time()}).encode()
    rec = {"first": time.time(), "acked": None, "attempts": 0, "dup_ack": False}
    stats.webhooks[delivery_id] = rec
    host, port = args.target.rsplit(":", 1)
    attempt = 0
    while True:
        attempt += 1
        async with sem:
            start = time.time()
            status, text = await post_once(host, int(port), args.path, delivery_id, body, args.timeout)
            end = time.time()
        rec["attempts"] = attempt
        stats.attempts.append([round(start, 4), round(end, 4), status])
        stats.window[status] += 1
        if not status.startswith("2") and len(stats.samples[status]) < SAMPLES_PER_STATUS:
            stats.samples[status].append({"t": end, "id": delivery_id, "body": text[:300]})
        if status.startswith("2"):
            rec["acked"] = end
            rec["dup_ack"] = '"duplicate":true' in text.replace(" ", "")
            return
        if stop_retrying.is_set():
            return
        delay = min(2.0, 0.25 * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        try:
            await asyncio.wait_for(stop_retrying.wait(), delay)
            return
        except asyncio.TimeoutError:
            pass


async def progress(stats, interval):
    while True:
        await asyncio.sleep(interval)
        acked = sum(1 for r in stats.webhooks.values() if r["acked"] is not None)
        window = ", ".join(f"{k}:{v}" for k, v in sorted(stats.window.items())) or "none"
        stats.window.clear()
        print(f"  load: {len(stats.webhooks)} sent, {acked} acknowledged, "
              f"{len(stats.webhooks) - acked} waiting; answers last {interval:.0f}s: {window}",
              file=sys.stderr, flush=True)


async def run(args):
    stats = Stats()
    sem = asyncio.Semaphore(args.concurrency)
    stop_new = asyncio.Event()
    stop_retrying = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop_new.set)
    loop.add_signal_handler(signal.SIGINT, stop_new.set)

    reporter = asyncio.create_task(progress(stats, args.progress_seconds))
    tasks = set()
    started = time.time()
    deadline = started + args.max_seconds
    n = 0
    next_at = time.monotonic()
    # Open loop: a webhook every 1/rate seconds whatever the gateway does, as providers
    # do; when the loop falls behind it catches up in a burst.
    while not stop_new.is_set() and time.time() < deadline:
        n += 1
        task = asyncio.create_task(send_webhook(args, stats, sem, n, stop_retrying))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += 1.0 / args.rate
        delay = next_at - time.monotonic()
        if delay > 0:
            try:
                await asyncio.wait_for(stop_new.wait(), delay)
            except asyncio.TimeoutError:
                pass
    stopped = time.time()
    print(f"  load: stopped creating webhooks after {n}; retrying the unacknowledged "
          f"for up to {args.finish_seconds:.0f}s", file=sys.stderr, flush=True)
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=args.finish_seconds)
        if pending:
            stop_retrying.set()
            await asyncio.wait(pending, timeout=args.timeout + 1)
    reporter.cancel()

    out = {
        "run_id": args.run_id,
        "rate": args.rate,
        "started": started,
        "stopped": stopped,
        "finished": time.time(),
        "webhooks": stats.webhooks,
        "attempts": stats.attempts,
        "samples": stats.samples,
    }
    with open(args.out + ".tmp", "w", encoding="utf-8") as f:
        json.dump(out, f, separators=(",", ":"))
    os.replace(args.out + ".tmp", args.out)
    acked = sum(1 for r in stats.webhooks.values() if r["acked"] is not None)
    print(f"  load: done, {n} sent, {acked} acknowledged; results in {args.out}", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="gateway host:port")
    ap.add_argument("--path", required=True, help="ingest path, e.g. /ingest/drill")
    ap.add_argument("--rate", type=float, default=150.0, help="new webhooks per second")
    ap.add_argument("--out", required=True, help="results file (JSON)")
    ap.add_argument("--run-id", default=f"drill{int(time.time())}", help="prefix of every delivery id")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds an attempt may take")
    ap.add_argument("--concurrency", type=int, default=512, help="attempts in flight at most")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop creating webhooks after this")
    ap.add_argument("--finish-seconds", type=float, default=60.0,
                    help="after the stop, how long unacknowledged webhooks are still retried")
    ap.add_argument("--progress-seconds", type=float, default=5.0)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()

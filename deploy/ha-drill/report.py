#!/usr/bin/env python3
"""Drain check and summary for the HA drill (standard library only).

1. Drain: waits until every webhook the load generator saw acknowledged has reached
   the sink and the gateway has no pending delivery left (so late duplicates, e.g. a
   delivery re-sent when its lease ran out, are counted too), or `--drain-seconds`
   pass.
2. Prints the summary as a Markdown table, and the details behind any failure.
3. Exit status: 3 if an acknowledged webhook was never delivered (lost), any answer
   was a 500, or a webhook was stored twice (two different webhook-ids for one
   delivery id: the dedupe broke); 0 otherwise. Deliveries repeated under one
   Idempotency-Key are counted, not failed: delivery is at least once. (A crash
   of this script exits 1.)

Inputs: the load generator's JSON, the sink's JSON lines, and the drill's timeline
(`name<TAB>unix time` lines written by `run`: switchover_start, failover_start, ...).
"""

import argparse
import collections
import json
import sys
import time
import urllib.request


def load_sink(path):
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n"):
                    rows.append(json.loads(line))
    except FileNotFoundError:
        pass
    return rows


def load_timeline(path):
    marks = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            name, _, value = line.strip().partition("\t")
            if value:
                marks[name] = float(value)
    return marks


def pending_deliveries(gateway, token):
    """How many deliveries the gateway still has pending (None if it cannot say)."""
    req = urllib.request.Request(f"{gateway}/v1/deliveries?status=pending&limit=1000",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return len(json.load(r)["data"])
    except Exception:  # noqa: BLE001 - a drain check must not die on a hiccup
        return None


def drain(acked_ids, args):
    start = time.time()
    last_note = 0.0
    while True:
        delivered = {r["delivery_id"] for r in load_sink(args.sink)}
        missing = acked_ids - delivered
        pending = pending_deliveries(args.gateway, args.token) if args.gateway else 0
        waited = time.time() - start
        if not missing and pending == 0:
            print(f"  drain: all {len(acked_ids)} acknowledged webhooks delivered, "
                  f"nothing pending ({waited:.1f}s)", file=sys.stderr, flush=True)
            return waited, True
        if waited > args.drain_seconds:
            print(f"  drain: TIMEOUT after {args.drain_seconds:.0f}s: {len(missing)} acknowledged "
                  f"webhooks not delivered, {pending} deliveries pending", file=sys.stderr, flush=True)
            return waited, False
        if waited - last_note >= 5:
            last_note = waited
            print(f"  drain: {len(missing)} acknowledged webhooks not delivered yet, "
                  f"{pending} deliveries pending ({waited:.0f}s)", file=sys.stderr, flush=True)
        time.sleep(1)


def longest_gap(times, lo, hi):
    """Longest span between two consecutive events (acknowledgements, or deliveries)
    whose middle falls in [lo, hi): (seconds, gap start). A gap belongs to the phase
    it mostly lies in, even when it began a moment before that phase's fault."""
    best, best_at = 0.0, None
    for a, b in zip(times, times[1:]):
        if lo <= (a + b) / 2 < hi and b - a > best:
            best, best_at = b - a, a
    return best, best_at


def fmt_statuses(counter):
    if not counter:
        return "none"
    def key(item):
        k = item[0]
        return (0, int(k)) if k.isdigit() else (1, k)
    return ", ".join(f"{k}: {v}" for k, v in sorted(counter.items(), key=key))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", required=True)
    ap.add_argument("--sink", required=True)
    ap.add_argument("--timeline", required=True)
    ap.add_argument("--gateway", help="gateway base URL, to wait for its pending deliveries")
    ap.add_argument("--token", help="admin token for --gateway")
    ap.add_argument("--drain-seconds", type=float, default=120.0)
    args = ap.parse_args()

    with open(args.load, encoding="utf-8") as f:
        load = json.load(f)
    marks = load_timeline(args.timeline)
    webhooks = load["webhooks"]
    acked_ids = {i for i, r in webhooks.items() if r["acked"] is not None}

    drain_secs, drained = drain(acked_ids, args)

    rows = load_sink(args.sink)
    per_key = collections.Counter(r["key"] for r in rows)
    keys_per_id = collections.defaultdict(set)
    for r in rows:
        keys_per_id[r["delivery_id"]].add(r["key"])
    delivered = set(keys_per_id)
    lost = sorted(acked_ids - delivered)
    duplicated_keys = {k: n for k, n in per_key.items() if n > 1}
    stored_twice = {i: ks for i, ks in keys_per_id.items() if len(ks) > 1}
    unknown = delivered - set(webhooks)
    never_acked = [i for i, r in webhooks.items() if r["acked"] is None]
    dup_acks = sum(1 for r in webhooks.values() if r["dup_ack"])
    unacked_delivered = [i for i in never_acked if i in delivered]

    attempts = load["attempts"]
    ack_times = sorted(r["acked"] for r in webhooks.values() if r["acked"] is not None)

    # Phase windows: each runs from its fault to the next phase (or the load's end),
    # so whatever the fault caused, however late, is counted in its column.
    end_of_load = load["stopped"]
    phases = []
    if "switchover_start" in marks:
        phases.append(("switchover", marks["switchover_start"],
                       marks.get("failover_start", end_of_load)))
    if "failover_start" in marks:
        phases.append(("failover", marks["failover_start"], end_of_load))

    def statuses_between(lo, hi):
        return collections.Counter(s for (t0, _t1, s) in attempts if lo <= t0 < hi)

    def sent_between(lo, hi):
        return sum(1 for r in webhooks.values() if lo <= r["first"] < hi)

    def acked_between(lo, hi):
        return sum(1 for t in ack_times if lo <= t < hi)

    whole = collections.Counter(s for (_t0, _t1, s) in attempts)
    n500 = whole.get("500", 0)

    cols = ["whole run"] + [name for name, _, _ in phases]
    table = []
    table.append(["webhooks sent (new ids)", str(len(webhooks))]
                 + [str(sent_between(lo, hi)) for _, lo, hi in phases])
    table.append(["acknowledged (2xx)", str(len(acked_ids))]
                 + [str(acked_between(lo, hi)) for _, lo, hi in phases])
    table.append(["never acknowledged (gave up)", str(len(never_acked))] + ["" for _ in phases])
    table.append(["acknowledged as `duplicate: true`", str(dup_acks)] + ["" for _ in phases])
    table.append(["**lost** (acknowledged, never delivered)", f"**{len(lost)}**"] + ["" for _ in phases])
    table.append(["delivered more than once (by Idempotency-Key)",
                  f"{len(duplicated_keys)} keys, {sum(duplicated_keys.values()) - len(duplicated_keys)} extra requests"]
                 + ["" for _ in phases])
    table.append(["stored twice (2+ webhook-ids for one delivery id)", str(len(stored_twice))]
                 + ["" for _ in phases])
    table.append(["ingest answers by status", fmt_statuses(whole)]
                 + [fmt_statuses(statuses_between(lo, hi)) for _, lo, hi in phases])
    table.append(["**500 answers**", f"**{n500}**"]
                 + [str(statuses_between(lo, hi).get("500", 0)) for _, lo, hi in phases])
    gaps = []
    for name, lo, hi in [("whole run", load["started"], end_of_load)] + phases:
        gap, at = longest_gap(ack_times, lo, hi)
        where = "" if at is None or name == "whole run" else f" (from fault {round(at - lo, 1) + 0.0:+.1f} s)"
        gaps.append(f"**{gap:.2f} s**{where}")
    table.append(["longest unavailability (no ingest acknowledged)"] + gaps)

    def since_fault(key, lo):
        return f"{marks[key] - lo:.1f} s" if key in marks else "n/a"
    delivery_times = sorted(r["t"] for r in rows)
    pauses = []
    for name, lo, hi in [("whole run", load["started"], end_of_load)] + phases:
        gap, at = longest_gap(delivery_times, lo, hi)
        where = "" if at is None or name == "whole run" else f" (from fault {round(at - lo, 1) + 0.0:+.1f} s)"
        pauses.append(f"{gap:.2f} s{where}")
    table.append(["longest delivery pause (nothing reached the sink)"] + pauses)
    table.append(["new primary takes writes through HAProxy after", ""]
                 + [since_fault(f"{name}_writable", lo) for name, lo, _ in phases])
    table.append(["both nodes back, with a sync standby, after", ""]
                 + [since_fault(f"{name}_settled", lo) for name, lo, _ in phases])

    out = []
    out.append("| | " + " | ".join(cols) + " |")
    out.append("| --- | " + " | ".join("---" for _ in cols) + " |")
    for row in table:
        out.append("| " + " | ".join(row) + " |")

    print()
    print(f"### HA drill summary (load {load['rate']:.0f} webhooks/s for "
          f"{end_of_load - load['started']:.0f} s; drain {drain_secs:.1f} s"
          f"{'' if drained else ', TIMED OUT'})")
    print()
    print("\n".join(out))
    print()
    def when(t):
        inside = [(name, lo) for name, lo, hi in phases if lo <= t < hi]
        return f"{inside[0][0]} +{t - inside[0][1]:.2f} s" if inside else "outside the faults"
    if n500:
        print("500 answers (first few bodies):")
        for s in load["samples"].get("500", []):
            print(f"  {when(s['t'])}  {s['id']}: {s['body']}")
    if lost:
        print(f"lost ids (first 20 of {len(lost)}): {', '.join(lost[:20])}")
    if stored_twice:
        sample = list(stored_twice.items())[:10]
        print(f"stored twice (first 10 of {len(stored_twice)}): {sample}")
    if unknown:
        print(f"deliveries for ids never sent: {len(unknown)}")
    if unacked_delivered:
        print(f"never acknowledged but delivered (fine: stored, the answer was lost): {len(unacked_delivered)}")
    for status, samples in sorted(load["samples"].items()):
        if status != "500" and samples:
            print(f"first {status} answer ({when(samples[0]['t'])}): {samples[0]['body'][:240]}")

    failed = bool(lost) or n500 > 0 or bool(stored_twice)
    print()
    print("RESULT: " + ("FAIL (" + ", ".join(
        x for x, bad in (("lost webhooks", lost), ("500 answers", n500), ("stored twice", stored_twice)) if bad
    ) + ")" if failed else "PASS (nothing acknowledged was lost, no 500)"))
    sys.exit(3 if failed else 0)


if __name__ == "__main__":
    main()

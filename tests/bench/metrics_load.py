"""The load side of tests/bench/metrics_load.sh (a benchmark, not a test).

Against `regrade watch --dry-run` with `[metrics] listen` on loopback, for a calm
phase and then a load phase: IDLE connections that open and send nothing, SLOW ones
that send a request head one byte a second (each reopened a second after the server
closes it, so the load stays), one scrape of /metrics a second, and a /healthz probe
every 100 ms on a new connection. watch's samples are timed by the STATUS= datagram
it sends on NOTIFY_SOCKET at each sample (this script binds that socket). The load
runs in a process of its own, apart from the probes and the scraper, as a real prober
is apart from whoever floods the port: a probe's latency is then the server's, not
the load's own event loop's. Prints the figures; judges nothing but says whether each
target was met.

    python3 metrics_load.py PORT NOTIFY_SOCKET PID CALM_SECS LOAD_SECS PERIOD_SECS
"""

import asyncio
import multiprocessing
import os
import socket
import sys
import time

PORT = int(sys.argv[1])
NOTIFY = sys.argv[2]
PID = int(sys.argv[3])
CALM = float(sys.argv[4])
LOAD = float(sys.argv[5])
PERIOD = float(sys.argv[6])
IDLE = int(os.environ.get("REGRADE_BENCH_IDLE", "1000"))
SLOW = int(os.environ.get("REGRADE_BENCH_SLOW", "200"))
HOST = "127.0.0.1"

phase = "warm-up"
samples = []  # (phase, monotonic time) of each STATUS datagram
probes = {"calm": [], "load": []}  # latency in seconds, None for a failed probe
failures = {"calm": {}, "load": {}}  # why probes failed: count by kind
scrapes = {"calm": [0, 0], "load": [0, 0]}  # ok, total
rss = {"calm": [], "load": []}  # kB
held = {"idle_open": 0, "slow_open": 0, "closed_by_server": 0, "refused": 0}
stop = asyncio.Event()


def vmrss():
    with open(f"/proc/{PID}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def held_open(send_slowly: bool):
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    key = "slow_open" if send_slowly else "idle_open"
    while not stop.is_set():
        try:
            r, w = await asyncio.open_connection(HOST, PORT)
        except OSError:
            held["refused"] += 1
            await asyncio.sleep(1)
            continue
        held[key] += 1
        try:
            if send_slowly:
                i = 0
                while not stop.is_set() and not r.at_eof():
                    w.write(head[i % len(head) : i % len(head) + 1])
                    await w.drain()
                    i += 1
                    try:
                        if await asyncio.wait_for(r.read(65536), 1.0) == b"":
                            break
                    except asyncio.TimeoutError:
                        pass
            else:
                while not stop.is_set():
                    try:
                        if await asyncio.wait_for(r.read(65536), 1.0) == b"":
                            break
                    except asyncio.TimeoutError:
                        pass
        except OSError:
            pass
        finally:
            held[key] -= 1
            w.close()
        if not stop.is_set():
            held["closed_by_server"] += 1
            await asyncio.sleep(1)


def load_process(go, end, out):
    """The idle and slow clients, in a process of their own: started on `go`, stopped
    on `end`; sends the counts of `held` at the end through `out`."""
    go.wait()

    async def run():
        loaders = [asyncio.create_task(held_open(False)) for _ in range(IDLE)]
        loaders += [asyncio.create_task(held_open(True)) for _ in range(SLOW)]
        while not end.is_set():
            await asyncio.sleep(0.1)
        peak = dict(held)
        stop.set()
        await asyncio.gather(*loaders, return_exceptions=True)
        out.send(peak)

    asyncio.run(run())


async def get(path: str, timeout: float):
    """One request on a new connection; returns (status line, body) or raises."""

    async def go():
        r, w = await asyncio.open_connection(HOST, PORT)
        try:
            w.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            data = await r.read(-1)
        finally:
            w.close()
        head, _, body = data.partition(b"\r\n\r\n")
        return head.split(b"\r\n", 1)[0].decode(errors="replace"), body

    return await asyncio.wait_for(go(), timeout)


async def prober():
    while not stop.is_set():
        p = phase
        t0 = time.monotonic()
        why = None
        try:
            status, _ = await get("/healthz", 1.0)
            why = None if " 200 " in status + " " else (status or "closed without an answer")
        except asyncio.TimeoutError:
            why = "no answer within 1 s"
        except OSError as e:
            why = type(e).__name__
        took = None if why else time.monotonic() - t0
        if why and p in failures:
            failures[p][why] = failures[p].get(why, 0) + 1
        if p in probes:
            probes[p].append(took)
        await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))


async def scraper():
    while not stop.is_set():
        p = phase
        t0 = time.monotonic()
        try:
            status, body = await get("/metrics", 5.0)
            ok = " 200 " in status + " " and b'regrade_level{level="full"} 1\n' in body and body.endswith(b"\n")
        except (OSError, asyncio.TimeoutError):
            ok = False
        if p in scrapes:
            scrapes[p][0] += int(ok)
            scrapes[p][1] += 1
        if p in rss:
            rss[p].append(vmrss())
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))


def on_datagram(sock):
    while True:
        try:
            d = sock.recv(512)
        except BlockingIOError:
            return
        if d.startswith(b"STATUS="):
            samples.append((phase, time.monotonic()))


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def report(p):
    lat = [x for x in probes[p] if x is not None]
    failed = len(probes[p]) - len(lat)
    ms = lambda x: x * 1000
    within = failed == 0 and lat and max(lat) <= 0.1
    why = ", ".join(f"{k}: {v}" for k, v in sorted(failures[p].items()))
    print(
        f"  /healthz probes: {len(probes[p])}, failed {failed}{f' ({why})' if why else ''}; latency max {ms(max(lat or [0])):.1f} ms, "
        f"p99 {ms(pct(lat, 0.99)):.1f} ms, p50 {ms(pct(lat, 0.5)):.1f} ms; each within 100 ms: "
        f"{'yes' if within else 'NO'}"
    )
    ok, total = scrapes[p]
    print(f"  /metrics scrapes complete: {ok}/{total}")
    t = [at for ph, at in samples if ph == p]
    gaps = [b - a for a, b in zip(t, t[1:])]
    late = [g for g in gaps if g > PERIOD * 1.2]
    print(
        f"  watch's samples: {len(t)} (period {PERIOD:g} s), longest gap {max(gaps or [0]):.3f} s, "
        f"late (gap > 1.2 periods): {len(late)}; on time: {'yes' if t and not late else 'NO'}"
    )
    r = rss[p]
    if r:
        print(f"  VmRSS: {min(r) / 1024:.2f}..{max(r) / 1024:.2f} MiB")
    return within, ok == total, bool(t) and not late


async def main():
    global phase
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(NOTIFY)
    sock.setblocking(False)
    asyncio.get_running_loop().add_reader(sock, on_datagram, sock)
    # watch started first; its STATUS datagrams went nowhere until now.
    t0 = time.monotonic()
    while True:
        try:
            await get("/healthz", 1.0)
            break
        except (OSError, asyncio.TimeoutError):
            if time.monotonic() - t0 > 30:
                print("metrics_load: the listener never answered", file=sys.stderr)
                sys.exit(1)
            await asyncio.sleep(0.2)
    tasks = [asyncio.create_task(prober()), asyncio.create_task(scraper())]
    await asyncio.sleep(2)
    phase = "calm"
    await asyncio.sleep(CALM)
    phase = "load"
    LOAD_GO.set()
    await asyncio.sleep(LOAD)
    phase = "done"
    LOAD_END.set()
    peak = await asyncio.get_running_loop().run_in_executor(None, LOAD_OUT[0].recv)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)

    print(f"metrics listener under load, loopback, {IDLE} idle + {SLOW} slow clients, a scrape a second, "
          f"a /healthz probe every 100 ms (calm {CALM:g} s, then load {LOAD:g} s)")
    print("calm (scraper and probes only):")
    report("calm")
    print(f"load: at the end {peak['idle_open']} idle and {peak['slow_open']} slow connections open; "
          f"{peak['closed_by_server']} closed by the server (and reopened), {peak['refused']} connects failed")
    h, s, on_time = report("load")
    calm_rss, load_rss = rss["calm"], rss["load"]
    if calm_rss and load_rss:
        d = (max(load_rss) - max(calm_rss)) / 1024
        print(f"VmRSS under load: peak {max(load_rss) / 1024:.2f} MiB vs calm {max(calm_rss) / 1024:.2f} MiB: "
              f"{d:+.2f} MiB (target within 1 MiB: {'met' if d <= 1 else 'MISSED'})")
    print(f"targets: /healthz within 100 ms {'met' if h else 'MISSED'}, scrapes complete {'met' if s else 'MISSED'}, "
          f"samples on time {'met' if on_time else 'MISSED'}")


# Forked before any event loop exists; it waits for LOAD_GO.
fork = multiprocessing.get_context("fork")
LOAD_GO, LOAD_END = fork.Event(), fork.Event()
LOAD_OUT = fork.Pipe(duplex=False)
loader = fork.Process(target=load_process, args=(LOAD_GO, LOAD_END, LOAD_OUT[1]), daemon=True)
loader.start()
asyncio.run(main())
loader.join(10)

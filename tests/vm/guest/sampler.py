# TEST CODE (tests/vm/guest/vm-sampler.service): once a second, one line to the host
# over the virtio-serial port given as argv[1]:
#   S t=<guest unix time> psi=<some avg10> full=<full avg10> avail=<MemAvailable kB>
#     k3s=<some>/<full>/<memory.current kB> pods=<some>/<full>/<memory.current kB>
#     k3sio=<some>/<full> k3scpu=<some>/<full> cpu=<k3s>/<pods>/<busy>
#     procs=<k3s>/<apiserver>/<kswapd> etcd=<1|0>
# PSI from /proc/pressure/memory (the guest's), k3s.service's and kubepods.slice's
# memory.pressure (cgroup v2), and k3s.service's io.pressure and cpu.pressure (what
# its member waits on besides memory); cpu: the share of all the guest's CPUs, in %,
# used since the last line by k3s.service and kubepods.slice (their cpu.stat
# usage_usec) and by everything (/proc/stat less idle and iowait: kswapd, the other
# units, interrupts too), "-" on the first line; procs: the same shares split within
# k3s.service between the k3s process (etcd embedded) and its kube-apiserver, and the
# kernel's kswapd threads' (the host's own reclaim, in no unit); etcd: server1's /health on 127.0.0.1:2381
# answered "true" within 0.8 s. A cgroup not there (yet) reads "-".
# Beside it, server1's etcd member for tests/testsuite/incident/member.rs: every 250 ms
#   H t=<guest unix time> ok=<1|0>       its /health answered "true" within 0.8 s
# and every 2 s its metrics listener's histograms and counters the table uses:
#   M <metric lines, tab-separated>
import os, sys, threading, time, urllib.request

CG = "/sys/fs/cgroup/"

def avg10(path):
    try:
        with open(path) as f:
            some, full = f.read().splitlines()[:2]
        return some.split()[1][6:], full.split()[1][6:]
    except (OSError, IndexError, ValueError):
        return "-", "-"

def current_kb(path):
    try:
        with open(path) as f:
            return str(int(f.read()) >> 10)
    except (OSError, ValueError):
        return "-"

def avail_kb():
    with open("/proc/meminfo") as f:
        for l in f:
            if l.startswith("MemAvailable:"):
                return l.split()[1]
    return "-"

def get(path):
    try:
        with urllib.request.urlopen("http://127.0.0.1:2381" + path, timeout=0.8) as r:
            return r.read()
    except Exception:
        return None

def etcd():
    body = get("/health")
    return "1" if body is not None and b'"health":"true"' in body else "0"

MEMBER_SERIES = (b"etcd_disk_wal_fsync_duration_seconds_bucket", b"etcd_disk_backend_commit_duration_seconds_bucket",
                 b"etcd_server_heartbeat_send_failures_total", b"etcd_server_slow_apply_total")

def cgroup(name):
    s, f = avg10(CG + name + "/memory.pressure")
    return "%s/%s/%s" % (s, f, current_kb(CG + name + "/memory.current"))

def usage_usec(name):
    try:
        with open(CG + name + "/cpu.stat") as f:
            return int(f.readline().split()[1])
    except (OSError, IndexError, ValueError):
        return None

def busy_total_usec():
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) * 1e6 / hz, sum(ticks) * 1e6 / hz

def kswapd_pids():
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/comm" % pid) as f:
                if f.read().startswith("kswapd"):
                    pids.append(pid)
        except OSError:
            pass
    return pids

KSWAPD = kswapd_pids()

def procs_usec(cgroup):
    """{pid: (comm, utime+stime in usec)} of the cgroup's processes and of kswapd."""
    try:
        with open(CG + cgroup + "/cgroup.procs") as f:
            pids = f.read().split()
    except OSError:
        pids = []
    out = {}
    hz = os.sysconf("SC_CLK_TCK")
    for pid in pids + KSWAPD:
        try:
            with open("/proc/%s/stat" % pid) as f:
                stat = f.read()
        except OSError:
            continue
        comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[pid] = (comm, (int(fields[11]) + int(fields[12])) * 1e6 / hz)
    return out

class CpuShares:
    def __init__(self):
        self.last = None

    def line(self, k3s):
        now = (usage_usec(k3s), usage_usec("kubepods.slice"), *busy_total_usec(), procs_usec(k3s))
        last, self.last = self.last, now
        if last is None or now[3] <= last[3]:
            return "-/-/- procs=-/-/-"
        total = now[3] - last[3]
        share = lambda a, b: "-" if a is None or b is None else "%.1f" % (100.0 * (a - b) / total)
        # Only processes there at both readings: a new one's whole past is not this second's.
        by = {"apiserver": 0.0, "k3s": 0.0, "kswapd": 0.0}
        for pid, (comm, used) in now[4].items():
            if pid in last[4]:
                who = "kswapd" if pid in KSWAPD else "apiserver" if comm.startswith("kube-apiserver") else "k3s"
                by[who] += used - last[4][pid][1]
        return "%s/%s/%s procs=%s" % (share(now[0], last[0]), share(now[1], last[1]), share(now[2], last[2]),
                                      "/".join("%.1f" % (100.0 * by[w] / total) for w in ("k3s", "apiserver", "kswapd")))

try:
    out = open(sys.argv[1], "w", buffering=1)
except OSError:
    out = sys.stdout
lock = threading.Lock()

def say(line):
    with lock:
        out.write(line + "\n")

def member():
    last_metrics = 0.0
    while True:
        t0 = time.time()
        say("H t=%.3f ok=%s" % (t0, etcd()))
        if t0 - last_metrics >= 2.0:
            last_metrics = t0
            body = get("/metrics")
            if body is not None:
                kept = [l for l in body.splitlines() if l.startswith(MEMBER_SERIES)]
                say("M " + "\t".join(l.decode() for l in kept))
        time.sleep(max(0.01, t0 + 0.25 - time.time()))

threading.Thread(target=member, daemon=True).start()
cpu = CpuShares()
while True:
    t0 = time.time()
    s, f = avg10("/proc/pressure/memory")
    k3s = "system.slice/k3s.service"
    line = "S t=%.3f psi=%s full=%s avail=%s k3s=%s pods=%s k3sio=%s/%s k3scpu=%s/%s cpu=%s etcd=%s" % (
        t0, s, f, avail_kb(), cgroup(k3s), cgroup("kubepods.slice"), *avg10(CG + k3s + "/io.pressure"),
        *avg10(CG + k3s + "/cpu.pressure"), cpu.line(k3s), etcd())
    say(line)
    time.sleep(max(0.05, t0 + 1.0 - time.time()))

# TEST CODE (tests/vm/guest/vm-sampler.service): once a second, one line to the host
# over the virtio-serial port given as argv[1]:
#   S t=<guest unix time> psi=<some avg10> full=<full avg10> avail=<MemAvailable kB>
#     k3s=<some>/<full>/<memory.current kB> pods=<some>/<full>/<memory.current kB> etcd=<1|0>
# PSI from /proc/pressure/memory (the guest's), k3s.service's and kubepods.slice's
# memory.pressure (cgroup v2); etcd: server1's /health on 127.0.0.1:2381 answered
# "true" within 0.8 s. A cgroup not there (yet) reads "-".
import sys, time, urllib.request

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

def etcd():
    try:
        with urllib.request.urlopen("http://127.0.0.1:2381/health", timeout=0.8) as r:
            return "1" if b'"health":"true"' in r.read() else "0"
    except Exception:
        return "0"

def cgroup(name):
    s, f = avg10(CG + name + "/memory.pressure")
    return "%s/%s/%s" % (s, f, current_kb(CG + name + "/memory.current"))

try:
    out = open(sys.argv[1], "w", buffering=1)
except OSError:
    out = sys.stdout
while True:
    t0 = time.time()
    s, f = avg10("/proc/pressure/memory")
    line = "S t=%.3f psi=%s full=%s avail=%s k3s=%s pods=%s etcd=%s" % (
        t0, s, f, avail_kb(), cgroup("system.slice/k3s.service"), cgroup("kubepods.slice"), etcd())
    out.write(line + "\n")
    time.sleep(max(0.05, t0 + 1.0 - time.time()))

# TEST CODE: the workload process of tests/testsuite/incident_real_pressure.rs, run by the
# kubelet stand-in (--exec-node server1) in server1's memory cgroup.
#   hog.py FILE INITIAL_MIB GROW_MIB_PER_S CAP_MIB
# Allocates INITIAL_MIB of anonymous memory (touched), then GROW_MIB_PER_S more every
# second up to CAP_MIB, and holds it until killed; meanwhile it and seven reader processes read random 4 KiB pages
# of FILE through mmap, as a workload reading its data would. Readers end when the
# allocating parent is gone (e.g. OOM-killed).
import mmap, os, random, sys, time

path, initial, rate, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
f = open(path, "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
pages = len(m) // 4096
parent = os.getpid()
for _ in range(7):
    if os.fork() == 0:
        while os.getppid() == parent:
            for _ in range(64):
                m[random.randrange(pages) * 4096]
        os._exit(0)
chunks = []
held = 0
def grow(mib):
    global held
    mib = min(mib, cap - held)
    if mib > 0:
        chunks.append(bytearray(b"\x01") * (mib << 20))
        held += mib
grow(initial)
print("hog: %d MiB allocated, growing %d MiB/s" % (initial, rate), flush=True)
while True:
    t = time.monotonic() + 0.25
    grow(max(1, rate // 4))
    while time.monotonic() < t:
        m[random.randrange(pages) * 4096]

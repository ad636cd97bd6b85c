//! `watch` allocates nothing per sample (issue 2): on a thrashing host the watcher must
//! not need memory to notice it. A counting global allocator checks the steady state of
//! the per-sample work (`Ticker::tick`: pread both files, parse, classify, update the
//! core, STATUS and WATCHDOG to systemd, the metrics registry), with the metrics
//! listener serving scrapes meanwhile, as `watch` does with `[metrics] listen` set.
//! Then the same with `pressure.memory_cgroup` (a v1 and a v2 cgroup's files), whose
//! sample reads three more files instead of /proc/meminfo.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use regrade::config::Config;
use regrade::level::Level;
use regrade::pressure::Sampler;
use regrade::watch::{Mode, Ticker};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

#[test]
fn a_calm_sample_allocates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (psi, mem, state) = (dir.path().join("psi"), dir.path().join("meminfo"), dir.path().join("state.json"));
    std::fs::write(
        &psi,
        "some avg10=1.00 avg60=1.00 avg300=1.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    )
    .unwrap();
    std::fs::write(&mem, "MemTotal: 24000000 kB\nMemFree: 1000 kB\nMemAvailable: 20000000 kB\n").unwrap();
    let cfg = Config::parse(&format!(
        "state_file = {state:?}\n[pressure]\nsource = {psi:?}\nmeminfo = {mem:?}\nsample_period = \"1s\"\nsustain = \"1s\"\n"
    ))
    .unwrap();
    // A notify socket, so STATUS and WATCHDOG really are sent.
    let sock_path = dir.path().join("notify");
    let sock = std::os::unix::net::UnixDatagram::bind(&sock_path).unwrap();
    sock.set_nonblocking(true).unwrap();
    // SAFETY: single-threaded at this point of the test binary's only test.
    unsafe {
        std::env::set_var("NOTIFY_SOCKET", &sock_path);
        std::env::set_var("WATCHDOG_USEC", "20000000");
    }
    // The metrics listener on its own thread, as a scraper sees it. Allocations are
    // counted per thread: what serving costs is not the sample loop's.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let listener = regrade::metrics::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let ages = regrade::metrics::MaxSampleAge {
                polling: Duration::from_secs(60),
                on_trigger: Duration::from_secs(60),
            };
            regrade::metrics::serve(listener, &regrade::metrics::METRICS, ages).await;
        });
    });
    let addr = rx.recv().unwrap();
    let (stop, scrapes, last) =
        (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)), Arc::new(std::sync::Mutex::new(String::new())));
    let scraper = {
        let (stop, scrapes, last) = (stop.clone(), scrapes.clone(), last.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
                let mut text = String::new();
                s.read_to_string(&mut text).unwrap();
                *last.lock().unwrap() = text;
                scrapes.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let sampler = Sampler::for_config(&cfg.pressure).unwrap();
    let mut ticker = Ticker::new(&cfg, sampler, Level::ALL.to_vec(), Level::Full, Mode::Act);
    let per_1000 = allocations_in_1000_calm_ticks(&mut ticker);
    // Make sure a scrape overlapped the loop and saw what it stored.
    while scrapes.load(Ordering::Relaxed) < 2 {
        std::thread::yield_now();
    }
    stop.store(true, Ordering::Relaxed);
    scraper.join().unwrap();
    let text = last.lock().unwrap().clone();
    assert!(text.contains("\nregrade_pressure_ratio{metric=\"some_avg10\"} 0.01\n"), "{text}");
    assert!(text.contains("\nregrade_level{level=\"full\"} 1\n"), "{text}");
    assert!(text.contains("\nregrade_reading{reading=\"calm\"} 1\n"), "{text}");
    assert!(state.exists(), "the state file was never published");
    let mut buf = [0u8; 512];
    let n = sock.recv(&mut buf).unwrap();
    assert!(std::str::from_utf8(&buf[..n]).unwrap().starts_with("STATUS=level full"), "systemd was told nothing");
    assert_eq!(per_1000, 0, "{per_1000} allocations in 1000 calm samples");

    for version in ["v1", "v2"] {
        let per_1000 = cgroup_samples(dir.path(), version);
        assert_eq!(per_1000, 0, "{per_1000} allocations in 1000 calm samples of a cgroup {version}");
    }
}

/// 1000 calm ticks reading a memory cgroup's files (`version`: "v1" or "v2"); returns
/// the allocations the last 1000 made.
fn cgroup_samples(dir: &std::path::Path, version: &str) -> u64 {
    let cg = dir.join(format!("cg-{version}"));
    std::fs::create_dir(&cg).unwrap();
    let (limit, usage, stat) = match version {
        "v1" => ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache 1\ntotal_inactive_file 1048576\n"),
        _ => ("memory.max", "memory.current", "anon 1\nfile 2\ninactive_file 1048576\nactive_file 9\n"),
    };
    std::fs::write(cg.join(limit), "4294967296\n").unwrap();
    std::fs::write(cg.join(usage), "1073741824\n").unwrap();
    std::fs::write(cg.join("memory.stat"), stat).unwrap();
    let cfg = Config::parse(&format!(
        "state_file = {:?}\n[pressure]\nsource = {:?}\nmeminfo = {:?}\nmemory_cgroup = {cg:?}\n\
         sample_period = \"1s\"\nsustain = \"1s\"\n",
        dir.join(format!("state-{version}.json")),
        dir.join("psi"),
        dir.join("meminfo"),
    ))
    .unwrap();
    let mut sampler = Sampler::for_config(&cfg.pressure).unwrap();
    assert!(sampler.memory_source().contains(version), "{}", sampler.memory_source());
    assert_eq!(sampler.sample().unwrap().mem_available, (3 << 30) + (1 << 20));
    let mut ticker = Ticker::new(&cfg, sampler, Level::ALL.to_vec(), Level::Full, Mode::Act);
    allocations_in_1000_calm_ticks(&mut ticker)
}

/// The allocations of 1000 calm ticks, after 3 that warm up (the first samples start
/// the calm streak and publish the state file).
fn allocations_in_1000_calm_ticks(ticker: &mut Ticker) -> u64 {
    for i in 0..3 {
        assert!(ticker.tick(Duration::from_secs(i)).unwrap().is_none());
    }
    let before = allocs();
    for i in 3..1003 {
        assert!(ticker.tick(Duration::from_secs(i)).unwrap().is_none());
    }
    allocs() - before
}

//! `runtime::shed_start_up_code`, which `watch` calls once before its loop: the code
//! pages start-up faulted in (here: everything this test binary ran so far) leave the
//! resident set, and the process runs on, faulting back what it runs. Its own test
//! binary: it changes the whole process's memory locking.

fn rss_file_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("RssFile:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn start_up_code_leaves_the_resident_set_and_the_process_runs_on() {
    // Touch a good deal of code first, as start-up does: parse and validate a config.
    let cfg = regrade::config::Config::parse("[pressure]\nthreshold = 30\n").unwrap();
    let before = rss_file_kib();
    regrade::runtime::shed_start_up_code();
    let after = rss_file_kib();
    println!("RssFile {before} KiB before, {after} KiB after");
    // Read-only data and what the test harness's other thread runs stay; the code
    // this thread ran (well over a MiB in a debug build) goes.
    assert!(after + 1024 < before, "RssFile {before} KiB -> {after} KiB: the code pages were not dropped");
    // Code runs on: faulted back from the file, unchanged.
    assert_eq!(
        regrade::config::Config::parse("[pressure]\nthreshold = 30\n").unwrap().pressure.threshold,
        cfg.pressure.threshold
    );
    let locked = std::fs::read_to_string("/proc/self/status").unwrap();
    assert!(locked.lines().any(|l| l.starts_with("VmLck:") && !l.ends_with(" 0 kB")), "locked again on fault");
}

//! `runtime::shed_start_up_code`, which `watch` calls once before its loop: the code
//! pages start-up faulted in (here: everything this test binary ran so far) leave the
//! resident set, and the process runs on, faulting back what it runs. Its own test
//! binary: it changes the whole process's memory locking. Then, as `watch` runs it
//! (without `REGRADE_TEST_TEXT_ON_FAULT`), the whole of the binary's code is locked
//! at once, so a step's code never faults.

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
    // SAFETY: this test binary's only test, before any other thread of its own.
    unsafe { std::env::set_var("REGRADE_TEST_TEXT_ON_FAULT", "1") };
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

    // As `watch` runs it: the binary's code comes back whole, locked.
    unsafe { std::env::remove_var("REGRADE_TEST_TEXT_ON_FAULT") };
    let (size, rss, locked) = own_text_kib();
    assert!(locked < size, "the code never run was not dropped: {locked} of {size} kB locked");
    regrade::runtime::shed_start_up_code();
    let (size, rss_after, locked) = own_text_kib();
    println!("the binary's r-xp mapping: {size} kB; Rss {rss} -> {rss_after} kB; Locked {locked} kB");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: RLIMIT_MEMLOCK may refuse locking {size} kB; not checked");
        return;
    }
    // Locked is counted as Pss: a page at a segment's edge is mapped twice (the end of
    // the r--p before, the start of this one) and counts half in each.
    assert!(rss_after == size && locked + 8 >= size, "the binary's code is not locked whole: {locked} of {size} kB");
}

/// The size, Rss and Locked of this binary's r-xp mapping, in kB (/proc/self/smaps).
fn own_text_kib() -> (u64, u64, u64) {
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let (mut inside, mut got) = (false, (0, 0, 0));
    for line in smaps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.first().is_some_and(|r| r.contains('-') && !r.ends_with(':')) && f.len() >= 5 {
            inside = f[1] == "r-xp" && f.get(5).is_some_and(|p| std::path::Path::new(p) == exe);
            continue;
        }
        let kb = || f[1].parse::<u64>().unwrap();
        match (inside, f.first()) {
            (true, Some(&"Size:")) => got.0 = kb(),
            (true, Some(&"Rss:")) => got.1 = kb(),
            (true, Some(&"Locked:")) => got.2 = kb(),
            _ => {}
        }
    }
    assert!(got.0 > 0, "no r-xp mapping of {} in smaps", exe.display());
    got
}

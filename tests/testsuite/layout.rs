//! The test suite's layout (issue 56): every test file is built and run. A file in
//! tests/testsuite/ without its `mod` line in main.rs is compiled by no one, silently;
//! a new tests/*.rs is a test binary of its own, with its own build and link of kube
//! and the helpers. Both are caught here.

use std::path::Path;

/// The test binaries that stay out of the one binary, and why.
const OWN_PROCESS: &[(&str, &str)] = &[
    ("alloc_per_sample.rs", "a counting global allocator; NOTIFY_SOCKET set for the whole process"),
    ("shed_start_up_code.rs", "changes the whole process's memory locking"),
];

fn rs_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".rs"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_test_file_is_a_module_of_the_one_binary() {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let main = std::fs::read_to_string(tests.join("testsuite/main.rs")).unwrap();
    let declared = |m: &str| main.lines().any(|l| l.trim() == format!("mod {m};"));
    let missing: Vec<String> = rs_files(&tests.join("testsuite"))
        .into_iter()
        .filter(|f| f != "main.rs" && !declared(f.trim_end_matches(".rs")))
        .collect();
    assert!(missing.is_empty(), "tests/testsuite/main.rs has no `mod` line for {missing:?}: never built, never run");
    let own: Vec<String> = rs_files(&tests).into_iter().filter(|f| !OWN_PROCESS.iter().any(|(o, _)| o == f)).collect();
    assert!(
        own.is_empty(),
        "{own:?}: a test binary of its own; move it to tests/testsuite/ (a module, `use crate::common;`), \
         or, if it must have a process of its own, add it to OWN_PROCESS with the reason"
    );
}

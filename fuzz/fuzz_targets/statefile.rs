//! The state file `watch` publishes and `status` reads.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(p) = serde_json::from_slice::<regrade::statefile::Published>(data) {
        let _ = p.state();
    }
});

//! /proc/pressure/memory as the kernel (or a fixture) may write it.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(psi) = regrade::pressure::parse_psi(data) {
        // What parses is a percentage the core can compare.
        for v in psi.some.iter().chain(psi.full.iter()) {
            assert!((0.0..=100.0).contains(v), "{v}");
        }
    }
});

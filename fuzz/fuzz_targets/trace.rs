//! A `simulate` trace (CSV) replayed through the core.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let cfg = regrade::config::Config::default();
    let _ = regrade::simulate::replay(&cfg, data, regrade::level::Level::Full, |_| Ok(()));
});

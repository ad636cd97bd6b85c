//! A k3s config drop-in: the level it stands for, and its top-level keys.
#![no_main]
use regrade::actuator::systemd::dropin;
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let levels = regrade::config::Config::default().levels;
        let _ = dropin::classify(text, &levels);
        for key in dropin::top_level_keys(text) {
            assert!(!key.is_empty());
        }
    }
});

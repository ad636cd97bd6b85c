//! A coordination.k8s.io Lease as the API server returns it.
#![no_main]
use k8s_openapi::api::coordination::v1::Lease;
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(l) = serde_json::from_slice::<Lease>(data) {
        let _ = regrade::cluster::lease::holder_of(&l);
    }
});

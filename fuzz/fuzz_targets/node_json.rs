//! A Node as the API server returns it: the marks regrade would patch onto it.
#![no_main]
use k8s_openapi::api::core::v1::Node;
use regrade::cluster::node::NodeMarks;
use regrade::level::Level;
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(node) = serde_json::from_slice::<Node>(data) else { return };
    let levels = regrade::config::Config::default().levels;
    let marks = NodeMarks {
        node_name: "n",
        level_label: "regrade.dev/level",
        taint_key: "regrade.dev/stepped-down",
        set_annotation: "regrade.dev/set",
    };
    for level in Level::ALL {
        let _ = marks.patch_for(&node, level, &levels);
    }
});

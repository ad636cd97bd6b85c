//! etcd's JSON gateway: a member list and a member's status as /v3/cluster/member/list
//! and /v3/maintenance/status return them (split at the first NUL byte), then the gate's
//! judgement of them, which must never panic.
#![no_main]
use regrade::etcd::client::{MemberList, Status};
use regrade::etcd::judge::{self, View};
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let (list, status) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(list) = serde_json::from_slice::<MemberList>(list) else { return };
    let status = serde_json::from_slice::<Status>(status).map_err(|e| e.to_string());
    let statuses = list.members.iter().map(|m| (m.id, status.clone())).collect();
    let me = list.header.member_id;
    let view = View { list, statuses, me };
    let _ = judge::may_restart(&view, 1000);
    let _ = judge::is_back(&view, me, 1000);
    let _ = view.members(1000);
});

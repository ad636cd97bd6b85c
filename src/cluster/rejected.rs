//! When the API server rejects regrade's token (401): the Node it is bound to was deleted
//! and registered again, or its ServiceAccount made again. Every call fails until a new
//! token is minted, so the first 401 is said once in the journal and written down beside
//! the kubeconfig (`<kubeconfig>.rejected`): `status` shows it, and the NixOS module's
//! `regrade-credentials.path` starts the credential unit at once when it appears
//! (`regrade credential`, which asks the API server whether the token at hand is still
//! accepted, mints a new one and removes the note). `watch` itself never holds the
//! admin credentials that minting needs.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::endpoints::CallError;

/// Where the note for the credential of `kubeconfig` is kept.
pub fn note_path(kubeconfig: &Path) -> PathBuf {
    let mut p = kubeconfig.as_os_str().to_owned();
    p.push(".rejected");
    PathBuf::from(p)
}

/// What was rejected, when, and where.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RejectedNote {
    /// Unix seconds of the first 401.
    pub since: f64,
    /// The call and the API server's answer.
    pub error: String,
}

impl RejectedNote {
    /// The note beside `kubeconfig`, if there is one.
    pub fn read(kubeconfig: &Path) -> Option<RejectedNote> {
        let text = crate::fsutil::read_string_if_exists(&note_path(kubeconfig)).ok()??;
        serde_json::from_str(&text).ok()
    }
}

/// The first 401 of a run of them: said once, and written down.
pub fn report(kubeconfig: &Path, e: &CallError) {
    let note = RejectedNote { since: crate::statefile::unix(std::time::SystemTime::now()), error: e.to_string() };
    let path = note_path(kubeconfig);
    tracing::warn!(
        error = %e,
        note = %path.display(),
        "the API server rejects regrade's credential (401): every API call fails until `regrade credential` mints \
         a new token (on NixOS regrade-credentials.path starts it now, seeing the note)"
    );
    let text = serde_json::to_string(&note).expect("a note serialises") + "\n";
    if let Err(e) = crate::fsutil::publish_atomic(&path, text.as_bytes(), 0o644) {
        tracing::warn!(note = %path.display(), error = %e, "could not write the note of the rejected credential");
    }
}

/// The API server accepts the credential again (after a 401 this process saw).
pub fn accepted_again(kubeconfig: &Path) {
    tracing::info!("the API server accepts regrade's credential again");
    clear(kubeconfig);
}

/// Removes the note, if any (`regrade credential`, once the token is good).
pub fn clear(kubeconfig: &Path) {
    let path = note_path(kubeconfig);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(note = %path.display(), error = %e, "could not remove the note of the rejected credential")
        }
    }
}

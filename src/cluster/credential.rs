//! Each server's own credential (docs/behaviour.md, "Least privilege"): a token of the
//! ServiceAccount `regrade/<its Node>`, bound to that Node where the API server can bind
//! one (Kubernetes >= 1.31), in a file of its own beside a kubeconfig that names the file
//! (`tokenFile`). `regrade credential` mints it with k3s's admin kubeconfig, and mints a
//! new one once less than half of `--lifetime` is left; the running `watch` reads the new
//! file at its next API call ([`super::endpoints`]), with no restart.
//!
//! The renewal decision is pure ([`renewal`]): the token's own claims and the time in.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use kube::api::PostParams;
use kube::config::{Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext};
use kube::Api;
use serde::Deserialize;

use super::endpoints::{EndpointSettings, Endpoints};

/// The namespace of regrade's ServiceAccounts, one per server, each named after its Node
/// (deploy/rbac.yaml binds the namespace's group; deploy/admission-policy.yaml reads
/// the Node from the name).
pub const NAMESPACE: &str = "regrade";

/// The user name the API server gives a token of `node`'s ServiceAccount.
pub fn user_name(node: &str) -> String {
    format!("system:serviceaccount:{NAMESPACE}:{node}")
}

/// Where the token is kept: beside the kubeconfig that names it.
pub fn token_path(kubeconfig: &Path) -> PathBuf {
    let mut p = kubeconfig.as_os_str().to_owned();
    p.push(".token");
    PathBuf::from(p)
}

/// What a ServiceAccount token says about itself: its JWT claims. The signature is the
/// API server's to check; these only decide when to mint a new one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenClaims {
    /// `system:serviceaccount:<namespace>:<name>`.
    pub subject: String,
    pub issued_at: i64,
    pub expires_at: i64,
    /// The Node the token is bound to, if any.
    pub node: Option<String>,
    /// The token's ID (`jti`): what the API server reports as its credential ID.
    pub id: Option<String>,
}

impl TokenClaims {
    pub fn parse(token: &str) -> Result<TokenClaims, String> {
        #[derive(Deserialize)]
        struct Named {
            name: String,
        }
        #[derive(Deserialize)]
        struct Kubernetes {
            node: Option<Named>,
        }
        #[derive(Deserialize)]
        struct Claims {
            sub: String,
            iat: i64,
            exp: i64,
            jti: Option<String>,
            #[serde(rename = "kubernetes.io")]
            kubernetes: Option<Kubernetes>,
        }
        let payload = token.trim().split('.').nth(1).ok_or("not a JWT (no payload)")?;
        let bytes = base64url_decode(payload).ok_or("not a JWT (payload is not base64url)")?;
        let c: Claims = serde_json::from_slice(&bytes).map_err(|e| format!("not a ServiceAccount token: {e}"))?;
        Ok(TokenClaims {
            subject: c.sub,
            issued_at: c.iat,
            expires_at: c.exp,
            node: c.kubernetes.and_then(|k| k.node).map(|n| n.name),
            id: c.jti,
        })
    }
}

/// Unpadded base64url (RFC 4648 §5), as JWTs are; `None` for anything else.
fn base64url_decode(s: &str) -> Option<Vec<u8>> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'-' => Some(62),
        b'_' => Some(63),
        _ => None,
    };
    let s = s.trim_end_matches('=').as_bytes();
    if s.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    for chunk in s.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= u32::from(value(c)?) << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}

/// What to do with the token at hand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Renewal {
    /// Still good: renewed from `renew_at` (Unix seconds) on.
    Keep { renew_at: i64 },
    /// Mint a new one, for this reason.
    Renew(String),
}

/// Whether the token (`None`: absent or unreadable, with why) must be replaced at `now`
/// (Unix seconds): once less than half of `lifetime` is left, or when it is another
/// ServiceAccount's or bound to another Node. A timer that asks every few minutes then
/// replaces a token half a lifetime before it expires, so the API servers may be away
/// that long without regrade losing its credential.
pub fn renewal(now: i64, token: Result<&TokenClaims, &str>, node: &str, lifetime: Duration) -> Renewal {
    let c = match token {
        Ok(c) => c,
        Err(why) => return Renewal::Renew(why.to_string()),
    };
    let want = user_name(node);
    if c.subject != want {
        return Renewal::Renew(format!("it is {}'s, not {want}'s", c.subject));
    }
    if let Some(bound) = c.node.as_deref().filter(|b| *b != node) {
        return Renewal::Renew(format!("it is bound to Node {bound}, not {node}"));
    }
    let half = i64::try_from(lifetime.as_secs() / 2).unwrap_or(i64::MAX);
    let renew_at = c.expires_at.saturating_sub(half);
    if now >= renew_at {
        let left = c.expires_at - now;
        return Renewal::Renew(if left <= 0 {
            format!("it expired {}s ago", -left)
        } else {
            format!("{left}s of it are left, less than half of the {}s lifetime", lifetime.as_secs())
        });
    }
    Renewal::Keep { renew_at }
}

/// What `regrade credential` is asked to do.
#[derive(Clone, Debug)]
pub struct MintSettings {
    /// Credentials that may read Nodes and make ServiceAccounts and their tokens.
    pub admin_kubeconfig: PathBuf,
    /// Tried after the admin kubeconfig's own server (`cluster.api_servers`).
    pub api_servers: Vec<String>,
    pub tls_server_name: Option<String>,
    pub request_timeout: Duration,
    pub node: String,
    /// The kubeconfig regrade reads (`cluster.kubeconfig`); the token goes beside it.
    pub kubeconfig: PathBuf,
    pub lifetime: Duration,
    /// Mint a new token even when the one at hand is good.
    pub force: bool,
}

/// How the token at hand came to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Minted {
    Kept {
        claims: TokenClaims,
        renew_at: i64,
    },
    /// A new token; `why` the old one was replaced, `unbound` why it is bound to no
    /// Node (an API server older than 1.31, or with ServiceAccountTokenNodeBinding off);
    /// and whether the admission policy bounds it.
    Renewed {
        claims: TokenClaims,
        why: String,
        unbound: Option<String>,
        policy: PolicyState,
    },
}

/// The admission policy of deploy/admission-policy.yaml and its binding.
pub const POLICY: &str = "regrade-own-node";

/// Whether the admission policy is there to bound regrade's credentials.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyState {
    InForce,
    /// Served, but the policy or its binding is missing (named).
    NotInstalled(String),
    /// The API server serves no ValidatingAdmissionPolicy (before Kubernetes 1.30).
    NotServed,
}

impl PolicyState {
    /// What is wrong, for the operator; `None` when the policy is in force.
    pub fn refusal(&self) -> Option<String> {
        let unbounded = "regrade's credential is bounded by its RBAC alone: it may patch any field of any Node, \
                         take any Lease in kube-system and record Events about anything";
        match self {
            PolicyState::InForce => None,
            PolicyState::NotInstalled(what) => {
                Some(format!("{what} is not installed (apply deploy/admission-policy.yaml): until it is, {unbounded}"))
            }
            PolicyState::NotServed => Some(format!(
                "this cluster's API server serves no ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, \
                 Kubernetes 1.30 or later), so deploy/admission-policy.yaml cannot be installed: {unbounded}"
            )),
        }
    }
}

/// Asks the API server (with rights to read admission policies: the admin's) whether it
/// serves ValidatingAdmissionPolicy, and whether regrade's is installed and bound.
pub async fn policy_state(eps: &Endpoints) -> Result<PolicyState, super::endpoints::CallError> {
    use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding};
    let gv = "admissionregistration.k8s.io/v1";
    let served = eps
        .call(format!("get /apis/{gv}"), |c| async move {
            match c.list_api_group_resources(gv).await {
                Ok(list) => Ok(list.resources.iter().any(|r| r.name == "validatingadmissionpolicies")),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
                Err(e) => Err(e),
            }
        })
        .await?;
    if !served {
        return Ok(PolicyState::NotServed);
    }
    let policy = eps
        .call(format!("get validatingadmissionpolicies/{POLICY}"), |c| async move {
            Api::<ValidatingAdmissionPolicy>::all(c).get_opt(POLICY).await
        })
        .await?;
    if policy.is_none() {
        return Ok(PolicyState::NotInstalled(format!("the ValidatingAdmissionPolicy {POLICY}")));
    }
    let binding = eps
        .call(format!("get validatingadmissionpolicybindings/{POLICY}"), |c| async move {
            Api::<ValidatingAdmissionPolicyBinding>::all(c).get_opt(POLICY).await
        })
        .await?;
    Ok(match binding {
        Some(_) => PolicyState::InForce,
        None => PolicyState::NotInstalled(format!("the ValidatingAdmissionPolicyBinding {POLICY}")),
    })
}

/// Keeps or replaces the token of `s.node`'s ServiceAccount, and writes the kubeconfig
/// naming it. Nothing is written unless a new token was had in full.
pub async fn ensure(s: &MintSettings, now: i64) -> anyhow::Result<Minted> {
    if s.kubeconfig == s.admin_kubeconfig {
        anyhow::bail!(
            "cluster.kubeconfig is the admin kubeconfig {}: regrade credential writes its own kubeconfig there; \
             set cluster.kubeconfig to another path (e.g. /var/lib/regrade/kubeconfig)",
            s.admin_kubeconfig.display()
        );
    }
    let token_file = token_path(&s.kubeconfig);
    let kubeconfig = kubeconfig_text(&s.admin_kubeconfig, &s.node, &token_file)?;
    let at_hand = match crate::fsutil::read_string_if_exists(&token_file) {
        Ok(Some(t)) => TokenClaims::parse(&t).map_err(|e| format!("{}: {e}", token_file.display())),
        Ok(None) => Err(format!("there is no token at {}", token_file.display())),
        Err(e) => Err(format!("{}: {e}", token_file.display())),
    };
    let decision = renewal(now, at_hand.as_ref().map_err(String::as_str), &s.node, s.lifetime);
    let why = match (decision, s.force) {
        (Renewal::Keep { renew_at }, false) => {
            write_if_changed(&s.kubeconfig, &kubeconfig)?;
            let claims = at_hand.expect("kept only a readable token");
            return Ok(Minted::Kept { claims, renew_at });
        }
        (Renewal::Keep { .. }, true) => "--force".to_string(),
        (Renewal::Renew(why), _) => why,
    };
    let eps = Endpoints::new(EndpointSettings {
        kubeconfig: s.admin_kubeconfig.clone(),
        api_servers: s.api_servers.clone(),
        tls_server_name: s.tls_server_name.clone(),
        request_timeout: s.request_timeout,
        cache: None,
    });
    let (token, unbound) = request_token(&eps, &s.node, s.lifetime).await?;
    let policy = policy_state(&eps).await?;
    let claims = TokenClaims::parse(&token).map_err(|e| anyhow::anyhow!("the API server's token: {e}"))?;
    crate::fsutil::write_atomic(&token_file, token.as_bytes(), 0o600, "credential-token")
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", token_file.display()))?;
    write_if_changed(&s.kubeconfig, &kubeconfig)?;
    Ok(Minted::Renewed { claims, why, unbound, policy })
}

/// A token of `node`'s ServiceAccount (made if missing), bound to the Node where the
/// API server can bind one; with why not, where it could not.
async fn request_token(eps: &Endpoints, node: &str, lifetime: Duration) -> anyhow::Result<(String, Option<String>)> {
    let n = eps
        .call(format!("get nodes/{node}"), |c| async move { Api::<Node>::all(c).get_opt(node).await })
        .await?
        .ok_or_else(|| {
            anyhow::anyhow!(
                "Node {node} is not registered (yet): its credential is bound to it, so it is minted once k3s \
                 has registered the Node (cluster.node_name names it)"
            )
        })?;
    let uid = n.metadata.uid.clone();
    let sa = eps
        .call(format!("get serviceaccounts {NAMESPACE}/{node}"), |c| async move {
            Api::<ServiceAccount>::namespaced(c, NAMESPACE).get_opt(node).await
        })
        .await?;
    if sa.is_none() {
        let account = ServiceAccount {
            metadata: kube::api::ObjectMeta { name: Some(node.into()), ..Default::default() },
            ..Default::default()
        };
        let account = &account;
        let made = eps
            .call(format!("create serviceaccounts {NAMESPACE}/{node}"), |c| async move {
                Api::<ServiceAccount>::namespaced(c, NAMESPACE).create(&PostParams::default(), account).await
            })
            .await;
        match made {
            Ok(_) => {}
            Err(e) if e.code() == Some(409) => {} // made meanwhile
            Err(e) if e.code() == Some(404) => anyhow::bail!(
                "{e}: the namespace {NAMESPACE} is missing: apply deploy/rbac.yaml (the NixOS module has k3s apply it)"
            ),
            Err(e) => return Err(e.into()),
        }
    }
    let request = |bound: bool| TokenRequest {
        spec: TokenRequestSpec {
            audiences: Vec::new(), // the API server's own
            expiration_seconds: Some(i64::try_from(lifetime.as_secs()).unwrap_or(i64::MAX)),
            bound_object_ref: bound.then(|| BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(node.into()),
                uid: uid.clone(),
            }),
        },
        ..Default::default()
    };
    let create = |r: TokenRequest| async move {
        let r = &r;
        eps.call(format!("create serviceaccounts/token {NAMESPACE}/{node}"), |c| async move {
            Api::<ServiceAccount>::namespaced(c, NAMESPACE).create_token_request(node, &PostParams::default(), r).await
        })
        .await
    };
    let (answer, unbound) = match create(request(true)).await {
        // Before 1.29 "cannot bind token to object of type /v1, Kind=Node"; 1.29-1.30
        // with the gate off "cannot bind token to a Node object as the ... feature-gate is
        // disabled".
        Err(super::endpoints::CallError::Status { status, .. })
            if status.code == 400 && status.message.contains("cannot bind token") =>
        {
            let why = format!("this API server binds no token to a Node ({})", status.message);
            (create(request(false)).await?, Some(why))
        }
        other => (other?, None),
    };
    let token = answer.status.map(|s| s.token).filter(|t| !t.is_empty());
    Ok((token.ok_or_else(|| anyhow::anyhow!("the API server's TokenRequest answer had no token"))?, unbound))
}

/// The kubeconfig regrade reads: the admin kubeconfig's cluster (server, CA), and the
/// token file as the user (JSON, which is YAML).
fn kubeconfig_text(admin: &Path, node: &str, token_file: &Path) -> anyhow::Result<String> {
    let kc = Kubeconfig::read_from(admin).map_err(|e| anyhow::anyhow!("kubeconfig {}: {e}", admin.display()))?;
    let context = kc.current_context.as_deref().and_then(|c| kc.contexts.iter().find(|n| n.name == c));
    let cluster_name = context.and_then(|c| c.context.as_ref()).map(|c| c.cluster.clone());
    let cluster = kc
        .clusters
        .iter()
        .find(|c| Some(&c.name) == cluster_name.as_ref())
        .or(kc.clusters.first())
        .and_then(|c| c.cluster.clone())
        .ok_or_else(|| anyhow::anyhow!("kubeconfig {}: no cluster in it", admin.display()))?;
    let user = format!("{NAMESPACE}/{node}");
    let auth = kube::config::AuthInfo { token_file: Some(token_file.display().to_string()), ..Default::default() };
    let out = Kubeconfig {
        api_version: Some("v1".into()),
        kind: Some("Config".into()),
        clusters: vec![NamedCluster { name: "k3s".into(), cluster: Some(cluster), ..Default::default() }],
        auth_infos: vec![NamedAuthInfo { name: user.clone(), auth_info: Some(auth), ..Default::default() }],
        contexts: vec![NamedContext {
            name: "regrade".into(),
            context: Some(Context {
                cluster: "k3s".into(),
                user: Some(user),
                namespace: Some(NAMESPACE.into()),
                ..Default::default()
            }),
            ..Default::default()
        }],
        current_context: Some("regrade".into()),
        ..Default::default()
    };
    Ok(serde_json::to_string_pretty(&out)? + "\n")
}

fn write_if_changed(path: &Path, text: &str) -> anyhow::Result<()> {
    let old = crate::fsutil::read_string_if_exists(path).ok().flatten();
    if old.as_deref() != Some(text) {
        crate::fsutil::write_atomic(path, text.as_bytes(), 0o600, "credential-kubeconfig")
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwt(claims: serde_json::Value) -> String {
        let enc = |b: &[u8]| {
            const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
            let mut s = String::new();
            for chunk in b.chunks(3) {
                let n = chunk.iter().enumerate().fold(0u32, |n, (i, &c)| n | u32::from(c) << (16 - 8 * i));
                for i in 0..=chunk.len() {
                    s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
                }
            }
            s
        };
        format!("{}.{}.sig", enc(br#"{"alg":"RS256"}"#), enc(claims.to_string().as_bytes()))
    }

    fn claims(sub: &str, iat: i64, exp: i64, node: Option<&str>) -> TokenClaims {
        TokenClaims { subject: sub.into(), issued_at: iat, expires_at: exp, node: node.map(String::from), id: None }
    }

    #[test]
    fn a_node_bound_token_is_read_from_its_claims() {
        let t = jwt(serde_json::json!({
            "sub": "system:serviceaccount:regrade:server1", "iat": 1000, "exp": 87400, "jti": "j-1",
            "kubernetes.io": {"namespace": "regrade", "serviceaccount": {"name": "server1", "uid": "u"},
                              "node": {"name": "server1", "uid": "n"}},
        }));
        let c = TokenClaims::parse(&t).unwrap();
        assert_eq!(c.subject, "system:serviceaccount:regrade:server1");
        assert_eq!((c.issued_at, c.expires_at), (1000, 87400));
        assert_eq!((c.node.as_deref(), c.id.as_deref()), (Some("server1"), Some("j-1")));
        assert!(TokenClaims::parse("no-dots").is_err());
        assert!(TokenClaims::parse("a.!!!.c").is_err());
        assert_eq!(base64url_decode("aGk").unwrap(), b"hi");
        assert_eq!(base64url_decode("aGk=").unwrap(), b"hi");
    }

    /// Renewed once less than half the lifetime is left, or when it is not this
    /// server's; kept before that.
    #[test]
    fn a_token_is_renewed_past_half_its_lifetime_or_when_it_is_another_servers() {
        let day = Duration::from_secs(86400);
        let sub = "system:serviceaccount:regrade:server1";
        let t = claims(sub, 0, 86400, Some("server1"));
        assert_eq!(renewal(0, Ok(&t), "server1", day), Renewal::Keep { renew_at: 43200 });
        assert_eq!(renewal(43199, Ok(&t), "server1", day), Renewal::Keep { renew_at: 43200 });
        let r = renewal(43200, Ok(&t), "server1", day);
        assert!(matches!(&r, Renewal::Renew(why) if why.contains("43200s of it are left")), "{r:?}");
        let r = renewal(90000, Ok(&t), "server1", day);
        assert!(matches!(&r, Renewal::Renew(why) if why.contains("expired 3600s ago")), "{r:?}");
        // A 10-minute token is past the renewal point of a day's lifetime at once.
        let short = claims(sub, 0, 600, Some("server1"));
        assert!(matches!(renewal(0, Ok(&short), "server1", day), Renewal::Renew(_)));
        let other = claims("system:serviceaccount:regrade:server2", 0, 86400, None);
        assert!(matches!(renewal(0, Ok(&other), "server1", day), Renewal::Renew(w) if w.contains("server2")));
        let bound_elsewhere = claims(sub, 0, 86400, Some("server2"));
        assert!(
            matches!(renewal(0, Ok(&bound_elsewhere), "server1", day), Renewal::Renew(w) if w.contains("Node server2"))
        );
        // An unbound token of the right account (an older API server) is kept.
        let unbound = claims(sub, 0, 86400, None);
        assert!(matches!(renewal(0, Ok(&unbound), "server1", day), Renewal::Keep { .. }));
        assert_eq!(renewal(0, Err("absent"), "server1", day), Renewal::Renew("absent".into()));
    }

    #[test]
    fn the_token_lives_beside_the_kubeconfig() {
        assert_eq!(
            token_path(Path::new("/var/lib/regrade/kubeconfig")),
            Path::new("/var/lib/regrade/kubeconfig.token")
        );
    }
}

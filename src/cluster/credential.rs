//! Each server's own credential (docs/behaviour.md, "Least privilege"): a token of the
//! ServiceAccount `regrade/<its Node>`, bound to that Node where the API server can bind
//! one (Kubernetes >= 1.31), in a file of its own beside a kubeconfig that names the file
//! (`tokenFile`). `regrade credential` mints it with k3s's admin kubeconfig, through the
//! same endpoints and failover as `watch` (configured, discovered, cached), and mints a
//! new one once less than half of the lifetime and one renewal period are left, or once
//! the API server no longer accepts the one at hand (a Node registered again, a
//! ServiceAccount made again); the running `watch` reads the new file at its next API
//! call ([`super::endpoints`]), with no restart, and asks for one at once when the API
//! server rejects its token ([`super::rejected`]).
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

use super::endpoints::{CallError, EndpointSettings, Endpoints};
use crate::units::{format_duration, HumanDuration};

/// The shortest token the API server issues.
pub const MIN_LIFETIME: Duration = Duration::from_secs(600);

/// `[credential]`: this server's own credential, as `regrade credential` keeps it.
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CredentialConfig {
    /// How long a new token is valid (`regrade credential --lifetime` overrides it).
    pub lifetime: HumanDuration,
    /// How often `regrade credential` runs (its timer's period). A token is replaced once
    /// less than half of `lifetime` and one period are left: at the latest at half of
    /// its lifetime.
    pub renew_period: HumanDuration,
}

impl Default for CredentialConfig {
    fn default() -> Self {
        CredentialConfig {
            lifetime: HumanDuration(Duration::from_secs(86400)),
            renew_period: HumanDuration(Duration::from_secs(900)),
        }
    }
}

impl CredentialConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        check_lifetime(self.lifetime.0, self.renew_period.0, "credential.lifetime")
    }
}

/// Whether a token of `lifetime`, renewed by a run every `period`, never runs out
/// between runs. A run replaces it once less than half of the lifetime and one period
/// are left, so the period must fit in that half with room to spare: at most a quarter
/// of the lifetime leaves a quarter for failed runs tried again (and the timer's own
/// accuracy). `lifetime_key` names where the lifetime came from.
pub fn check_lifetime(lifetime: Duration, period: Duration, lifetime_key: &str) -> anyhow::Result<()> {
    if lifetime < MIN_LIFETIME {
        anyhow::bail!(
            "{lifetime_key} = {} is shorter than {} (the shortest token the API server issues)",
            format_duration(lifetime),
            format_duration(MIN_LIFETIME)
        );
    }
    if period.is_zero() {
        anyhow::bail!("credential.renew_period must be more than 0");
    }
    if period > lifetime / 4 {
        anyhow::bail!(
            "credential.renew_period = {} is more than a quarter of {lifetime_key} = {}: a token is replaced at the \
             latest at half of its lifetime, and a run every {} leaves too little of the other half for a failed \
             run to be tried again before it expires; renew at least every {} (or a longer lifetime)",
            format_duration(period),
            format_duration(lifetime),
            format_duration(period),
            format_duration(lifetime / 4)
        );
    }
    Ok(())
}

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
/// (Unix seconds): once less than half of `lifetime` and one renewal `period` are left,
/// or when it is another ServiceAccount's or bound to another Node. A timer that asks
/// every `period` then replaces a token at the latest half a lifetime before it
/// expires, so the API servers may be away that long without regrade losing its
/// credential. Whether the API server still accepts it is asked apart ([`ensure`]).
pub fn renewal(
    now: i64,
    token: Result<&TokenClaims, &str>,
    node: &str,
    lifetime: Duration,
    period: Duration,
) -> Renewal {
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
    let margin = i64::try_from(lifetime.as_secs() / 2 + period.as_secs()).unwrap_or(i64::MAX);
    let renew_at = c.expires_at.saturating_sub(margin);
    if now >= renew_at {
        let left = c.expires_at - now;
        return Renewal::Renew(if left <= 0 {
            format!("it expired {}s ago", -left)
        } else {
            format!(
                "{left}s of it are left, less than half of the {}s lifetime and the {}s renewal period",
                lifetime.as_secs(),
                period.as_secs()
            )
        });
    }
    Renewal::Keep { renew_at }
}

/// What `regrade credential` is asked to do.
#[derive(Clone, Debug)]
pub struct MintSettings {
    /// Credentials that may read Nodes and make ServiceAccounts and their tokens.
    pub admin_kubeconfig: PathBuf,
    /// Tried after the kubeconfig's own server (`cluster.api_servers`).
    pub api_servers: Vec<String>,
    pub tls_server_name: Option<String>,
    pub request_timeout: Duration,
    /// The API servers discovered while the local one answered (`cluster.endpoints_cache`),
    /// tried when none are configured: `watch`'s cache, shared.
    pub endpoints_cache: Option<PathBuf>,
    pub node: String,
    /// The kubeconfig regrade reads (`cluster.kubeconfig`); the token goes beside it.
    pub kubeconfig: PathBuf,
    pub lifetime: Duration,
    /// How often this is run (`credential.renew_period`).
    pub renew_period: Duration,
    /// Mint a new token even when the one at hand is good.
    pub force: bool,
}

/// How the token at hand came to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Minted {
    /// The token at hand is good; `unasked` why no API server could say whether it
    /// still accepts it (it is kept: minting would need one too).
    Kept { claims: TokenClaims, renew_at: i64, unasked: Option<String> },
    /// A new token; `why` the old one was replaced, `unbound` why it is bound to no
    /// Node (an API server older than 1.31, or with ServiceAccountTokenNodeBinding off);
    /// and whether the admission policy bounds it.
    Renewed { claims: TokenClaims, why: String, unbound: Option<String>, policy: PolicyState },
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
    /// It could not be asked (why): advice only, the token is written all the same.
    Unknown(String),
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
            PolicyState::Unknown(why) => Some(format!(
                "could not tell whether the admission policy {POLICY} bounds regrade's credential ({why}): the check \
                 needs --admin-kubeconfig to get validatingadmissionpolicies and validatingadmissionpolicybindings \
                 (admissionregistration.k8s.io); the token was written all the same"
            )),
        }
    }
}

/// Asks the API server (with rights to read admission policies: the admin's) whether it
/// serves ValidatingAdmissionPolicy, and whether regrade's is installed and bound.
pub async fn policy_state(eps: &Endpoints) -> Result<PolicyState, CallError> {
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
    if same_file(&s.kubeconfig, &s.admin_kubeconfig) {
        anyhow::bail!(
            "cluster.kubeconfig {} is the admin kubeconfig {}: regrade credential writes its own kubeconfig there; \
             set cluster.kubeconfig to another path (e.g. /var/lib/regrade/kubeconfig)",
            s.kubeconfig.display(),
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
    let decision = renewal(now, at_hand.as_ref().map_err(String::as_str), &s.node, s.lifetime, s.renew_period);
    let why = match (decision, s.force) {
        (Renewal::Keep { renew_at }, false) => {
            write_if_changed(&s.kubeconfig, &kubeconfig)?;
            let claims = at_hand.expect("kept only a readable token");
            match accepted(&Endpoints::new(s.endpoints(&s.kubeconfig))).await {
                Acceptance::Accepted => {
                    super::rejected::clear(&s.kubeconfig);
                    return Ok(Minted::Kept { claims, renew_at, unasked: None });
                }
                Acceptance::Unasked(why) => return Ok(Minted::Kept { claims, renew_at, unasked: Some(why) }),
                Acceptance::Rejected(why) => why,
            }
        }
        (Renewal::Keep { .. }, true) => "--force".to_string(),
        (Renewal::Renew(why), _) => why,
    };
    let eps = Endpoints::new(s.endpoints(&s.admin_kubeconfig));
    let (token, unbound) = request_token(&eps, &s.node, s.lifetime).await?;
    let claims = TokenClaims::parse(&token).map_err(|e| anyhow::anyhow!("the API server's token: {e}"))?;
    crate::fsutil::write_atomic(&token_file, token.as_bytes(), 0o600, "credential-token")
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", token_file.display()))?;
    write_if_changed(&s.kubeconfig, &kubeconfig)?;
    super::rejected::clear(&s.kubeconfig);
    // Advice only, asked once the token is safe on disk: its failure loses nothing.
    let policy = policy_state(&eps).await.unwrap_or_else(|e| PolicyState::Unknown(e.to_string()));
    Ok(Minted::Renewed { claims, why, unbound, policy })
}

impl MintSettings {
    /// The endpoints `watch` uses, with `kubeconfig`'s credentials: its server first,
    /// then the configured or cached others.
    fn endpoints(&self, kubeconfig: &Path) -> EndpointSettings {
        EndpointSettings {
            kubeconfig: kubeconfig.to_path_buf(),
            api_servers: self.api_servers.clone(),
            tls_server_name: self.tls_server_name.clone(),
            request_timeout: self.request_timeout,
            cache: self.endpoints_cache.clone(),
            report_rejected: false,
        }
    }
}

/// Whether the API server takes the token at hand.
enum Acceptance {
    Accepted,
    /// It answered 401: why, for the renewal.
    Rejected(String),
    /// No answer to judge by (why).
    Unasked(String),
}

/// The cheapest authenticated look: a SelfSubjectReview (any authenticated user may
/// make one). A 401 is the API server rejecting the token: the Node it is bound to was
/// deleted (and registered again under its name), or the ServiceAccount was. A 404
/// (an API server before 1.28) got past authentication all the same.
async fn accepted(eps: &Endpoints) -> Acceptance {
    match super::boundary::who_am_i(eps).await {
        Ok(_) => Acceptance::Accepted,
        Err(e) if e.code() == Some(401) => Acceptance::Rejected(format!("the API server rejects it ({e})")),
        Err(e) if e.code() == Some(404) => Acceptance::Accepted,
        Err(e) => Acceptance::Unasked(e.to_string()),
    }
}

/// Whether two paths name one file: a symlink to the admin kubeconfig is the admin
/// kubeconfig. Paths that cannot be resolved (not there yet) are compared as written.
fn same_file(a: &Path, b: &Path) -> bool {
    let resolved = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    a == b || resolved(a) == resolved(b)
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
        Err(CallError::Status { status, .. }) if status.code == 400 && status.message.contains("cannot bind token") => {
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

    /// Renewed once less than half the lifetime and one renewal period are left (at the
    /// latest at half of its lifetime, for a timer that runs every period), or when it
    /// is not this server's; kept before that.
    #[test]
    fn a_token_is_renewed_by_half_its_lifetime_or_when_it_is_another_servers() {
        let day = Duration::from_secs(86400);
        let period = Duration::from_secs(900);
        let renewal = |now, t| renewal(now, t, "server1", day, period);
        let sub = "system:serviceaccount:regrade:server1";
        let t = claims(sub, 0, 86400, Some("server1"));
        assert_eq!(renewal(0, Ok(&t)), Renewal::Keep { renew_at: 42300 });
        assert_eq!(renewal(42299, Ok(&t)), Renewal::Keep { renew_at: 42300 });
        let r = renewal(42300, Ok(&t));
        assert!(matches!(&r, Renewal::Renew(why) if why.contains("44100s of it are left")), "{r:?}");
        // The timer's last run before the renewal point comes at most a period before it:
        // its next one, at the latest, is at half of the lifetime (43200).
        let r = renewal(90000, Ok(&t));
        assert!(matches!(&r, Renewal::Renew(why) if why.contains("expired 3600s ago")), "{r:?}");
        // A 10-minute token is past the renewal point of a day's lifetime at once.
        let short = claims(sub, 0, 600, Some("server1"));
        assert!(matches!(renewal(0, Ok(&short)), Renewal::Renew(_)));
        let other = claims("system:serviceaccount:regrade:server2", 0, 86400, None);
        assert!(matches!(renewal(0, Ok(&other)), Renewal::Renew(w) if w.contains("server2")));
        let bound_elsewhere = claims(sub, 0, 86400, Some("server2"));
        assert!(matches!(renewal(0, Ok(&bound_elsewhere)), Renewal::Renew(w) if w.contains("Node server2")));
        // An unbound token of the right account (an older API server) is kept.
        let unbound = claims(sub, 0, 86400, None);
        assert!(matches!(renewal(0, Ok(&unbound)), Renewal::Keep { .. }));
        assert_eq!(renewal(0, Err("absent")), Renewal::Renew("absent".into()));
    }

    /// A lifetime and a renewal period that leave a gap are refused, naming both keys:
    /// the shortest lifetime (10m) with the old 15-minute timer expired between runs.
    #[test]
    fn a_lifetime_and_a_renewal_period_that_leave_a_gap_are_refused() {
        let m = |s: u64| Duration::from_secs(60 * s);
        let e = check_lifetime(m(10), m(15), "credential.lifetime").unwrap_err().to_string();
        assert!(e.contains("credential.renew_period = 15m") && e.contains("credential.lifetime = 10m"), "{e}");
        assert!(e.contains("at least every 150s"), "{e}");
        assert!(check_lifetime(m(10), Duration::from_secs(150), "credential.lifetime").is_ok());
        assert!(check_lifetime(m(60), m(15), "--lifetime").is_ok());
        let e = check_lifetime(m(59), m(15), "--lifetime").unwrap_err().to_string();
        assert!(e.contains("--lifetime = 59m"), "{e}");
        let e = check_lifetime(m(9), Duration::from_secs(60), "credential.lifetime").unwrap_err().to_string();
        assert!(e.contains("shorter than 10m"), "{e}");
        assert!(check_lifetime(m(60), Duration::ZERO, "x").is_err());
        // The defaults agree; check-config refuses the shortest lifetime with them.
        CredentialConfig::default().validate().unwrap();
        let e = format!("{:#}", crate::config::Config::parse("[credential]\nlifetime = \"10m\"\n").unwrap_err());
        assert!(e.contains("credential.renew_period = 15m is more than a quarter of credential.lifetime"), "{e}");
        crate::config::Config::parse("[credential]\nlifetime = \"10m\"\nrenew_period = \"2m\"\n").unwrap();
    }

    /// The admin kubeconfig is told by the file, not by the path as written. Given
    /// through a symlink while cluster.kubeconfig names k3s.yaml itself, k3s.yaml was
    /// written over (with a token at hand that is kept, before any API server is asked);
    /// a symlink to k3s.yaml as cluster.kubeconfig would have been replaced by regrade's
    /// own file. Both are refused, and nothing is written.
    #[test]
    fn the_admin_kubeconfig_behind_a_symlink_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let admin = super::super::endpoints::tests::kubeconfig_at(dir.path(), "https://127.0.0.1:1");
        let link = dir.path().join("link.yaml");
        std::os::unix::fs::symlink(&admin, &link).unwrap();
        let before = std::fs::read_to_string(&admin).unwrap();
        let good = jwt(serde_json::json!({"sub": user_name("server1"), "iat": 0, "exp": 86400}));
        for (admin_kubeconfig, kubeconfig) in [(link.clone(), admin.clone()), (admin.clone(), link.clone())] {
            std::fs::write(token_path(&kubeconfig), &good).unwrap();
            let s = MintSettings {
                admin_kubeconfig,
                api_servers: Vec::new(),
                tls_server_name: None,
                request_timeout: Duration::from_millis(200),
                endpoints_cache: None,
                node: "server1".into(),
                kubeconfig,
                lifetime: Duration::from_secs(86400),
                renew_period: Duration::from_secs(900),
                force: false,
            };
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let r = rt.block_on(ensure(&s, 0)).map(drop);
            assert_eq!(std::fs::read_to_string(&admin).unwrap(), before, "k3s.yaml written over: {s:?}");
            assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link replaced: {s:?}");
            let e = r.unwrap_err().to_string();
            assert!(e.contains("is the admin kubeconfig"), "{e}");
        }
    }

    #[test]
    fn the_token_lives_beside_the_kubeconfig() {
        assert_eq!(
            token_path(Path::new("/var/lib/regrade/kubeconfig")),
            Path::new("/var/lib/regrade/kubeconfig.token")
        );
    }
}

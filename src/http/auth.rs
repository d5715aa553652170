//! Bearer-token authentication of the HTTP API.
//!
//! `--api-token-file FILE` holds one `TOKEN SCOPE` per line (`#` starts a comment, blank lines
//! are skipped; a token may be listed once per scope, or with `route,read`). Scopes:
//! `route` for `/v1/route` and `/v1/release`, `read` for `/v1/workers` and `/metrics`.
//! `/healthz` and `/readyz` never need a token (probes carry none). Any other path needs a
//! valid token of either scope, so an unauthenticated caller learns nothing but 401.
//!
//! Tokens are compared in constant time (no early exit on the first differing byte, and every
//! configured token is compared). The file is re-read on SIGHUP; a file that does not parse
//! then keeps the previous tokens.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use subtle::ConstantTimeEq;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// `/v1/route`, `/v1/release`.
    Route,
    /// `/v1/workers`, `/metrics`.
    Read,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Route => "route",
            Scope::Read => "read",
        }
    }

    fn bit(self) -> u8 {
        match self {
            Scope::Route => 1,
            Scope::Read => 2,
        }
    }

    /// The scope a path needs: `None` for the probes, `Some(None)` for any valid token.
    fn needed_for(path: &str) -> Option<Option<Scope>> {
        match path {
            "/healthz" | "/readyz" => None,
            "/v1/route" | "/v1/release" => Some(Some(Scope::Route)),
            "/v1/workers" | "/metrics" => Some(Some(Scope::Read)),
            _ => Some(None),
        }
    }
}

/// Shortest token accepted: a guessable token is no protection.
pub const MIN_TOKEN_LEN: usize = 16;

/// The parsed token file: each token with the set of its scopes.
#[derive(Debug, Default)]
struct TokenSet {
    tokens: Vec<(Box<[u8]>, u8)>,
}

impl TokenSet {
    /// Parses a token file. Errors name the line and never echo a token.
    fn parse(text: &str) -> Result<TokenSet, String> {
        let mut set = TokenSet::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default().trim();
            if line.is_empty() {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [token, scopes] = fields[..] else {
                return Err(format!(
                    "line {}: expected `TOKEN SCOPE`, got {} fields",
                    n + 1,
                    fields.len()
                ));
            };
            if token.len() < MIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "line {}: a token must be at least {MIN_TOKEN_LEN} visible ASCII characters",
                    n + 1
                ));
            }
            let mut bits = 0;
            for scope in scopes.split(',') {
                bits |= match scope {
                    "route" => Scope::Route.bit(),
                    "read" => Scope::Read.bit(),
                    other => {
                        return Err(format!(
                            "line {}: unknown scope {other:?} (scopes: route, read)",
                            n + 1
                        ))
                    }
                };
            }
            match set
                .tokens
                .iter_mut()
                .find(|(t, _)| **t == *token.as_bytes())
            {
                Some((_, existing)) => *existing |= bits,
                None => set.tokens.push((token.as_bytes().into(), bits)),
            }
        }
        if set.tokens.is_empty() {
            return Err("names no token".into());
        }
        Ok(set)
    }

    /// The scopes of `presented`, 0 if it is unknown. Compares against every token, each in
    /// constant time, without an early exit.
    fn scopes_of(&self, presented: &[u8]) -> u8 {
        let mut scopes = 0u8;
        for (token, bits) in &self.tokens {
            let equal = token.as_ref().ct_eq(presented).unwrap_u8();
            scopes |= bits & equal.wrapping_neg();
        }
        scopes
    }
}

/// The API tokens in force, reloadable from their file.
#[derive(Debug)]
pub struct ApiTokens {
    path: PathBuf,
    current: RwLock<Arc<TokenSet>>,
}

/// Why a request was refused (the label of `kvrouted_http_auth_failures_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A token that is not in the file.
    Unknown,
    /// A known token without the scope the endpoint needs.
    Scope,
}

impl AuthFailure {
    pub const ALL: [AuthFailure; 3] = [
        AuthFailure::Missing,
        AuthFailure::Unknown,
        AuthFailure::Scope,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing",
            AuthFailure::Unknown => "unknown",
            AuthFailure::Scope => "scope",
        }
    }
}

fn read_tokens(path: &Path) -> anyhow::Result<TokenSet> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read --api-token-file {}: {e}", path.display()))?;
    TokenSet::parse(&text).map_err(|e| anyhow::anyhow!("--api-token-file {}: {e}", path.display()))
}

impl ApiTokens {
    /// Reads the token file; any problem is a one-line error.
    pub fn load(path: &Path) -> anyhow::Result<ApiTokens> {
        let set = read_tokens(path)?;
        Ok(ApiTokens {
            path: path.to_path_buf(),
            current: RwLock::new(Arc::new(set)),
        })
    }

    /// Re-reads the file. On success the new tokens replace the old ones and their count is
    /// returned; on failure the old tokens stay in force.
    pub fn reload(&self) -> anyhow::Result<usize> {
        let set = read_tokens(&self.path)?;
        let n = set.tokens.len();
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(set);
        Ok(n)
    }

    /// Checks an `Authorization` header value against the scope a path needs (`None`: any
    /// valid token).
    pub fn check(
        &self,
        authorization: Option<&HeaderValue>,
        needed: Option<Scope>,
    ) -> Result<(), AuthFailure> {
        let presented = authorization
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, token) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            })
            .filter(|t| !t.is_empty())
            .ok_or(AuthFailure::Missing)?;
        let set = self
            .current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let scopes = set.scopes_of(presented.as_bytes());
        if scopes == 0 {
            return Err(AuthFailure::Unknown);
        }
        match needed {
            Some(scope) if scopes & scope.bit() == 0 => Err(AuthFailure::Scope),
            _ => Ok(()),
        }
    }
}

/// Middleware: refuses requests without a valid token of the path's scope (401 without or with
/// an unknown token, 403 with the wrong scope), each reply a one-line JSON `error`.
pub async fn require_token(
    State(tokens): State<Arc<ApiTokens>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(needed) = Scope::needed_for(request.uri().path()) else {
        return next.run(request).await;
    };
    match tokens.check(request.headers().get(header::AUTHORIZATION), needed) {
        Ok(()) => next.run(request).await,
        Err(failure) => {
            metrics::counter!("kvrouted_http_auth_failures_total", "reason" => failure.as_str())
                .increment(1);
            let (status, message) = match failure {
                AuthFailure::Missing => (
                    StatusCode::UNAUTHORIZED,
                    "missing bearer token: send Authorization: Bearer TOKEN".to_string(),
                ),
                AuthFailure::Unknown => (StatusCode::UNAUTHORIZED, "unknown token".to_string()),
                AuthFailure::Scope => (
                    StatusCode::FORBIDDEN,
                    format!(
                        "this token lacks the {} scope",
                        needed.map_or("", Scope::as_str)
                    ),
                ),
            };
            let mut response = (status, Json(json!({ "error": message }))).into_response();
            if status == StatusCode::UNAUTHORIZED {
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            response
        }
    }
}

/// The client side: how an HTTP client of kvrouted (such as a command that drives the API)
/// takes its bearer token. Flatten into the client's arguments and call
/// [`ApiClientArgs::bearer`].
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ApiClientArgs {
    /// Bearer token for the kvrouted API (prefer the environment variable: flags show in
    /// process lists)
    #[arg(long, env = "KVROUTED_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// The daemon's token file: the first token with the needed scope is used (--api-token,
    /// when given, wins)
    #[arg(long, env = "KVROUTED_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
}

impl ApiClientArgs {
    /// The token to send as `Authorization: Bearer ...` for requests that need `scope`, if any
    /// was configured.
    pub fn bearer(&self, scope: Scope) -> anyhow::Result<Option<String>> {
        if let Some(token) = &self.api_token {
            return Ok(Some(token.clone()));
        }
        let Some(path) = &self.api_token_file else {
            return Ok(None);
        };
        let set = read_tokens(path)?;
        let token = set
            .tokens
            .iter()
            .find(|(_, bits)| bits & scope.bit() != 0)
            .map(|(t, _)| String::from_utf8_lossy(t).into_owned());
        match token {
            Some(t) => Ok(Some(t)),
            None => anyhow::bail!(
                "--api-token-file {} has no token with the {} scope",
                path.display(),
                scope.as_str()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTER: &str = "route-token-0123456789";
    const READER: &str = "read-token-0123456789";

    fn tokens(text: &str) -> ApiTokens {
        ApiTokens {
            path: PathBuf::new(),
            current: RwLock::new(Arc::new(TokenSet::parse(text).unwrap())),
        }
    }

    fn bearer(token: &str) -> HeaderValue {
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap()
    }

    #[test]
    fn a_token_opens_only_the_endpoints_of_its_scopes() {
        let t = tokens(&format!(
            "# gateways\n{ROUTER} route\n\n{READER} read # dashboards\n"
        ));
        assert_eq!(t.check(Some(&bearer(ROUTER)), Some(Scope::Route)), Ok(()));
        assert_eq!(
            t.check(Some(&bearer(ROUTER)), Some(Scope::Read)),
            Err(AuthFailure::Scope),
            "a route token does not read"
        );
        assert_eq!(t.check(Some(&bearer(READER)), Some(Scope::Read)), Ok(()));
        assert_eq!(
            t.check(Some(&bearer(READER)), Some(Scope::Route)),
            Err(AuthFailure::Scope)
        );
        assert_eq!(
            t.check(Some(&bearer(READER)), None),
            Ok(()),
            "any valid token passes where no scope is needed"
        );
    }

    #[test]
    fn missing_malformed_and_unknown_tokens_are_told_apart() {
        let t = tokens(&format!("{ROUTER} route,read"));
        assert_eq!(t.check(None, Some(Scope::Route)), Err(AuthFailure::Missing));
        let basic = HeaderValue::from_static("Basic dXNlcjpwYXNz");
        assert_eq!(
            t.check(Some(&basic), Some(Scope::Route)),
            Err(AuthFailure::Missing)
        );
        assert_eq!(
            t.check(Some(&bearer("route-token-0123456788")), Some(Scope::Route)),
            Err(AuthFailure::Unknown),
            "a token one byte off is unknown"
        );
        assert_eq!(
            t.check(
                Some(&bearer(&ROUTER[..ROUTER.len() - 1])),
                Some(Scope::Route)
            ),
            Err(AuthFailure::Unknown),
            "a prefix of a token is unknown"
        );
        assert_eq!(
            t.check(Some(&bearer(ROUTER)), Some(Scope::Read)),
            Ok(()),
            "route,read grants both"
        );
    }

    #[test]
    fn a_bad_token_file_names_the_line_and_not_the_token() {
        for (text, expected) in [
            ("", "names no token"),
            ("# only a comment\n", "names no token"),
            (
                &format!("{ROUTER}\n") as &str,
                "line 1: expected `TOKEN SCOPE`",
            ),
            (
                &format!("\n{ROUTER} write\n"),
                "line 2: unknown scope \"write\"",
            ),
            ("short route\n", "line 1: a token must be at least 16"),
        ] {
            let err = TokenSet::parse(text).unwrap_err();
            assert!(err.starts_with(expected), "{text:?}: {err}");
            assert!(!err.contains(ROUTER), "errors never echo a token: {err}");
        }
    }

    #[test]
    fn the_probes_need_no_token_and_unknown_paths_need_one() {
        assert_eq!(Scope::needed_for("/healthz"), None);
        assert_eq!(Scope::needed_for("/readyz"), None);
        assert_eq!(Scope::needed_for("/v1/release"), Some(Some(Scope::Route)));
        assert_eq!(Scope::needed_for("/metrics"), Some(Some(Scope::Read)));
        assert_eq!(Scope::needed_for("/v1/other"), Some(None));
    }

    #[test]
    fn a_client_takes_the_first_token_of_the_scope_it_needs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, format!("{READER} read\n{ROUTER} route\n")).unwrap();
        let args = ApiClientArgs {
            api_token: None,
            api_token_file: Some(path),
        };
        assert_eq!(args.bearer(Scope::Route).unwrap().as_deref(), Some(ROUTER));
        assert_eq!(args.bearer(Scope::Read).unwrap().as_deref(), Some(READER));
        assert_eq!(ApiClientArgs::default().bearer(Scope::Route).unwrap(), None);
    }
}

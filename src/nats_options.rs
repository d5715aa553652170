//! How kvrouted connects to NATS: the server URL, the credentials it presents and its TLS
//! settings. One set of flags ([`NatsArgs`]) for every command that talks to the broker, so each
//! takes the same credentials the same way.
//!
//! Credentials (at most one kind): `--nats-creds FILE` (a JWT and nkey seed, as `nsc` writes
//! them), `--nats-nkey FILE` (an nkey seed), `--nats-user`/`--nats-password` (or
//! `user:password@` in the URL), `--nats-token` (or `token@` in the URL). TLS: `--nats-tls-ca`
//! to trust a private CA, `--nats-tls-cert`/`--nats-tls-key` for a client certificate; any of
//! them (or a `tls://` URL) makes TLS required.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use async_nats::{ConnectOptions, ServerAddr};
use clap::Args;

/// NATS connection flags. Commands flatten this into their own arguments
/// (`#[command(flatten)] nats: NatsArgs`) and connect with [`NatsArgs::connect`].
#[derive(Debug, Clone, Args)]
pub struct NatsArgs {
    /// NATS server(s), comma-separated; `nats://user:password@host:port` or `nats://token@host`
    /// carry credentials (prefer the flags or environment below: a URL shows in process lists)
    #[arg(
        long,
        env = "KVROUTED_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    /// Credentials file with a user JWT and nkey seed (as written by `nsc`)
    #[arg(long, env = "KVROUTED_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// File holding an nkey seed (`SU...`) to authenticate with
    #[arg(long, env = "KVROUTED_NATS_NKEY")]
    pub nats_nkey: Option<PathBuf>,
    /// User name to authenticate with (with --nats-password)
    #[arg(long, env = "KVROUTED_NATS_USER", requires = "nats_password")]
    pub nats_user: Option<String>,
    /// Password of --nats-user (prefer the environment variable: flags show in process lists)
    #[arg(
        long,
        env = "KVROUTED_NATS_PASSWORD",
        requires = "nats_user",
        hide_env_values = true
    )]
    pub nats_password: Option<String>,
    /// Authentication token (prefer the environment variable: flags show in process lists)
    #[arg(long, env = "KVROUTED_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// PEM file of the CA(s) that signed the server's certificate; makes TLS required
    #[arg(long, env = "KVROUTED_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate for servers that verify clients (with --nats-tls-key)
    #[arg(long, env = "KVROUTED_NATS_TLS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM private key of --nats-tls-cert
    #[arg(long, env = "KVROUTED_NATS_TLS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,
}

/// Credentials found in a server URL (`user:password@` or `token@`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum UrlAuth {
    UserPassword(String, String),
    Token(String),
}

/// One server URL split into the address to dial (without credentials) and its credentials.
fn split_url(raw: &str) -> anyhow::Result<(ServerAddr, Option<UrlAuth>)> {
    let with_scheme = if raw.contains("://") {
        raw.to_string()
    } else {
        format!("nats://{raw}")
    };
    let mut url = url::Url::parse(&with_scheme)
        .with_context(|| format!("invalid NATS url {}", redact(raw)))?;
    let decode = |s: &str| {
        url::form_urlencoded::parse(format!("x={s}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default()
    };
    let auth = match (url.username(), url.password()) {
        ("", None) => None,
        (user, Some(password)) => Some(UrlAuth::UserPassword(decode(user), decode(password))),
        (token, None) => Some(UrlAuth::Token(decode(token))),
    };
    let _ = url.set_username("");
    let _ = url.set_password(None);
    let addr = ServerAddr::from_str(url.as_str())
        .map_err(|e| anyhow::anyhow!("invalid NATS url {}: {e}", redact(raw)))?;
    Ok((addr, auth))
}

/// A URL list with any `user:password@` or `token@` replaced by `***@`, for logs and errors.
pub fn redact(urls: &str) -> String {
    urls.split(',')
        .map(|u| match (u.find("://"), u.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                format!("{}***{}", &u[..scheme + 3], &u[at..])
            }
            (None, Some(at)) => format!("***{}", &u[at..]),
            _ => u.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn readable(path: &Path, flag: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {flag} {}", path.display()))
}

impl NatsArgs {
    /// The server URL(s) with credentials masked, for logs.
    pub fn redacted_url(&self) -> String {
        redact(&self.nats_url)
    }

    /// The servers to dial, without the credentials a URL may carry.
    pub fn server_addrs(&self) -> anyhow::Result<Vec<ServerAddr>> {
        self.split_urls().map(|(addrs, _)| addrs)
    }

    fn split_urls(&self) -> anyhow::Result<(Vec<ServerAddr>, Option<UrlAuth>)> {
        let mut addrs = Vec::new();
        let mut auth: Option<UrlAuth> = None;
        for raw in self
            .nats_url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
        {
            let (addr, url_auth) = split_url(raw)?;
            if let Some(a) = url_auth {
                if auth.as_ref().is_some_and(|prev| *prev != a) {
                    bail!(
                        "the NATS urls {} carry different credentials; give one set",
                        self.redacted_url()
                    );
                }
                auth = Some(a);
            }
            addrs.push(addr);
        }
        if addrs.is_empty() {
            bail!("--nats-url names no server");
        }
        Ok((addrs, auth))
    }

    /// Connect options carrying these credentials and TLS settings. Files are read now, so a
    /// missing or unreadable one is an error at start, not a reconnect loop. Add the caller's
    /// own settings (name, reconnect policy, event callback) and pass the result to
    /// [`NatsArgs::connect`].
    pub fn connect_options(&self) -> anyhow::Result<ConnectOptions> {
        let (addrs, url_auth) = self.split_urls()?;
        let mut kinds = Vec::new();
        if self.nats_creds.is_some() {
            kinds.push("--nats-creds");
        }
        if self.nats_nkey.is_some() {
            kinds.push("--nats-nkey");
        }
        if self.nats_user.is_some() {
            kinds.push("--nats-user");
        }
        if self.nats_token.is_some() {
            kinds.push("--nats-token");
        }
        if url_auth.is_some() {
            kinds.push("credentials in --nats-url");
        }
        if kinds.len() > 1 {
            bail!(
                "give one kind of NATS credentials, not {}",
                kinds.join(" and ")
            );
        }
        let mut options = ConnectOptions::new();
        if let Some(path) = &self.nats_creds {
            let text = readable(path, "--nats-creds")?;
            options = ConnectOptions::with_credentials(&text)
                .map_err(|e| anyhow::anyhow!("--nats-creds {}: {e}", path.display()))?;
        } else if let Some(path) = &self.nats_nkey {
            let seed = readable(path, "--nats-nkey")?.trim().to_string();
            if let Err(e) = nkey_public(&seed) {
                bail!("--nats-nkey {}: not an nkey seed: {e}", path.display());
            }
            options = options.nkey(seed);
        } else if let (Some(user), Some(password)) = (&self.nats_user, &self.nats_password) {
            options = options.user_and_password(user.clone(), password.clone());
        } else if let Some(token) = &self.nats_token {
            options = options.token(token.clone());
        } else {
            match url_auth {
                Some(UrlAuth::UserPassword(user, password)) => {
                    options = options.user_and_password(user, password)
                }
                Some(UrlAuth::Token(token)) => options = options.token(token),
                None => {}
            }
        }
        let tls_url = addrs.iter().any(|a| a.tls_required());
        if let Some(ca) = &self.nats_tls_ca {
            readable(ca, "--nats-tls-ca")?;
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&self.nats_tls_cert, &self.nats_tls_key) {
            readable(cert, "--nats-tls-cert")?;
            readable(key, "--nats-tls-key")?;
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if tls_url || self.nats_tls_ca.is_some() || self.nats_tls_cert.is_some() {
            options = options.require_tls(true);
        }
        Ok(options)
    }

    /// Options for a long-running process named `name`: these credentials and TLS, retrying the
    /// first connect and every reconnect with backoff for as long as it runs. Refusals that
    /// retrying will not fix (credentials, TLS, permissions) are clear, rate-limited error lines
    /// ([`RefusalLog`]); `on_connection` hears every connect (`true`) and disconnect (`false`).
    pub fn reconnecting_options(
        &self,
        name: &str,
        on_connection: impl Fn(bool) + Send + Sync + 'static,
    ) -> anyhow::Result<ConnectOptions> {
        let refusals = std::sync::Arc::new(RefusalLog::default());
        let on_connection = std::sync::Arc::new(on_connection);
        Ok(self
            .connect_options()?
            .name(name)
            .retry_on_initial_connect()
            .max_reconnects(None)
            .event_callback(move |event| {
                let refusals = refusals.clone();
                let on_connection = on_connection.clone();
                async move {
                    if refusals.record(&event) {
                        return;
                    }
                    match event {
                        async_nats::Event::Connected => {
                            on_connection(true);
                            tracing::info!("NATS connected");
                        }
                        async_nats::Event::Disconnected => on_connection(false),
                        other => tracing::info!("NATS: {other}"),
                    }
                }
            }))
    }

    /// Connects with `options` (from [`NatsArgs::connect_options`], plus the caller's settings)
    /// to the configured servers.
    pub async fn connect(&self, options: ConnectOptions) -> anyhow::Result<async_nats::Client> {
        let addrs = self.server_addrs()?;
        options
            .connect(addrs)
            .await
            .with_context(|| format!("cannot connect to NATS at {}", self.redacted_url()))
    }
}

/// Checks an nkey seed (`nkeys` is what async-nats signs with).
fn nkey_public(seed: &str) -> Result<String, String> {
    nkeys::KeyPair::from_seed(seed)
        .map(|k| k.public_key())
        .map_err(|e| e.to_string())
}

/// Turns connection events into clear, rate-limited error lines for refusals that retrying
/// will not fix by itself: the broker rejected our credentials, or TLS failed. Without it a
/// broker that refuses us looks like a silent reconnect loop.
#[derive(Debug, Default)]
pub struct RefusalLog {
    last: Mutex<Option<(Instant, u64)>>,
}

/// How often a repeated refusal is logged again.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// Why the broker refused a connection attempt or an operation, if the event says so: a bounded
/// label for the counter (`authorization`, `tls`, `permissions`) and a one-line explanation.
pub fn refusal(event: &async_nats::Event) -> Option<(&'static str, String)> {
    let text = match event {
        async_nats::Event::ClientError(e) => e.to_string(),
        async_nats::Event::ServerError(async_nats::ServerError::AuthorizationViolation) => {
            "authorization violation".to_string()
        }
        async_nats::Event::ServerError(e) => {
            let text = e.to_string();
            return text
                .to_ascii_lowercase()
                .contains("permissions violation")
                .then(|| {
                    (
                        "permissions",
                        format!(
                            "the NATS server refused an operation of ours ({text}); check the \
                         permissions of our user on the server"
                        ),
                    )
                });
        }
        _ => return None,
    };
    let lower = text.to_ascii_lowercase();
    if lower.contains("authorization") || lower.contains("authentication") {
        Some((
            "authorization",
            format!(
                "the NATS server refused our credentials ({text}); check --nats-creds, \
                 --nats-nkey, --nats-user/--nats-password, --nats-token or the url's \
                 user:password@ against the server's accounts; retrying"
            ),
        ))
    } else if lower.contains("tls") || lower.contains("certificate") {
        Some((
            "tls",
            format!(
                "TLS with the NATS server failed ({text}); check --nats-tls-ca, \
                 --nats-tls-cert/--nats-tls-key and the url scheme; retrying"
            ),
        ))
    } else {
        None
    }
}

impl RefusalLog {
    /// Counts a refusal (`kvrouted_nats_refused_total{reason}`) and logs it at ERROR: the first
    /// one at once, repeats at most every 10s with how many were suppressed. Returns whether
    /// the event was a refusal.
    pub fn record(&self, event: &async_nats::Event) -> bool {
        let Some((reason, message)) = refusal(event) else {
            return false;
        };
        metrics::counter!("kvrouted_nats_refused_total", "reason" => reason).increment(1);
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match last.as_mut() {
            Some((at, suppressed)) if now.duration_since(*at) < REFUSAL_LOG_EVERY => {
                *suppressed += 1;
            }
            _ => {
                let suppressed = last.map_or(0, |(_, s)| s);
                tracing::error!(reason, suppressed, "{message}");
                *last = Some((now, 0));
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        nats: NatsArgs,
    }

    fn args(argv: &[&str]) -> NatsArgs {
        Cli::try_parse_from(std::iter::once("t").chain(argv.iter().copied()))
            .unwrap()
            .nats
    }

    #[test]
    fn user_and_password_in_the_url_become_credentials_and_leave_the_address() {
        let (addr, auth) = split_url("nats://alice:s%40cret@127.0.0.1:4222").unwrap();
        assert_eq!(
            auth,
            Some(UrlAuth::UserPassword("alice".into(), "s@cret".into())),
            "user:password@ in the url are used, percent-decoded"
        );
        assert!(
            !format!("{addr:?}").contains("alice"),
            "the dialled address carries no credentials: {addr:?}"
        );
        let (_, auth) = split_url("nats://tok3n@127.0.0.1:4222").unwrap();
        assert_eq!(auth, Some(UrlAuth::Token("tok3n".into())));
        let (_, auth) = split_url("127.0.0.1:4222").unwrap();
        assert_eq!(auth, None);
    }

    #[test]
    fn logged_urls_hide_credentials() {
        assert_eq!(
            redact("nats://alice:secret@h:4222,tls://t@g:4443,nats://h2:4222"),
            "nats://***@h:4222,tls://***@g:4443,nats://h2:4222"
        );
    }

    #[test]
    fn two_kinds_of_credentials_are_refused_at_start() {
        let err = args(&[
            "--nats-url",
            "nats://a:b@127.0.0.1:4222",
            "--nats-token",
            "t",
        ])
        .connect_options()
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--nats-token") && err.contains("credentials in --nats-url"),
            "{err}"
        );
    }

    #[test]
    fn an_unreadable_credentials_file_is_an_error_at_start() {
        let err = args(&["--nats-creds", "/nonexistent/kvrouted.creds"])
            .connect_options()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--nats-creds") && err.contains("/nonexistent/kvrouted.creds"),
            "{err}"
        );
    }

    #[test]
    fn a_broker_refusing_our_credentials_is_named_as_such() {
        let event = async_nats::Event::ClientError(async_nats::ClientError::Other(
            "authorization violation".into(),
        ));
        let (reason, message) = refusal(&event).expect("an authorization refusal is recognised");
        assert_eq!(reason, "authorization");
        assert!(message.contains("--nats-user"), "{message}");
        assert!(refusal(&async_nats::Event::Connected).is_none());
        let denied = async_nats::Event::ServerError(async_nats::ServerError::Other(
            "permissions violation for subscription to \"kv.>\"".into(),
        ));
        assert_eq!(refusal(&denied).map(|r| r.0), Some("permissions"));
    }
}

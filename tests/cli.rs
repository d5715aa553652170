//! The command line of docs/architecture.md, "Command line and configuration", from outside: `serve
//! --help` documents every flag with its default; settings come from flags over the environment
//! (`KVROUTED_...`) over a TOML file (`--config`), observed through the running daemon; bad
//! configuration and a locked data dir stop the daemon at start with a non-zero exit and one clear
//! line.
mod common;

use std::net::{SocketAddr, TcpStream};
use std::process::Command;

use common::*;
use serde_json::json;
use tempfile::TempDir;

fn kvrouted() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvrouted"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KVROUTED_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// The paragraph of `--help` output documenting `flag`: its line and the description under it.
fn help_entry<'a>(help: &'a str, flag: &str) -> Option<String> {
    let lines: Vec<&'a str> = help.lines().collect();
    let start = lines.iter().position(|l| {
        let l = l.trim_start();
        l == flag
            || l.strip_prefix(flag)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('='))
    })?;
    let entry: Vec<&str> = std::iter::once(lines[start])
        .chain(
            lines[start + 1..]
                .iter()
                .copied()
                .take_while(|l| !l.trim_start().starts_with('-')),
        )
        .collect();
    Some(entry.join(" "))
}

/// The README's flag table: each flag with the default the README gives it. Rows like
/// `` `--a` / `--b` + `--c` `` with defaults `x / y` give `--a` the default `x` and both `--b`
/// and `--c` the default `y`; a single default applies to every flag of its row.
fn readme_flags() -> Vec<(String, String)> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md is readable");
    let table = readme
        .split_once("| flag | default | meaning |")
        .expect("the README has the flag table")
        .1;
    let mut flags = Vec::new();
    for row in table.lines().skip(2).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = row.split(" | ").collect();
        let (names, defaults) = (cells[0].trim_start_matches("| "), cells[1]);
        let groups: Vec<&str> = names.split(" / ").collect();
        let defaults: Vec<&str> = defaults.split(" / ").collect();
        for (i, group) in groups.iter().enumerate() {
            let default = if defaults.len() == groups.len() {
                defaults[i]
            } else {
                defaults[0]
            };
            for name in group.split(" + ") {
                let flag = name.trim().trim_matches('`');
                let flag = flag.split_whitespace().next().unwrap_or(flag); // `--flag NAME=SIZE`
                assert!(
                    flag.starts_with("--"),
                    "a README flag cell names flags: {row}"
                );
                flags.push((
                    flag.to_string(),
                    default.trim().trim_matches('`').to_string(),
                ));
            }
        }
    }
    flags
}

/// A default as `--help` prints it: sizes in bytes, no digit grouping.
fn as_help_prints_it(default: &str) -> String {
    let plain = default.replace(',', "");
    for (unit, shift) in [(" GiB", 30), (" MiB", 20)] {
        if let Some(n) = plain.strip_suffix(unit).and_then(|n| n.parse::<u64>().ok()) {
            return (n << shift).to_string();
        }
    }
    plain
}

/// The daemon's defaults are written once, in its flag definitions: `--help` shows them, and
/// the README's flag table must say the same (checked here rather than restated).
#[test]
fn serve_help_documents_every_flag_of_the_readme_table_with_the_readme_default() {
    let mut cmd = kvrouted();
    cmd.args(["serve", "--help"]);
    let (status, help, stderr) = run_to_exit(cmd);
    assert!(status.success(), "serve --help succeeds: {stderr}");
    let flags = readme_flags();
    assert!(
        flags.len() >= 40,
        "the README table lists the daemon's flags ({} found)",
        flags.len()
    );
    for (flag, default) in flags {
        let entry = help_entry(&help, &flag)
            .unwrap_or_else(|| panic!("serve --help lists {flag}:\n{help}"));
        let env = format!(
            "[env: KVROUTED_{}",
            flag.trim_start_matches('-')
                .replace('-', "_")
                .to_uppercase()
        );
        // Secrets are shown without their value: `[env: NAME]`.
        assert!(
            entry.contains(&format!("{env}=")) || entry.contains(&format!("{env}]")),
            "{flag} names its environment variable {env}...]: {entry}"
        );
        let described = entry
            .split_once(flag.as_str())
            .map(|(_, rest)| rest.replace(['[', ']'], " "))
            .unwrap_or_default();
        assert!(
            described.split_whitespace().count() > 4,
            "{flag} is explained, not only listed: {entry}"
        );
        let shown = entry
            .split_once("[default: ")
            .map(|(_, rest)| rest.split(']').next().unwrap_or_default().to_string());
        match (default.as_str(), shown) {
            // No value, or a switch that is off unless given.
            ("none", None) | ("off", None) => {}
            (readme, Some(shown)) => assert_eq!(
                as_help_prints_it(readme),
                shown,
                "the README's default of {flag} is the one --help shows: {entry}"
            ),
            (readme, None) => {
                panic!("{flag}: the README says {readme}, --help shows no default: {entry}")
            }
        }
    }
}

/// Writes `text` as a TOML config file in `dir`.
fn config_file(dir: &TempDir, text: &str) -> String {
    let path = dir.path().join("kvrouted.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

fn listening(addr: SocketAddr) -> bool {
    TcpStream::connect(addr).is_ok()
}

/// The one owner of a prefix is pressured and a cool worker is a safe home: the decision is
/// `pressure_spill` when the owner ceiling allows a second owner, `ceiling_hold` at a ceiling
/// of 1. Returns the decision label.
async fn owner_ceiling_decision(daemon: &Daemon, nats: &Nats) -> String {
    daemon.wait_ready().await;
    let mut owner = Worker::connect(&nats.url(), "owner").await;
    let cool = Worker::connect(&nats.url(), "cool").await;
    let tokens = prompt(1, 8);
    owner.store(&tokens).await;
    owner.load(0.95).await;
    cool.load(0.1).await;
    daemon.wait_blocks("owner", 8).await;
    daemon.wait_load("owner", 0.95).await;
    daemon.wait_load("cool", 0.1).await;
    let (status, body) = daemon.route(&tokens, json!({})).await;
    assert_eq!(status, 200, "{body}");
    body["decision"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_file_sets_what_no_flag_or_environment_variable_overrides() {
    let nats = Nats::start();
    let dir = TempDir::new().unwrap();
    let file_addr = free_addr();
    let file = config_file(
        &dir,
        &format!(
            "http-addr = \"{file_addr}\"\nmax-owners-per-prefix = 1\nspill-cooldown = \"60s\"\n"
        ),
    );
    let mut daemon = Daemon::new(&nats.url(), &["--config", &file]);
    daemon.pass_http_addr = false;
    daemon.http = file_addr;
    daemon.restart().await; // waits for /healthz on the file's address
    assert_eq!(
        owner_ceiling_decision(&daemon, &nats).await,
        "ceiling_hold",
        "the file's max-owners-per-prefix = 1 is in force"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_overrides_the_config_file() {
    let nats = Nats::start();
    let dir = TempDir::new().unwrap();
    let (file_addr, env_addr) = (free_addr(), free_addr());
    let file = config_file(
        &dir,
        &format!("http-addr = \"{file_addr}\"\nmax-owners-per-prefix = 1\n"),
    );
    let mut daemon = Daemon::new(&nats.url(), &["--config", &file]);
    daemon.pass_http_addr = false;
    daemon.http = env_addr;
    daemon.env = vec![
        ("KVROUTED_HTTP_ADDR".into(), env_addr.to_string()),
        ("KVROUTED_MAX_OWNERS_PER_PREFIX".into(), "4".into()),
    ];
    daemon.restart().await; // waits for /healthz on the environment's address
    assert!(
        !listening(file_addr),
        "KVROUTED_HTTP_ADDR wins over the file's http-addr: nothing listens on {file_addr}"
    );
    assert_eq!(
        owner_ceiling_decision(&daemon, &nats).await,
        "pressure_spill",
        "KVROUTED_MAX_OWNERS_PER_PREFIX=4 wins over the file's 1: a second owner may be created"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flags_override_the_environment_and_the_config_file() {
    let nats = Nats::start();
    let dir = TempDir::new().unwrap();
    let (file_addr, env_addr, flag_addr) = (free_addr(), free_addr(), free_addr());
    let file = config_file(
        &dir,
        &format!("http-addr = \"{file_addr}\"\nmax-owners-per-prefix = 2\n"),
    );
    let mut daemon = Daemon::new(
        &nats.url(),
        &["--config", &file, "--max-owners-per-prefix", "1"],
    );
    daemon.http = flag_addr; // passed as --http-addr
    daemon.env = vec![
        ("KVROUTED_HTTP_ADDR".into(), env_addr.to_string()),
        ("KVROUTED_MAX_OWNERS_PER_PREFIX".into(), "3".into()),
    ];
    daemon.restart().await; // waits for /healthz on the flag's address
    assert!(
        !listening(file_addr) && !listening(env_addr),
        "--http-addr wins over the environment and the file: nothing listens on {env_addr} or \
         {file_addr}"
    );
    assert_eq!(
        owner_ceiling_decision(&daemon, &nats).await,
        "ceiling_hold",
        "--max-owners-per-prefix 1 wins over the environment's 3 and the file's 2"
    );
}

/// Starts `serve --config <file with text>` plus `flags`, which must exit at once; returns
/// its status, stderr and the file's path.
fn serve_with_config(text: &str, flags: &[&str]) -> (std::process::ExitStatus, String, String) {
    let dir = TempDir::new().unwrap();
    let file = config_file(&dir, text);
    let data_dir = dir.path().join("data");
    let mut cmd = kvrouted();
    cmd.args([
        "serve",
        "--config",
        &file,
        "--nats-url",
        "nats://127.0.0.1:1",
    ])
    .arg("--data-dir")
    .arg(&data_dir)
    .args(["--http-addr", &free_addr().to_string()])
    .args(flags);
    let (status, _, stderr) = run_to_exit(cmd);
    (status, stderr, file)
}

#[test]
fn a_bad_config_file_exits_non_zero_with_one_line_naming_the_problem() {
    let cases: &[(&str, &str, &[&str], &[&str])] = &[
        (
            "an unknown setting",
            "max-owner-per-prefix = 2\n",
            &[],
            &["max-owner-per-prefix", "unknown setting"],
        ),
        (
            "a duration without its unit",
            "spill-cooldown = \"5\"\n",
            &[],
            &["spill-cooldown", "'5'", "unit"],
        ),
        (
            "a duration without its unit, even when a flag overrides it",
            "spill-cooldown = \"5\"\n",
            &["--spill-cooldown", "1s"],
            &["spill-cooldown", "'5'", "unit"],
        ),
        (
            "a fraction out of range",
            "pressure-high-water = 1.5\n",
            &[],
            &["pressure-high-water", "1.5"],
        ),
        (
            "a number that is not one",
            "max-owners-per-prefix = \"many\"\n",
            &[],
            &["max-owners-per-prefix", "many"],
        ),
        (
            "a boolean for a setting that takes a value",
            "block-size = true\n",
            &[],
            &["block-size", "boolean"],
        ),
        (
            "a string for a switch",
            "no-jetstream = \"yes\"\n",
            &[],
            &["no-jetstream", "true or false"],
        ),
        (
            "a table for a setting",
            "http-addr = { host = \"x\" }\n",
            &[],
            &["http-addr", "table"],
        ),
        (
            "a file that is not TOML",
            "this is = = not toml\n",
            &[],
            &["invalid TOML", "line 1"],
        ),
    ];
    for (what, text, flags, named) in cases {
        let (status, stderr, file) = serve_with_config(text, flags);
        assert!(
            !status.success() && status.code().is_some(),
            "{what}: the daemon refuses to start and exits with an error code ({status}): {stderr}"
        );
        let message = stderr.trim();
        assert_eq!(
            message.lines().count(),
            1,
            "{what}: the message is one line: {message:?}"
        );
        for part in named.iter().copied().chain([file.as_str()]) {
            assert!(
                message.contains(part),
                "{what}: the message names {part:?}: {message:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_on_a_locked_data_dir_exits_non_zero_with_a_clear_message() {
    let nats = Nats::start();
    let mut first = Daemon::start(&nats.url(), &[]).await;
    first.wait_ready().await;

    let mut second = Daemon::new(&nats.url(), &[]);
    second.data_dir = first.data_dir.clone();
    let (status, stderr) = second.run_expecting_exit();
    assert!(
        !status.success(),
        "the second daemon must not start on a data dir in use ({status}): {stderr}"
    );
    let last = stderr.trim().lines().last().unwrap_or_default();
    assert!(
        last.contains("in use") && last.contains(&first.data_dir.display().to_string()),
        "the message says the data dir is in use and names it: {stderr}"
    );
    assert!(
        !listening(second.http),
        "the refused daemon never served HTTP"
    );
    assert!(first.is_running(), "the first daemon is unaffected");
    first.wait_ready().await;
}

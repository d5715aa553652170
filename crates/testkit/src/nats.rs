//! A nats-server process with JetStream on a free loopback port and its own storage dir,
//! killed on drop.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use tempfile::TempDir;

use crate::processes::{free_port, nats_server_bin, wait_for_port};

/// A nats-server with JetStream on a free port and its own storage dir.
pub struct Nats {
    child: Option<Child>,
    pub port: u16,
    dir: TempDir,
    /// nats-server configuration text (authorization, TLS), if started with one.
    config: Option<String>,
}

impl Nats {
    pub fn start() -> Nats {
        let mut nats = Nats {
            child: None,
            port: free_port(),
            dir: TempDir::new().unwrap(),
            config: None,
        };
        nats.restart();
        nats
    }

    /// A nats-server with JetStream on a free port and its own storage dir, with this
    /// configuration text added (e.g. an `authorization` or `tls` block).
    pub fn start_with_config(config: &str) -> Nats {
        let mut nats = Nats {
            child: None,
            port: free_port(),
            dir: TempDir::new().unwrap(),
            config: Some(config.to_string()),
        };
        nats.restart();
        nats
    }

    /// A scratch dir that lives as long as the server (for its certificates and keys).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port with the same storage.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "nats-server already running");
        let log = std::fs::File::create(self.dir.path().join("nats.log")).unwrap();
        let mut cmd = Command::new(nats_server_bin());
        cmd.args([
            "-a",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-js",
            "-sd",
        ])
        .arg(self.dir.path().join("js"));
        if let Some(config) = &self.config {
            let path = self.dir.path().join("nats.conf");
            std::fs::write(&path, config).unwrap();
            cmd.arg("-c").arg(path);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        wait_for_port(self.port, "nats-server");
    }

    /// Deletes the stopped server's JetStream storage: the next [`Nats::restart`] comes back
    /// empty, without streams or consumers.
    pub fn wipe_storage(&mut self) {
        assert!(self.child.is_none(), "stop nats-server first");
        let _ = std::fs::remove_dir_all(self.dir.path().join("js"));
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
    }
}

//! A nats-server process with JetStream on a free loopback port and its own storage dir,
//! killed on drop.

use std::process::{Child, Command, Stdio};

use tempfile::TempDir;

use crate::processes::{free_port, nats_server_bin, wait_for_port};

/// A nats-server with JetStream on a free port and its own storage dir.
pub struct Nats {
    child: Option<Child>,
    pub port: u16,
    dir: TempDir,
}

impl Nats {
    pub fn start() -> Nats {
        let mut nats = Nats {
            child: None,
            port: free_port(),
            dir: TempDir::new().unwrap(),
        };
        nats.restart();
        nats
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port with the same storage.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "nats-server already running");
        let log = std::fs::File::create(self.dir.path().join("nats.log")).unwrap();
        let child = Command::new(nats_server_bin())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path().join("js"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        wait_for_port(self.port, "nats-server");
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

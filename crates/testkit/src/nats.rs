//! A nats-server process with JetStream on a free loopback port and its own storage dir,
//! killed on drop; and a 3-server cluster of them.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use tempfile::TempDir;

use crate::poll::{eventually, poll_until};
use crate::ports::free_port;
use crate::processes::{nats_server_bin, read_log, LISTEN_DEADLINE};

/// Starts on fresh ports before giving up. A port picked free can still be taken before the
/// server binds it by a server another test process started ([`free_port`] keeps ports off the
/// range outgoing connections take theirs from, and never repeats one within a process); the
/// server then exits at once.
const START_ATTEMPTS: usize = 5;

/// What `try_start` starts, tried again on fresh ports (each try picks its own) after each
/// start that fails, up to [`START_ATTEMPTS`]; panics with every failure, naming `what`.
fn on_fresh_ports<T>(what: &str, mut try_start: impl FnMut() -> Result<T, String>) -> T {
    let mut failures = Vec::new();
    for _ in 0..START_ATTEMPTS {
        match try_start() {
            Ok(started) => return started,
            Err(why) => failures.push(why),
        }
    }
    panic!("{what} did not start in {START_ATTEMPTS} attempts: {failures:#?}");
}

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
        on_fresh_ports("nats-server", || Nats::try_start(None))
    }

    /// A nats-server with JetStream on a free port and its own storage dir, with this
    /// configuration text added (e.g. an `authorization` or `tls` block).
    pub fn start_with_config(config: &str) -> Nats {
        on_fresh_ports("nats-server", || Nats::try_start(Some(config.to_string())))
    }

    /// One start on a free port, or why the server exited.
    fn try_start(config: Option<String>) -> Result<Nats, String> {
        let mut nats = Nats {
            child: None,
            port: free_port(),
            dir: TempDir::new().unwrap(),
            config,
        };
        nats.spawn()?;
        Ok(nats)
    }

    /// A scratch dir that lives as long as the server (for its certificates and keys).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's process id (a benchmark reads its CPU time, and a watchdog kills it); None
    /// while it is stopped.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts (again) on the same port with the same storage.
    pub fn restart(&mut self) {
        if let Err(why) = self.spawn() {
            panic!("nats-server did not start again: {why}");
        }
    }

    /// Starts the server and waits until it says it is ready; `Err` with its log when it exits
    /// first (its port taken). Panics when it neither gets ready nor exits within the deadline.
    fn spawn(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "nats-server already running");
        let log_path = self.dir.path().join("nats.log");
        let log = std::fs::File::create(&log_path).unwrap();
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
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        let port = self.port;
        // Some(Err) when it exits first (its port taken), Some(Ok) once it is ready.
        let outcome = poll_until(LISTEN_DEADLINE, || match child.try_wait().unwrap() {
            Some(status) => Some(Err(format!(
                "nats-server on port {port} exited ({status}) before it was ready: {}",
                read_log(&log_path)
            ))),
            None => read_log(&log_path)
                .contains("Server is ready")
                .then_some(Ok(())),
        });
        match outcome {
            Some(Ok(())) => {
                self.child = Some(child);
                Ok(())
            }
            Some(Err(exited)) => Err(exited),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "nats-server on port {port} was not ready within {LISTEN_DEADLINE:?}: {}",
                    read_log(&log_path)
                );
            }
        }
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

/// Servers in a [`NatsCluster`]: the smallest cluster in which JetStream keeps a stream with 3
/// replicas, and the quorum of its meta group, through the loss of any one server.
pub const CLUSTER_SIZE: usize = 3;

/// A 3-server nats-server cluster on loopback: cluster routes between the servers, JetStream on
/// each with its own storage dir, free client and cluster ports. Each server can be stopped and
/// restarted on its own ports and storage. Killed on drop.
pub struct NatsCluster {
    servers: Vec<Nats>,
}

impl NatsCluster {
    /// Starts the 3 servers and waits until JetStream answers on every one of them (the meta
    /// group has a leader, so streams can be created).
    pub async fn start() -> NatsCluster {
        // The cluster ports are in every server's configuration, so a server that fails to
        // start (a port taken) starts the whole cluster again on fresh ports.
        let servers = on_fresh_ports("the nats-server cluster", NatsCluster::try_start_servers);
        let cluster = NatsCluster { servers };
        for i in 0..CLUSTER_SIZE {
            cluster.wait_jetstream(i).await;
        }
        cluster
    }

    /// One start of the 3 servers on fresh client and cluster ports; the servers started so far
    /// are killed (dropped) when one fails.
    fn try_start_servers() -> Result<Vec<Nats>, String> {
        let cluster_ports: Vec<u16> = (0..CLUSTER_SIZE).map(|_| free_port()).collect();
        (0..CLUSTER_SIZE)
            .map(|i| {
                let routes: Vec<String> = cluster_ports
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != i)
                    .map(|(_, port)| format!("nats-route://127.0.0.1:{port}"))
                    .collect();
                Nats::try_start(Some(format!(
                    "server_name: n{i}\n\
                     cluster {{\n  name: kvrouted-test\n  listen: 127.0.0.1:{}\n  routes: [{}]\n}}\n",
                    cluster_ports[i],
                    routes.join(", ")
                )))
            })
            .collect()
    }

    /// Waits until server `i` can place a stream with 3 replicas (after a start or a restart,
    /// once it has rejoined the cluster's meta group): it creates and deletes a probe stream.
    pub async fn wait_jetstream(&self, i: usize) {
        let client = async_nats::connect(self.url(i)).await.expect("connect");
        let js = async_nats::jetstream::new(client);
        let probe = format!("TESTKIT_PROBE_{i}");
        eventually(
            &format!("cluster server {i} places a stream with 3 replicas"),
            || {
                let (js, probe) = (js.clone(), probe.clone());
                async move {
                    let config = async_nats::jetstream::stream::Config {
                        name: probe.clone(),
                        subjects: vec![format!("testkit.probe.{i}")],
                        num_replicas: CLUSTER_SIZE,
                        ..Default::default()
                    };
                    js.get_or_create_stream(config).await.ok()?;
                    js.delete_stream(&probe).await.ok().map(|_| ())
                }
            },
        )
        .await;
    }

    /// Client URL of server `i`.
    pub fn url(&self, i: usize) -> String {
        self.servers[i].url()
    }

    /// Every server's client URL, comma-separated (what `--nats-url` takes).
    pub fn urls(&self) -> String {
        (0..CLUSTER_SIZE)
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Kills server `i` (its storage stays for [`NatsCluster::restart`]).
    pub fn stop(&mut self, i: usize) {
        self.servers[i].stop();
    }

    /// Starts server `i` again on its ports and storage; it rejoins the cluster.
    pub fn restart(&mut self, i: usize) {
        self.servers[i].restart();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_whose_port_is_taken_is_reported_as_exited_not_waited_for() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut nats = Nats {
            child: None,
            port: taken.local_addr().unwrap().port(),
            dir: TempDir::new().unwrap(),
            config: None,
        };
        let why = nats
            .spawn()
            .expect_err("a server cannot listen on a port another socket holds");
        assert!(
            why.contains("exited") && why.contains("address already in use"),
            "the failure says the server exited and shows its log: {why}"
        );
    }
}

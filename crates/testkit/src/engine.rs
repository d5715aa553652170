//! A test engine that publishes KV events on ZeroMQ exactly as vLLM 0.33's and SGLang 0.5.23's
//! `ZmqEventPublisher` do:
//!
//! - one PUB socket per dp rank, bound at the base port + rank, sending `[topic, seq (u64 BE),
//!   payload]`; the sequence starts at 0 per process and grows by one per batch;
//! - a replay buffer of the last `buffer_steps` batches;
//! - one ROUTER replay socket per dp rank (base replay port + rank): a request is `[identity,
//!   "", start_seq (u64 BE)]` (anything else is ignored, as the engines log and drop it); the
//!   reply is every buffered batch with seq ≥ start as `[identity, "", topic, seq, payload]`
//!   (vLLM since mid-2026, SGLang 0.5.23, TensorRT-LLM) or `[identity, "", seq, payload]` (older
//!   vLLM and SGLang), then the end marker `[identity, "", "", ff…ff, ""]` (or without the
//!   topic frame in the older shape).
//!
//! A batch can also be numbered and buffered without going out on the PUB socket: what a PUB
//! socket does with a message past its high-water mark.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::ports::free_port_run;

#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub topic: String,
    /// Replay replies carry the topic frame (vLLM 0.33, SGLang 0.5.23) or not (older builds).
    pub replay_with_topic: bool,
    pub buffer_steps: usize,
    pub dp_size: u32,
}

impl EngineOptions {
    /// vLLM 0.33.0's defaults: empty topic, replay replies with the topic frame, 10,000 steps.
    pub fn vllm() -> EngineOptions {
        EngineOptions {
            topic: String::new(),
            replay_with_topic: true,
            buffer_steps: 10_000,
            dp_size: 1,
        }
    }

    /// An older SGLang / vLLM build: replay replies without the topic frame.
    pub fn sglang_legacy() -> EngineOptions {
        EngineOptions {
            replay_with_topic: false,
            ..EngineOptions::vllm()
        }
    }
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

struct RankPublisher {
    socket: PubSocket,
    next_seq: u64,
    buffer: Buffer,
    replay: tokio::task::JoinHandle<()>,
}

pub struct TestEngine {
    pub opts: EngineOptions,
    pub pub_port: u16,
    pub replay_port: u16,
    ranks: Vec<RankPublisher>,
}

impl TestEngine {
    /// Binds the sockets of every rank on free ports.
    pub async fn start(opts: EngineOptions) -> TestEngine {
        let pub_port = free_port_run(opts.dp_size as u16);
        let replay_port = free_port_run(opts.dp_size as u16);
        TestEngine::start_on(opts, pub_port, replay_port).await
    }

    /// Binds on these base ports (a restarted engine comes back on the same ones).
    pub async fn start_on(opts: EngineOptions, pub_port: u16, replay_port: u16) -> TestEngine {
        let mut ranks = Vec::new();
        for r in 0..opts.dp_size as u16 {
            let mut socket = PubSocket::new();
            socket
                .bind(&format!("tcp://127.0.0.1:{}", pub_port + r))
                .await
                .expect("bind PUB");
            let mut router = RouterSocket::new();
            router
                .bind(&format!("tcp://127.0.0.1:{}", replay_port + r))
                .await
                .expect("bind ROUTER");
            let buffer: Buffer = Arc::default();
            let replay = tokio::spawn(serve_replay(router, buffer.clone(), opts.clone()));
            ranks.push(RankPublisher {
                socket,
                next_seq: 0,
                buffer,
                replay,
            });
        }
        TestEngine {
            opts,
            pub_port,
            replay_port,
            ranks,
        }
    }

    pub fn zmq_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.pub_port)
    }

    pub fn replay_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay_port)
    }

    /// Numbers, buffers and publishes a batch on `rank`; returns its sequence.
    pub async fn publish(&mut self, rank: u32, payload: Vec<u8>) -> u64 {
        self.publish_inner(rank, payload.into(), true).await
    }

    /// Numbers and buffers a batch that the PUB socket drops (past its high-water mark).
    pub async fn publish_dropped(&mut self, rank: u32, payload: Vec<u8>) -> u64 {
        self.publish_inner(rank, payload.into(), false).await
    }

    async fn publish_inner(&mut self, rank: u32, payload: Bytes, send: bool) -> u64 {
        let topic = Bytes::from(self.opts.topic.clone().into_bytes());
        let steps = self.opts.buffer_steps;
        let r = &mut self.ranks[rank as usize];
        let seq = r.next_seq;
        r.next_seq += 1;
        if send {
            let message = ZmqMessage::try_from(vec![
                topic,
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ])
            .unwrap();
            r.socket.send(message).await.expect("PUB send");
        }
        let mut buffer = r.buffer.lock().unwrap();
        buffer.push_back((seq, payload));
        while buffer.len() > steps {
            buffer.pop_front();
        }
        seq
    }

    /// The engine process exits: its sockets close and its buffer is gone.
    pub async fn stop(self) {
        for r in self.ranks {
            r.replay.abort();
            let _ = r.replay.await;
            let _ = r.socket.close().await;
        }
    }
}

async fn serve_replay(mut router: RouterSocket, buffer: Buffer, opts: EngineOptions) {
    let topic = Bytes::from(opts.topic.clone().into_bytes());
    loop {
        let Ok(request) = router.recv().await else {
            continue;
        };
        let frames = request.into_vec();
        let [identity, _, start] = frames.as_slice() else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .unwrap()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let reply = |topic: &Bytes, seq: [u8; 8], payload: Bytes| {
            let mut frames = vec![identity.clone(), Bytes::new()];
            if opts.replay_with_topic {
                frames.push(topic.clone());
            }
            frames.push(Bytes::copy_from_slice(&seq));
            frames.push(payload);
            ZmqMessage::try_from(frames).unwrap()
        };
        for (seq, payload) in batches {
            if router
                .send(reply(&topic, seq.to_be_bytes(), payload))
                .await
                .is_err()
            {
                break;
            }
        }
        let _ = router
            .send(reply(&Bytes::new(), [0xff; 8], Bytes::new()))
            .await;
    }
}
